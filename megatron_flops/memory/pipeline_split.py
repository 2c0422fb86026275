"""Uneven pipeline splits of a GPT decoder as megatron-core 0.16.1 builds them (stdlib only).

A model file's (or Megatron-LM command line's) ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage`` (``--decoder-first/last-pipeline-num-layers``) give the
first / last pipeline rank that many layers, split evenly over its VPP model chunks, the other
ranks the rest evenly; ``account_for_embedding_in_pipeline_split`` /
``account_for_loss_in_pipeline_split`` count the embedding / loss as one layer of the even split,
which the first / last virtual stage then builds one layer fewer of (``get_num_layers_to_build``;
layers numbered in virtual-stage order ``v x PP + r``, as ``get_transformer_layer_offset``).
``tests/test_memory_pipeline_split.py`` checks every stage's layers against those functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from megatron_flops.memory.hybrid_pipeline import is_hybrid
from megatron_flops.memory.layout import Parallelism
from megatron_flops.model.spec import ModelSpec

_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
           "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def uneven_stage_layers(num_layers: int, pp: int, vpp: int | None, *, first: int | None = None,
                        last: int | None = None, embedding: bool = False, loss: bool = False) -> tuple[int, ...]:
    """Decoder layers of each virtual stage, in the order ``v x PP + r``; ValueError where
    megatron-core's asserts refuse the split."""
    chunks = vpp or 1
    if first is not None or last is not None:
        if 0 in (first, last):
            raise ValueError("megatron-core needs num_layers_in_first/last_pipeline_stage larger than 0")
        if embedding or loss:
            raise ValueError("megatron-core does not support account_for_embedding/loss_in_pipeline_split with "
                             "num_layers_in_first/last_pipeline_stage")
        left = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if rest < 0 or (left and rest % left) or (not left and rest):
            raise ValueError(f"uneven pipeline split: the {rest} layers left over do not divide over the {left} "
                             "middle pipeline stages")
        per_rank = [rest // left if left else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        total = num_layers + embedding + loss
        if total % pp:
            raise ValueError(f"num_layers={num_layers}{' + 1 (embedding)' if embedding else ''}"
                             f"{' + 1 (loss)' if loss else ''} is not divisible by --pp {pp}")
        per_rank = [total // pp] * pp
    if any(n % chunks for n in per_rank):
        raise ValueError(f"a pipeline rank's layers {per_rank} are not divisible by VPP {chunks}")
    stages = [per_rank[r] // chunks for _ in range(chunks) for r in range(pp)]
    stages[0] -= embedding
    stages[-1] -= loss
    if min(stages) < 0:
        raise ValueError("not enough layers in the first or last virtual pipeline stage for the embedding or loss")
    return tuple(stages)


def pipeline_split(spec: ModelSpec, par: Parallelism, fields: Mapping[str, Any]) -> Parallelism:
    """``par`` with the stages ``fields`` (a model file's or command line's TransformerConfig
    fields) ask for: ``stage_layers`` for an uneven split (``par`` itself for an even one or PP 1);
    ValueError for what megatron-core refuses or this report does not model."""
    uneven = {k: fields[k] for k in _FIELDS if fields.get(k) not in (None, False)}
    if par.pp == 1:
        return par
    if fields.get("pipeline_model_parallel_layout"):
        raise ValueError("pipeline_model_parallel_layout (--pipeline-model-parallel-layout) is not modelled: give the "
                         "split as num_layers_in_first/last_pipeline_stage or account_for_*_in_pipeline_split")
    if not uneven:
        return par
    if is_hybrid(spec):
        raise ValueError("an uneven pipeline split of a hybrid model is not modelled (megatron-core builds hybrid "
                         "stages from the pattern's '|' separators)")
    stages = uneven_stage_layers(spec.num_layers, par.pp, par.vpp,
                                 first=uneven.get("num_layers_in_first_pipeline_stage"),
                                 last=uneven.get("num_layers_in_last_pipeline_stage"),
                                 embedding=bool(uneven.get("account_for_embedding_in_pipeline_split")),
                                 loss=bool(uneven.get("account_for_loss_in_pipeline_split")))
    return replace(par, stage_layers=stages)
