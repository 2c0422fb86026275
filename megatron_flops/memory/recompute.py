"""Collectives that selective recompute runs again in backward (stdlib only).

Selective ``mlp`` recompute (megatron-core's ``CheckpointFunction`` around each dense layer's
MLP) re-runs the MLP's forward before its backward, collectives included: per dense layer and
micro-batch, ``linear_fc2``'s output all-reduce over TP, or under sequence parallelism
``linear_fc1``'s input all-gather and ``linear_fc2``'s output reduce-scatter, [s, b, h] in the
activation dtype, and the forward collectives of LoRA adapters on ``linear_fc1`` and
``linear_fc2`` (:func:`~megatron_flops.memory.lora.adapter_forward_payload`). ``core_attn``
re-runs no collective. A checkpoint whose input requires no
grad (a frozen model's first layer before its first adapter) never re-runs.
"""

from __future__ import annotations

from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.lora import adapter_forward_payload
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.model.spec import ModelSpec

_BEFORE_MLP = ("linear_qkv", "linear_proj")
# Modules whose activations are modelled beside core_attn and mlp (at TP 1 and EP 1 but layernorm,
# without LoRA or a frozen base), measured on CPU (tests/test_memory_recompute_modules.py).
_LATER = ("layernorm", "mla_up_proj", "moe", "shared_experts")


def selective_reason(spec: ModelSpec, par: Parallelism, modules: tuple[str, ...], peft: PeftSpec | None) -> str | None:
    """Why the activations of selective recompute of ``modules`` are not modelled (None: they are)."""
    if "moe_act" in modules:
        return ("activations under selective recompute of moe_act are not modelled: megatron-core recomputes it "
                "in its grouped-GEMM experts only (moe_grouped_gemm: GroupedMLP or TEGroupedMLP, CUDA kernels), not in the "
                "SequentialMLP experts these figures follow")
    if "mla_up_proj" in modules and spec.mla is None:
        return ("activations under selective recompute of mla_up_proj: megatron-core refuses it without "
                "multi-latent attention")
    later = [m for m in modules if m in _LATER]
    if later and peft is not None and (peft.frozen or peft.lora_rank is not None):
        return f"activations under selective recompute of {later} are modelled without LoRA or a frozen base"
    applies = {"mla_up_proj": spec.mla is not None, "moe": spec.moe is not None,
               "shared_experts": spec.moe is not None and bool(spec.moe.shared_expert_ffn_hidden_size)}
    collectives = [m for m in later if applies.get(m)]
    if collectives and par.tp * par.ep > 1:
        return (f"activations under selective recompute of {collectives} are modelled with --tp 1 and --ep 1 "
                "(the collectives it re-runs are not)")
    if "layernorm" in modules and any(m in ("mamba", "gdn") or f == "none" for (m, f), _ in spec.layer_runs):
        return ("activations under selective recompute of layernorm are modelled for attention layers (no Mamba, "
                "GDN or hybrid layers)")
    return None


def selective_rerun_communication(spec: ModelSpec, par: Parallelism, training: Training, *, pp_rank: int,
                                  recompute: RecomputeSpec | None, peft: PeftSpec | None) -> dict[str, int]:
    """``tp/*`` payload per step of the MLPs selective ``mlp`` recompute re-runs on pipeline rank
    ``pp_rank`` (see the module doc); {} at TP 1 or without it."""
    if par.tp == 1 or recompute is None or recompute.granularity != "selective" or "mlp" not in recompute.modules:
        return {}
    kinds = spec.layers
    dense = sum(kinds[i][1] == "mlp" for c in range(par.num_chunks)
                for i in par.chunk_layers(spec.num_layers, pp_rank, c))
    if dense and par.is_first_stage(pp_rank, 0) and peft is not None and peft.frozen \
            and not any(t in _BEFORE_MLP for t in peft.lora_targets) and kinds[0][1] == "mlp":
        dense -= 1  # (layer 0's MLP input requires no grad: its checkpoint never re-runs)
    tokens, act = training.seq_length * training.micro_batch_size, training.param_bytes
    hidden = tokens * spec.hidden_size * act
    out = adapter_forward_payload(peft, ("linear_fc1", "linear_fc2"), tokens, spec.hidden_size, act,
                                  sp=par.sequence_parallel)
    if par.sequence_parallel:
        out["tp/all_gather"] += hidden
        out["tp/reduce_scatter"] = hidden
    else:
        out["tp/all_reduce"] += hidden
    m = training.num_microbatches
    return {key: m * dense * value for key, value in out.items() if value}
