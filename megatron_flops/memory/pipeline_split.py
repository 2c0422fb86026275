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

from dataclasses import replace

from megatron_flops.flops.pipeline_split import FIELDS, PipelineSplit, split_stages
from megatron_flops.memory.hybrid_pipeline import is_hybrid
from megatron_flops.memory.layout import Parallelism
from megatron_flops.model.spec import ModelSpec


def uneven_stages(split: PipelineSplit, par: Parallelism, *, spec: ModelSpec) -> Parallelism:
    """``par`` with ``split``'s virtual stages of ``spec`` as ``stage_layers`` (and a layout's VPP);
    ``par`` itself for an even split."""
    if not split.uneven or par.pp == 1:  # (one stage holds every layer: a file's split is for its PP run)
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
    return replace(par, vpp=vpp, stage_layers=stages)


def split_note(split: PipelineSplit, par: Parallelism) -> list[str]:
    """The assumption an uneven split adds (none for an even one)."""
    if not split.uneven or par.stage_layers is None:
        return []
    given = ", ".join(f"{k}={v!r}" for k in FIELDS if (v := getattr(split, k)) not in (None, False))
    return [f"pipeline stages as megatron-core 0.16.1 splits them ({given}): decoder layers per virtual stage "
            f"{list(par.stage_layers)} (stage v x PP + r on model chunk v of pipeline rank r); the embedding on the "
            "first virtual stage, the output layer and loss on the last"]
