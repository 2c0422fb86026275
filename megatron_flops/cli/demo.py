"""``megatron-flops demo``: train a small megatron-core GPT on CPU, static vs corrected TFLOP/s/GPU."""

from __future__ import annotations

import argparse
import importlib.util
import os
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


def add_parser(sub: Any) -> None:
    """Register ``demo`` on the top-level subparsers."""
    demo = sub.add_parser("demo", help="train a small megatron-core GPT on CPU and print static vs corrected TFLOP/s/GPU")
    demo.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1: one process)")
    demo.add_argument("--vpp", type=int, help="model chunks per pipeline stage (interleaved 1F1B)")
    demo.add_argument("--dp", type=int, help="data-parallel replicas (default 2 with --pp > 1, else 1)")
    demo.add_argument("--iterations", type=int, default=12, help="training iterations (default 12)")
    demo.add_argument("--micro-batches", type=int, default=4, help="micro-batches per iteration per replica")
    demo.add_argument("--pack-length", type=int, default=256,
                      help="tokens per packed row: the model's sequence length and the longest document (default 256)")
    demo.add_argument("--padded-rows", type=int, default=4,
                      help="rows per dynamically padded micro-batch (default 4)")
    demo.add_argument("--log-interval", type=int, default=1, help="iterations per log line")
    demo.add_argument("--warmup", type=int, default=2, help="iterations left out of the steady-state summary")
    demo.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one device, for MFU (a CPU has none)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the model weights and of each rank's data (default 0)")
    demo.add_argument("--attention", choices=ATTENTION_CONVENTIONS, default="causal",
                      help="core-attention convention of the corrected number: causal halves the s^2 product "
                           "(Megatron-LM's, the default), full counts every query/key pair")
    demo.add_argument("--flops-trace", metavar="FILE", help="append the per-step trace (JSON Lines) to FILE "
                      f"(default: ${TRACE}); read it with megatron-flops compare")
    demo.set_defaults(func=_cmd_demo)
