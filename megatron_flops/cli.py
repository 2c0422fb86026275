"""Command line: ``megatron-flops estimate`` (FLOPs of a model over given rows) and ``demo``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_flops.formulas import ATTENTION_CONVENTIONS, Row, SeqStats, parse_rows, training_flops
from megatron_flops.spec import ModelSpec, load_model_file


def _json_list_arg(flag: str, value: str) -> Any:
    """A JSON list given inline or as a file path."""
    text = value.strip()
    if not text.startswith("["):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"{flag}: {value!r} is neither a JSON list nor a readable file ({exc.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: invalid JSON: {exc}") from None


def _static_stats(rows: Sequence[Row], seq_length: int, window: int | None) -> SeqStats:
    return SeqStats.full_length(len(rows), seq_length, window=window)


def estimate_report(
    spec: ModelSpec,
    rows: Sequence[Row],
    *,
    attention: str = "causal",
    seq_length: int | None = None,
) -> dict[str, Any]:
    """Everything ``estimate --json`` prints: totals, components, statistics, and the static
    number that prices every row as one full ``seq_length`` sequence."""
    stats = SeqStats.from_rows(rows, window=spec.window_size)
    model = training_flops(spec, stats, attention=attention)
    executed = training_flops(spec, stats, attention=attention, include_padding=True)
    static_len = seq_length or max(r.num_padded_tokens for r in rows)
    static = training_flops(spec, _static_stats(rows, static_len, spec.window_size), attention=attention)
    return {
        "total_flops": model.total,
        "components": dict(model.components),
        "executed_flops": executed.total,
        "executed_components": dict(executed.components),
        "static_flops": static.total,
        "static_seq_length": static_len,
        "over_report_factor": static.total / model.total,
        "attention": attention,
        "num_rows": stats.num_rows,
        "num_sequences": stats.num_sequences,
        "num_tokens": stats.num_tokens,
        "num_padded_tokens": stats.num_padded_tokens,
        "sum_seqlen_squared": stats.sum_seqlen_squared,
        "padded_vocab_size": spec.padded_vocab_size,
    }


def _format_components(components: dict[str, int], total: int) -> list[str]:
    lines = [f"{'component':<24}{'FLOPs (fwd+bwd)':>26}{'share':>9}"]
    for name, value in components.items():
        lines.append(f"{name:<24}{value:>26,}{value / total:>9.1%}")
    lines.append(f"{'total':<24}{total:>26,}")
    return lines


def _format_vision(report: dict[str, Any]) -> str:
    head = (f"vision tower: {report['num_images']} grids, {report['num_frames']} frames, "
            f"{report['num_patches']:,} patches -> {report['num_visual_tokens']:,} visual tokens")
    return "\n".join([head, "attention: full (within each frame or window)", "",
                      *_format_components(report["components"], report["total_flops"])])


def _format_report(report: dict[str, Any]) -> str:
    total = report["total_flops"]
    lines = [
        f"rows: {report['num_rows']}  sequences: {report['num_sequences']}  "
        f"tokens: {report['num_tokens']:,} real / {report['num_padded_tokens']:,} padded",
        f"attention convention: {report['attention']}",
        "",
        *_format_components(report["components"], total),
        "",
        f"executed (padding included): {report['executed_flops']:,}",
        f"static (every row priced as {report['static_seq_length']} tokens): {report['static_flops']:,}"
        f"  -> over-reports {report['over_report_factor']:.2f}x",
    ]
    return "\n".join(lines)


def _rows_from_args(args: argparse.Namespace) -> tuple[Row, ...] | None:
    if args.seqlens is not None:
        if args.seq_length is not None or args.batch_size is not None:
            raise ValueError("give either --seqlens or --seq-length with --batch-size, not both")
        return parse_rows(_json_list_arg("--seqlens", args.seqlens))
    if args.seq_length is None and args.batch_size is None:
        return None
    if args.seq_length is None or args.batch_size is None:
        raise ValueError("give --seqlens ROWS, or --seq-length N with --batch-size B")
    if args.seq_length <= 0 or args.batch_size <= 0:
        raise ValueError("--seq-length and --batch-size must be positive")
    return parse_rows([args.seq_length] * args.batch_size)


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


def _cmd_estimate(args: argparse.Namespace) -> int:
    spec, raw = load_model_file(args.model)
    rows = _rows_from_args(args)
    vision = None
    if args.grid_thw is not None:
        from megatron_flops.vision import vision_report

        vision = vision_report(raw, _json_list_arg("--grid-thw", args.grid_thw))
    if rows is None and vision is None:
        raise ValueError("give --seqlens ROWS, --seq-length N with --batch-size B, or --grid-thw GRIDS")
    if rows is None:
        report = vision
    else:
        if spec is None:
            raise ValueError(f"{args.model}: holds no decoder model to price --seqlens with")
        report = estimate_report(spec, rows, attention=args.attention, seq_length=args.seq_length)
        if vision is not None:
            report = _add_vision(report, vision)
    if args.json:
        print(json.dumps(report))
    elif rows is None:
        print(_format_vision(report))
    else:
        print(_format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-flops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="training FLOPs (forward + backward) of a model over rows")
    est.add_argument("--model", required=True, help="JSON/YAML of TransformerConfig fields + vocab_size, or a HF config.json")
    est.add_argument("--seqlens", help="JSON list of rows (int: a sequence; list: a packed row), or a file holding one")
    est.add_argument("--seq-length", type=int, help="every row one sequence of N tokens (with --batch-size)")
    est.add_argument("--batch-size", type=int, help="number of rows (with --seq-length)")
    est.add_argument("--grid-thw", help="JSON list of [t, h, w] vision grids (or a file): prices the vision tower")
    est.add_argument("--attention", choices=ATTENTION_CONVENTIONS, default="causal")
    est.add_argument("--json", action="store_true", help="print one JSON object")
    est.set_defaults(func=_cmd_estimate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user errors exit 2 with one line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"megatron-flops: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
