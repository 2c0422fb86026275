"""``megatron-flops compare``: steady-state throughput of runs from their per-step traces."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from megatron_flops.reporting.runs import METRICS, SEGMENT_CHOICES, RunStats, comparability, read_trace, run_stats

LABELS = {
    "step_time_s": "step time (ms)",
    "tflops_per_gpu": "corrected TFLOP/s/GPU",
    "static_tflops_per_gpu": "static TFLOP/s/GPU",
    "tokens_per_s_per_gpu": "tokens/s/GPU",
    "mfu_percent": "MFU (%)",
    "hfu_percent": "HFU (%)",
}
# Ratios against the first run: higher is faster for all but step time.
RATIO_METRICS = ("tflops_per_gpu", "tokens_per_s_per_gpu", "step_time_s")


def load_runs(
    paths: Sequence[str], *, warmup: int | None, segments: str, peak_tflops: float | None
) -> tuple[list[RunStats], list[str]]:
    """Statistics of every trace, in order, and the notes and comparability warnings."""
    if peak_tflops is not None and not peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be positive, got {peak_tflops}")
    peak = None if peak_tflops is None else peak_tflops * 1e12
    runs: list[RunStats] = []
    notes: list[str] = []
    for path in paths:
        trace = read_trace(path)
        notes.extend(trace.notes)
        runs.append(run_stats(trace, warmup=warmup, segments=segments, peak_flops_per_s=peak))
    return runs, notes + comparability(runs)


def run_record(run: RunStats, base: RunStats | None = None) -> dict[str, Any]:
    """One run as ``compare --json`` prints it: counts, then ``median_``/``q1_``/``q3_``/``min_``/
    ``max_`` of every metric (null where unknown), then ratios of medians against ``base``."""
    header = run.header
    record: dict[str, Any] = {
        "trace": run.name,
        "num_steps": run.num_steps,
        "num_warmup_steps": run.num_warmup_steps,
        "num_failed_steps": run.num_failed_steps,
        "num_segments": run.num_segments,
        "world_size": run.world_size,
        "framework": header.get("framework"),
        "framework_version": header.get("framework_version"),
    }
    for metric in METRICS:
        spread = run.metrics.get(metric)
        for stat in ("median", "q1", "q3", "min", "max"):
            record[f"{stat}_{metric}"] = None if spread is None else getattr(spread, stat)
    if base is not None:
        for metric in RATIO_METRICS:
            ours, theirs = run.median(metric), base.median(metric)
            record[f"ratio_{metric}"] = None if ours is None or not theirs else ours / theirs
    return record


def _fmt(metric: str, value: float) -> str:
    return f"{1000 * value:.1f}" if metric == "step_time_s" else f"{value:.4g}"


def format_run(index: int, run: RunStats, base: RunStats) -> list[str]:
    """A block of lines for one run: what it is, then median [IQR] min-max of every known metric."""
    header = run.header
    version = header.get("framework_version")
    framework = f"{header.get('framework', '?')}{' ' + version if version else ''}"
    gpus = f"{run.world_size} GPU{'s' if run.world_size > 1 else ''}"
    segments = f", {run.num_segments} segments" if run.num_segments > 1 else ""
    lines = [
        f"run {index}: {run.name} ({framework}, {gpus}{segments}; {run.num_steps} steps used, "
        f"{run.num_warmup_steps} warm-up, {run.num_failed_steps} fell back)"
    ]
    record = run_record(run, base)
    for metric in ("step_time_s", *[m for m in METRICS if m != "step_time_s"]):
        spread = run.metrics.get(metric)
        if spread is None:
            continue
        text = (f"  {LABELS[metric]:<24} median {_fmt(metric, spread.median):>9}   IQR {_fmt(metric, spread.q1)}-"
                f"{_fmt(metric, spread.q3)}   min-max {_fmt(metric, spread.min)}-{_fmt(metric, spread.max)}")
        ratio = record.get(f"ratio_{metric}")
        if index > 1 and ratio is not None:
            text += f"   {ratio:.3f}x run 1"
        lines.append(text)
    return lines


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.plot:
        from megatron_flops.cli.plot import require_matplotlib

        require_matplotlib("--plot")
    runs, warnings = load_runs(args.traces, warmup=args.warmup, segments=args.segments, peak_tflops=args.peak_tflops)
    if args.json:
        records = [run_record(run, runs[0]) for run in runs]
        print(json.dumps({"runs": records, "warnings": warnings}, indent=2))
    else:
        for index, run in enumerate(runs, start=1):
            print("\n".join(format_run(index, run, runs[0])))
    for warning in warnings:
        print(f"megatron-flops: warning: {warning}", file=sys.stderr)
    if args.plot:
        from megatron_flops.cli.plot import plot_runs

        plot_runs(runs, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``compare`` on the top-level subparsers."""
    compare = sub.add_parser(
        "compare",
        help="steady-state TFLOP/s/GPU, tokens/s/GPU and step time of runs from their --flops-trace files",
        description="Median and spread of each run's per-step throughput after warm-up, without the steps "
        "that fell back; ratios against the first run; warns when runs are not comparable.",
    )
    compare.add_argument("traces", nargs="+", metavar="TRACE", help="a trace file written by --flops-trace")
    compare.add_argument("--warmup", type=int, help="steps left out at the start of every run or restart "
                         "(default: the trace header's warmup_iterations)")
    compare.add_argument("--segments", choices=SEGMENT_CHOICES, default="all",
                         help="a file appended to by restarts holds several runs: pool them (all, they must "
                         "match) or use the newest (last)")
    compare.add_argument("--peak-tflops", type=float, help="one GPU's dense peak TFLOP/s for MFU/HFU "
                         "(default: the trace header's)")
    compare.add_argument("--json", action="store_true", help="print the statistics as JSON")
    compare.add_argument("--plot", metavar="FILE.png", help="draw static and corrected TFLOP/s/GPU per iteration, "
                         "one panel per run (needs matplotlib)")
    compare.set_defaults(func=_cmd_compare)
