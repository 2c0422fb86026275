"""Uneven pipeline stages as megatron-core 0.16.1 builds them (stdlib only).

``TransformerConfig``'s ``num_layers_in_first_pipeline_stage`` / ``..._last_...`` (Megatron-LM's
``--decoder-first/last-pipeline-num-layers``) give the first and last pipeline ranks their own
layer counts and split the rest evenly over the middle ranks, each rank's layers evenly over its
VPP model chunks (``transformer_block.get_num_layers_to_build``); ``account_for_embedding/loss_in_
pipeline_split`` count the embedding (the loss) as one more layer, which the first (last)
virtual stage then builds one decoder layer fewer for; ``pipeline_model_parallel_layout`` lists
each virtual stage's layers (``E`` embedding, ``t`` decoder, ``m`` MTP, ``L`` loss; ``|`` between
stages, ``(..)*n`` and ``x*n`` repeat), stage ``v x PP + r`` on model chunk ``v`` of pipeline rank
``r``, and makes VPP = stages / PP (``PipelineParallelLayerLayout``). Every virtual stage holds the
layers after the previous one's (``get_transformer_layer_offset``), so the counts in the order
``v x PP + r`` are :attr:`~megatron_flops.memory.layout.Parallelism.stage_layers`. The embedding
stays on the first virtual stage and the output layer and loss on the last whatever the split
(megatron-core's ``pre_process``/``post_process``). ``tests/test_memory_pipeline_split.py``
checks every count against megatron-core 0.16.1's own functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from megatron_flops.memory.hybrid_pipeline import is_hybrid
from megatron_flops.memory.layout import Parallelism
from megatron_flops.model.spec import ModelSpec

FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
          "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
          "pipeline_model_parallel_layout")
_LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


@dataclass(frozen=True, kw_only=True)
class PipelineSplit:
    """How the decoder layers split over pipeline stages (``TransformerConfig`` field names)."""

    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: str | None = None

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any], *, source: str = "model file") -> PipelineSplit:
        values = {k: fields.get(k) for k in FIELDS}
        for key in FIELDS[:2]:
            if values[key] is not None and (isinstance(values[key], bool) or not isinstance(values[key], int)):
                raise ValueError(f"{source}: {key} must be an integer, got {values[key]!r}")
        layout = values["pipeline_model_parallel_layout"]
        if layout is not None and not isinstance(layout, str):
            raise ValueError(f"{source}: pipeline_model_parallel_layout must be a string such as 'Et|tt|tL', "
                             f"got {layout!r}")
        return cls(num_layers_in_first_pipeline_stage=values[FIELDS[0]],
                   num_layers_in_last_pipeline_stage=values[FIELDS[1]],
                   account_for_embedding_in_pipeline_split=bool(values[FIELDS[2]]),
                   account_for_loss_in_pipeline_split=bool(values[FIELDS[3]]),
                   pipeline_model_parallel_layout=layout or None)

    @property
    def uneven(self) -> bool:
        return any((self.num_layers_in_first_pipeline_stage is not None,
                    self.num_layers_in_last_pipeline_stage is not None,
                    self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split,
                    self.pipeline_model_parallel_layout is not None))


def parse_layout(layout: str) -> list[list[str]]:
    """A layout string's virtual stages, each a list of layer kinds (``embedding``, ``decoder``,
    ``mtp``, ``loss``), as ``PipelineParallelLayerLayout.parse_str_to_list`` reads it."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = []
    for stage in text.split("|"):
        bad = [c for c in stage if c not in _LAYOUT_CHARS]
        if bad:
            raise ValueError(f"pipeline_model_parallel_layout: invalid layer character {bad[0]!r} "
                             f"(known: {', '.join(_LAYOUT_CHARS)}), as megatron-core refuses")
        stages.append([_LAYOUT_CHARS[c] for c in stage])
    return stages


def split_stages(split: PipelineSplit, *, num_layers: int, pp: int, vpp: int | None,
                 mtp_num_layers: int = 0) -> tuple[tuple[int, ...], int | None]:
    """The decoder layers of each virtual stage (order ``v x PP + r``) and the VPP they make;
    ValueError with megatron-core's reason for a split it refuses."""
    if split.pipeline_model_parallel_layout is not None:
        if split.num_layers_in_first_pipeline_stage is not None or split.num_layers_in_last_pipeline_stage is not None \
                or split.account_for_embedding_in_pipeline_split or split.account_for_loss_in_pipeline_split:
            raise ValueError("pipeline_model_parallel_layout cannot be set with other pipeline layout arguments "
                             "(megatron-core's TransformerConfig refuses it)")
        return _layout_stages(split.pipeline_model_parallel_layout, num_layers=num_layers, pp=pp, vpp=vpp,
                              mtp_num_layers=mtp_num_layers)
    first, last = split.num_layers_in_first_pipeline_stage, split.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        if split.account_for_embedding_in_pipeline_split or split.account_for_loss_in_pipeline_split:
            raise ValueError("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be "
                             "set at the same time with account_for_embedding_in_pipeline_split and "
                             "account_for_loss_in_pipeline_split (megatron-core's TransformerConfig refuses it)")
        per_rank = _uneven_ranks(first, last, num_layers=num_layers, pp=pp, vpp=vpp)
    else:
        per_rank = _accounted_ranks(split, num_layers=num_layers, pp=pp, vpp=vpp)
    chunks = vpp or 1
    stages = [per_rank[r] // chunks for _ in range(chunks) for r in range(pp)]
    if split.account_for_embedding_in_pipeline_split:
        stages[0] -= 1
    if split.account_for_loss_in_pipeline_split:
        stages[-1] -= 1
    if min(stages) < 0:
        raise ValueError("Not enough layers in the first (last) virtual pipeline stage for the embedding (loss) "
                         "(megatron-core's get_num_layers_to_build refuses it)")
    return tuple(stages), vpp


def _uneven_ranks(first: int | None, last: int | None, *, num_layers: int, pp: int, vpp: int | None) -> list[int]:
    """Layers per pipeline rank with a given first and/or last rank (``TransformerConfig``'s checks)."""
    middle_layers, middle_ranks = num_layers, pp
    for name, value in (("first", first), ("last", last)):
        if value is None:
            continue
        if value <= 0:
            raise ValueError(f"num_layers_in_{name}_pipeline_stage must be larger than 0")
        if vpp is not None and value % vpp:
            raise ValueError(f"number of layers at {name} stage: {value} must be divisible by virtual pipeline "
                             f"parallel degree {vpp} (megatron-core's TransformerConfig refuses it)")
        middle_layers, middle_ranks = middle_layers - value, middle_ranks - 1
    if bool(middle_layers) != bool(middle_ranks) or middle_ranks < 0:
        raise ValueError(f"Mismatch: {middle_layers} middle layers remaining but {middle_ranks} middle PP stages "
                         "available (megatron-core's TransformerConfig refuses it)")
    if middle_ranks and middle_layers % middle_ranks:
        raise ValueError(f"number of layers at middle stage: {middle_layers} must be divisible by the middle "
                         f"pipeline model parallel size {middle_ranks} (megatron-core's TransformerConfig refuses it)")
    middle = middle_layers // middle_ranks if middle_ranks else 0
    if middle_ranks and vpp is not None and middle % vpp:
        raise ValueError(f"number of layers on each middle pipeline rank: {middle} must be divisible by virtual "
                         f"pipeline parallel degree {vpp} (megatron-core's TransformerConfig refuses it)")
    ranks = [middle] * pp
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    return ranks


def _accounted_ranks(split: PipelineSplit, *, num_layers: int, pp: int, vpp: int | None) -> list[int]:
    """Layers per pipeline rank, the embedding and loss counted as layers where the split says so."""
    total = num_layers + split.account_for_embedding_in_pipeline_split + split.account_for_loss_in_pipeline_split
    if total % pp:
        raise ValueError(f"num_layers: {total} after account_for_embedding_in_pipeline_split or "
                         f"account_for_loss_in_pipeline_split must be divisible by pipeline_model_parallel_size {pp} "
                         "(megatron-core's TransformerConfig refuses it)")
    if vpp is not None and (total // pp) % vpp:
        raise ValueError(f"number of layers on each pipeline rank: {total // pp} must be divisible by "
                         f"virtual_pipeline_model_parallel_size {vpp} (megatron-core's TransformerConfig refuses it)")
    return [total // pp] * pp


def _layout_stages(layout: str, *, num_layers: int, pp: int, vpp: int | None,
                   mtp_num_layers: int) -> tuple[tuple[int, ...], int | None]:
    """A layout string's decoder layers per virtual stage, checked as ``validate_layer_layout``
    checks it; where it places the embedding, loss or MTP elsewhere than megatron-core builds
    them for these reports (first stage, last stage), ValueError."""
    stages = parse_layout(layout)
    if len(stages) % pp:
        raise ValueError(f"pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size "
                         f"({len(stages)} stages, PP {pp}), as megatron-core refuses")
    detected = len(stages) // pp
    if vpp is not None and vpp != detected:
        raise ValueError(f"virtual_pipeline_model_parallel_size {vpp} conflicts with pipeline_model_parallel_layout "
                         f"(VPP {detected}), as megatron-core refuses")
    flat = [kind for stage in stages for kind in stage]
    checks = (
        (bool(flat) and flat[0] == "embedding", "The first layer must be embedding"),
        (bool(flat) and flat[-1] == "loss", "The last layer must be loss"),
        (flat.count("embedding") == 1, "Embedding must be specified exactly once"),
        (flat.count("loss") == 1, "Loss must be specified exactly once"),
        (flat.count("decoder") == num_layers,
         f"Number of decoder layers {flat.count('decoder')} must match num_layers {num_layers}"),
        (flat.count("mtp") == mtp_num_layers, "Number of mtp layers in layout must match mtp_num_layers"),
        ("mtp" not in flat or "decoder" not in flat[flat.index("mtp"):], "decoder layers must be placed before MTP layers"),
    )
    for ok, reason in checks:
        if not ok:
            raise ValueError(f"pipeline_model_parallel_layout {layout!r}: {reason} (megatron-core refuses it)")
    where = [i for i, stage in enumerate(stages) if "mtp" in stage]
    if where and (where != [len(stages) - 1]):
        raise ValueError(f"pipeline_model_parallel_layout {layout!r}: MTP layers on a virtual stage other than the "
                         "last (the one with the loss) are not modelled")
    if "embedding" not in stages[0] or "loss" not in stages[-1]:
        raise ValueError(f"pipeline_model_parallel_layout {layout!r}: megatron-core builds the embedding on the first "
                         "virtual stage and the loss on the last whatever the layout says; a layout with empty stages "
                         "before the embedding or after the loss is not modelled")
    return tuple(stage.count("decoder") for stage in stages), (detected if detected > 1 else None)


def uneven_stages(split: PipelineSplit, par: Parallelism, *, spec: ModelSpec) -> Parallelism:
    """``par`` with ``split``'s virtual stages of ``spec`` as ``stage_layers`` (and a layout's VPP);
    ``par`` itself for an even split."""
    if not split.uneven:
        return par
    if par.stage_layers is not None:
        raise ValueError("megatron-core 0.19 refuses num_layers_in_first/last_pipeline_stage and the other split "
                         "fields when the hybrid pattern contains '|' separators: the pipeline layout is already "
                         "defined by the separators")
    if is_hybrid(spec) and (split.pipeline_model_parallel_layout is not None
                            or split.account_for_embedding_in_pipeline_split or split.account_for_loss_in_pipeline_split):
        raise ValueError("a hybrid pattern's stages with pipeline_model_parallel_layout or account_for_*_in_pipeline_"
                         "split are not modelled (megatron-core's MambaStack reads num_layers_in_first/last_pipeline_"
                         "stage only)")
    stages, vpp = split_stages(split, num_layers=spec.num_layers, pp=par.pp, vpp=par.vpp,
                               mtp_num_layers=spec.mtp_num_layers)
    if vpp is not None and par.pp == 1:
        raise ValueError("pipeline_model_parallel_layout: interleaving needs PP > 1")
    return replace(par, vpp=vpp, stage_layers=stages)


def split_note(split: PipelineSplit, par: Parallelism) -> list[str]:
    """The assumption an uneven split adds (none for an even one)."""
    if not split.uneven or par.stage_layers is None:
        return []
    given = ", ".join(f"{k}={v!r}" for k in FIELDS if (v := getattr(split, k)) not in (None, False))
    return [f"pipeline stages as megatron-core 0.16.1 splits them ({given}): decoder layers per virtual stage "
            f"{list(par.stage_layers)} (stage v x PP + r on model chunk v of pipeline rank r); the embedding on the "
            "first virtual stage, the output layer and loss on the last"]
