"""Time spent in megatron-flops' hooks per iteration, inside the real training loops (CPU, gloo, 1 process).

    python benchmarks/bench_hooks_in_loop.py megatron-lm [--iterations 300] [--packed]
    python benchmarks/bench_hooks_in_loop.py megatron-bridge [--iterations 300] [--scenario packed]

Runs the framework tests' training (``tests/frameworks``: Megatron-LM core_v0.16.1's stock
``pretrain_gpt.py`` in this environment, or Megatron-Bridge 0.3.1's ``pretrain()`` with the stock
``gpt_step`` in its venv, ``MEGATRON_FLOPS_TEST_VENVS``) with ``--flops-accounting corrected``, and
times (the training thread's CPU time, ``time.thread_time_ns``; ``--clock wall``: ``perf_counter_ns``) what the package adds, each part as the wrapper's time less the
original's inside it:

- ``train_step``: the step wrapper (``begin_step``, the observed forward step's set-up, ``end_step``:
  settling the step's host batches, the reduction, pricing);
- ``forward_step``: the forward step wrapper (ownership, the observed iterator, arming the cross-check);
- ``observe``: reading each batch and adding it to the tracker (inside the data iterator's ``next()``);
- ``model_input_check``: the forward pre-hook on the model chunk (the cross-check);
- ``training_log``, ``log_line`` and ``num_floating_point_operations``: the log hook and the scalars, the
  amended log line (the interval's report, inside the framework's own print), the framework's number;
- ``all_reduce``: the step's one all-reduce and its read-back, reported apart (the target excludes it).

``shim_lift``: the time spent lifting the test CPU shim's mode around the package's calls
(``--shim-mode lift``), inside the parts; the driver also reports the total without it.
``BENCH_PROFILE=path`` writes a cProfile of the rank's whole run to ``path``.

torch's own cost of calling a module that has a forward pre-hook is not inside any of these; it
is measured apart (``hooked_module_call_ns``: a call of a module with the hook less one without).
Per-iteration numbers are medians over the iterations after the first ``WARMUP``. Nothing here is
asserted: it is a benchmark, reported in docs/performance.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5
PARTS = ("train_step", "forward_step", "observe", "model_input_check", "training_log", "log_line",
         "num_floating_point_operations")
_MARK = "BENCH-HOOKS "


# ---- inside the rank: the timers ------------------------------------------------------------------


class Clock:
    """Accumulated nanoseconds per key, and a snapshot of them at every iteration's start.

    ``now``: ``time.thread_time_ns`` (CPU time of the training thread: what the hooks cost, and
    not the time other processes of a busy machine take) or ``time.perf_counter_ns`` (wall)."""

    def __init__(self, now: Any = time.thread_time_ns) -> None:
        self.now = now
        self.ns: collections.Counter[str] = collections.Counter()
        self.iterations: list[dict[str, int]] = []

    def timed(self, key: str, fn: Any) -> Any:
        now = self.now

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[key] += now() - start

        return wrapper

    def per_iteration(self) -> list[dict[str, int]]:
        """Each iteration's own time per part (the wrapper less the original), from the snapshots."""
        snaps = [*self.iterations, dict(self.ns)]
        out = []
        for before, after in zip(snaps, snaps[1:]):
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
            row = {part: delta.get(part, 0) - delta.get(f"{part}.inner", 0) for part in PARTS}
            row["all_reduce"] = delta.get("all_reduce", 0)
            row["shim_lift"] = delta.get("shim_lift", 0)
            row.update({k: v for k, v in delta.items() if k.startswith("detail/")})
            row["iteration_wall"] = delta.get("train_step", 0)
            out.append(row)
        return out


def lifted(fn: Any, clock: Clock) -> Any:
    """``fn`` run with the test CPU shim's ``TorchFunctionMode`` lifted (see ``--shim-mode``); the
    lifting's own time (popping and pushing the mode) is added to ``shim_lift``, which the
    driver reports and takes out of ``hooks_total`` (no GPU run has the shim)."""
    from torch._C import _len_torch_function_stack, _pop_torch_function_stack, _push_on_torch_function_stack

    now = clock.now

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _len_torch_function_stack():
            return fn(*args, **kwargs)
        start = now()
        mode = _pop_torch_function_stack()
        popped = now()
        try:
            return fn(*args, **kwargs)
        finally:
            pushing = now()
            _push_on_torch_function_stack(mode)
            clock.ns["shim_lift"] += popped - start + now() - pushing

    return wrapper


def lift_shim_mode(clock: Clock) -> None:
    """Run the package's own code (never the framework's) without the CPU shim's mode."""
    from megatron_flops.adapters import _crosscheck, _hooks
    from megatron_flops.reporting.session import Session

    for cls, names in ((Session, ("begin_step", "end_step", "observe", "observing", "report")),
                       (_crosscheck.ModelInputCheck, ("arm", "expect", "_pre_hook")),
                       (_hooks._LogLine, ("amend",))):
        for name in names:
            setattr(cls, name, lifted(getattr(cls, name), clock))
    _hooks.write_scalars = lifted(_hooks.write_scalars, clock)


def install_timers(clock: Clock) -> None:
    from megatron_flops.adapters import _crosscheck, _hooks, megatron_bridge, megatron_lm
    from megatron_flops.tracking.reduction import StepReducer
    from megatron_flops.reporting.session import Session

    def outer_inner(name: str, wrap: Any) -> Any:
        def timed_wrap(original: Any, adapter: Any) -> Any:
            wrapped = wrap(clock.timed(f"{name}.inner", original), adapter)
            timed = clock.timed(name, wrapped)
            outer = timed
            if name == "train_step":
                def step(*args: Any, **kwargs: Any) -> Any:
                    clock.iterations.append(dict(clock.ns))
                    return timed(*args, **kwargs)
                outer = functools.wraps(wrapped)(step)
            setattr(outer, _hooks.ORIGINAL_ATTR, original)
            return outer
        return timed_wrap

    for module in (megatron_lm, megatron_bridge):
        for name, wrap in list(module._WRAPPERS.items()):
            module._WRAPPERS[name] = outer_inner(name, wrap)
    observe_forward_step = _hooks.observe_forward_step

    def timed_observe_forward_step(forward_step_func: Any, *args: Any) -> Any:
        inner = clock.timed("forward_step.inner", forward_step_func)
        return clock.timed("forward_step", observe_forward_step(inner, *args))

    _hooks.observe_forward_step = timed_observe_forward_step
    Session.observe = clock.timed("observe", Session.observe)  # type: ignore[method-assign]
    _crosscheck.ModelInputCheck._pre_hook = clock.timed(  # type: ignore[method-assign]
        "model_input_check", _crosscheck.ModelInputCheck._pre_hook)
    _hooks._LogLine.amend = clock.timed("log_line", _hooks._LogLine.amend)  # type: ignore[method-assign]
    # Inside train_step (details, part of its time): closing the step and its parts.
    from megatron_flops.tracking.step_tracker import StepTracker
    from megatron_flops.tracking.tracker import FlopsTracker

    Session.end_step = clock.timed("detail/end_step", Session.end_step)  # type: ignore[method-assign]
    Session._flush = clock.timed("detail/flush (meter, trace)", Session._flush)  # type: ignore[method-assign]
    FlopsTracker._settle = clock.timed("detail/settle (host batches)", FlopsTracker._settle)  # type: ignore[method-assign]
    StepReducer.reduce = clock.timed("detail/reduce (all-reduce included)", StepReducer.reduce)  # type: ignore[method-assign]
    StepTracker._price = clock.timed("detail/price", StepTracker._price)  # type: ignore[method-assign]
    StepReducer._all_reduce = clock.timed("all_reduce", StepReducer._all_reduce)  # type: ignore[method-assign]


def python_call_ns(clock: Clock, repeats: int = 100_000) -> float:
    """A timed call of an empty Python function, as this machine runs it now (a yardstick)."""
    fn = clock.timed("calibration", lambda: None)
    start = clock.now()
    for _ in range(repeats):
        fn()
    return (clock.now() - start) / repeats


def hooked_module_call_ns(repeats: int = 20_000) -> float:
    """torch's extra cost of calling a module with one (returning) forward pre-hook, per call."""
    import torch

    module = torch.nn.Identity()
    x = torch.zeros(1)

    def best(n: int) -> float:
        runs = []
        for _ in range(5):
            start = time.perf_counter_ns()
            for _ in range(n):
                module(x)
            runs.append((time.perf_counter_ns() - start) / n)
        return min(runs)

    bare = best(repeats)
    handle = module.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    hooked = best(repeats)
    handle.remove()
    return hooked - bare


def rank(argv: list[str]) -> None:
    clock = Clock(time.perf_counter_ns if os.environ.get("BENCH_CLOCK") == "wall" else time.thread_time_ns)
    install_timers(clock)
    if os.environ.get("BENCH_SHIM_MODE") == "lift":
        lift_shim_mode(clock)
    sys.path.insert(0, str(REPO / "tests"))
    from frameworks import bridge, rank_main

    if "--bench-iterations" in argv:
        i = argv.index("--bench-iterations")
        bridge.ITERATIONS = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    sys.argv = [rank_main.__file__, *argv]
    profile_path = os.environ.get("BENCH_PROFILE")
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        rank_main.main()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)
        rows = clock.per_iteration()[WARMUP:]
        keys = (*PARTS, "all_reduce", "shim_lift", "iteration_wall", *sorted({k for r in rows for k in r if k.startswith("detail/")}))
        summary = {key: statistics.median(r.get(key, 0) for r in rows) for key in keys}
        totals = [sum(r[p] for p in PARTS) - r["all_reduce"] for r in rows]
        summary["hooks_total"] = statistics.median(totals)
        summary["hooks_total_min"] = min(totals)
        unlifted = [total - r["shim_lift"] for total, r in zip(totals, rows)]
        summary["hooks_total_less_shim_lift"] = statistics.median(unlifted)
        summary["hooks_total_less_shim_lift_min"] = min(unlifted)
        summary["python_call_ns"] = python_call_ns(clock)
        summary["iterations"] = len(rows)
        summary["hooked_module_call_ns"] = hooked_module_call_ns()
        print(_MARK + json.dumps(summary), flush=True)


# ---- the driver -----------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("framework", choices=("megatron-lm", "megatron-bridge"))
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--packed", action="store_true", help="Megatron-LM: packed rows (cu_seqlens)")
    parser.add_argument("--scenario", default="packed", help="Megatron-Bridge: a tests/frameworks/bridge scenario")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: the training thread's CPU time (default; robust on a busy machine); wall")
    parser.add_argument("--shim-mode", choices=("lift", "keep"), default="lift",
                        help="lift (default): the package's code runs without the test CPU shim's TorchFunctionMode, "
                             "which no GPU run has and which costs ~8 us per tensor attribute read; keep: with it")
    options = parser.parse_args()
    os.environ["BENCH_CLOCK"] = options.clock
    os.environ["BENCH_SHIM_MODE"] = options.shim_mode
    sys.path.insert(0, str(REPO / "tests"))
    from frameworks import envs, procs
    from frameworks import megatron_lm as mlm

    if options.framework == "megatron-lm":
        env = envs.megatron_lm("0.16.1")
        scenario = mlm.SCENARIOS["packed" if options.packed else "1proc"]
        args = mlm.rank_args(scenario, envs.snapshot("0.16.1"), "0.16.1")
        args[args.index("--train-iters") + 1] = str(options.iterations)
    else:
        env = envs.megatron_bridge()
        script = str(REPO / "tests" / "frameworks" / "bridge_pretrain.py")
        args = ["megatron-bridge", "--bench-iterations", str(options.iterations), "--", "--flops-accounting",
                "corrected", script, options.scenario]
    procs.RANK_MAIN = Path(__file__).resolve()
    with tempfile.TemporaryDirectory() as workdir:
        [ranked] = procs.launch(env.python, ["rank", *args], world_size=1, workdir=Path(workdir),
                                timeout_s=3600, pythonpath=list(env.pythonpath))
    line = next(line for line in ranked.output.splitlines() if line.startswith(_MARK))
    summary = json.loads(line[len(_MARK):])
    us = {k: v / 1000 for k, v in summary.items() if k not in ("iterations",)}
    print(f"{options.framework}: {summary['iterations']} iterations after {WARMUP} warm-up, median us per iteration "
          f"({options.clock} time, shim mode {options.shim_mode})")
    details = sorted(k for k in us if k.startswith("detail/"))
    for key in (*PARTS, "all_reduce", "shim_lift", "hooks_total", "hooks_total_min", "hooks_total_less_shim_lift",
                "hooks_total_less_shim_lift_min", "iteration_wall", "hooked_module_call_ns",
                "python_call_ns", *details):
        print(f"  {key:<32}{us[key]:10.1f}")
    print(f"  (hooks_total: every part but the all-reduce; shim_lift: lifting the test CPU shim's mode, inside the "
          f"parts; {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
