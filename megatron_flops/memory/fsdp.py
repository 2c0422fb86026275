"""Memory and traffic per GPU of a WAN-style DiT under torch FSDP2 (``fully_shard`` on every
block, then on the root), with a frozen base and LoRA or fully trained (stdlib only).

NB: what ``fully_shard`` allocates and sends (torch 2.x): every parameter is split along dim 0
into ``ceil(dim0 / dp)`` rows per rank, and each rank allocates that many rows, padding included
(the last ranks hold fewer real rows, or none). Parameters are kept in fp32: with
``params_dtype`` bf16/fp16 they are cast for compute by ``MixedPrecisionPolicy(param_dtype=...,
reduce_dtype=fp32)`` (``grad_reduce_in_fp32``), so the fp32 shards are the main copies: no
separate ``optimizer/main_params``. Gradients are fp32 shards of the trainable parameters,
padding included (views into the reduce-scatter output); Adam moments cover the real rows. Per micro-batch each block's parameters are all-gathered twice
(forward and backward) and the root's once; gradients are reduce-scattered once per step (the
last micro-batch, with ``set_requires_gradient_sync`` off before it), for units that train.
Payloads as in :mod:`megatron_flops.memory.comm`: the all-gather output and the reduce-scatter
input, padded, in the compute and reduce dtypes.

Not modelled: activations (what a DiT block saves depends on its elementwise adaLN code: WAN's
per-sample modulation vs a packed per-token one), the all-gathered unit(s) alive during compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_flops.dit import DiTSpec, dit_adapted_modules
from megatron_flops.memory.comm import bus_bytes
from megatron_flops.memory.layout import Training
from megatron_flops.memory.states import optimizer_keys
from megatron_flops.passes import PeftSpec


@dataclass(frozen=True)
class FsdpParam:
    """One parameter of an FSDP unit: its full shape and whether it trains."""

    name: str
    shape: tuple[int, ...]
    trainable: bool

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    def shard_rows(self, dp: int) -> int:
        """Rows each rank allocates: ``ceil(dim0 / dp)``."""
        return -(-self.rows // dp)

    def real_rows(self, dp: int, rank: int) -> int:
        """Rows of real data on ``rank``."""
        per = self.shard_rows(dp)
        return max(0, min(per, self.rows - rank * per))


def _linear(name: str, d_in: int, d_out: int, trainable: bool, rank: int | None) -> list[FsdpParam]:
    """``nn.Linear(d_in, d_out)``; LoRA-wrapped as PEFT names it when ``rank`` is given."""
    if rank is None:
        return [FsdpParam(f"{name}.weight", (d_out, d_in), trainable), FsdpParam(f"{name}.bias", (d_out,), trainable)]
    return [FsdpParam(f"{name}.base_layer.weight", (d_out, d_in), trainable),
            FsdpParam(f"{name}.base_layer.bias", (d_out,), trainable),
            FsdpParam(f"{name}.lora_A.weight", (rank, d_in), True),
            FsdpParam(f"{name}.lora_B.weight", (d_out, rank), True)]


def dit_fsdp_units(spec: DiTSpec, peft: PeftSpec | None = None) -> dict[str, tuple[FsdpParam, ...]]:
    """The parameters of each FSDP unit (``blocks.{i}``, then ``root``) of a ``WanModel``, in
    ``named_parameters()`` order, LoRA adapters as PEFT names them (no bias)."""
    adapted = set(dit_adapted_modules(spec, peft))
    base = not (peft is not None and peft.frozen)
    r = None if peft is None else peft.lora_rank
    h, f = spec.hidden_size, spec.ffn_hidden_size

    def linear(name: str, d_in: int, d_out: int, module: str | None = None) -> list[FsdpParam]:
        return _linear(name, d_in, d_out, base, r if module in adapted else None)

    def vector(name: str, n: int) -> FsdpParam:
        return FsdpParam(name, (n,), base)

    units: dict[str, tuple[FsdpParam, ...]] = {}
    for i in range(spec.num_layers):
        p = f"blocks.{i}."
        block = [FsdpParam(p + "modulation", (1, 6, h), base)]
        for m in ("q", "k", "v", "o"):
            block += linear(f"{p}self_attn.{m}", h, h, f"self_attn.{m}")
        if spec.qk_norm:
            block += [vector(p + "self_attn.norm_q.weight", h), vector(p + "self_attn.norm_k.weight", h)]
        if spec.cross_attn_norm:
            block += [vector(p + "norm3.weight", h), vector(p + "norm3.bias", h)]
        for m in ("q", "k", "v", "o"):
            block += linear(f"{p}cross_attn.{m}", h, h, f"cross_attn.{m}")
        if spec.qk_norm:
            block += [vector(p + "cross_attn.norm_q.weight", h), vector(p + "cross_attn.norm_k.weight", h)]
        if spec.image_dim is not None:
            block += linear(p + "cross_attn.k_img", h, h, "cross_attn.k_img")
            block += linear(p + "cross_attn.v_img", h, h, "cross_attn.v_img")
            if spec.qk_norm:
                block.append(vector(p + "cross_attn.norm_k_img.weight", h))
        block += linear(p + "ffn.0", h, f, "ffn.0") + linear(p + "ffn.2", f, h, "ffn.2")
        units[f"blocks.{i}"] = tuple(block)
    patch = math.prod(spec.patch_size)
    root = [FsdpParam("patch_embedding.weight", (h, spec.in_channels, *spec.patch_size), base),
            vector("patch_embedding.bias", h)]
    root += linear("text_embedding.0", spec.text_dim, h) + linear("text_embedding.2", h, h)
    root += linear("time_embedding.0", spec.freq_dim, h) + linear("time_embedding.2", h, h)
    root += linear("time_projection.1", h, 6 * h)
    root += [FsdpParam("head.modulation", (1, 2, h), base)] + linear("head.head", h, spec.out_channels * patch)
    if spec.image_dim is not None:
        w = spec.image_dim
        root += [vector("img_emb.proj.0.weight", w), vector("img_emb.proj.0.bias", w)]
        root += linear("img_emb.proj.1", w, w) + linear("img_emb.proj.3", w, h)
        root += [vector("img_emb.proj.4.weight", h), vector("img_emb.proj.4.bias", h)]
    units["root"] = tuple(root)
    return units


@dataclass(frozen=True, kw_only=True)
class FsdpRank:
    """One rank: state bytes (``weights``, ``gradients``, ``optimizer/...``) and the step's
    payload per ``fsdp/all_gather`` and ``fsdp/reduce_scatter``."""

    rank: int
    states: dict[str, int]
    communication: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.states.values())


def fsdp_rank_memory(spec: DiTSpec, training: Training, *, dp: int, rank: int = 0,
                     peft: PeftSpec | None = None) -> FsdpRank:
    """Bytes on FSDP rank ``rank`` of ``dp`` for one step of ``training.num_microbatches``
    micro-batches (see the module NB)."""
    if not 0 <= rank < dp:
        raise ValueError(f"rank {rank} is outside the {dp} data-parallel ranks")
    units = dit_fsdp_units(spec, peft)
    shard = 4  # NB: fp32 shards (the main copies under mixed precision)
    weights = sum(p.shard_rows(dp) * p.row_numel for ps in units.values() for p in ps) * shard
    # NB: the sharded gradients are views into each unit's padded reduce-scatter output.
    grads = sum(p.shard_rows(dp) * p.row_numel for ps in units.values() for p in ps if p.trainable)
    trained = sum(p.real_rows(dp, rank) * p.row_numel for ps in units.values() for p in ps if p.trainable)
    states = {"weights": weights, "gradients": grads * shard}
    for key in optimizer_keys(training):
        if key != "optimizer/main_params":
            states[key] = trained * 4
    gather = training.param_bytes
    comm = {"fsdp/all_gather": 0, "fsdp/reduce_scatter": 0}
    for name, params in units.items():
        unsharded = sum(dp * p.shard_rows(dp) * p.row_numel for p in params)
        times = 1 if name == "root" else 2
        comm["fsdp/all_gather"] += training.num_microbatches * times * unsharded * gather
        grads = sum(dp * p.shard_rows(dp) * p.row_numel for p in params if p.trainable)
        comm["fsdp/reduce_scatter"] += grads * training.grad_bytes
    if dp == 1:
        comm = {}
    return FsdpRank(rank=rank, states=states, communication={k: v for k, v in comm.items() if v})


def dit_memory_report(spec: DiTSpec, training: Training, *, dp: int, peft: PeftSpec | None = None) -> dict[str, object]:
    """The JSON form of :func:`fsdp_rank_memory` for the most loaded rank (rank 0 holds the most
    real rows), in the keys the decoder report uses."""
    from megatron_flops.dit import dit_parameter_counts

    top = fsdp_rank_memory(spec, training, dp=dp, rank=0, peft=peft)
    counts = dit_parameter_counts(spec, peft)
    optimizer = sum(v for k, v in top.states.items() if k.startswith("optimizer/"))
    bus = bus_bytes(top.communication, {"fsdp": dp})
    rank = {
        "weights_bytes": top.states["weights"],
        "gradients_bytes": top.states["gradients"],
        "optimizer_bytes": optimizer,
        "activations_bytes": None,
        "total_bytes": top.total,
        "components": dict(top.states),
    }
    return {
        "parameters": {"total": counts.num_params, "trainable": counts.num_trainable_params,
                       "per_block": counts.num_block_params, "adapters": counts.num_adapters},
        "per_gpu": rank,
        "communication_per_step": {**top.communication, "total_bytes": sum(top.communication.values())},
        "bus_bytes_per_step": {**bus, "total_bytes": sum(bus.values())},
        "not_modelled": ["activations: what a DiT block saves depends on its elementwise adaLN code"],
    }
