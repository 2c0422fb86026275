"""The model-reading arguments ``estimate`` and ``memory`` share (one builder, so that any model
one command reads, the other reads), and the model they name."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatron_flops.model.hf_config import HF_FAMILIES, is_hf_config
from megatron_flops.model.spec import ModelOptions, ModelSpec, load_model_file


def add_model_arguments(parser: argparse.ArgumentParser, *, model_help: str) -> None:
    """``--model FILE`` or ``--megatron-args ARGS`` (one required), and the flags that say how
    to read them."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="FILE", help=model_help)
    source.add_argument("--megatron-args", metavar="ARGS",
                        help='the Megatron-LM arguments you launch with, quoted ("--num-layers 32 --hidden-size '
                             '4096 ... --swiglu"), or a file holding them or an args dump (.json/.yaml of vars(args))')
    parser.add_argument("--megatron-release", metavar="TAG",
                        help="with --megatron-args: accept only this Megatron-LM release's options and use its "
                             "defaults (core_v0.14.0, core_v0.16.1 or core_v0.19.0; default: any of them, with the "
                             "defaults of the newest release that has every option given)")
    parser.add_argument("--hf-family", choices=HF_FAMILIES,
                        help="read a Hugging Face config.json of a model_type we do not know with this family's "
                             "rules; refused (exit 2, the key named) when the file shows another architecture")
    parser.add_argument("--pad-vocab-to-multiple", type=int, metavar="N",
                        help="pad the vocabulary to a multiple of N, as Megatron-LM does with "
                             "make_vocab_size_divisible_by x TP (1: no padding). Default: the file's "
                             "make_vocab_size_divisible_by; else 128 x TP for megatron-core fields and "
                             "Megatron-LM args, no padding for a Hugging Face config.json (estimate; memory pads "
                             "it to 128 x TP, as Megatron-Bridge does)")
    parser.add_argument("--mtp-num-layers", type=int, metavar="N",
                        help="multi-token-prediction layers trained, overriding the model file (a Hugging Face "
                             "file's num_nextn_predict_layers is counted only with this flag)")


def model_options(args: argparse.Namespace) -> ModelOptions:
    return ModelOptions(hf_family=args.hf_family, vocab_multiple=args.pad_vocab_to_multiple,
                        mtp_num_layers=args.mtp_num_layers)


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """The model (None: a vision-only or DiT file), the raw mapping its other sections come from (a
    command line's recompute and pipeline fields), a source name for messages, the training
    sequence length, and the Megatron-LM arguments it came from (else None)."""

    spec: ModelSpec | None
    raw: dict[str, Any]
    source: str
    seq_length: int | None
    megatron_args: SimpleNamespace | None = None


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model of ``--model`` or ``--megatron-args``, read as the other flags say."""
    options = model_options(args)
    if args.megatron_args is not None:
        from megatron_flops.model.megatron_args import load_megatron_args, model_spec, training_fields

        if args.hf_family is not None:
            raise ValueError("--hf-family applies to a Hugging Face config.json (--model), not to --megatron-args")
        namespace, source = load_megatron_args(args.megatron_args, release=args.megatron_release)
        spec: ModelSpec | None = model_spec(namespace, source, options=options)
        seq_length = args.seq_length if args.seq_length is not None else namespace.seq_length
        return LoadedModel(spec=spec, raw=training_fields(namespace), source=source, seq_length=seq_length,
                           megatron_args=namespace)
    if args.megatron_release is not None:
        raise ValueError("--megatron-release applies to --megatron-args, not to --model")
    spec, raw = load_model_file(args.model, options=options)
    if args.hf_family is not None and not is_hf_config(raw):
        raise ValueError(f"--hf-family applies to a Hugging Face config.json; {Path(args.model).name} holds "
                         "megatron-core fields")
    return LoadedModel(spec=spec, raw=raw, source=Path(args.model).name, seq_length=args.seq_length)
