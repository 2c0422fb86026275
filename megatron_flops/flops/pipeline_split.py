"""Uneven pipeline stages as megatron-core 0.16.1 builds them (stdlib only): which decoder layers
each virtual stage holds (:mod:`megatron_flops.memory.pipeline_split` explains the fields and
places them in a memory report; block recompute re-runs the first layers of each such stage).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


def standalone_mtp_stage(split: PipelineSplit) -> int | None:
    """The virtual stage (order ``v x PP + r``) of a layout's MTP layers when it is not the loss's:
    megatron-core's ``mtp_standalone``, which ``validate_layer_layout`` sets when the MTP layers sit
    in the last model chunk of a pipeline rank other than the last; None otherwise."""
    if split.pipeline_model_parallel_layout is None:
        return None
    stages = parse_layout(split.pipeline_model_parallel_layout)
    where = [i for i, stage in enumerate(stages) if "mtp" in stage]
    return where[0] if where and where[0] != len(stages) - 1 else None


def first_stage_without_decoder(fields: Mapping[str, Any], *, num_layers: int, mtp_num_layers: int = 0,
                                source: str = "model file") -> bool:
    """Whether a model file's pipeline fields put no decoder layer on the first virtual stage (it
    builds the embedding alone: ``E|tt...``, or the embedding counted in the split on a stage of
    one layer). A layout needs no ``pipeline_model_parallel_size``; the other fields are read only
    with it (without it, every layer is on one stage)."""
    split = PipelineSplit.from_mapping(fields, source=source)
    if split.pipeline_model_parallel_layout is not None:
        kinds = parse_layout(split.pipeline_model_parallel_layout)
        return len(kinds) > 1 and "decoder" not in kinds[0]
    pp, vpp = fields.get("pipeline_model_parallel_size"), fields.get("virtual_pipeline_model_parallel_size")
    if not split.uneven or not isinstance(pp, int) or isinstance(pp, bool) or pp < 2:
        return False
    stages, _ = split_stages(split, num_layers=num_layers, pp=pp, vpp=vpp if isinstance(vpp, int) else None,
                             mtp_num_layers=mtp_num_layers)
    return stages[0] == 0


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
    checks it (ValueError with its reason)."""
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
    if any(i < len(stages) - pp for i in where):  # (stage v x PP + r: not the last model chunk of its rank)
        raise ValueError(f"pipeline_model_parallel_layout {layout!r}: Currently we restrict that the MTP should be "
                         "always in the last virtual pipeline stage of that rank (megatron-core refuses it)")
    if len(where) > 1:
        raise ValueError(f"pipeline_model_parallel_layout {layout!r}: All of the MTP layers must be in the same one "
                         "virtual pipeline stage (megatron-core refuses it)")
    # (Empty stages before E or after L pass: megatron-core builds the embedding where pre_process
    # is true, the first virtual stage, and the output layer and loss on the last, whatever the
    # layout says; the layout decides the decoder and MTP layers only. memory/pipeline_split.py says so.)
    return tuple(stage.count("decoder") for stage in stages), (detected if detected > 1 else None)
