"""``megatron-flops demo``: train a small megatron-core GPT on CPU, static vs corrected TFLOP/s/GPU."""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from megatron_flops.reporting.trace import TRACE_ENV as TRACE
from megatron_flops.flops.formulas import ATTENTION_CONVENTIONS


def _have_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no top-level ``megatron`` package
        return False


def _cmd_demo(args: argparse.Namespace) -> int:
    from megatron_flops.demo.data import DataConfig
    from megatron_flops.demo.run import DemoOptions, main as run_demo

    options = DemoOptions(
        pp=args.pp,
        vpp=args.vpp,
        dp=args.dp,
        iterations=args.iterations,
        num_microbatches=args.micro_batches,
        log_interval=args.log_interval,
        warmup=args.warmup,
        peak_tflops=args.peak_tflops,
        seed=args.seed,
        attention=args.attention,
        data=DataConfig(seq_length=args.pack_length, num_padded_rows=args.padded_rows),
        trace=args.flops_trace or os.environ.get(TRACE) or None,
    )
    if not _have_megatron_core():
        raise ValueError("the demo trains a megatron-core model: pip install megatron-core")
    return run_demo(options)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, checked before the demo imports torch."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_parser(sub: Any) -> None:
    """Register ``demo`` on the top-level subparsers."""
    demo = sub.add_parser(
        "demo",
        help="train a small megatron-core GPT on CPU and print static vs corrected TFLOP/s/GPU",
        description="Trains a small megatron-core GPT (4 layers, hidden 128) on CPU through megatron-core's own "
        "pipeline schedule, in one process or (--pp > 1) local gloo processes, on packed rows of whole documents "
        "and dynamically padded batches, and prints Megatron-style log lines with the stock formula's (static) "
        "and the corrected TFLOP/s/GPU, then a steady-state summary. Needs megatron-core; about 10 s on 2 cores.",
    )
    demo.add_argument("--pp", type=_at_least(1), default=1, help="pipeline stages (default 1: one process)")
    demo.add_argument("--vpp", type=_at_least(2), help="model chunks per pipeline stage, interleaved 1F1B "
                      "(default none; needs --pp >= 2)")
    demo.add_argument("--dp", type=_at_least(1), help="data-parallel replicas (default 2 with --pp > 1, else 1)")
    demo.add_argument("--iterations", type=_at_least(1), default=12, help="training iterations (default 12)")
    demo.add_argument("--micro-batches", type=_at_least(1), default=4,
                      help="micro-batches per iteration per replica (default 4)")
    demo.add_argument("--pack-length", type=_at_least(8), default=256,
                      help="tokens per packed row: the model's sequence length and the longest document (default 256)")
    demo.add_argument("--padded-rows", type=_at_least(1), default=4,
                      help="rows per dynamically padded micro-batch (default 4)")
    demo.add_argument("--log-interval", type=_at_least(1), default=1, help="iterations per log line (default 1)")
    demo.add_argument("--warmup", type=_at_least(0), default=2,
                      help="iterations left out of the steady-state summary (default 2)")
    demo.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one device, for MFU (default none: a CPU "
                      "has no peak in the table)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the model weights and of each rank's data (default 0)")
    demo.add_argument("--attention", choices=ATTENTION_CONVENTIONS, default="causal",
                      help="core-attention convention of the corrected number: causal halves the s^2 product "
                           "(Megatron-LM's, the default), full counts every query/key pair")
    demo.add_argument("--flops-trace", metavar="FILE", help="append the per-step trace (JSON Lines) to FILE "
                      f"(default: ${TRACE}, else none); read it with megatron-flops compare")
    demo.set_defaults(func=_cmd_demo)
