"""``memory``'s uneven pipeline split flags (Megatron-LM's names), over what the model file or
``--megatron-args`` command line says (:mod:`megatron_flops.memory.pipeline_split`)."""

from __future__ import annotations

import argparse

from megatron_flops.cli._model_args import LoadedModel
from megatron_flops.flops.pipeline_split import FIELDS as SPLIT_FIELDS
from megatron_flops.flops.pipeline_split import PipelineSplit

# Flag dest -> TransformerConfig field (the names Megatron-LM passes them under).
_FLAGS = {
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split": "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split": "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout": "pipeline_model_parallel_layout",
}
__all__ = ["SPLIT_FIELDS", "add_split_arguments", "pipeline_split"]


def add_split_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, metavar="N",
                        help="decoder layers (a DiT: blocks) on the first pipeline rank (the rest split evenly "
                             "over the others; default: the model file's num_layers_in_first_pipeline_stage or "
                             "--megatron-args')")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N",
                        help="decoder layers (a DiT: blocks) on the last pipeline rank (default: the model file's "
                             "num_layers_in_last_pipeline_stage or --megatron-args')")
    parser.add_argument("--account-for-embedding-in-pipeline-split", action="store_true", default=None,
                        help="count the embedding as a layer when splitting the layers over pipeline ranks")
    parser.add_argument("--account-for-loss-in-pipeline-split", action="store_true", default=None,
                        help="count the output layer and loss as a layer when splitting the layers over pipeline ranks")
    parser.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                        help="megatron-core's layer layout per virtual stage, e.g. 'Et|(tt|)*2,tL' (E embedding, "
                             "t decoder layer or DiT block, m MTP, L loss; '|' between stages v x PP + r; "
                             "VPP = stages / PP)")


def pipeline_split(args: argparse.Namespace, model: LoadedModel) -> PipelineSplit:
    """The model file's or command line's split fields, each flag given overriding its field."""
    fields = {k: model.raw.get(k) for k in SPLIT_FIELDS}
    fields.update({field: getattr(args, dest) for dest, field in _FLAGS.items() if getattr(args, dest) is not None})
    return PipelineSplit.from_mapping(fields, source=model.source)
