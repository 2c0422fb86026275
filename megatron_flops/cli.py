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


def _parse_rows_arg(value: str) -> tuple[Row, ...]:
    text = value.strip()
    if not text.startswith("["):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"--seqlens: {value!r} is neither a JSON list nor a readable file ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--seqlens: invalid JSON: {exc}") from None
    return parse_rows(data)


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


def _format_report(report: dict[str, Any]) -> str:
    total = report["total_flops"]
    lines = [
        f"rows: {report['num_rows']}  sequences: {report['num_sequences']}  "
        f"tokens: {report['num_tokens']:,} real / {report['num_padded_tokens']:,} padded",
        f"attention convention: {report['attention']}",
        "",
        f"{'component':<24}{'FLOPs (fwd+bwd)':>26}{'share':>9}",
    ]
    for name, value in report["components"].items():
        lines.append(f"{name:<24}{value:>26,}{value / total:>9.1%}")
    lines += [
        f"{'total':<24}{total:>26,}",
        "",
        f"executed (padding included): {report['executed_flops']:,}",
        f"static (every row priced as {report['static_seq_length']} tokens): {report['static_flops']:,}"
        f"  -> over-reports {report['over_report_factor']:.2f}x",
    ]
    return "\n".join(lines)


def _cmd_estimate(args: argparse.Namespace) -> int:
    spec, _raw = load_model_file(args.model)
    if spec is None:
        raise ValueError(f"{args.model}: holds no decoder model")
    if args.seqlens is not None:
        if args.seq_length is not None or args.batch_size is not None:
            raise ValueError("give either --seqlens or --seq-length with --batch-size, not both")
        rows = _parse_rows_arg(args.seqlens)
    else:
        if args.seq_length is None or args.batch_size is None:
            raise ValueError("give --seqlens ROWS, or --seq-length N with --batch-size B")
        if args.seq_length <= 0 or args.batch_size <= 0:
            raise ValueError("--seq-length and --batch-size must be positive")
        rows = parse_rows([args.seq_length] * args.batch_size)
    report = estimate_report(spec, rows, attention=args.attention, seq_length=args.seq_length)
    if args.json:
        print(json.dumps(report))
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
