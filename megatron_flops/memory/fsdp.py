"""Memory and traffic per GPU of a WAN-style DiT under torch FSDP2 (``fully_shard`` on every
block, then on the root), with a frozen base and LoRA or fully trained (stdlib only).

NB: what ``fully_shard`` allocates and sends (torch 2.x): every parameter is split along dim 0
into ``ceil(dim0 / dp)`` rows per rank, and each rank allocates that many rows, padding included
(the last ranks hold fewer real rows, or none). Parameters are kept in fp32: with
``params_dtype`` bf16/fp16 they are cast for compute by ``MixedPrecisionPolicy(param_dtype=...,
reduce_dtype=fp32)`` (``grad_reduce_in_fp32``), so the fp32 shards are the main copies: no
separate ``optimizer/main_params``. Gradients are fp32 shards of the trainable parameters,
padding included (views into the reduce-scatter output); Adam moments (SGD's momentum buffer) cover
the real rows.
NB: with more than one micro-batch, the micro-batches before the last run without gradient sync:
FSDP2 keeps every trainable parameter's whole (unsharded, unpadded) gradient, in the reduce dtype
(``to_accumulated_grad_if_needed``), until the last micro-batch's reduce-scatter:
``gradients/unsharded_accumulation``. Per micro-batch each block's parameters are all-gathered twice
(forward and backward) and the root's once; gradients are reduce-scattered once per step (the
last micro-batch, with ``set_requires_gradient_sync`` off before it), for units that train.
Payloads as in :mod:`megatron_flops.memory.comm`: the all-gather output and the reduce-scatter
input, padded, in the compute and reduce dtypes.

Activations: :mod:`megatron_flops.memory.dit_activations` (the embeddings, the blocks, the head
and an fp32 MSE loss).
NB: ``fsdp/unsharded_working_copies`` (a formula, not measured; shared with the decoder path:
:func:`megatron_flops.memory.fsdp_transients.unsharded_working_copies`): the root's all-gathered
parameters and whole gradients, kept through forward and backward, plus two neighbouring blocks'
all-gathered parameters (the one computing and the one prefetched) and one block's whole
gradients before its reduce-scatter; each unit as its step payloads count it: the padded
all-gather output in the compute dtype, the padded reduce-scatter input in the reduce dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron_flops.flops.dit import DiTParam, DiTSpec, dit_block_parameters, dit_root_parameters
from megatron_flops.memory.comm import bus_bytes
from megatron_flops.memory.dit_activations import DiTBatch, dit_activations
from megatron_flops.memory.fsdp_transients import unsharded_working_copies
from megatron_flops.memory.layout import FP32_BYTES, Training
from megatron_flops.memory.states import optimizer_keys
from megatron_flops.flops.passes import PeftSpec


FSDP_TRANSIENTS = ("fsdp/unsharded_working_copies: the root's all-gathered parameters and whole gradients (kept "
                   "through forward and backward), two neighbouring blocks' all-gathered parameters (computing and "
                   "prefetched) and one block's whole gradients before its reduce-scatter (when CUDA streams prefetch "
                   "the next all-gather; gloo on CPU runs each collective to completion, so which gathered units are "
                   "alive at once cannot be measured here)")


def shard_rows(param: DiTParam, dp: int) -> int:
    """Rows each rank allocates: ``ceil(dim0 / dp)``."""
    return -(-param.shape[0] // dp)


def real_rows(param: DiTParam, dp: int, rank: int) -> int:
    """Rows of real data on ``rank``."""
    per = shard_rows(param, dp)
    return max(0, min(per, param.shape[0] - rank * per))


def _row_numel(param: DiTParam) -> int:
    return math.prod(param.shape[1:])


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


def _unit_params(spec: DiTSpec, peft: PeftSpec | None,
                 shard: Callable[[DiTParam], DiTParam] | None) -> tuple[tuple[DiTParam, ...], tuple[DiTParam, ...]]:
    """(one block's, the root's) parameters, each as ``shard`` maps it (a TP rank's slice; None: whole)."""
    block, root = dit_block_parameters(spec, peft), dit_root_parameters(spec, peft)
    if shard is None:
        return block, root
    return tuple(map(shard, block)), tuple(map(shard, root))


def fsdp_rank_memory(spec: DiTSpec, training: Training, *, dp: int, rank: int = 0, peft: PeftSpec | None = None,
                     shard: Callable[[DiTParam], DiTParam] | None = None) -> FsdpRank:
    """Bytes on FSDP rank ``rank`` of ``dp`` for one step of ``training.num_microbatches``
    micro-batches (see the module NB); ``shard``: each parameter as one TP rank holds it."""
    if not 0 <= rank < dp:
        raise ValueError(f"rank {rank} is outside the {dp} data-parallel ranks")
    # NB: every block is one unit with the same parameters: one block's bytes, times the blocks.
    block, root = _unit_params(spec, peft, shard)
    units = ((block, spec.num_layers, 2), (root, 1, 1))

    def total(elements: Callable[[DiTParam], int], trainable_only: bool = False) -> int:
        return sum(times * sum(elements(p) for p in params if p.trainable or not trainable_only)
                   for params, times, _ in units)

    fp32 = FP32_BYTES  # NB: fp32 shards (the main copies under mixed precision)
    weights = total(lambda p: shard_rows(p, dp) * _row_numel(p)) * fp32
    # NB: the sharded gradients are views into each unit's padded reduce-scatter output.
    grads = total(lambda p: shard_rows(p, dp) * _row_numel(p), trainable_only=True)
    trained = total(lambda p: real_rows(p, dp, rank) * _row_numel(p), trainable_only=True)
    states = {"weights": weights, "gradients": grads * fp32}
    if training.num_microbatches > 1:
        # Accumulated without sync: whole gradients of every trainable parameter, reduce dtype.
        states["gradients/unsharded_accumulation"] = total(lambda p: p.numel, trainable_only=True) * training.grad_bytes
    for key in optimizer_keys(training):
        if key != "optimizer/main_params":
            states[key] = trained * 4
    comm = {"fsdp/all_gather": 0, "fsdp/reduce_scatter": 0}
    for params, times, gathers in units:  # gathers per micro-batch: a block twice, the root once
        unsharded = sum(dp * shard_rows(p, dp) * _row_numel(p) for p in params)
        comm["fsdp/all_gather"] += times * training.num_microbatches * gathers * unsharded * training.param_bytes
        unsharded_grads = sum(dp * shard_rows(p, dp) * _row_numel(p) for p in params if p.trainable)
        comm["fsdp/reduce_scatter"] += times * unsharded_grads * training.grad_bytes
    if dp == 1:
        comm = {}
    return FsdpRank(rank=rank, states=states, communication={k: v for k, v in comm.items() if v})


def fsdp_working_copies(spec: DiTSpec, training: Training, *, dp: int, peft: PeftSpec | None = None,
                        shard: Callable[[DiTParam], DiTParam] | None = None) -> int:
    """``fsdp/unsharded_working_copies`` bytes (see the module NB): the root resident, the blocks
    in forward order; ``shard`` as :func:`fsdp_rank_memory`'s."""
    def whole(params: tuple[DiTParam, ...], trainable_only: bool) -> int:
        return sum(dp * shard_rows(p, dp) * _row_numel(p) for p in params if p.trainable or not trainable_only)

    block, root = _unit_params(spec, peft, shard)
    gathered, grads = whole(block, False) * training.param_bytes, whole(block, True) * training.grad_bytes
    resident = whole(root, False) * training.param_bytes + whole(root, True) * training.grad_bytes
    return unsharded_working_copies([gathered] * spec.num_layers, [grads] * spec.num_layers, resident=resident)


def dit_memory_report(spec: DiTSpec, training: Training, *, dp: int, peft: PeftSpec | None = None,
                      attention: str = "flash", checkpointed_blocks: int = 0,
                      checkpoint_group: int = 1) -> dict[str, object]:
    """The JSON form of :func:`fsdp_rank_memory` for the most loaded rank (rank 0 holds the most
    real rows), in the keys the decoder report uses; activations for micro-batches
    of ``training.micro_batch_size`` clips of ``training.seq_length`` video tokens and WAN's
    ``text_len`` (padded) text tokens: the whole model and its loss."""
    from megatron_flops.flops.dit import dit_parameter_counts

    top = fsdp_rank_memory(spec, training, dp=dp, rank=0, peft=peft)
    counts = dit_parameter_counts(spec, peft)
    optimizer = sum(v for k, v in top.states.items() if k.startswith("optimizer/"))
    bus = bus_bytes(top.communication, {"fsdp": dp})
    batch = DiTBatch.uniform(spec, video_tokens=training.seq_length, num_clips=training.micro_batch_size)
    activations = dit_activations(spec, batch, act_bytes=training.param_bytes, attention=attention, peft=peft,
                                  checkpointed_blocks=checkpointed_blocks,
                                  checkpoint_group=checkpoint_group).total
    # NB: one rank (dp 1) is no FSDP: the CLI asks --fsdp only with --dp > 1.
    transients = {"fsdp/unsharded_working_copies": fsdp_working_copies(spec, training, dp=dp, peft=peft)} if dp > 1 else {}
    rank = {
        "weights_bytes": top.states["weights"],
        "gradients_bytes": sum(v for k, v in top.states.items() if k.startswith("gradients")),
        "optimizer_bytes": optimizer,
        "activations_bytes": activations,
        "total_bytes": top.total + sum(transients.values()) + activations,
        "components": {**top.states, **transients},
    }
    unmeasured = [] if attention == "local" else [
        "activations of the flash attention kernel (fp32 log-sum-exp and outputs; the example's "
        "explicit-matmul attention is measured: --attention-backend local)"]
    unmeasured += [FSDP_TRANSIENTS] if transients else []
    return {
        "parameters": {"total": counts.num_params, "trainable": counts.num_trainable_params,
                       "per_block": counts.num_block_params, "adapters": counts.num_adapters},
        "per_gpu": rank,
        "communication_per_step": {**top.communication, "total_bytes": sum(top.communication.values())},
        "bus_bytes_per_step": {**bus, "total_bytes": sum(bus.values())},
        "not_modelled": [],
        "needs_input": [],
        "unmeasured": unmeasured,
        "modelling_assumptions": dit_assumptions(attention, checkpointed_blocks, spec.num_layers),
    }


def dit_assumptions(attention: str, checkpointed_blocks: int, num_layers: int) -> list[str]:
    """What can make the DiT activations differ from a real run (printed with the report)."""
    kernel = ("flash attention convention: q, k, v, output and fp32 log-sum-exp per call (the default, "
              "as the decoder's attention_backend auto)" if attention == "flash" else
              "local attention: the softmax output [heads, s, kv] per clip (the example's explicit matmuls)")
    return [
        f"DiT blocks: {kernel}",
        "adaLN modulation per token ([T, 6, h], as the example packs clips), torch's composite RMSNorm "
        "(fp32), LayerNorm statistics in fp32 (CUDA), bf16/fp16 compute by casting the weights (no autocast)",
        "outside the blocks: the time sinusoid cast to the compute dtype, each clip's time projection repeated "
        "per token (an int64 index), an MSE loss in fp32 against fp32 targets [T, out_channels x patch]",
        f"{checkpointed_blocks} of {num_layers} blocks checkpointed; FSDP2: one micro-batch in flight",
        "gradient accumulation without sync (set_requires_gradient_sync(False) before the last micro-batch, as "
        "the example does): whole gradients held until the last reduce-scatter (gradients/unsharded_accumulation); "
        "syncing every micro-batch instead holds no whole gradients and reduce-scatters once per micro-batch",
    ]
