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

A hybrid pattern (Mamba, GDN, ... symbols) is split by its own stack: megatron-core 0.16.1's
``MambaStack._select_layers_for_pipeline_parallel`` and 0.19's ``select_pipeline_segment`` read
the first/last sizes as above (without ``|`` separators; 0.19 refuses them beside ``|``) and
nothing else: 0.16.1 ignores the account-for fields and a layout (its stack takes
``num_layers // PP`` layers per rank, dropping the remainder), Megatron-LM 0.19 refuses them with
a hybrid pattern, and so do these reports, with 0.19's reason. A DiT (Megatron-Bridge 0.6.2's
``WanModel``) builds its blocks in megatron-core's ``TransformerBlock``, which places them by
``get_num_layers_to_build`` as for a GPT, every split field honoured; its ``provide`` passes no
``vp_stage``, so a layout with more stages than PP is refused (memory/dit_layouts.py).
``tests/test_memory_pipeline_split_hybrid_dit.py`` checks both against the frameworks' functions.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_flops.flops.pipeline_split import FIELDS, PipelineSplit, parse_layout, split_stages, standalone_mtp_stage
from megatron_flops.memory.hybrid_pipeline import is_hybrid
from megatron_flops.memory.layout import Parallelism
from megatron_flops.model.spec import ModelSpec

# Megatron-LM 0.19's flag per split field it refuses beside a hybrid layer pattern (validate_args).
_HYBRID_REFUSED = {"pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
                   "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
                   "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split"}


def uneven_stages(split: PipelineSplit, par: Parallelism, *, spec: ModelSpec) -> Parallelism:
    """``par`` with ``split``'s virtual stages of ``spec`` as ``stage_layers`` (and a layout's VPP);
    ``par`` itself for an even split."""
    if not split.uneven or par.pp == 1:  # (one stage holds every layer: a file's split is for its PP run)
        return par
    if is_hybrid(spec):
        _hybrid_split_check(split)
    if par.stage_layers is not None:
        raise ValueError("megatron-core 0.19 refuses num_layers_in_first/last_pipeline_stage when the hybrid pattern "
                         "contains '|' separators: the pipeline layout is already explicitly defined by the pipe "
                         "separators")
    stages, vpp = split_stages(split, num_layers=spec.num_layers, pp=par.pp, vpp=par.vpp,
                               mtp_num_layers=spec.mtp_num_layers)
    return replace(par, vpp=vpp, stage_layers=stages, mtp_stage=standalone_mtp_stage(split))


def _hybrid_split_check(split: PipelineSplit) -> None:
    """Megatron-LM 0.19's refusal of the split fields a hybrid stack does not read."""
    given = [flag for field, flag in _HYBRID_REFUSED.items() if getattr(split, field) not in (None, False)]
    if given:
        raise ValueError(f"Megatron-LM 0.19 refuses {' and '.join(given)} with a hybrid layer pattern (\"Pipeline "
                         "stage layout is defined by | separators in the pattern\"; megatron-core 0.16.1's MambaStack "
                         "ignores it and takes num_layers // PP layers per rank): give the stages as '|' separators "
                         "in the pattern, or --decoder-first/last-pipeline-num-layers")


def dit_uneven_stages(split: PipelineSplit, par: Parallelism, *, num_layers: int) -> Parallelism:
    """``par`` with ``split``'s stages of a DiT's ``num_layers`` blocks as ``stage_layers`` (and a
    layout's VPP, which memory/dit_layouts.py refuses); ``par`` itself for an even split."""
    if not split.uneven or par.pp == 1:
        return par
    stages, vpp = split_stages(split, num_layers=num_layers, pp=par.pp, vpp=par.vpp)
    return replace(par, vpp=vpp, stage_layers=stages)


def split_note(split: PipelineSplit, par: Parallelism, *, hybrid: bool = False) -> list[str]:
    """The assumption an uneven split adds (none for an even one)."""
    if not split.uneven or par.stage_layers is None:
        return []
    builder = ("megatron-core 0.16.1's MambaStack (and 0.19's select_pipeline_segment) split the hybrid pattern"
               if hybrid else "megatron-core 0.16.1 splits them")
    return [f"pipeline stages as {builder} ({_given(split)}): decoder layers per virtual stage "
            f"{list(par.stage_layers)} (stage v x PP + r on model chunk v of pipeline rank r); the embedding on the "
            f"first virtual stage, the output layer and loss on the last{_edge_note(split)}"]


def _edge_note(split: PipelineSplit, *, names: tuple[str, str] = ("the embedding", "the output layer and loss"),
               layers: str = "the decoder and MTP layers", stage: str = "virtual stage") -> str:
    """Where a layout's empty edge stages leave the embedding and loss: megatron-core builds them
    where ``pre_process``/``post_process`` are true, not where the layout writes them (``stage``:
    what a layout's segment is, a virtual stage or, for a DiT without VPP, a stage)."""
    if split.pipeline_model_parallel_layout is None:
        return ""
    stages = parse_layout(split.pipeline_model_parallel_layout)
    where = [next(i for i, stage in enumerate(stages) if kind in stage) for kind in ("embedding", "loss")]
    moved = [f"{name} on {stage} {edge}, not stage {i} where the layout "
             f"writes {char}" for name, char, i, edge in zip(names, "EL", where, (0, len(stages) - 1)) if i != edge]
    if not moved:
        return ""
    return (f"; megatron-core builds {' and '.join(moved)} (pre_process/post_process place them; a layout decides "
            f"only {layers})")


def dit_split_note(split: PipelineSplit, par: Parallelism) -> list[str]:
    """The assumption an uneven split of a DiT's blocks adds (none for an even one)."""
    if not split.uneven or par.stage_layers is None:
        return []
    return [f"pipeline stages as megatron-core 0.19.2's get_num_layers_to_build places Megatron-Bridge 0.6.2's WanModel "
            f"blocks ({_given(split)}): blocks per stage {list(par.stage_layers)}; the patch embedding on the first "
            "stage, the head and loss on the last, the text and time embeddings on every stage"
            + _edge_note(split, names=("the patch embedding", "the head and loss"), layers="the blocks", stage="stage")]


def _given(split: PipelineSplit) -> str:
    return ", ".join(f"{k}={v!r}" for k in FIELDS if (v := getattr(split, k)) not in (None, False))
