"""A frozen base whose first layer is MoE and whose first adapter is an expert's
(``--lora-targets linear_fc1,linear_fc2`` without an attention target, as for Mixtral): what that
layer saves before and after the hidden states start to require grad inside it, and which of its
backward collectives never run (stdlib only).

Measured (megatron-core 0.16.1's local layers on CPU, Megatron-Bridge 0.3.1's adapters, EP 1,
``SequentialMLP`` experts; ``tests/test_memory_activations.py`` at TP 1: GELU, fused and unfused
SwiGLU experts, gated shared experts, alltoall and allgather; ``tests/test_memory_moe_lora_start_dist.py``
under TP2 + SP on gloo): nothing requires grad before the first expert adapter, so the attention,
the pre-MLP norm, the router and the dispatcher's permutation save nothing. The shared experts run
first, as a frozen dense MLP whose adapter starts the gradient (the caller walks them); their gate
keeps only its output [T_l, 1]. From ``linear_fc1``'s adapter on (it keeps the permuted tokens and
its [n, r] intermediate) a routed expert saves as a started frozen one, less the activation's
output the probabilities multiply (unfused: the probabilities need no gradient, so the product
keeps only them; the fused SwiGLU kernel keeps its input and the probabilities regardless). With
``linear_fc2`` the only expert target, nothing before its adapter saves either: its input
[n, ffn] and [n, r]. The combine (unpermutation) then keeps the permutation's sorted indices
(int64: this rank's [T_l x k] before the all-to-all, or the gathered tokens its experts take with
the allgather dispatcher); the routing map and the scattered probabilities are not kept. In
backward the dispatcher's tokens and probabilities need no gradient: no reduce-scatter of theirs.
With latent projections (``moe_latent_size``) ``fc1_latent_proj`` runs before any adapter and the
frozen ``fc2_latent_proj`` keeps no input (Transformer Engine's linear keeps it only when its weight
trains); the dispatcher, experts and adapters work at the latent width (measured with a stand-in for
``TELinear``, tests/mcore_cpu.py). Selective ``mlp`` checkpoints the dense layers only (measured). Selective
``mla_up_proj`` (an MLA first layer): its ``CheckpointWithoutOutput`` runs with inputs that need no grad, so it saves
nothing and registers no re-run (measured at TP 1 and TP2 + SP); selective ``layernorm`` fails in megatron-core
(:func:`.recompute.selective_reason` says so).
"""

from __future__ import annotations

from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.decoder import DecoderOptions, experts_module, experts_take_adapters
from megatron_flops.memory.grouped_start import (grouped_first_adapter_reason, grouped_start_unmeasured,
                                                 leading_frozen_layers, legacy_combine_skip)
from megatron_flops.memory.layout import FP32_BYTES, INDEX_BYTES, Parallelism, Training
from megatron_flops.memory.moe import expert_lora_activations, expert_tp_group, moe_activations
from megatron_flops.model.spec import ModelSpec


def first_adapter_moe_reason(spec: ModelSpec, options: DecoderOptions, par: Parallelism,
                             recompute: RecomputeSpec | None, peft: PeftSpec | None) -> str | None:
    """Why a frozen MoE first layer whose first adapter is an expert's is not modelled (None: it
    is, or this is not that layer). (Selective ``moe`` there trains no adapter of the layer: refused
    before, by flops.passes.check_checkpointed_regions.)"""
    if not starts_in_experts(spec, peft):
        return None
    modules = set(recompute.modules) if recompute is not None and recompute.granularity == "selective" else set()
    # Every selective module but moe is modelled in this layer: mlp (the dense layers only), shared_experts (none here:
    # flops.passes refuses adapted ones), mla_up_proj (its checkpoint's inputs require no grad there: it saves nothing
    # and never re-runs, as core_attn's), moe_act (grouped experts), layernorm (megatron-core fails:
    # recompute.selective_reason says why).
    return grouped_first_adapter_reason(spec, options, peft, moe_act="moe_act" in modules)


def starts_in_experts(spec: ModelSpec, peft: PeftSpec | None) -> bool:
    """A frozen base whose first layer is MoE and whose first adapter is a routed expert's."""
    if peft is None or peft.lora_rank is None or not peft.frozen or spec.moe is None or spec.layers[0][1] != "moe":
        return False
    attention = {"linear_proj"} if spec.mla is not None else {"linear_qkv", "linear_proj"}
    mla = {t for t in peft.lora_targets if spec.mla is not None and t.startswith(("linear_q_", "linear_kv_"))}
    return not (attention | mla) & set(peft.lora_targets)


def first_adapter_moe_saved(spec: ModelSpec, options: DecoderOptions, peft: PeftSpec, *, tokens: int,
                            local_tokens: int, act: int, tp: int, ep: int = 1,
                            received: int | None = None, moe_act: bool = False) -> dict[str, int]:
    """Bytes that MoE layer saves per micro-batch by key (see the module doc; ``moe_act`` and
    legacy ``GroupedMLP``, whose routed path keeps nothing: :mod:`.grouped_start`)."""
    moe = spec.moe
    assert moe is not None and peft.lora_rank is not None
    if not experts_take_adapters(options):
        return {}
    got, ffn = tokens * moe.router_topk if received is None else received, moe.ffn_hidden_size // tp
    adapted = tuple(t for t in ("linear_fc1", "linear_fc2") if t in peft.lora_targets)
    experts = 0
    if "linear_fc1" in adapted:
        started = moe_activations(spec, options, tokens=tokens, local_tokens=local_tokens, act=act, tp=tp, ep=ep,
                                  received=received, frozen=True, moe_act=moe_act)
        # NB: the fused SwiGLU's kernel keeps its input and the probabilities only (no product to drop); under
        # moe_act the checkpoint keeps fc1's output and the probabilities only.
        fused = spec.gated_linear_unit and options.bias_activation_fusion
        experts = started["moe/experts"] - (0 if fused or moe_act else got * ffn * act)
    # The combine's sorted indices: of this rank's T_l tokens permuted before the all-to-all, or (allgather)
    # of the gathered tokens its experts take. NB: flex (a formula, CUDA only): DeepEP's unpermute of the
    # pairs that reached this rank; HybridEP permutes inside its kernels (its handle not counted).
    dispatcher = options.moe_token_dispatcher_type
    permuted = {"allgather": got, "alltoall": local_tokens * moe.router_topk}.get(
        dispatcher, 0 if options.moe_flex_dispatcher_backend == "hybridep" else got)
    return {"moe/dispatcher": permuted * INDEX_BYTES, "moe/experts": experts,
            "lora": expert_lora_activations(spec, adapted=adapted, rank=peft.lora_rank, frozen=True, tokens=tokens,
                                            act=act, tp=tp, received=received, moe_act=moe_act)}


def first_adapter_dispatcher_skip(spec: ModelSpec, par: Parallelism, training: Training, *, dispatcher: str,
                                  routed: int) -> dict[str, int]:
    """Payload bytes per micro-batch the first layer's dispatcher does not run in backward under
    expert TP (its tokens and probabilities require no grad), beyond the trained layer's: with
    ``alltoall``, the reduce-scatter of the ``routed`` tokens' and probabilities' gradients [n, h + 1]
    (h: the latent size with latent projections). The experts' output gradient is still all-gathered
    (EP and ``allgather``: :func:`first_adapter_ep_skip`)."""
    assert spec.moe is not None
    a, h = training.param_bytes, spec.moe.latent_size or spec.hidden_size
    if dispatcher != "alltoall" or par.expert_tp == 1:  # (flex: in its all-to-all, first_adapter_ep_skip)
        return {}
    return {f"{expert_tp_group(par)}/reduce_scatter": routed * (h + 1) * a}


def first_adapter_ep_skip(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *,
                          pp_rank: int, peft: PeftSpec | None, recompute: RecomputeSpec | None) -> dict[str, int]:
    """Payload bytes per step the first layer's dispatcher does not run in backward over the
    expert TP x EP group, as negative ``group/kind`` entries (measured at EP 2, TP 1 and TP2 + SP):
    ``alltoall`` (EP > 1): the all-to-all of this rank's routed tokens' and probabilities'
    gradients [T_l x k, h + 1] (the combine's all-to-all still runs backward); ``allgather``
    (expert TP x EP > 1): the reduce-scatter of the gathered tokens' and probabilities' gradients
    [G, h + E] (h: the latent size with latent projections); legacy ``GroupedMLP`` (no expert
    adapter): the combine's backward too (:func:`~megatron_flops.memory.grouped_start.legacy_combine_skip`,
    a formula), and without shared experts in each leading MoE layer before the first dense layer
    (:func:`~megatron_flops.memory.grouped_start.leading_frozen_layers`). None under full recompute
    (Bridge makes the decoder's input require grad)."""
    moe = spec.moe
    if (moe is None or not starts_in_experts(spec, peft) or not par.holds_frozen_first_layer(spec.num_layers, pp_rank)
            or (recompute is not None and recompute.granularity == "full")):
        return {}
    skip = _dispatch_skip(spec, options, par, training)
    for key, value in legacy_combine_skip(spec, options, par, training).items():
        skip[key] = skip.get(key, 0) + value
    leading = leading_frozen_layers(spec, options, par.chunk_layers(spec.num_layers, pp_rank, 0))
    return {key: leading * value for key, value in skip.items()}


def _dispatch_skip(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training) -> dict[str, int]:
    moe = spec.moe
    assert moe is not None
    a, h, m = training.param_bytes, moe.latent_size or spec.hidden_size, training.num_microbatches
    local = training.seq_length * training.micro_batch_size // par.tp  # this rank's T_l tokens
    if options.moe_token_dispatcher_type == "allgather":
        rows = local * par.expert_tp * par.ep
        return {"tp_ep/reduce_scatter": -m * rows * (h + moe.num_experts) * a} if par.expert_tp * par.ep > 1 else {}
    if options.moe_token_dispatcher_type == "alltoall" and par.ep > 1:
        return {"ep/all_to_all": -m * local * moe.router_topk * (h + 1) * a}
    if options.moe_token_dispatcher_type == "flex":
        # NB: a formula (moe_grouped.flex_communication's backward less the combine's, which still runs):
        # per (token, rank) sent, the gradient [h] and DeepEP's ETP x topk fp32 weights' gradient (HybridEP:
        # the rank's E/EP fp32 probabilities).
        sent = local * par.expert_tp * min(moe.router_topk, par.ep)
        extra = (moe.num_experts // par.ep if options.moe_flex_dispatcher_backend == "hybridep"
                 else par.expert_tp * moe.router_topk) * FP32_BYTES
        return {f"{'ep' if par.expert_tp == 1 else 'tp_ep'}/all_to_all": -m * sent * (h * a + extra)}
    return {}


def first_adapter_unmeasured(spec: ModelSpec, options: DecoderOptions, peft: PeftSpec | None,
                             recompute: RecomputeSpec | None = None) -> list[str]:
    """The figures of this module that are formulas (CUDA-only experts or dispatcher)."""
    if not starts_in_experts(spec, peft):
        return []
    moe_act = recompute is not None and recompute.granularity == "selective" and "moe_act" in recompute.modules
    out = grouped_start_unmeasured(spec, options, peft, moe_act=moe_act)
    if experts_module(options) == "TEGroupedMLP":
        layout = peft.grouped_expert_adapters if peft is not None else "shared"
        adapters = f"{layout} adapter{'s' if layout == 'per-expert' else ''}"
        out.append("the first MoE layer's TEGroupedMLP experts under a frozen base whose first adapter is theirs: "
                   f"as SequentialMLP's (measured): from linear_fc1's {adapters} on, no activation output kept")
    if options.moe_token_dispatcher_type == "flex":
        out.append("the first MoE layer's flex dispatcher under a frozen base whose first adapter is an expert's: "
                   "only the combine's sorted indices kept (DeepEP; HybridEP nothing), and no backward of the "
                   "dispatch all-to-all (the combine's runs)")
    return out
