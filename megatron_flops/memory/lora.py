"""LoRA adapters as Megatron-Bridge builds them around megatron-core's local linear layers
(``peft/utils.py``'s ``ParallelLinearAdapter``), under tensor parallelism: their parameters per
TP rank, the bases' collectives a frozen model skips, and the adapters' own collectives
(stdlib only).

Bridge's adapter for a rank-``r`` target, ``linear_out(linear_in(x))`` added to the wrapped
layer's output:

- column-parallel target (``linear_qkv``, ``linear_fc1``; input whole on every TP rank):
  ``linear_in = ColumnParallelLinear(in, r, gather_output=True)`` [r/TP, in] and
  ``linear_out = ColumnParallelLinear(r, out, gather_output=False)`` [out/TP, r]. Per
  micro-batch: forward, ``tp/all_gather`` of linear_in's output [T, r]; backward,
  ``tp/all_reduce`` of linear_out's input gradient [T, r] and of linear_in's input gradient
  [T, h] (megatron-core's linear computes and all-reduces the input gradient even where the
  input needs none: the first adapter of a frozen model).
- row-parallel target (``linear_proj``, ``linear_fc2``; input split over TP):
  ``linear_in = RowParallelLinear(in, r, input_is_parallel=True)`` [r, in/TP] and
  ``linear_out = ColumnParallelLinear(r, out, gather_output=True)`` [out/TP, r]. Per
  micro-batch: forward, ``tp/all_reduce`` of linear_in's output [T, r] and ``tp/all_gather`` of
  linear_out's output [T, out]; backward, ``tp/all_reduce`` of linear_out's input gradient [T, r].

A checkpoint that re-runs an adapter's forward (selective ``mlp`` recompute) runs its forward
collectives again (:mod:`megatron_flops.memory.recompute`).

Either way every TP rank keeps the whole [T, r] intermediate for linear_out's weight gradient,
and linear_in keeps the wrapped layer's input (this rank's part): what
:mod:`megatron_flops.memory.activations` counts at TP 1 holds per rank.

A frozen base layer runs megatron-core's ``LinearWithFrozenWeight``: autograd records it only
once its input requires grad, so a column-parallel base layer before the first adapter of the
first pipeline stage does not all-reduce its input gradient in backward.

NB: measured with megatron-core's local layers without sequence parallelism; Bridge's adapters
around Transformer Engine's fused norm + linear (``return_layernorm_output_gathered``) and under
sequence parallelism are not modelled here.
"""

from __future__ import annotations

from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.model.spec import ModelSpec

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")
# The order in which a dense layer runs its linear layers (forward).
_LAYER_ORDER = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def adapter_numels(name: str, d_in: int, d_out: int, rank: int, tp: int) -> tuple[int, int]:
    """Elements of ``linear_in`` and ``linear_out`` on one TP rank, for a target ``name`` whose
    weight on that rank is [d_out, d_in]: a column-parallel target splits linear_in's rank rows,
    a row-parallel one linear_out's (whole) output rows."""
    if name in ROW_PARALLEL:
        return rank * d_in, d_out // tp * rank
    return rank // tp * d_in, d_out * rank


def lora_tp_reason(spec: ModelSpec, par: Parallelism, peft: PeftSpec | None) -> str | None:
    """Why LoRA adapters under tensor parallelism are not modelled (None: they are, or TP 1)."""
    if peft is None or peft.lora_rank is None or par.tp == 1:
        return None
    if par.sequence_parallel:
        return "LoRA adapters under tensor parallelism are modelled without --sequence-parallel"
    other = [t for t in peft.lora_targets if t not in COLUMN_PARALLEL + ROW_PARALLEL]
    if other or spec.mla is not None:
        return f"LoRA adapters under tensor parallelism are modelled on {', '.join(_LAYER_ORDER)} (not {other})"
    if peft.lora_rank % par.tp:
        return f"--lora-rank {peft.lora_rank} is not divisible by --tp {par.tp} (Bridge splits linear_in's rows)"
    if spec.hidden_size % par.tp:
        return f"hidden_size={spec.hidden_size} is not divisible by --tp {par.tp} (LoRA's linear_out rows)"
    return None


def _skipped_base_dgrads(peft: PeftSpec) -> int:
    """Column-parallel base layers of the first pipeline stage's first layer that run before
    the first adapter, with a frozen base: their input gradient is never all-reduced."""
    if not peft.frozen:
        return 0
    first = min(_LAYER_ORDER.index(t) for t in peft.lora_targets)
    return sum(1 for name in _LAYER_ORDER[: first + 1] if name in COLUMN_PARALLEL)


def adapter_forward_payload(peft: PeftSpec | None, targets: tuple[str, ...], tokens: int, hidden: int,
                            act: int) -> dict[str, int]:
    """``tp/*`` payload of the forward passes of one layer's adapters on ``targets`` (among
    ``peft.lora_targets``), for ``tokens`` tokens at TP > 1 (see the module doc)."""
    out = {"tp/all_gather": 0, "tp/all_reduce": 0}
    if peft is None or peft.lora_rank is None:
        return out
    r = peft.lora_rank
    for target in (t for t in targets if t in peft.lora_targets):
        if target in ROW_PARALLEL:
            out["tp/all_reduce"] += tokens * r * act  # linear_in's partial [T, r]
            out["tp/all_gather"] += tokens * hidden * act  # linear_out's output [T, out]
        else:
            out["tp/all_gather"] += tokens * r * act  # linear_in's output [T, r]
    return out


def lora_tp_communication(spec: ModelSpec, par: Parallelism, training: Training, *, pp_rank: int,
                          peft: PeftSpec | None) -> dict[str, int]:
    """``tp/*`` payload per step that LoRA adapters add on pipeline rank ``pp_rank`` (TP > 1),
    less the frozen base's skipped input-gradient all-reduces (see the module doc); {} at TP 1."""
    if peft is None or peft.lora_rank is None or par.tp == 1:
        return {}
    a, r, h = training.param_bytes, peft.lora_rank, spec.hidden_size
    tokens = training.seq_length * training.micro_batch_size
    per_layer = adapter_forward_payload(peft, _LAYER_ORDER, tokens, h, a)
    # Backward: every adapter all-reduces linear_out's input gradient [T, r]; a column-parallel
    # target's linear_in also its input gradient [T, h].
    column = sum(t in COLUMN_PARALLEL for t in peft.lora_targets)
    per_layer["tp/all_reduce"] += len(peft.lora_targets) * tokens * r * a + column * tokens * h * a
    layers = sum(len(par.chunk_layers(spec.num_layers, pp_rank, c)) for c in range(par.num_chunks))
    layers += spec.mtp_num_layers if par.is_last_stage(pp_rank, par.num_chunks - 1) else 0
    skipped = _skipped_base_dgrads(peft) if par.is_first_stage(pp_rank, 0) else 0
    m = training.num_microbatches
    return {"tp/all_gather": m * layers * per_layer["tp/all_gather"],
            "tp/all_reduce": m * (layers * per_layer["tp/all_reduce"] - skipped * tokens * h * a)}
