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

Under sequence parallelism (Bridge's local-layer path, ``disable_sequence_parallel_comm``
False) a column-parallel target's adapter all-gathers its [T/TP, h] input itself before
linear_in (``tp/all_gather`` [T, h]; its gradient reduce-scattered in backward), with
linear_in's own input-gradient all-reduce off, and keeps that gathered [T, h]; a row-parallel
target's adapter splits its output back to [T/TP, h] (its gradient all-gathered in backward).

A frozen base layer runs megatron-core's ``LinearWithFrozenWeight``: no weight gradient (under
sequence parallelism, no weight-gradient all-gather), and autograd records it only once its input
requires grad, so the base layers before the first adapter of the first pipeline stage run no
backward collective (unless full recompute, where Bridge makes the decoder's input require grad).
Full recompute re-runs the adapters' forward collectives with the layer.

MLA's projections (``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_kv_down_proj``,
``linear_kv_up_proj``, direct q's ``linear_q_proj``) are column-parallel layers in megatron-core's
local spec (the down projections' outputs split over TP and all-gathered by the attention), so
Bridge adapts each as a column-parallel target whose input is the hidden states (down
projections, ``linear_q_proj``) or a latent (up projections: [T, q_lora], [T, kv_lora]).
Transformer Engine's spec keeps the down projections whole on every TP rank (``TELinear``,
``parallel_mode="duplicated"``; Bridge: ``base_linear_is_parallel=False``): Bridge's adapter there
splits ``linear_in`` [r/TP, h] and ``linear_out`` [out/TP, r] as around a column-parallel target
and gathers its output (``tp/all_gather`` [T, out] in forward); without sequence parallelism a
formula, the rest as the local spec. Under sequence parallelism megatron-core feeds those layers
this rank's [T/TP] tokens, which Bridge's adapter does not gather: linear_in's all-gather then
concatenates different ranks' tokens and its input gradient is unreduced (refused, as Bridge's).
The up projections are column parallel in both specs (``TEColumnParallelLinear``, or with
``qk_layernorm`` ``TELayerNormColumnParallelLinear``, the latent norm fused in) and read the
latent all-gathered over the sequence by the base layer, so their adapters are Bridge's
column-parallel ones, as the local spec's (a formula), but for one difference under sequence
parallelism: around a fused norm + linear Bridge sets ``return_layernorm_output_gathered`` and
``disable_sequence_parallel_comm`` (Transformer Engine >= 1.5, no TP communication overlap),
so the adapter reads the norm output the base layer all-gathered and Transformer Engine adds the
adapter's input gradient to its own before its reduce-scatter: no adapter all-gather of its
[T, latent] input in forward, no reduce-scatter of its gradient in backward.

MoE, MLA and multi-token prediction layers: :mod:`megatron_flops.memory.lora_layers`.

Transformer Engine's spec fuses the same norms into a dense attention's ``linear_qkv`` (the input
norm) and a dense MLP's ``linear_fc1`` (the pre-MLP norm; a MoE layer's is its own module, its
shared experts' ``linear_fc1`` plain ``TEColumnParallelLinear``): under sequence parallelism their
adapters too gather no [T, h] input and reduce-scatter no input gradient of their own (a formula,
:func:`lora_fused_norm_unmeasured`); without it they are the local spec's.

NB: measured with megatron-core's local layers and Bridge 0.3.1's adapter (gloo, CPU); Bridge's
adapters around Transformer Engine's fused norm + linear are formulas (no Transformer Engine on CPU).
"""

from __future__ import annotations

from megatron_flops.memory.layout import Parallelism
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.model.spec import ModelSpec

# MLA's projections, in forward order (the down projections, then the up projections or direct q).
MLA_TARGETS = ("linear_q_down_proj", "linear_kv_down_proj", "linear_q_up_proj", "linear_q_proj", "linear_kv_up_proj")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1") + MLA_TARGETS
ROW_PARALLEL = ("linear_proj", "linear_fc2")
# The order in which a dense layer runs its linear layers (forward).
LAYER_ORDER = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def mla_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The MLA projections of ``spec``'s attention layers, in forward order (none without MLA)."""
    if spec.mla is None:
        return ()
    q = ("linear_q_down_proj", "linear_q_up_proj") if spec.mla.q_lora_rank is not None else ("linear_q_proj",)
    return tuple(t for t in MLA_TARGETS if t in q or "_kv_" in t)


def input_widths(spec: ModelSpec, *, fused: tuple[str, ...] = (), experts: bool = False) -> dict[str, int]:
    """The input widths of column-parallel targets whose input the adapter gathers under sequence
    parallelism where they are not the hidden size, by target name: MLA's up projections' latents;
    a target in ``fused`` (Transformer Engine's fused norm + linear under sequence parallelism) 0,
    the adapter gathering no input and reduce-scattering no input gradient of its own (the base's
    all-gathered norm output and reduce-scatter serve it), but ``linear_fc1`` in a MoE layer
    (``experts``: the shared experts' fc1 has no norm fused in)."""
    out = {} if spec.mla is None else {"linear_q_up_proj": spec.mla.q_lora_rank or 0,
                                       "linear_kv_up_proj": spec.mla.kv_lora_rank}
    return out | {t: 0 for t in fused if not (experts and t == "linear_fc1")}


def adapter_numels(name: str, d_in: int, d_out: int, rank: int, tp: int, *,
                   duplicated: bool = False) -> tuple[int, int]:
    """Elements of ``linear_in`` and ``linear_out`` on one TP rank, for a target ``name`` whose
    weight on that rank is [d_out, d_in]: a column-parallel target splits linear_in's rank rows,
    a row-parallel one linear_out's (whole) output rows, a ``duplicated`` one (Transformer
    Engine's MLA down projections, weight whole on every rank) both: [r/TP, d_in], [d_out/TP, r]."""
    if name in ROW_PARALLEL:
        return rank * d_in, d_out // tp * rank
    return rank // tp * d_in, (d_out // tp if duplicated else d_out) * rank


def lora_tp_reason(spec: ModelSpec, par: Parallelism, peft: PeftSpec | None, *,
                   duplicated: bool = False) -> str | None:
    """Why LoRA adapters under tensor parallelism are not modelled (None: they are, or TP 1);
    ``duplicated``: Transformer Engine's MLA down projections, whole on every TP rank."""
    if peft is None or peft.lora_rank is None or par.tp == 1:
        return None
    downs = [t for t in peft.lora_targets if t in mla_targets(spec) and "_down_" in t]
    if duplicated and downs and par.sequence_parallel:
        return (f"Megatron-Bridge (0.3.1 to 0.6.2) cannot train LoRA adapters on MLA's {downs} under sequence "
                "parallelism as Transformer Engine's spec builds them (duplicated TELinear, fed this rank's "
                "[s/TP] tokens): its ParallelLinearAdapter there (base_linear_is_parallel=False) skips the "
                "sequence all-gather, so linear_in's gather_output concatenates different ranks' tokens along "
                "the rank dimension, and its input gradient is left unreduced (disable_grad_reduce); "
                "--transformer-impl local is measured")
    mla = spec.mla
    if duplicated and downs and mla is not None:
        for name, width in (("q_lora_rank", mla.q_lora_rank or 0),
                            ("kv_lora_rank + qk_pos_emb_head_dim", mla.kv_lora_rank + mla.qk_pos_emb_head_dim)):
            if width % par.tp:
                return (f"{name}={width} is not divisible by --tp {par.tp} (LoRA's linear_out rows on a "
                        "duplicated down projection)")
    if peft.lora_rank % par.tp:
        return f"--lora-rank {peft.lora_rank} is not divisible by --tp {par.tp} (Bridge splits linear_in's rows)"
    if spec.hidden_size % par.tp:
        return f"hidden_size={spec.hidden_size} is not divisible by --tp {par.tp} (LoRA's linear_out rows)"
    absent = set(MLA_TARGETS) - set(mla_targets(spec))
    absent |= {"linear_qkv"} if spec.mla is not None else set()
    if peft.frozen and not set(peft.lora_targets) - absent:
        return ("LoRA under tensor parallelism on a frozen base whose first layer has no adapter is not modelled: "
                "add an attention target (linear_proj)")
    return None


def lora_duplicated_unmeasured(spec: ModelSpec, par: Parallelism, peft: PeftSpec | None, *,
                               duplicated: bool, fused: tuple[str, ...] = ()) -> list[str]:
    """The LoRA figures on MLA's projections that are formulas (Transformer Engine's spec under
    TP; under sequence parallelism only the up projections' adapters, the down projections'
    being refused: :func:`lora_tp_reason`); ``fused``: the targets built with a norm fused in
    (the up projections with ``qk_layernorm``)."""
    if peft is None or peft.lora_rank is None or par.tp == 1 or not duplicated:
        return []
    mla = [t for t in peft.lora_targets if t in mla_targets(spec)]
    if not mla:
        return []
    ups = "the up projections' adapters as the local spec's"
    if par.sequence_parallel and "linear_q_up_proj" in fused:
        ups = f"the up projections' adapters as the local spec's but for {_FUSED_SP.format(width='latent')}"
    return [f"LoRA adapters on MLA's {mla} as Transformer Engine's spec builds MLA (no Transformer Engine on CPU; "
            "--transformer-impl local is measured): on a duplicated down projection Bridge's adapter splits "
            "linear_in [r/TP, h] and linear_out [out/TP, r] and all-gathers its output [T, out] (tp/all_gather), "
            f"its input-gradient and [T, r] all-reduces and saved tensors as the local spec's adapter; {ups}"]


_FUSED_SP = ("their sequence-parallel input all-gather [T, {width}] and its gradient's reduce-scatter, which they "
             "do not run: the fused norm + linear (TELayerNormColumnParallelLinear) returns its all-gathered norm "
             "output to the adapter (return_layernorm_output_gathered, Transformer Engine >= 1.5, no TP "
             "communication overlap) and reduce-scatters the adapter's input gradient with its own")


def lora_fused_norm_unmeasured(spec: ModelSpec, par: Parallelism, peft: PeftSpec | None, *,
                               fused: tuple[str, ...]) -> list[str]:
    """The label of adapters on a dense layer's targets that Transformer Engine's spec builds with a
    norm fused in (``fused``: ``linear_qkv``, ``linear_fc1``) under TP + sequence parallelism (a
    formula: see the module doc; MLA's up projections: :func:`lora_duplicated_unmeasured`)."""
    if peft is None or peft.lora_rank is None or par.tp == 1 or not par.sequence_parallel:
        return []
    dense_mlp = any(ffn == "mlp" for _, ffn in spec.layers) or bool(spec.mtp_num_layers and spec.mtp_ffn != "moe")
    present = {"linear_qkv": spec.mla is None, "linear_fc1": dense_mlp}
    adapted = [t for t in ("linear_qkv", "linear_fc1") if t in fused and t in peft.lora_targets and present[t]]
    if not adapted:
        return []
    return [f"LoRA adapters on {adapted} around Transformer Engine's fused norm + linear (no Transformer Engine on "
            "CPU; --transformer-impl local is measured): as the local spec's adapters, saved tensors included, but "
            f"for {_FUSED_SP.format(width='h')}"]


def lora_activation_reason(spec: ModelSpec, peft: PeftSpec | None, *, selective: bool = False) -> str | None:
    """Why activations of a LoRA decoder with MoE or MLA layers are not modelled (None: they
    are). Measured at TP 1 and under TP (+ sequence parallelism, EP): frozen MoE layers
    (router, dispatcher, routed and shared experts, adapters on every expert's ``linear_fc1``/
    ``linear_fc2``) and MLA layers with adapters on ``linear_proj``, ``linear_fc1``,
    ``linear_fc2`` (an MLA layer has no ``linear_qkv``: that target adapts nothing there, as in
    Bridge) and on MLA's own projections, with or without selective ``core_attn`` recompute;
    ``selective``: selective ``mla_up_proj`` recompute."""
    if peft is None or peft.lora_rank is None or (spec.moe is None and spec.mla is None):
        return None
    if spec.mla is not None and peft.frozen and (selective or any(m == "dsa" for (m, _), _ in spec.layer_runs)):
        adapted = set(peft.lora_targets) & set(mla_targets(spec))
        q, kv = {t for t in adapted if "_q_" in t}, {t for t in adapted if "_kv_" in t}
        if bool(q) != bool(kv):
            if selective:
                return (f"activations of a frozen MLA layer adapted on one latent branch only ({sorted(q or kv)}) under "
                        "selective recompute of mla_up_proj: in the first layer the other branch's q, or k and v, "
                        "require no grad, and megatron-core 0.16.1's and 0.19.0's CheckpointWithoutOutput fail in "
                        "backward (torch.autograd.backward of an output without grad_fn); seen here with both releases")
            return (f"activations of a frozen MLA layer adapted on one latent branch only ({sorted(q or kv)}: in the "
                    "first layer the other branch's q, or k and v, require no grad) are modelled without DSA layers")
    return None  # (a frozen MoE first layer whose experts' adapters come first: memory/moe_lora_start.py)


def adapter_forward_payload(peft: PeftSpec | None, targets: tuple[str, ...], tokens: int, hidden: int, act: int,
                            *, sp: bool = False, widths: dict[str, int] | None = None,
                            duplicated: dict[str, int] | None = None) -> dict[str, int]:
    """``tp/*`` payload of the forward passes of one layer's adapters on ``targets`` (among
    ``peft.lora_targets``), for ``tokens`` tokens at TP > 1 (see the module doc); ``widths``: a
    column-parallel target's input width where it is not ``hidden`` (MLA's up projections);
    ``duplicated``: the output width of a target whole on every TP rank (Transformer Engine's MLA
    down projections, a formula), whose adapter's linear_out all-gathers its output [T, out]."""
    out = {"tp/all_gather": 0, "tp/all_reduce": 0}
    if peft is None or peft.lora_rank is None:
        return out
    r = peft.lora_rank
    for target in (t for t in targets if t in peft.lora_targets):
        if target in ROW_PARALLEL:
            out["tp/all_reduce"] += tokens * r * act  # linear_in's partial [T, r]
            out["tp/all_gather"] += tokens * hidden * act  # linear_out's output [T, out]
        else:
            # linear_in's output [T, r]; under sequence parallelism first its input [T, h].
            width = (widths or {}).get(target, hidden)
            out["tp/all_gather"] += tokens * r * act + (tokens * width * act if sp else 0)
            out["tp/all_gather"] += tokens * (duplicated or {}).get(target, 0) * act  # linear_out's [T, out]
    return out


def adapter_backward_payload(peft: PeftSpec, targets: tuple[str, ...], tokens: int, hidden: int, act: int,
                             *, sp: bool, widths: dict[str, int] | None = None) -> dict[str, int]:
    """``tp/*`` payload of the backward passes of one layer's adapters on ``targets`` (among
    ``peft.lora_targets``): every linear_out all-reduces its input gradient [T, r]; a
    column-parallel target's input gradient [T, h] is all-reduced (reduce-scattered under
    sequence parallelism), a row-parallel target's output gradient all-gathered under sequence
    parallelism (``widths``: as :func:`adapter_forward_payload`)."""
    assert peft.lora_rank is not None
    adapted = [t for t in targets if t in peft.lora_targets]
    column = sum((widths or {}).get(t, hidden) for t in adapted if t in COLUMN_PARALLEL)
    row = sum(t in ROW_PARALLEL for t in adapted)
    out = {"tp/all_reduce": len(adapted) * tokens * peft.lora_rank * act}
    if sp:
        out["tp/reduce_scatter"] = column * tokens * act
        out["tp/all_gather"] = row * tokens * hidden * act
    else:
        out["tp/all_reduce"] += column * tokens * act
    return out
