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

_BEFORE_MLP = ("linear_qkv", "linear_proj")  # (an MLA layer has no linear_qkv)


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
            and not any(t in _BEFORE_MLP[spec.mla is not None:] for t in peft.lora_targets) and kinds[0][1] == "mlp":
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
