"""A stand-in training command for the sweep tests: writes a megatron-flops trace with given
numbers to ``$MEGATRON_FLOPS_TRACE`` (or ``--trace``), or fails, hangs, runs out of memory or
writes no trace, as asked; ``banner`` prints a hint that mentions memory and fails,
``killed`` dies of SIGKILL, ``stubborn`` ignores SIGTERM and starts a child that does too. Step ``i`` (1-based) takes ``elapsed[(i - 1) % len(elapsed)]`` seconds
(written, not slept). ``wait_for`` and ``alive``: the tests' waits on its processes."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def header(*, world_size: int = 1, warmup: int = 2, attention: str = "causal", num_layers: int = 4) -> dict:
    return {"run": {
        "format": "megatron-flops-trace/1", "megatron_flops_version": "0.1.0", "framework": "custom",
        "framework_version": None, "world_size": world_size,
        "model": {"num_layers": num_layers, "hidden_size": 128},
        "conventions": {"attention": attention, "model_flops": "needed", "recompute": None, "peft": None},
        "warmup_iterations": warmup, "peak_flops_per_s": None, "started_at": "2026-01-01T00:00:00",
    }}


def step(iteration: int, *, flops: int, tokens: int, elapsed_s: float, ok: bool = True, static: int | None = None) -> dict:
    return {"iteration": iteration, "flops": flops, "executed_flops": flops, "static_flops": static,
            "num_tokens": tokens, "num_padded_tokens": tokens, "num_sequences": 1, "num_microbatches": 1,
            "elapsed_s": elapsed_s, "ok": ok}


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 600.0) -> None:
    """Poll ``predicate`` every 0.1 s; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ok", "fail", "hang", "oom", "no-trace", "banner", "killed", "stubborn"),
                        default="ok")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--flops", type=int, default=10**12)
    parser.add_argument("--static-flops", type=int)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--elapsed", default="1.0", help="comma-separated step times, cycled")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--trace", default=os.environ.get("MEGATRON_FLOPS_TRACE"))
    parser.add_argument("--hang-once", metavar="MARKER", help="with --mode hang: hang only if MARKER does not exist")
    parser.add_argument("--fail-in", nargs=2, metavar=("SUFFIX", "RUN_DIR"), help="fail if RUN_DIR ends with SUFFIX")
    parser.add_argument("--slow-in", nargs=3, metavar=("SUFFIX", "FACTOR", "RUN_DIR"),
                        help="multiply the step times by FACTOR if RUN_DIR ends with SUFFIX (a noisy repeat)")
    args = parser.parse_args()
    print(f"fake training starting, pid {os.getpid()}", flush=True)
    if args.fail_in and args.fail_in[1].endswith(args.fail_in[0]):
        args.mode = "fail"
    if args.mode == "hang" and args.hang_once:
        if os.path.exists(args.hang_once):
            args.mode = "ok"
        else:
            open(args.hang_once, "w").close()
    if args.mode == "fail":
        print("Traceback (most recent call last):\nRuntimeError: something broke", file=sys.stderr)
        return 3
    if args.mode == "oom":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        return 1
    if args.mode == "no-trace":
        return 0
    if args.mode == "banner":
        print("NOTE: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid out of memory errors", flush=True)
        print("Traceback (most recent call last):\nValueError: bad config", file=sys.stderr)
        return 1
    if args.mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "stubborn":
        return _stubborn()
    elapsed = [float(x) for x in args.elapsed.split(",")]
    if args.slow_in and args.slow_in[2].endswith(args.slow_in[0]):
        elapsed = [float(args.slow_in[1]) * x for x in elapsed]
    with open(args.trace, "a") as f:
        f.write(json.dumps(header(world_size=args.world_size, warmup=args.warmup)) + "\n")
        for i in range(1, args.steps + 1):
            f.write(json.dumps(step(i, flops=args.flops, tokens=args.tokens, elapsed_s=elapsed[(i - 1) % len(elapsed)],
                                    static=args.static_flops)) + "\n")
            f.flush()
            if args.mode == "hang" and i == 2:
                print("hanging", flush=True)
                time.sleep(3600)
    print("fake training done", flush=True)
    return 0


def _stubborn() -> int:
    """Ignore SIGTERM here (saying so) and in a child; print both pids; wait forever."""
    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM ignored", flush=True))
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('child ready', flush=True); time.sleep(3600)"])
    print(f"stubborn {os.getpid()} {child.pid}", flush=True)
    time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
