"""Collectives that selective recompute runs again in backward (stdlib only).

Selective ``mlp`` recompute (megatron-core's ``CheckpointFunction`` around each dense layer's
MLP) re-runs the MLP's forward before its backward, collectives included: per dense layer and
micro-batch, ``linear_fc2``'s output all-reduce over TP, or under sequence parallelism
``linear_fc1``'s input all-gather and ``linear_fc2``'s output reduce-scatter, [s, b, h] in the
activation dtype, and the forward collectives of LoRA adapters on ``linear_fc1`` and
``linear_fc2`` (:func:`~megatron_flops.memory.lora.adapter_forward_payload`). ``core_attn``
re-runs no collective, nor does ``layernorm``. A checkpoint whose input requires no
grad (a frozen model's first layer before its first adapter) never re-runs.

Selective ``moe`` re-runs each MoE layer's forward (the MTP block's too): its dispatcher's
collectives (:func:`~megatron_flops.memory.moe.rerun_moe_layers` counts it among the layers
:func:`~megatron_flops.memory.moe.moe_communication` re-runs) and its shared experts' all-gather
and reduce-scatter (megatron-core trains MoE under TP with sequence parallelism only);
``shared_experts`` re-runs the shared experts once more. Measured on CPU (gloo) under TP2 + SP
and TP2 x EP2 + SP (tests/test_memory_dist.py).

Selective ``mla_up_proj`` (``CheckpointWithoutOutput`` around the up projections and RoPE) re-runs
them in backward: without sequence parallelism their column-parallel inputs enter by
``copy_to_tensor_model_parallel_region`` (identity forward), so no collective re-runs; under
sequence parallelism each up projection all-gathers its [s/TP, b, .] latent input again, per MLA
layer (the MTP block's too) and micro-batch: ``linear_q_up_proj``'s q latent [s, b, q_lora]
(``linear_q_proj``'s hidden states [s, b, h] without a q latent) and ``linear_kv_up_proj``'s kv
latent [s, b, kv_lora]. Measured on CPU (gloo) under TP2 + SP (tests/test_memory_mla_mtp_dist.py).
"""

from __future__ import annotations

from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.lora import adapter_forward_payload, input_widths, mla_targets
from megatron_flops.memory.lora_layers import expert_adapter_payload
from megatron_flops.memory.moe import expert_tp_group
from megatron_flops.memory.mtp_layers import last_stage_mtp_kinds, mtp_moe_layers
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.model.spec import ModelSpec

_BEFORE_MLP = ("linear_qkv", "linear_proj")  # (an MLA layer has no linear_qkv)


def selective_reason(spec: ModelSpec, par: Parallelism, modules: tuple[str, ...], peft: PeftSpec | None) -> str | None:
    """Why the activations of selective recompute of ``modules`` are not modelled (None: they are)."""
    if "layernorm" in modules and peft is not None and peft.frozen:
        return ("activations under selective recompute of layernorm with a frozen base: megatron-core 0.16.1's and "
                "0.19.0's CheckpointWithoutOutput fail in backward (no saved input) where a norm's input requires no "
                "grad, as the first layer's does (Megatron-Bridge makes the decoder's input require grad under full "
                "recompute only); seen here with both releases")
    adapted = set(peft.lora_targets) & set(mla_targets(spec)) if peft is not None and peft.lora_rank else set()
    if "mla_up_proj" in modules and peft is not None and peft.frozen and adapted \
            and not adapted & {"linear_q_down_proj", "linear_kv_down_proj"}:
        return ("activations under selective recompute of mla_up_proj on a frozen base with adapters on MLA's up "
                f"projections ({sorted(adapted)}) and none on a down projection: the first layer's checkpoint inputs "
                "require no grad, so megatron-core runs its up projections and their adapters under no_grad (they "
                "train nowhere there); adapt a down projection too")
    if "layernorm" in modules and any(m in ("mamba", "gdn", "kda") or f == "none" for (m, f), _ in spec.layer_runs):
        return ("activations under selective recompute of layernorm are modelled for attention layers (no Mamba, KDA, "
                "GDN or hybrid layers)")
    return None


def selective_unmeasured(options: DecoderOptions, recompute: RecomputeSpec | None, *,
                         sequence_parallel: bool = False) -> list[str]:
    """The selective recompute figures that are formulas (Transformer Engine's spec: no CPU step)."""
    if recompute is None or recompute.granularity != "selective" or options.transformer_impl != "transformer_engine":
        return []
    out = []
    if "layernorm" in recompute.modules:
        out.append("selective layernorm recompute as Transformer Engine's spec builds the layers (the input norm fused "
                   "into linear_qkv and a dense layer's pre-MLP norm into linear_fc1, not recomputed; MLA's input norm "
                   "and MoE layers' pre-MLP norm recomputed); --transformer-impl local is measured")
    if "mla_up_proj" in recompute.modules and sequence_parallel:
        out.append("selective mla_up_proj recompute under sequence parallelism as Transformer Engine's spec builds MLA "
                   "(duplicated down projections: the checkpoint keeps k_pos_emb's own all-gathered [s, b, rope]); "
                   "--transformer-impl local is measured")
    if "mla_up_proj" in recompute.modules and options.qk_layernorm:
        out.append("selective mla_up_proj recompute as Transformer Engine's spec builds MLA (the latent norms fused "
                   "into the up projections, re-run with them); --transformer-impl local is measured")
    return out


def selective_rerun_communication(spec: ModelSpec, par: Parallelism, training: Training, *, pp_rank: int,
                                  recompute: RecomputeSpec | None, peft: PeftSpec | None,
                                  fused: tuple[str, ...] = (), expert_adapters: bool = True) -> dict[str, int]:
    """``tp/*`` payload per step of the MLPs selective ``mlp`` recompute re-runs on pipeline rank
    ``pp_rank`` (see the module doc), and of the shared experts ``moe`` and ``shared_experts``
    re-run; {} at TP 1 or without them. ``fused``: the targets Transformer Engine builds with a norm
    fused in (a dense MLP's ``linear_fc1``, MLA's up projections with latent norms), whose adapters under
    sequence parallelism gather nothing of their own; ``expert_adapters``: whether the routed experts
    have adapters (as :func:`~megatron_flops.memory.lora_layers.lora_tp_communication`)."""
    if par.tp == 1 or recompute is None or recompute.granularity != "selective":
        return {}
    kinds = spec.layers
    layers = [i for c in range(par.num_chunks) for i in par.chunk_layers(spec.num_layers, pp_rank, c)]
    dense = sum(kinds[i][1] == "mlp" for i in layers) if "mlp" in recompute.modules else 0
    if dense and par.holds_frozen_first_layer(spec.num_layers, pp_rank) and peft is not None and peft.frozen \
            and not any(t in _BEFORE_MLP[spec.mla is not None:] for t in peft.lora_targets) and kinds[0][1] == "mlp":
        dense -= 1  # (layer 0's MLP input requires no grad: its checkpoint never re-runs)
    tokens, act = training.seq_length * training.micro_batch_size, training.param_bytes
    hidden = tokens * spec.hidden_size * act
    mlp = {"tp/all_gather": hidden, "tp/reduce_scatter": hidden} if par.sequence_parallel else {"tp/all_reduce": hidden}
    out = {key: dense * value for key, value in mlp.items()}
    widths = input_widths(spec, fused=fused if par.sequence_parallel else ())
    if dense:
        for key, value in adapter_forward_payload(peft, ("linear_fc1", "linear_fc2"), tokens, spec.hidden_size, act,
                                                  sp=par.sequence_parallel, widths=widths).items():
            out[key] = out.get(key, 0) + dense * value
    shared = _shared_expert_reruns(spec, par, recompute, layers, pp_rank)
    for key, value in mlp.items():
        out[key] += shared * value
    if spec.moe is not None and peft is not None and peft.lora_rank is not None:
        _add_expert_adapter_reruns(out, spec, par, recompute, peft, layers, pp_rank, shared=shared, tokens=tokens,
                                   act=act, routed=expert_adapters)
    mla = _mla_up_proj_reruns(spec, par, recompute, layers, pp_rank, peft)
    if mla and spec.mla is not None:
        q = spec.mla.q_lora_rank if spec.mla.q_lora_rank is not None else spec.hidden_size
        if par.sequence_parallel:
            out["tp/all_gather"] = out.get("tp/all_gather", 0) + mla * (q + spec.mla.kv_lora_rank) * tokens * act
        ups = tuple(t for t in mla_targets(spec) if t != "linear_q_down_proj" and t != "linear_kv_down_proj")
        for key, value in adapter_forward_payload(peft, ups, tokens, spec.hidden_size, act, sp=par.sequence_parallel,
                                                  widths=widths).items():
            out[key] = out.get(key, 0) + mla * value
    m = training.num_microbatches
    return {key: m * value for key, value in out.items() if value}


def _add_expert_adapter_reruns(out: dict[str, int], spec: ModelSpec, par: Parallelism, recompute: RecomputeSpec,
                               peft: PeftSpec, layers: list[int], pp_rank: int, *, shared: int, tokens: int,
                               act: int, routed: bool) -> None:
    """Add the forward collectives of the LoRA adapters that selective ``moe`` and
    ``shared_experts`` re-run per micro-batch: the shared experts' ``linear_fc1``/``linear_fc2``
    adapters as a dense MLP's, once per ``shared`` re-run, and each re-run MoE layer's routed-expert
    adapters when they exist (``routed``) and split over expert TP > 1
    (:func:`~megatron_flops.memory.lora_layers.expert_adapter_payload` over the expert TP group,
    balanced routing: ``s/TP*b x ETP x topk`` tokens, as
    :func:`~megatron_flops.memory.lora_layers.lora_tp_communication` counts their first run)."""
    assert spec.moe is not None
    if spec.moe.shared_expert_ffn_hidden_size:
        for key, value in adapter_forward_payload(peft, ("linear_fc1", "linear_fc2"), tokens, spec.hidden_size, act,
                                                  sp=par.sequence_parallel).items():
            out[key] = out.get(key, 0) + shared * value
    if "moe" in recompute.modules and routed and par.expert_tp > 1:
        last = any(par.holds_mtp(pp_rank, c) for c in range(par.num_chunks))  # (the MTP layers' rank)
        moe = sum(spec.layers[i][1] == "moe" for i in layers) + mtp_moe_layers(spec, last)
        key = f"{expert_tp_group(par)}/all_gather"
        out[key] = out.get(key, 0) + moe * expert_adapter_payload(
            spec, peft, routed=tokens // par.tp * par.expert_tp * spec.moe.router_topk, act=act)


def _mla_up_proj_reruns(spec: ModelSpec, par: Parallelism, recompute: RecomputeSpec, layers: list[int],
                        pp_rank: int, peft: PeftSpec | None) -> int:
    """MLA layers whose up projections selective ``mla_up_proj`` re-runs per micro-batch over
    ``layers`` (and the MTP block's layers on the last stage); each all-gathers its inputs again
    under sequence parallelism, the q latent (or the hidden states) and the kv latent, and its
    up projections' adapters run their forward collectives again. A frozen model's first layer
    never re-runs unless a down projection is adapted: its checkpoint's inputs require no grad."""
    if spec.mla is None or "mla_up_proj" not in recompute.modules:
        return 0
    last = any(par.holds_mtp(pp_rank, c) for c in range(par.num_chunks))  # (the MTP layers' rank)
    mla_kinds = ("attention", "dsa", "dsa_shared")
    mtp = [mixer for mixer, _ in last_stage_mtp_kinds(spec, last)]  # (a hybrid MTP part: its MLA layers only)
    num = sum(mixer in mla_kinds for mixer in [spec.layers[i][0] for i in layers] + mtp)
    down = peft is not None and bool({"linear_q_down_proj", "linear_kv_down_proj"} & set(peft.lora_targets))
    return num - bool(peft is not None and peft.frozen and not down and par.holds_frozen_first_layer(spec.num_layers, pp_rank)
                      and spec.layers[0][0] in mla_kinds)


def _shared_expert_reruns(spec: ModelSpec, par: Parallelism, recompute: RecomputeSpec, layers: list[int],
                          pp_rank: int) -> int:
    """Dense-MLP-sized runs (fc1's input all-gathered, fc2's output reduce-scattered: megatron-core
    trains MoE under TP with sequence parallelism only) that selective ``moe`` and
    ``shared_experts`` recompute add per micro-batch over ``layers`` (and the multi-token-prediction
    block's MoE layers on the last stage): a re-run MoE layer's shared experts, or without them
    what :func:`~megatron_flops.memory.moe.moe_communication` takes off a re-run layer's count
    (its dense count has no re-run here); ``shared_experts`` their shared experts again (inside
    a re-run ``moe`` checkpoint, once more)."""
    if spec.moe is None:
        return 0
    last = any(par.holds_mtp(pp_rank, c) for c in range(par.num_chunks))  # (the MTP layers' rank)
    moe = sum(spec.layers[i][1] == "moe" for i in layers) + mtp_moe_layers(spec, last)
    runs = moe if "moe" in recompute.modules else 0
    if spec.moe.shared_expert_ffn_hidden_size and "shared_experts" in recompute.modules:
        runs += moe
    return runs
