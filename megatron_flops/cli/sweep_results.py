"""A sweep's results: each run's status and statistics, per-configuration medians, the
recommendation, and the files ``results.json`` and ``summary.csv``.

A run's status comes from its ``run.json`` (exit code, time-out), its log and its trace, in this
order: ``timeout`` (stopped at ``--timeout``), ``oom`` (a non-zero exit whose log tail holds an
out-of-memory message), ``failed`` (any other non-zero exit), ``no-trace`` (exit 0 but no trace
with a steady-state step), ``ok``. A configuration's medians are the medians of its ``ok``
repeats' medians; the statistics of runs that are not ``ok`` are reported but never used.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_flops.cli.compare import LABELS, run_record
from megatron_flops.cli.plot import SweepBar
from megatron_flops.reporting.runs import RULE, Candidate, Recommendation, RunStats, comparability, read_trace, recommend, run_stats

if TYPE_CHECKING:
    from megatron_flops.cli.sweep import Run

OBJECTIVES = {"tflops": "tflops_per_gpu", "tokens": "tokens_per_s_per_gpu"}
STATUSES = ("ok", "failed", "timeout", "oom", "no-trace")
SUMMARY_METRICS = ("tflops_per_gpu", "static_tflops_per_gpu", "tokens_per_s_per_gpu", "step_time_s", "mfu_percent")
LOG_TAIL_BYTES = 1 << 20
_OOM = re.compile(r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|std::bad_alloc|"
                  r"RESOURCE_EXHAUSTED", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A finished run's status, why, and its trace's statistics where there are any."""

    status: str
    reason: str
    stats: RunStats | None


def write_json(path: Path, obj: Any) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def classify(run_dir: Path, record: Mapping[str, Any], *, warmup: int | None) -> Outcome:
    """The status of a finished run (see the module docstring)."""
    stats, trace_problem = _stats(run_dir / "trace.jsonl", warmup=warmup)
    code = record["returncode"]
    if record["timed_out"]:
        return Outcome(status="timeout", reason=f"stopped after {record['wall_s']:.0f} s", stats=stats)
    if record.get("error"):
        return Outcome(status="failed", reason=record["error"], stats=stats)
    if code != 0:
        oom = _oom_line(run_dir / "log.txt")
        if oom is not None:
            return Outcome(status="oom", reason=oom, stats=stats)
        return Outcome(status="failed", reason=_exit_reason(code), stats=stats)
    if stats is None:
        return Outcome(status="no-trace", reason=trace_problem, stats=None)
    return Outcome(status="ok", reason="", stats=stats)


def describe(outcome: Outcome) -> str:
    """One line: the status, then the medians or the reason."""
    stats = outcome.stats
    if outcome.status == "ok" and stats is not None:
        return (f"ok, {stats.num_steps} steps, median {stats.median('tflops_per_gpu'):.4g} TFLOP/s/GPU, "
                f"{stats.median('tokens_per_s_per_gpu'):.4g} tokens/s/GPU")
    return f"{outcome.status}: {outcome.reason}"


def _stats(trace: Path, *, warmup: int | None) -> tuple[RunStats | None, str]:
    if not trace.exists():
        return None, "no trace.jsonl written (does the command enable megatron-flops and honour MEGATRON_FLOPS_TRACE?)"
    try:
        return run_stats(read_trace(trace), warmup=warmup), ""
    except ValueError as exc:
        return None, str(exc)


def _oom_line(log: Path) -> str | None:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        if _OOM.search(line):
            return line.strip()[:200]
    return None


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


@dataclass(frozen=True, kw_only=True)
class SweepResults:
    """Everything ``results.json`` and ``summary.csv`` hold."""

    params: Mapping[str, Sequence[str]]
    repeats: int
    objective: str
    tolerance: float
    runs: list[dict[str, Any]]
    combos: list[dict[str, Any]]
    recommendation: dict[str, Any] | None
    warnings: list[str]
    num_pending: int

    @property
    def metric(self) -> str:
        return OBJECTIVES[self.objective]

    @property
    def objective_label(self) -> str:
        return f"median {LABELS[self.metric]}"

    @property
    def axis_label(self) -> str:
        return "median TFLOP/s/GPU" if self.objective == "tflops" else f"median {LABELS[self.metric]}"

    @property
    def threshold(self) -> float | None:
        if self.recommendation is None:
            return None
        return (1 - self.tolerance) * self.recommendation["fastest"]["value"]

    def write(self, out: Path) -> None:
        write_json(out / "results.json", {
            "sweep": {"params": self.params, "repeats": self.repeats, "objective": self.objective,
                      "tolerance": self.tolerance, "num_pending": self.num_pending},
            "runs": self.runs,
            "configurations": self.combos,
            "recommendation": self.recommendation,
            "warnings": self.warnings,
        })
        columns = [*self.params, "num_repeats", "num_ok", "statuses",
                   *(f"median_{m}" for m in SUMMARY_METRICS), "recommended"]
        with open(out / "summary.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            for combo in self.combos:
                writer.writerow({**combo["params"], **combo, "statuses": " ".join(combo["statuses"]),
                                 "recommended": "yes" if combo["recommended"] else ""})

    def summary_lines(self) -> list[str]:
        """The table of configurations and the recommendation, as the sweep prints them."""
        names = list(self.params)
        header = [*names, "ok", LABELS["tflops_per_gpu"], LABELS["static_tflops_per_gpu"], LABELS["tokens_per_s_per_gpu"],
                  LABELS["step_time_s"]]
        rows = [header]
        for combo in self.combos:
            cells = [combo["params"][n] for n in names]
            cells.append(f"{combo['num_ok']}/{self.repeats}" + ("" if combo["num_ok"] == self.repeats
                                                                else f" ({' '.join(combo['statuses']) or 'pending'})"))
            for metric in ("tflops_per_gpu", "static_tflops_per_gpu", "tokens_per_s_per_gpu"):
                value = combo[f"median_{metric}"]
                cells.append("-" if value is None else f"{value:.4g}")
            step = combo["median_step_time_s"]
            cells.append("-" if step is None else f"{1000 * step:.1f}")
            rows.append([c + (" *" if combo["recommended"] and i == len(cells) - 1 else "") for i, c in enumerate(cells)])
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        rec = self.recommendation
        if rec is None:
            lines.append("recommendation: none (no configuration had every repeat ok)")
        else:
            chosen = " ".join(f"{k}={v}" for k, v in rec["params"].items())
            fastest = " ".join(f"{k}={v}" for k, v in rec["fastest"]["params"].items())
            margin = ("the fastest" if rec["index"] == rec["fastest"]["index"] else
                      f"{100 * rec['margin']:.1f}% below the fastest, {fastest}: {rec['fastest']['value']:.4g}")
            lines.append(f"recommendation (*): {chosen}: {self.objective_label} {rec['value']:.4g} ({margin})")
            lines.append(f"rule: {rec['rule']}")
            static = rec.get("fastest_by_static")
            if static is not None:
                lines.append("by the stock formula's TFLOP/s/GPU the fastest would be "
                             + " ".join(f"{k}={v}" for k, v in static["params"].items()) + f" ({static['value']:.4g})")
        return lines

    def bars(self) -> list[SweepBar]:
        chosen = None if self.recommendation is None else self.recommendation["index"]
        return [
            SweepBar(label=" ".join(f"{k}={v}" for k, v in c["params"].items()), value=c[f"median_{self.metric}"],
                     static=c["median_static_tflops_per_gpu"] if self.objective == "tflops" else None,
                     status="ok" if c["num_ok"] == self.repeats else " ".join(c["statuses"]) or "pending",
                     chosen=c["index"] == chosen)
            for c in self.combos
        ]


def collect(out: Path, runs: Sequence[Run], *, params: Mapping[str, Sequence[str]], warmup: int | None,
            objective: str, tolerance: float) -> SweepResults:
    """Read every finished run of the plan and decide the recommendation."""
    metric = OBJECTIVES[objective]
    runs = sorted(runs, key=lambda r: (r.index, r.repeat))  # sweep order, whatever order they ran in
    records, outcomes = [], {}
    for run in runs:
        done = out / run.dir / "run.json"
        if not done.exists():
            continue
        finished = json.loads(done.read_text())
        outcome = classify(out / run.dir, finished, warmup=warmup)
        outcomes[(run.index, run.repeat)] = outcome
        entry = {"params": dict(run.params), "repeat": run.repeat, "status": outcome.status, "reason": outcome.reason,
                 "dir": run.dir, "returncode": finished["returncode"], "wall_s": finished["wall_s"]}
        stats = run_record(outcome.stats) if outcome.stats is not None else {"num_steps": 0}
        entry.update({k: v for k, v in stats.items() if k != "trace"})
        records.append(entry)
    combos = _combos(runs, outcomes)
    warnings, units_differ = _comparability(runs, outcomes)
    repeats = max(r.repeat for r in runs)
    candidates = [Candidate(index=c["index"], params=c["params"], all_ok=c["num_ok"] == repeats,
                            value=c[f"median_{metric}"]) for c in combos]
    chosen = None if units_differ and objective == "tflops" else recommend(candidates, tolerance=tolerance)
    recommendation = None if chosen is None else _recommendation(chosen, combos, objective, candidates)
    for combo in combos:
        combo["recommended"] = recommendation is not None and combo["index"] == recommendation["index"]
    return SweepResults(params=params, repeats=repeats, objective=objective,
                        tolerance=tolerance, runs=records, combos=combos, recommendation=recommendation,
                        warnings=warnings, num_pending=len(runs) - len(records))


def _comparability(runs: Sequence[Run], outcomes: Mapping[tuple[int, int], Outcome]) -> tuple[list[str], bool]:
    """Warnings for the first ok repeat of every configuration against the first configuration's,
    and for the repeats of a configuration against its first; and whether the FLOPs conventions
    differ (no TFLOP/s recommendation then)."""
    by_combo: dict[int, list[RunStats]] = {}
    for run in runs:
        outcome = outcomes.get((run.index, run.repeat))
        if outcome is not None and outcome.status == "ok" and outcome.stats is not None:
            by_combo.setdefault(run.index, []).append(outcome.stats)
    groups = [[repeats[0] for repeats in by_combo.values()], *(r for r in by_combo.values() if len(r) > 1)]
    warnings: list[str] = []
    for group in groups:
        try:
            warnings.extend(comparability(group))
        except ValueError as exc:
            return [str(exc)], True
    return warnings, False


def _combos(runs: Sequence[Run], outcomes: Mapping[tuple[int, int], Outcome]) -> list[dict[str, Any]]:
    """One row per configuration: statuses of its finished repeats, medians of its ok ones."""
    combos: dict[int, dict[str, Any]] = {}
    for run in runs:
        combo = combos.setdefault(run.index, {"index": run.index, "params": dict(run.params), "statuses": [], "ok": []})
        outcome = outcomes.get((run.index, run.repeat))
        if outcome is not None:
            combo["statuses"].append(outcome.status)
            if outcome.status == "ok" and outcome.stats is not None:
                combo["ok"].append(outcome.stats)
    rows = []
    for combo in combos.values():
        ok: list[RunStats] = combo.pop("ok")
        combo["num_repeats"] = len(combo["statuses"])
        combo["num_ok"] = len(ok)
        for metric in SUMMARY_METRICS:
            combo[f"median_{metric}"] = _median([s.median(metric) for s in ok])
        rows.append(combo)
    return rows


def _recommendation(chosen: Recommendation, combos: Sequence[Mapping[str, Any]], objective: str,
                    candidates: Sequence[Candidate]) -> dict[str, Any]:
    metric = OBJECTIVES[objective]
    rec: dict[str, Any] = {
        "index": chosen.chosen.index,
        "params": dict(chosen.chosen.params),
        "objective": objective,
        "metric": f"median_{metric}",
        "value": chosen.chosen.value,
        "margin": chosen.shortfall,
        "tolerance": chosen.tolerance,
        "rule": RULE.format(objective=LABELS[metric], tolerance=100 * chosen.tolerance),
        "fastest": {"index": chosen.fastest.index, "params": dict(chosen.fastest.params), "value": chosen.fastest.value},
    }
    if objective == "tflops":
        static = [Candidate(index=c.index, params=c.params, all_ok=c.all_ok, value=combos[i]["median_static_tflops_per_gpu"])
                  for i, c in enumerate(candidates)]
        by_static = recommend(static, tolerance=0.0)
        if by_static is not None:
            rec["fastest_by_static"] = {"params": dict(by_static.fastest.params), "value": by_static.fastest.value}
    return rec
