"""Memory and traffic per GPU of a WAN-style DiT under megatron-core's ``DistributedDataParallel``,
with or without its distributed optimizer, or under Megatron-FSDP
(:mod:`megatron_flops.memory.dit_megatron_fsdp`), and under tensor, pipeline and context
parallelism, as Megatron-Bridge trains WAN (stdlib only).

NB: Megatron-Bridge 0.6.2's WAN recipes (``diffusion/recipes/wan/wan.py``) wrap ``WanModel`` in
megatron-core's ``DistributedDataParallel`` with ``use_distributed_optimizer=True`` (WAN 1.3B:
TP 1 x CP 8; 14B: TP 2 x CP 4, sequence parallel, full uniform recompute): not torch DDP. So the
states are megatron-core's (:mod:`megatron_flops.memory.states`): a gradient buffer of the trainable
parameters in reverse ``named_parameters()`` order (``grad_reduce_in_fp32``: fp32; Bridge's recipe
turns it off), the 16-bit weights plus fp32 main copies and Adam moments, all whole per rank under
DDP; with the distributed optimizer the weights in a parameter buffer of the same layout, every
parameter at a multiple of 64 elements, the buffer padded to a multiple of ``lcm(DP x CP, 128)``,
main copies and moments for this rank's real elements only. Once per step ``dp/all_reduce`` of the
gradient buffer (DDP) or ``dp/reduce_scatter`` of it and ``dp/all_gather`` of the parameter buffer
(distributed optimizer), over DP x CP ranks (:func:`~megatron_flops.memory.comm.data_parallel_bytes`).
The parameters are those of ``examples/wan_dit_fsdp2.py``'s module in its order
(:func:`~megatron_flops.flops.dit.dit_block_parameters`); Bridge's ``WanModel`` fuses q/k/v and
the cross-attention's k/v into one weight each: the same elements, other alignment padding when a
width is not a multiple of 64.

Measured (tests/test_memory_dit_layouts.py: the example's module in megatron-core 0.16.1's DDP and
``get_megatron_optimizer`` on 2 gloo ranks): the states and the DP collectives. Activations per rank:
those of one GPU (:mod:`megatron_flops.memory.dit_activations`), one micro-batch at a time (no
pipeline: forward and backward of each micro-batch before the next).

Formulas, not measured (Bridge's ``WanModel`` builds Transformer Engine layers only, which do not
run on CPU), for ``T`` video tokens per rank (``s x b / CP``), ``C``/``M`` text/CLIP tokens, width
``h``, activation bytes ``a``:

- TP (Bridge's layer spec): column-parallel q, k, v, the cross-attention's q, k, v (k_img, v_img)
  and ``ffn.0`` split their weights and biases, row-parallel o and ``ffn.2`` their weights; the rest
  (embeddings, head, adaLN tables, norms) is whole on every TP rank, its gradients all-reduced over
  TP once per step (``finalize_model_grads``: ``average_gradients_across_tp_domain`` and the q/k
  norms). Per micro-batch and block, :func:`~megatron_flops.memory.dit_tp.block_collectives`:
  ``tp/all_reduce`` of the row-parallel outputs (forward) and of the column-parallel input gradients
  (backward), ``tp/all_gather`` of q and k (self and cross) for norms across heads
  (``layernorm_across_heads``) and of their gradients; with a frozen base only where autograd reaches
  them (the first block's q/k/v input and the text embeddings need no gradient). LoRA adapters as
  Bridge's ``ParallelLinearAdapter`` (:mod:`megatron_flops.memory.lora`). Activations per TP rank: the
  example's ops with the column-parallel outputs, attention heads and FFN split over TP, q and k
  all-gathered whole for the norms (``dit_activations(tp=...)``).
- TP + sequence parallelism (Bridge's WAN 14B recipe): the residual stream, adaLN ops, LayerNorms,
  head and checkpoints on ``T / TP`` video tokens; per block and micro-batch the all-gathers and
  reduce-scatters of :func:`~megatron_flops.memory.dit_tp.block_collectives` in place of the
  all-reduces; the patch embedding's output scattered (its gradient all-gathered, first stage, when
  it trains), the head's output all-gathered (its gradient reduce-scattered, last stage); once per
  step the row-parallel biases' gradients join the TP all-reduce (``sequence_parallel``). NB: the
  text (CLIP) embeddings, whole on every TP rank, are all-gathered by the cross-attention's
  sequence-parallel ``linear_kv``: ``TP x C`` rows of k and v (activations, collectives, the CP
  ring). LoRA adapters gather a column-parallel target's input themselves and keep it gathered
  (:mod:`megatron_flops.memory.dit_tp`, ``dit_activations``).
- PP: ``num_layers / PP`` blocks per stage (or an uneven split's, ``par.stage_layers``: megatron-core's
  ``get_num_layers_to_build``, :mod:`megatron_flops.memory.pipeline_split`); the patch embedding on the first, the head and loss on
  the last, the text and time embeddings (and ``img_emb``) on every stage (``WanModel`` builds them
  whatever the stage); 1F1B keeps ``min(PP - rank, micro-batches)`` micro-batches in flight;
  ``pp/send_recv`` the [T, h] hidden states and their gradients.
- CP: ``s / CP`` video tokens per rank through the flash convention, and ``1 / CP`` of the text
  (and CLIP) tokens, each padded to a multiple of 2 x CP (Bridge's flow-matching pipeline splits the
  context embeddings too: ``thd_split_inputs_cp``); ``cp/send_recv`` the self- and cross-attention's
  K and V round the CP ring (CP - 1 steps; backward K, V and their gradients; a checkpointed block's
  forward again), as :func:`~megatron_flops.memory.comm.step_communication` prices it for a decoder.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_flops.flops.dit import DiTParam, DiTSpec, dit_block_parameters, dit_parameter_counts, dit_root_parameters
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.comm import bus_bytes, data_parallel_bytes
from megatron_flops.memory.decoder import Param
from megatron_flops.memory.dit_activations import TP_COLUMN_PARALLEL, DiTBatch, dit_activations
from megatron_flops.memory.dit_megatron_fsdp import dit_megatron_fsdp_states
from megatron_flops.memory.dp_ranks import bucket_steps, most_loaded_rank
from megatron_flops.memory.dit_tp import ROW_PARALLEL, block_collectives
from megatron_flops.memory.fsdp import dit_assumptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.megatron_fsdp import megatron_fsdp_notes
from megatron_flops.memory.states import Bucket, StateBytes, chunk_buffers, chunk_state_bytes

_SUFFIXES = (".base_layer.weight", ".base_layer.bias", ".lora_A.weight", ".lora_B.weight", ".weight", ".bias")


def dit_layout_reason(spec: DiTSpec, par: Parallelism, training: Training, peft: PeftSpec | None) -> str | None:
    """Why this layout is not modelled for a DiT (None: it is)."""
    if par.vpp:
        return ("virtual pipeline stages of a DiT are not modelled: Megatron-Bridge 0.6.2 cannot interleave WAN itself "
                "(WanModelProvider.provide ignores vp_stage and builds every model chunk with the pre_process/"
                "post_process of its pipeline rank alone)")
    if _sp(par) and training.seq_length % (par.cp * par.tp):
        return (f"sequence parallelism splits each rank's video tokens over TP: --seq-length {training.seq_length} is "
                f"not divisible by CP x TP = {par.cp * par.tp}")
    if par.ep > 1:
        return "a DiT has no experts to split over --ep"
    if par.distributed_optimizer and training.optimizer != "adam":
        return ("megatron-core's distributed optimizer supports Adam only (DistributedOptimizer asserts 'Only Adam and "
                "HybridDeviceOptimizer currently supported')")
    sizes = {"hidden_size": spec.hidden_size, "num_heads": spec.num_heads, "ffn_hidden_size": spec.ffn_hidden_size}
    if peft is not None and peft.lora_rank:
        sizes["--lora-rank"] = peft.lora_rank
    for name, value in sizes.items():
        if value % par.tp:
            return f"{name}={value} is not divisible by --tp {par.tp}"
    if par.stage_layers is None and spec.num_layers % par.pp:
        return f"num_layers={spec.num_layers} is not divisible by --pp {par.pp}"
    if par.cp > 1 and training.seq_length % (2 * par.cp):
        return (f"context parallelism splits each clip into 2 x CP chunks: --seq-length {training.seq_length} is not "
                f"divisible by {2 * par.cp}")
    return None


def _sp(par: Parallelism) -> bool:
    return par.sequence_parallel and par.tp > 1


def _module(name: str) -> str:
    return next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s)), name)


def _row_bias(name: str) -> bool:
    """A row-parallel layer's bias (LoRA-wrapped: ``.base_layer.bias``)."""
    return name.endswith(".bias") and _module(name).endswith(ROW_PARALLEL)


def tp_rank_param(p: DiTParam, tp: int, prefix: str = "") -> Param:
    """``p`` on one TP rank; ``tp_replicated``: whole on every TP rank, its gradient all-reduced
    over TP once per step."""
    module = _module(p.name)
    row = module in ROW_PARALLEL
    rows = p.shape[0] if len(p.shape) > 1 else None  # dim 0 (Megatron-FSDP's row size: numel / rows)
    if tp == 1 or not (row or module in TP_COLUMN_PARALLEL):
        return Param(prefix + p.name, p.numel, p.trainable, tp_replicated=tp > 1, rows=rows)
    if p.name.endswith(".bias") and row:  # a row-parallel bias: whole, all-reduced under SP only
        return Param(prefix + p.name, p.numel, p.trainable)
    # NB: an adapter (Bridge's ParallelLinearAdapter) splits lora_A's rank rows (column-parallel
    # target) or its input columns (row-parallel), and lora_B's output rows: 1/TP of each.
    split_rows = rows is not None and (not row or p.name.endswith("lora_B.weight"))
    return Param(prefix + p.name, p.numel // tp, p.trainable, rows=rows // tp if split_rows and rows else rows)


def dit_rank_params(spec: DiTSpec, par: Parallelism, *, pp_rank: int, peft: PeftSpec | None = None) -> list[Param]:
    """The parameters on one GPU of pipeline rank ``pp_rank``, in ``named_parameters()`` order:
    the embeddings (the patch embedding on the first stage), this stage's blocks, the head (last
    stage) and ``img_emb``."""
    first, last = pp_rank == 0, pp_rank == par.pp - 1
    root = [p for p in dit_root_parameters(spec, peft)
            if (first or not p.name.startswith("patch_embedding.")) and (last or not p.name.startswith("head."))]
    late = [p for p in root if p.name.startswith(("head.", "img_emb."))]
    block = dit_block_parameters(spec, peft)
    blocks = [tp_rank_param(p, par.tp, f"blocks.{i}.") for i in stage_blocks(spec, par, pp_rank) for p in block]
    return ([tp_rank_param(p, par.tp) for p in root if p not in late] + blocks
            + [tp_rank_param(p, par.tp) for p in late])


def stage_blocks(spec: DiTSpec, par: Parallelism, pp_rank: int) -> range:
    """The blocks of pipeline rank ``pp_rank``: ``num_layers / PP`` each, or an uneven split's
    (``par.stage_layers``, megatron-core's ``get_num_layers_to_build``)."""
    return par.chunk_layers(spec.num_layers, pp_rank, 0)


def dit_rank_states(spec: DiTSpec, par: Parallelism, training: Training, *, pp_rank: int, dp_rank: int | None = None,
                    peft: PeftSpec | None = None) -> tuple[StateBytes, tuple[Bucket, ...], list[Param]]:
    """(state bytes, the gradient buffer's buckets, the parameters) on data-parallel rank
    ``dp_rank`` of pipeline rank ``pp_rank`` (one model chunk; DP x CP ranks share a buffer;
    None: the rank whose optimizer shards hold the most, the lowest on a tie)."""
    params = dit_rank_params(spec, par, pp_rank=pp_rank, peft=peft)
    group = par.dp * par.cp
    # NB: megatron-core buckets only the first pipeline rank's model chunk.
    buffers = chunk_buffers(params, dp=group, expert_dp=1, distributed_optimizer=par.distributed_optimizer,
                            bucket_size=training.bucket_size if pp_rank == 0 else None)
    if dp_rank is None:
        dp_rank = most_loaded_rank(bucket_steps(buffers["dp"], group), ranks=group) if par.distributed_optimizer else 0
    states = chunk_state_bytes(params, buffers, training, sizes={"dp": group, "expt_dp": 1},
                               ranks={"dp": dp_rank, "expt_dp": 0}, distributed_optimizer=par.distributed_optimizer)
    return states, buffers["dp"], params


def clip_tokens(spec: DiTSpec, training: Training, par: Parallelism) -> tuple[int, int, int]:
    """(video, text, CLIP) tokens of one clip on one CP rank: ``s / CP``, and the text (CLIP)
    tokens padded to a multiple of 2 x CP, over CP (0 CLIP tokens for text-to-video)."""
    def split(n: int) -> int:
        return n if par.cp == 1 else -(-n // (2 * par.cp)) * 2

    return training.seq_length // par.cp, split(spec.text_len), split(spec.image_len) if spec.image_dim else 0


def dit_step_communication(spec: DiTSpec, par: Parallelism, training: Training, *, pp_rank: int,
                           buffers: tuple[Bucket, ...], params: list[Param], peft: PeftSpec | None = None,
                           checkpointed_blocks: int = 0) -> dict[str, int]:
    """Payload bytes per ``group/kind`` on one GPU of pipeline rank ``pp_rank`` for one step
    (``checkpointed_blocks``: this stage's blocks whose forward runs twice)."""
    out = data_parallel_bytes({"dp": buffers}, par, training, {"dp": par.dp * par.cp})
    m, a, h = training.num_microbatches, training.param_bytes, spec.hidden_size
    b = training.micro_batch_size
    video, text, image = clip_tokens(spec, training, par)
    tokens = (video * b, text * b, image * b)
    blocks = len(stage_blocks(spec, par, pp_rank))
    checkpointed_blocks = min(checkpointed_blocks, blocks)
    first, last = pp_rank == 0, pp_rank == par.pp - 1
    if par.tp > 1:
        # Once per step: the gradients of the weights every TP rank holds whole (not the row-parallel
        # biases, but under sequence parallelism, which marks them sequence_parallel).
        whole = sum(p.numel for p in params if p.trainable and (p.tp_replicated or (_sp(par) and _row_bias(p.name))))
        out["tp/all_reduce"] = whole * training.grad_bytes
        # NB: the first block of a frozen base's first stage: its input needs no gradient.
        frozen = peft is not None and peft.frozen
        walks = {g: block_collectives(spec, tokens, tp=par.tp, sp=_sp(par), peft=peft, input_grad=g)
                 for g in (False, True)}
        for i in range(blocks):
            for key, (fwd, bwd) in walks[not (frozen and first and i == 0)].items():
                out[key] = out.get(key, 0) + m * (fwd + bwd + (i < checkpointed_blocks) * fwd) * a
        if _sp(par):
            out.update(_sp_outside(spec, tokens[0], m * a, first=first and not frozen, last=last, out=out))
    split = par.tp if _sp(par) else 1
    hidden = tokens[0] // split * h * a
    if par.pp > 1:
        out["pp/send_recv"] = m * hidden * 2 * ((not first) + (not last))
    if par.cp > 1:
        # This rank's K and V: self-attention's, cross-attention's (under sequence parallelism the
        # text (CLIP) K and V are [TP x C, h/TP]: the whole C x h elements).
        kv = 2 * (tokens[0] * h // par.tp + (tokens[1] + tokens[2]) * h * split // par.tp) * a
        out["cp/send_recv"] = m * (par.cp - 1) * 2 * (blocks * 3 * kv + checkpointed_blocks * kv)
    return {k: v for k, v in out.items() if v}


def _sp_outside(spec: DiTSpec, video: int, scale: int, *, first: bool, last: bool,
                out: dict[str, int]) -> dict[str, int]:
    """Sequence parallelism outside the blocks, ``scale`` bytes per element for the whole step:
    the first stage scatters the patch embedding's output over TP (no traffic) and all-gathers its
    gradient [T, h] in backward (``first``: when it trains); the last gathers the head's output
    [T, P] (forward) and reduce-scatters its gradient (backward)."""
    gather, scatter = out.get("tp/all_gather", 0), out.get("tp/reduce_scatter", 0)
    P = spec.out_channels * math.prod(spec.patch_size)
    gather += scale * video * (spec.hidden_size * first + P * last)
    scatter += scale * video * P * last
    return {"tp/all_gather": gather, "tp/reduce_scatter": scatter}


def dit_stage_activations(spec: DiTSpec, par: Parallelism, training: Training, *, pp_rank: int,
                          peft: PeftSpec | None, attention: str, checkpointed_blocks: int,
                          checkpoint_group: int = 1) -> tuple[int, int]:
    """(peak saved bytes, micro-batches in flight) on pipeline rank ``pp_rank``. 1F1B holds
    ``min(PP - rank, micro-batches)`` forward passes, all but the one in backward whole."""
    in_flight = min(par.pp - pp_rank, training.num_microbatches)
    blocks = len(stage_blocks(spec, par, pp_rank))
    # NB: the report's checkpointing is for its largest stage: a smaller one checkpoints what it holds.
    checkpointed_blocks = min(checkpointed_blocks, blocks)
    checkpoint_group = max(1, min(checkpoint_group, blocks))
    video, text, image = clip_tokens(spec, training, par)
    b = training.micro_batch_size
    batch = DiTBatch(video=(video,) * b, text=(text,) * b, image=None if spec.image_dim is None else (image,) * b)
    act = dit_activations(spec, batch, act_bytes=training.param_bytes, attention="flash" if par.cp > 1 else attention,
                          peft=peft, checkpointed_blocks=checkpointed_blocks, first=pp_rank == 0,
                          last=pp_rank == par.pp - 1, tp=par.tp, sequence_parallel=_sp(par),
                          checkpoint_group=checkpoint_group, num_blocks=blocks)
    return (in_flight - 1) * act.held + act.total, in_flight


def dit_layout_report(spec: DiTSpec, par: Parallelism, training: Training, *, peft: PeftSpec | None = None,
                      attention: str = "flash", checkpointed_blocks: int = 0,
                      checkpoint_group: int = 1) -> dict[str, object]:
    """The JSON form for megatron-core DDP / distributed optimizer with TP, PP, CP (the CLI's
    keys): the most loaded stage, every stage, and the labels of what is a formula.
    ``checkpointed_blocks``: per pipeline stage, in groups of ``checkpoint_group``."""
    reason = dit_layout_reason(spec, par, training, peft)
    if reason is not None:
        raise ValueError(reason)
    stages: list[dict[str, Any]] = []
    for pp_rank in range(par.pp):
        states, buffers, params = dit_rank_states(spec, par, training, pp_rank=pp_rank, peft=peft)
        comm = dit_step_communication(spec, par, training, pp_rank=pp_rank, buffers=buffers, params=params, peft=peft,
                                      checkpointed_blocks=checkpointed_blocks)
        act, in_flight = dit_stage_activations(spec, par, training, pp_rank=pp_rank, peft=peft, attention=attention,
                                               checkpointed_blocks=checkpointed_blocks,
                                               checkpoint_group=checkpoint_group)
        c = states.components
        if par.megatron_fsdp is not None:  # its states and dp/ traffic in place of DDP's
            c, dp = dit_megatron_fsdp_states(params, par, training)
            comm = {**dp, **{k: v for k, v in comm.items() if not k.startswith("dp/")}}
        stages.append({
            "pp_rank": pp_rank, "weights_bytes": c["weights"], "gradients_bytes": c["gradients"],
            "optimizer_bytes": sum(v for k, v in c.items() if k.startswith("optimizer/")),
            "activations_bytes": act, "total_bytes": sum(c.values()) + act, "components": {**c, "activations": act},
            "forward_passes_in_flight": in_flight, "communication": comm,
        })
    top = max(stages, key=lambda r: r["total_bytes"])
    busiest: dict[str, int] = max(stages, key=lambda r: sum(r["communication"].values()))["communication"]
    bus = bus_bytes(busiest, {"dp": par.dp * par.cp, "tp": par.tp, "pp": par.pp, "cp": par.cp})
    counts = dit_parameter_counts(spec, peft)
    return {
        "parameters": {"total": counts.num_params, "trainable": counts.num_trainable_params,
                       "per_block": counts.num_block_params, "adapters": counts.num_adapters},
        "per_gpu": {k: v for k, v in top.items() if k != "communication"},
        "per_stage": [{k: v for k, v in r.items() if k != "communication"} for r in stages],
        "communication_per_step": {**busiest, "total_bytes": sum(busiest.values())},
        "bus_bytes_per_step": {**bus, "total_bytes": sum(bus.values())},
        "not_modelled": [],
        "needs_input": [],
        "unmeasured": layout_unmeasured(par, attention, peft),
        "modelling_assumptions": [*dit_assumptions(attention, checkpointed_blocks, spec.num_layers)[:3],
                                  _layout_assumption(par, checkpointed_blocks, spec.num_layers)],
    }


def _layout_assumption(par: Parallelism, checkpointed_blocks: int, num_layers: int) -> str:
    stages = [len(par.chunk_layers(num_layers, r, 0)) for r in range(par.pp)]
    if len(set(stages)) == 1:
        blocks = f"{checkpointed_blocks} of {stages[0]} blocks per stage checkpointed"
    else:
        blocks = f"{[min(checkpointed_blocks, n) for n in stages]} of {stages} blocks per stage checkpointed"
    if par.megatron_fsdp is not None:
        return (f"Megatron-FSDP ({par.megatron_fsdp}) over the example module's parameters as megatron-core 0.16.1 "
                "allocates it (each block an FSDP unit under optim_grads_params; fp32 main weights, no double buffer, "
                f"no hybrid sharding, no FP8); {blocks}")
    optimizer = "distributed optimizer" if par.distributed_optimizer else "no distributed optimizer"
    return (f"megatron-core DDP ({optimizer}) over the example module's parameters, as Megatron-Bridge's WAN recipe; "
            f"{blocks}; gradients accumulated in the buffer and reduced after the last micro-batch")


# A frozen base whose first stage holds no block: as measured on a GPT's frozen embedding-only stage
# (tests/test_memory_pipeline_split_dist.py, 'E|ttL' + LoRA) and read in WanModel.forward.
_FROZEN_EMPTY_FIRST = (
    "a frozen base whose first pipeline stage holds no block: that stage's output (the frozen patch embedding's, "
    "the only tensor WanModel sends between stages) needs no gradient, so megatron-core 0.16.1's backward_step "
    "skips its backward (it saves nothing and has no gradient buffer or optimizer state); the next stage receives "
    "its input with requires_grad=True (recv_forward), so block 0 saves and computes its input gradient as any "
    "later block (backward GEMMs a frozen first block skips, which the FLOPs estimate, PP-agnostic, leaves out) "
    "and pp/send_recv still carries that gradient back (the GPT analogue measured: a frozen embedding-only stage)")


def layout_unmeasured(par: Parallelism, attention: str, peft: PeftSpec | None = None) -> list[str]:
    """The figures that are formulas, not measured (see the module NB)."""
    out = _megatron_fsdp_unmeasured(par, peft)
    out += [] if attention == "local" and par.cp == 1 else [
        "activations of the flash attention kernel (fp32 log-sum-exp and outputs; the example's "
        "explicit-matmul attention is measured: --attention-backend local)"]
    if par.tp > 1:
        out.append(f"tensor parallelism (TP {par.tp}): Megatron-Bridge's WanModel split (q, k, v, the cross-attention's "
                   "q, k, v and ffn.0 column-parallel; o and ffn.2 row-parallel; the rest whole, its gradients "
                   "all-reduced over TP), the tp/all_reduce and tp/all_gather payloads and the activations per TP "
                   "rank (the example's ops with q/k/v, attention and the FFN split over TP, q and k gathered for "
                   "the norms across heads; Transformer Engine layers: no CPU run)")
    if _sp(par):
        out.append(f"sequence parallelism (TP {par.tp}): the residual stream, the adaLN and LayerNorm ops and the head "
                   "on 1/TP of the video tokens, the column-parallel layers' inputs all-gathered (saved unsplit, "
                   "gathered again for the weight gradients), the text (CLIP) embeddings gathered TP times over "
                   "by the cross-attention's k/v layer, tp/all_gather and tp/reduce_scatter in place of the "
                   "activations' all-reduces, the row-parallel biases' gradients all-reduced (Transformer Engine "
                   "layers: no CPU run)")
    if par.tp > 1 and peft is not None:
        sp = " and sequence parallelism" if _sp(par) else ""
        out.append(f"LoRA adapters or a frozen base under tensor parallelism{sp} (TP {par.tp}): Megatron-Bridge's "
                   "ParallelLinearAdapter around the Transformer Engine layers with the payloads measured for a GPT's "
                   "(megatron-core's local layers)" + (", each column-parallel target's adapter gathering its input "
                                                       "itself and keeping it gathered" if sp else "")
                   + "; a frozen base's backward collectives only where autograd reaches them (Transformer Engine "
                   "layers: no CPU run)")
    if par.pp > 1:
        split = "evenly" if par.stage_layers is None else f"{list(par.stage_layers)} (get_num_layers_to_build)"
        out.append(f"pipeline parallelism (PP {par.pp}): blocks split {split}, the text and time embeddings on every "
                   "stage, 1F1B in-flight micro-batches, pp/send_recv of the hidden states")
    if par.pp > 1 and par.stage_layers is not None and 0 in par.stage_layers:
        out.append("a pipeline stage without blocks: megatron-core builds it (an empty TransformerBlock), WanModel "
                   "computes the text and time embeddings there all the same, and only the head's time embedding is "
                   "kept for backward (the last stage; a first stage keeps the patch embedding's input only); their "
                   "weights, gradient buffer and optimizer state as on any stage (gradients of the embeddings that "
                   "feed nothing stay zero); pp/send_recv the hidden states alone")
    if par.pp > 1 and par.stage_layers is not None and par.stage_layers[0] == 0 and peft is not None and peft.frozen:
        out.append(_FROZEN_EMPTY_FIRST)
    if par.cp > 1:
        out.append(f"context parallelism (CP {par.cp}): s/CP video tokens per rank through the flash convention, "
                   "and 1/CP of the text (padded to 2 x CP), cp/send_recv of the self- and cross-attention's K/V ring")
    return out


def _megatron_fsdp_unmeasured(par: Parallelism, peft: PeftSpec | None) -> list[str]:
    """Megatron-FSDP's formulas (measured on a DiT, fully trained: its states and dp/ collectives
    over DP alone, with and without checkpointed blocks)."""
    if par.megatron_fsdp is None:
        return []
    out = [megatron_fsdp_notes(par)[1][0]]
    other = [f"{name} {size}" for name, size in (("TP", par.tp), ("PP", par.pp), ("CP", par.cp)) if size > 1]
    if other:
        out.append(f"Megatron-FSDP with {', '.join(other)}: its buffers and dp/ collectives as over data parallelism "
                   "alone (sharded over DP x CP), the other groups' traffic as without it")
    if peft is not None and peft.frozen:
        out.append("Megatron-FSDP with a frozen base: as megatron-core 0.19.2 (Bridge 0.6.2's) runs a GPT's (frozen "
                   "and trainable parameters in buckets of their own, per block under optim_grads_params; gradients "
                   "in the params dtype; the frozen buckets all-gathered too; measured on a GPT: 0.16.1's "
                   "MegatronFSDP cannot wrap a frozen parameter), not measured on the DiT module")
    return out
