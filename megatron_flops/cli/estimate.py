"""``megatron-flops estimate``: training FLOPs of a model over given rows (or vision grids, or DiT clips)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from megatron_flops.flops.formulas import ATTENTION_CONVENTIONS, Row, SeqStats, parse_rows, training_flops
from megatron_flops.flops.passes import (
    GROUPED_EXPERT_ADAPTERS,
    LORA_TARGETS,
    MODEL_FLOPS_CONVENTIONS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
    PeftSpec,
    check_recompute_modules,
    RecomputeSpec,
    price,
)
from megatron_flops.flops.pipeline_split import first_stage_without_decoder
from megatron_flops.cli._common import format_components, json_list_arg
from megatron_flops.cli._memory_model import grouped_gemm_experts, routed_expert_adapters
from megatron_flops.cli._model_args import LoadedModel, add_model_arguments, load_model
from megatron_flops.memory.hybrid_pipeline import is_hybrid
from megatron_flops.cli._dit import add_arguments as add_dit_arguments, estimate_dit
from megatron_flops.model.hf_config import hf_text_config, is_hf_config
from megatron_flops.model.spec import ModelSpec

# --batch-size builds one row per sample only for a DiT file; the decoder prices it in O(1).
MAX_BATCH_SIZE = 1 << 20


def _parse_rows_arg(flag: str, value: str) -> tuple[Row, ...]:
    try:
        return parse_rows(json_list_arg(flag, value))
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(flag) else f"{flag}: {message}") from None


def estimate_report(
    spec: ModelSpec,
    rows: Sequence[Row],
    *,
    attention: str = "causal",
    seq_length: int | None = None,
    peft: PeftSpec | None = None,
    recompute: RecomputeSpec | None = None,
    convention: str = "needed",
    decoder_input_grad: bool = False,
) -> dict[str, Any]:
    """Everything ``estimate --json`` prints: totals, components, statistics, and the static
    number that prices every row as one ``seq_length``-token sequence (default: the longest
    row), as the stock formula does. With ``peft`` or ``recompute``, model FLOPs follow
    ``convention`` and executed FLOPs add recompute and the GEMMs megatron-core runs unneeded
    (:mod:`megatron_flops.flops.passes`; ``decoder_input_grad``: a first pipeline stage without
    decoder layers)."""
    stats = SeqStats.from_rows(rows, window=spec.pair_window)
    static_len = seq_length or max(r.num_padded_tokens for r in rows)
    return _report(spec, stats, static_len, attention=attention, peft=peft, recompute=recompute,
                   convention=convention, decoder_input_grad=decoder_input_grad)


def _report(
    spec: ModelSpec,
    stats: SeqStats,
    static_len: int,
    *,
    attention: str,
    peft: PeftSpec | None,
    recompute: RecomputeSpec | None,
    convention: str,
    decoder_input_grad: bool = False,
) -> dict[str, Any]:
    priced = price(spec, stats, attention=attention, peft=peft, recompute=recompute, convention=convention,
                   decoder_input_grad=decoder_input_grad)
    model, executed = priced.model, priced.executed
    static = training_flops(spec, SeqStats.full_length(stats.num_rows, static_len, window=spec.pair_window),
                            attention=attention)
    return {
        "total_flops": model.total,
        "components": dict(model.components),
        "executed_flops": executed.total,
        "executed_components": dict(executed.components),
        "recompute_flops": priced.recompute_flops,
        "unneeded_flops": priced.unneeded_flops,
        "model_flops_convention": convention,
        "static_flops": static.total,
        "static_seq_length": static_len,
        "over_report_factor": static.total / model.total,
        "attention": attention,
        "num_rows": stats.num_rows,
        "num_sequences": stats.num_sequences,
        "num_tokens": stats.num_tokens,
        "num_padded_tokens": stats.num_padded_tokens,
        "sum_seqlen_squared": stats.sum_seqlen_squared,
        "vocab_size": spec.vocab_size,
        "padded_vocab_size": spec.padded_vocab_size,
    }


def _format_vision(report: dict[str, Any]) -> str:
    head = (f"vision tower: {report['num_images']} grids, {report['num_frames']} frames, "
            f"{report['num_patches']:,} patches -> {report['num_visual_tokens']:,} visual tokens")
    return "\n".join([head, "attention: full (within each frame or window)", "",
                      *format_components(report["components"], report["total_flops"])])


def _format_report(report: dict[str, Any]) -> str:
    total = report["total_flops"]
    lines = [
        f"rows: {report['num_rows']}  sequences: {report['num_sequences']}  "
        f"tokens: {report['num_tokens']:,} real / {report['num_padded_tokens']:,} padded",
        f"attention convention: {report['attention']}",
        f"vocabulary as priced: {report['padded_vocab_size']:,}" + (
            f" (padded from {report['vocab_size']:,})" if report["padded_vocab_size"] != report["vocab_size"] else ""),
        "",
        *format_components(report["components"], total),
        "",
        f"executed (padding included): {report['executed_flops']:,}",
        *([f"  of which recompute {report['recompute_flops']:,}, unneeded GEMMs {report['unneeded_flops']:,}"]
          if report["recompute_flops"] or report["unneeded_flops"] else []),
        f"static (every row priced as {report['static_seq_length']} tokens): {report['static_flops']:,}"
        f"  -> over-reports {report['over_report_factor']:.2f}x",
    ]
    return "\n".join(lines)


def _rows_from_args(args: argparse.Namespace, seq_length: int | None) -> tuple[Row, ...] | None:
    """The rows to price; ``seq_length`` is the training sequence length (``--seq-length``, else a
    Megatron-LM command line's): with ``--seqlens`` it is only the static length."""
    if seq_length is not None and seq_length <= 0:
        raise ValueError(f"--seq-length must be positive, got {seq_length}")
    if args.seqlens is not None:
        if args.batch_size is not None:
            raise ValueError("--batch-size goes with --seq-length alone: --seqlens gives the rows themselves")
        rows = _parse_rows_arg("--seqlens", args.seqlens)
        if seq_length is not None:
            for i, row in enumerate(rows):
                if row.num_padded_tokens > seq_length:
                    raise ValueError(f"--seqlens rows[{i}] holds {row.num_padded_tokens:,} tokens, more than "
                                     f"--seq-length {seq_length:,}")
        return rows
    batch_size = args.batch_size
    if batch_size is None:
        if args.seq_length is None:
            return None
        batch_size = 1  # --seq-length N alone: one row
    if seq_length is None:
        raise ValueError("--batch-size B needs --seq-length N")
    if not 0 < batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"--batch-size must be between 1 and {MAX_BATCH_SIZE:,}, got {batch_size}")
    return (Row(seqlens=(seq_length,), padded_seqlens=(seq_length,), num_padded_tokens=seq_length),) * batch_size


def _add_vision(report: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """Combine a decoder report with the vision tower's (executed) FLOPs."""
    merged = dict(report)
    merged["components"] = {**report["components"], **vision["components"]}
    merged["total_flops"] = report["total_flops"] + vision["total_flops"]
    merged["executed_flops"] = report["executed_flops"] + vision["total_flops"]
    merged["executed_components"] = {**report["executed_components"], **vision["components"]}
    merged["vision"] = vision
    # NB: the static number leaves the vision tower out, as stock language-model formulas do.
    merged["over_report_factor"] = report["static_flops"] / merged["total_flops"]
    return merged


def _training_setup(
    args: argparse.Namespace, raw: dict[str, Any], source: str
) -> tuple[PeftSpec | None, RecomputeSpec | None]:
    """Frozen weights and LoRA (the model file's ``"lora"`` section, then the flags) and
    recompute (the model file's or command line's ``recompute_*`` fields, then the flags)."""
    peft = PeftSpec.from_lora_mapping(raw["lora"], source=source) if raw.get("lora") is not None else None
    if args.lora_targets is not None and args.lora_rank is None and peft is None:
        raise ValueError("--lora-targets needs --lora-rank")
    grouped = getattr(args, "lora_grouped_experts", None)
    if grouped is not None and args.lora_rank is None and (peft is None or peft.lora_rank is None):
        raise ValueError("--lora-grouped-experts needs --lora-rank")
    if args.frozen or args.lora_rank is not None or args.lora_targets is not None or grouped is not None:
        base = peft or PeftSpec()
        peft = PeftSpec(
            frozen=args.frozen or base.frozen,
            lora_rank=base.lora_rank if args.lora_rank is None else args.lora_rank,
            lora_targets=base.lora_targets if args.lora_targets is None
            else tuple(t.strip() for t in args.lora_targets.split(",")),
            grouped_expert_adapters=base.grouped_expert_adapters if grouped is None else grouped,
        )
    flags = {
        "recompute_granularity": args.recompute,
        "recompute_method": args.recompute_method,
        "recompute_num_layers": args.recompute_num_layers,
        "recompute_modules": None if args.recompute_modules is None else args.recompute_modules.split(","),
    }
    fields = {**raw, **{k: v for k, v in flags.items() if v is not None}}
    if fields.get("recompute_granularity") is None and any(v is not None for v in flags.values()):
        raise ValueError(
            "--recompute-method/--recompute-num-layers/--recompute-modules need --recompute full|selective"
        )
    return peft, RecomputeSpec.from_mapping(fields, source=source)


def _notes(args: argparse.Namespace, raw: dict[str, Any]) -> list[str]:
    """Conventions the user should know about for this model file."""
    if args.megatron_args is not None or not is_hf_config(raw) or args.mtp_num_layers is not None:
        return []
    text = hf_text_config(raw) or {}
    mtp = text.get("num_nextn_predict_layers")
    if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0:
        return [f"num_nextn_predict_layers={mtp} (multi-token prediction) is not counted: transformers does "
                f"not run it; --mtp-num-layers {mtp} counts it as Megatron-LM trains it"]
    return []


def _hybrid_mtp_notes(args: argparse.Namespace, model: LoadedModel) -> list[str]:
    """A hybrid pattern without '/' beside mtp_num_layers: megatron-core builds no MTP layers."""
    spec = model.spec
    if spec is None or spec.mtp_num_layers or not is_hybrid(spec):
        return []
    asked = args.mtp_num_layers if args.mtp_num_layers is not None else \
        getattr(model.megatron_args, "mtp_num_layers", None) if model.megatron_args is not None else \
        model.raw.get("mtp_num_layers")
    if not isinstance(asked, int) or isinstance(asked, bool) or asked <= 0:
        return []
    return [f"mtp_num_layers={asked} is not counted: megatron-core builds no multi-token prediction layers for a "
            "hybrid pattern without '/' (0.19's HybridModel builds one depth per part after '/', e.g. "
            "'M*-M/*-'; 0.16.1's MambaModel has none)"]


def _cmd_estimate(args: argparse.Namespace) -> int:
    model = load_model(args)
    spec, raw, source, seq_length = model.spec, model.raw, model.source, model.seq_length
    rows = _rows_from_args(args, seq_length)
    if "dit" in raw:
        return estimate_dit(args, raw, rows)
    for flag, value in (("--kv-seqlens", args.kv_seqlens), ("--image-seqlens", args.image_seqlens)):
        if value is not None:
            raise ValueError(f"{flag} prices cross-attention: give a DiT model file (a 'dit' section)")
    peft, recompute = _training_setup(args, raw, source)
    if peft is not None and peft.lora_rank is not None and spec is not None and spec.moe is not None \
            and not routed_expert_adapters(model):
        peft = replace(peft, expert_adapters=False)
    empty_first = False
    if spec is not None:
        check_recompute_modules(spec, recompute, grouped_gemm=grouped_gemm_experts(model))
        empty_first = peft is not None and first_stage_without_decoder(
            raw, num_layers=spec.num_layers, mtp_num_layers=spec.mtp_num_layers, source=source)
    vision = None
    if args.grid_thw is not None:
        from megatron_flops.flops.vision import hf_vision_sections, vision_report

        if hf_vision_sections(raw) is None:
            raise ValueError(f"--grid-thw prices a vision tower, but {source} has no 'vision_config' "
                             "(a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-Omni config.json)")
        vision = vision_report(raw, json_list_arg("--grid-thw", args.grid_thw))
    if rows is None and vision is None:
        raise ValueError("give --seqlens ROWS, --seq-length N with --batch-size B, or --grid-thw GRIDS")
    if rows is None:
        assert vision is not None
        report = vision
    else:
        if spec is None:
            raise ValueError(f"{source}: holds no decoder model to price --seqlens with")
        if args.seqlens is None:  # --seq-length N --batch-size B: identical rows, priced in O(1)
            assert seq_length is not None
            stats = SeqStats.full_length(len(rows), seq_length, window=spec.pair_window)
            report = _report(spec, stats, seq_length, attention=args.attention, peft=peft, recompute=recompute,
                             convention=args.convention, decoder_input_grad=empty_first)
        else:
            report = estimate_report(spec, rows, attention=args.attention, seq_length=seq_length, peft=peft,
                                     recompute=recompute, convention=args.convention, decoder_input_grad=empty_first)
        if vision is not None:
            report = _add_vision(report, vision)
    notes = _notes(args, raw) + _hybrid_mtp_notes(args, model)
    for note in notes:
        print(f"megatron-flops: note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({**report, "notes": notes} if notes else report))
    elif rows is None:
        print(_format_vision(report))
    else:
        print(_format_report(report))
    return 0


_SEQLENS_HELP = (
    'the rows of a step: a JSON list, inline or in a JSON/YAML file. Each row is an integer (one '
    'unpacked sequence), a list of integers (a packed row of sub-sequences), or {"seqlens": ..., '
    '"padded_seqlens": [...], "pad_to": N} for padded rows: an unpacked sequence padded to pad_to is '
    'attended over pad_to tokens; a packed row\'s tail past its padded_seqlens runs only the linear layers'
)


def add_parser(sub: Any) -> None:
    """Register ``estimate`` on the top-level subparsers."""
    est = sub.add_parser(
        "estimate", help="training FLOPs (forward + backward) of a model over rows",
        description="Training FLOPs (forward + backward GEMMs) of a model over the rows of a step, with the "
                    "static number the stock formula reports for them.",
    )
    add_model_arguments(est, model_help="a JSON/YAML file of megatron-core TransformerConfig fields + vocab_size, "
                                        "or a Hugging Face config.json (YAML needs pip install 'megatron-flops[yaml]')")
    est.add_argument("--seqlens", metavar="ROWS", help=_SEQLENS_HELP)
    est.add_argument("--seq-length", type=int, metavar="N",
                     help="the training sequence length: with --batch-size, B rows of one N-token sequence; "
                          "with --seqlens, the length the static number prices each row at")
    est.add_argument("--batch-size", type=int, metavar="B", help="number of rows (with --seq-length; default 1)")
    est.add_argument("--grid-thw", metavar="GRIDS",
                     help="JSON list of [t, h, w] vision grids (inline or a file): prices the vision tower")
    est.add_argument("--attention", choices=ATTENTION_CONVENTIONS, default="causal",
                     help="core-attention convention: causal halves the s^2 product (Megatron-LM's, the "
                          "default), full counts every query/key pair")
    est.add_argument("--kv-seqlens", metavar="ROWS",
                     help="DiT model file: JSON list of text (key/value) tokens per sample, paired with --seqlens")
    est.add_argument("--frozen", action="store_true", help="freeze every base weight (train only the LoRA adapters)")
    est.add_argument("--lora-rank", type=int, metavar="R",
                     help="add rank-R LoRA adapters (model file: 'lora': {'dim': R})")
    est.add_argument("--lora-targets", metavar="NAMES",
                     help=f"comma-separated projections to adapt, of {','.join(LORA_TARGETS)}")
    est.add_argument("--lora-grouped-experts", choices=GROUPED_EXPERT_ADAPTERS,
                     help="Megatron-Bridge 0.6's adapters on grouped-GEMM (TEGroupedMLP) experts: one shared by "
                          "the local experts (default; share_expert_adapters), one per expert, or shared-outer "
                          "(experts_shared_outer_loras); the same FLOPs")
    est.add_argument("--recompute", choices=RECOMPUTE_GRANULARITIES,
                     help="activation recompute granularity (default: the model file's recompute_granularity)")
    est.add_argument("--recompute-method", choices=RECOMPUTE_METHODS,
                     help="full recompute: uniform (every layer) or block (the first --recompute-num-layers "
                          "layers of each pipeline model chunk)")
    est.add_argument("--recompute-num-layers", type=int, metavar="N",
                     help="full recompute: layers per checkpointed group (uniform) or recomputed layers per "
                          "pipeline model chunk (block)")
    est.add_argument("--recompute-modules", metavar="NAMES",
                     help=f"comma-separated selective recompute modules, of {','.join(RECOMPUTE_MODULES)} "
                          "(default core_attn)")
    est.add_argument("--convention", choices=MODEL_FLOPS_CONVENTIONS, default="needed",
                     help="model FLOPs: GEMMs training needs (default) or TRAIN_PASSES x every forward GEMM")
    est.add_argument("--json", action="store_true", help="print one JSON object")
    add_dit_arguments(est)
    est.set_defaults(func=_cmd_estimate)
