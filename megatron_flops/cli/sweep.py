"""``megatron-flops sweep``: run a command over a grid of settings and recommend one by its
steady-state corrected throughput.

Each run (a combination of ``--param`` values and a repeat) gets its own directory under
``--out`` with ``command.txt``, ``log.txt`` (stdout and stderr), ``trace.jsonl`` (the command
finds its path in ``MEGATRON_FLOPS_TRACE`` or the ``{trace}`` placeholder) and, once it has
finished, ``run.json``. A rerun with the same ``--out`` skips the runs that have a ``run.json``;
Ctrl-C (or SIGTERM) stops the running command and writes the results of the finished runs.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_flops.reporting.trace import TRACE_ENV as TRACE
from megatron_flops.cli.plot import require_matplotlib
from megatron_flops.cli.sweep_results import OBJECTIVES, classify, collect, describe, write_json
from megatron_flops.reporting.runs import DEFAULT_TOLERANCE

SWEEP_FORMAT = "megatron-flops-sweep/1"
BUILTINS = ("run_dir", "trace")  # placeholders the sweep fills in itself
DEFAULT_TIMEOUT_S = 3600.0
KILL_GRACE_S = 10.0
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")  # "${HOME}" is left to the shell
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass(frozen=True, kw_only=True)
class Run:
    """One command to run: the combination's position in sweep order, its values, the repeat."""

    index: int
    params: Mapping[str, str]
    repeat: int
    dir: str  # relative to --out

    def argv(self, template: Sequence[str], out: Path) -> list[str]:
        values = {**self.params, "run_dir": str((out / self.dir).resolve()),
                  "trace": str((out / self.dir / "trace.jsonl").resolve())}
        return [_PLACEHOLDER.sub(lambda m: values[m[1]], arg) for arg in template]


def parse_params(specs: Sequence[str]) -> dict[str, list[str]]:
    """``NAME=v1,v2,...`` for each ``--param``, in the order given."""
    params: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or not _NAME.match(name):
            raise ValueError(f"--param {spec!r}: expected NAME=v1,v2,... with NAME a Python-style identifier")
        if name in BUILTINS:
            raise ValueError(f"--param {name}: the name is reserved (the sweep fills in {{{name}}} itself)")
        if name in params:
            raise ValueError(f"--param {name} given twice")
        items = values.split(",")
        if not values or any(not v for v in items):
            raise ValueError(f"--param {name} has {'no values' if not values else 'an empty value'}: {spec!r}")
        if len(set(items)) != len(items):
            raise ValueError(f"--param {name} repeats a value: {spec!r}")
        params[name] = items
    return params


def check_command(command: Sequence[str], params: Mapping[str, Sequence[str]]) -> None:
    """Every ``--param`` appears as ``{NAME}`` in the command and every placeholder is known."""
    if not command:
        raise ValueError("no command to sweep: put it after '--', e.g. sweep --param mb=1,2 -- train.sh --mb {mb}")
    used = {name for arg in command for name in _PLACEHOLDER.findall(arg)}
    unknown = sorted(used - set(params) - set(BUILTINS))
    if unknown:
        raise ValueError(f"placeholder {{{unknown[0]}}} in COMMAND has no --param {unknown[0]}=...")
    unused = [name for name in params if name not in used]
    if unused:
        raise ValueError(f"--param {unused[0]}: placeholder {{{unused[0]}}} is not in COMMAND")


def plan(params: Mapping[str, Sequence[str]], repeats: int) -> list[Run]:
    """Every run in the order they run: repeat 1 of every combination, then repeat 2, ...
    (a slow drift of the machine then spreads over all combinations). Combinations are in sweep
    order: the first ``--param`` varying slowest, values in the order given."""
    combos = [dict(zip(params, values)) for values in itertools.product(*params.values())]
    runs = []
    for repeat in range(1, repeats + 1):
        for index, combo in enumerate(combos):
            slug = _UNSAFE.sub("_", "_".join(f"{k}-{v}" for k, v in combo.items()))[:80]
            runs.append(Run(index=index, params=combo, repeat=repeat, dir=f"{index:03d}_{slug}/r{repeat}"))
    return runs


def claim_out(out: Path, identity: Mapping[str, Any], *, write: bool) -> None:
    """Make ``out`` this sweep's directory; ``ValueError`` if it holds anything else."""
    marker = out / "sweep.json"
    if marker.exists():
        try:
            theirs = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--out {out}: unreadable {marker.name} ({exc})") from None
        for key in ("command", "params"):
            if theirs.get(key) != identity[key]:
                raise ValueError(
                    f"--out {out} holds another sweep's results ({key}: {json.dumps(theirs.get(key))}); "
                    "choose another --out"
                )
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not a sweep directory (no sweep.json); choose another --out")
    if write:
        out.mkdir(parents=True, exist_ok=True)
        write_json(marker, identity)


# ---- running -------------------------------------------------------------------------------------


def execute(argv: Sequence[str], run_dir: Path, *, timeout_s: float | None) -> dict[str, Any]:
    """Run one command in its own process group, output to ``log.txt``; kill the group on time-out
    (and on Ctrl-C, which is then re-raised). The outcome as ``run.json`` holds it."""
    env = {**os.environ, TRACE: str((run_dir / "trace.jsonl").resolve())}
    started = time.monotonic()
    with open(run_dir / "log.txt", "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        except OSError as exc:
            error = f"cannot start {argv[0]!r}: {exc.strerror}"
            log.write(f"megatron-flops sweep: {error}\n".encode())
            return {"returncode": 127, "timed_out": False, "wall_s": 0.0, "error": error}
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also on KeyboardInterrupt: nothing of the run survives it
            _kill_group(proc)
    return {"returncode": proc.returncode, "timed_out": timed_out, "wall_s": round(time.monotonic() - started, 3)}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group if its leader is alive, SIGKILL it after a grace period;
    then SIGKILL whatever of the group is left (ranks orphaned by a launcher that exited)."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while the sweep runs (a batch scheduler stopping it)."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_one(run: Run, args: argparse.Namespace, command: Sequence[str], out: Path, label: str) -> None:
    run_dir = out / run.dir
    done = run_dir / "run.json"
    if done.exists():
        previous = json.loads(done.read_text())
        status = classify(run_dir, previous, warmup=args.warmup).status
        if not (args.rerun_failed and status != "ok"):
            print(f"{label} {run.dir}: {status} (finished before; skipped)", flush=True)
            return
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted or retried run starts afresh
    run_dir.mkdir(parents=True)
    argv = run.argv(command, out)
    (run_dir / "command.txt").write_text(shlex.join(argv) + "\n")
    print(f"{label} {run.dir}: {shlex.join(argv)}", flush=True)
    outcome = execute(argv, run_dir, timeout_s=args.timeout or None)
    record = {"params": dict(run.params), "repeat": run.repeat, "argv": argv, **outcome}
    write_json(done, record)
    print(f"{label} {run.dir}: {describe(classify(run_dir, record, warmup=args.warmup))} "
          f"({outcome['wall_s']:.1f} s)", flush=True)


def _cmd_sweep(args: argparse.Namespace) -> int:
    params = parse_params(args.param)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    check_command(command, params)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.timeout < 0:
        raise ValueError(f"--timeout must be >= 0 seconds (0: none), got {args.timeout}")
    if not 0 <= args.tolerance < 100:
        raise ValueError(f"--tolerance must be a percentage in [0, 100), got {args.tolerance}")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.plot:
        require_matplotlib("--plot")
    out = Path(args.out)
    runs = plan(params, args.repeats)
    claim_out(out, {"format": SWEEP_FORMAT, "command": list(command), "params": params}, write=not args.dry_run)
    if args.dry_run:
        for number, run in enumerate(runs, start=1):
            skipped = " (finished: skipped)" if (out / run.dir / "run.json").exists() else ""
            print(f"[{number}/{len(runs)}] {run.dir}{skipped}: {shlex.join(run.argv(command, out))}")
        return 0
    interrupted = False
    with _sigterm_as_interrupt():
        try:
            for number, run in enumerate(runs, start=1):
                _run_one(run, args, command, out, f"[{number}/{len(runs)}]")
        except KeyboardInterrupt:
            interrupted = True
    results = collect(out, runs, params=params, warmup=args.warmup, objective=args.objective, tolerance=args.tolerance / 100)
    results.write(out)
    print("\n".join(results.summary_lines()))
    for warning in results.warnings:
        print(f"megatron-flops: warning: {warning}", file=sys.stderr)
    if args.plot:
        from megatron_flops.cli.plot import plot_sweep

        plot_sweep(results.bars(), args.plot, metric=results.axis_label, threshold=results.threshold)
        print(f"plot written to {args.plot}")
    if interrupted:
        finished = sum(1 for run in runs if (out / run.dir / "run.json").exists())
        print(f"megatron-flops sweep: interrupted; {finished} of {len(runs)} runs finished and kept in {out} "
              "(rerun the same command to resume)", file=sys.stderr)
        return 130
    return 0 if results.recommendation is not None else 1


def add_parser(sub: Any) -> None:
    """Register ``sweep`` on the top-level subparsers."""
    sweep = sub.add_parser(
        "sweep",
        help="run a training command over a grid of settings and recommend one by corrected throughput",
        description="Runs COMMAND once per combination of --param values (and repeat), substituting {NAME}, "
        "each in its own directory under --out with its trace passed in MEGATRON_FLOPS_TRACE (also {trace}; "
        "{run_dir} is the run's directory). Recommends the first configuration in sweep order, among those "
        "whose every repeat succeeded, within --tolerance percent of the fastest median. Exit status: 0 with "
        "a recommendation, 1 without one, 2 on bad input, 130 when interrupted.",
    )
    sweep.add_argument("--param", action="append", default=[], required=True, metavar="NAME=v1,v2,...",
                       help="values to substitute for {NAME} in COMMAND (repeatable; the first varies slowest)")
    sweep.add_argument("--repeats", type=int, default=1, help="runs of each combination (default 1)")
    sweep.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help=f"seconds before a run is stopped and marked timeout (default {DEFAULT_TIMEOUT_S:g}; 0: none)")
    sweep.add_argument("--out", default="sweep", help="directory of the sweep's runs and results (default ./sweep)")
    sweep.add_argument("--objective", choices=tuple(OBJECTIVES), default="tflops",
                       help="corrected TFLOP/s/GPU (default) or tokens/s/GPU")
    sweep.add_argument("--tolerance", type=float, default=100 * DEFAULT_TOLERANCE,
                       help=f"percent below the fastest that still counts as fast (default {100 * DEFAULT_TOLERANCE:g})")
    sweep.add_argument("--warmup", type=int, help="steps left out at the start of each run (default: the trace's)")
    sweep.add_argument("--rerun-failed", action="store_true", help="with an existing --out, run again the runs "
                       "that did not end ok (finished ok runs are still skipped)")
    sweep.add_argument("--plot", metavar="FILE.png", help="draw each configuration's median (needs matplotlib)")
    sweep.add_argument("--dry-run", action="store_true", help="print the runs and their commands; run nothing")
    sweep.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                       help="the training command, with {NAME} placeholders")
    sweep.set_defaults(func=_cmd_sweep)
