"""Per-step traces of training runs: reading, steady-state statistics, comparability (stdlib only).

A trace (``--flops-trace`` / ``MEGATRON_FLOPS_TRACE``) is JSON Lines: a ``{"run": {...}}`` header,
then one object per training iteration. Appending to a trace keeps it, so a file holds one
*segment* per run or restart, each opened by its own header.

Several segments of one trace are one run when they agree on everything that makes runs
comparable (world size, model, conventions): a restart of the same job. Each segment then has
its own warm-up (a restart compiles and allocates again) and their steady-state steps are pooled
(an iteration replayed after a restart is a real measurement and counts again). Segments that
disagree are different runs written to one file: an error, unless only the last segment is
asked for (``segments="last"``).

A step's rates: TFLOP/s/GPU = ``flops / elapsed_s / world_size / 1e12`` (the same with
``static_flops``), tokens/s/GPU = ``num_tokens / elapsed_s / world_size``, MFU/HFU = model or
executed FLOP/s/GPU over the header's peak. Steady state: every segment's steps after its first
``warmup`` ones (the header's ``warmup_iterations`` unless given, :data:`DEFAULT_WARMUP` when the
header has none), without the steps that fell back to the static number (``ok: false``), which
are counted. The statistics are the median, the quartiles (linear interpolation between closest
ranks, numpy's default) and the extremes over those steps.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from megatron_flops.reporting.meter import IntervalReport
from megatron_flops.reporting.trace import FORMAT as TRACE_FORMAT

DEFAULT_WARMUP = 2
DEFAULT_TOLERANCE = 0.03
SEGMENT_CHOICES = ("all", "last")
# Conventions that define what a counted FLOP is: runs that differ here are not in the same units.
UNIT_CONVENTIONS = ("attention", "model_flops")
# Metric keys, in display order; "median_<key>" etc. in the JSON output.
METRICS = ("tflops_per_gpu", "static_tflops_per_gpu", "tokens_per_s_per_gpu", "step_time_s", "mfu_percent", "hfu_percent")

_INT_FIELDS = ("iteration", "flops", "executed_flops", "num_tokens")


@dataclass(frozen=True, kw_only=True)
class TraceStep:
    """One training iteration as the trace reports it (the fields the statistics use)."""

    iteration: int
    flops: int
    executed_flops: int
    static_flops: int | None
    num_tokens: int
    elapsed_s: float
    ok: bool


@dataclass(frozen=True, kw_only=True)
class TraceSegment:
    """One run or restart: its header (the ``"run"`` object) and its steps in file order."""

    header: Mapping[str, Any]
    line: int
    steps: tuple[TraceStep, ...]

    @property
    def world_size(self) -> int:
        return self.header["world_size"]

    @property
    def warmup_iterations(self) -> int:
        value = self.header.get("warmup_iterations")
        return DEFAULT_WARMUP if value is None else value

    @property
    def peak_flops_per_s(self) -> int | None:
        return self.header.get("peak_flops_per_s")


@dataclass(frozen=True, kw_only=True)
class Trace:
    """A parsed trace file; ``notes`` are tolerated defects (a torn last line)."""

    name: str
    segments: tuple[TraceSegment, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Median, quartiles and extremes of one metric over ``num`` steps."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    num: int


@dataclass(frozen=True, kw_only=True)
class StepRates:
    """One step's per-GPU rates and why it is or is not in the steady state."""

    segment: int
    iteration: int
    warmup: bool
    ok: bool
    num_tokens: int
    rates: Mapping[str, float | None]


@dataclass(frozen=True, kw_only=True)
class RunStats:
    """Steady-state statistics of one run. ``metrics`` maps every :data:`METRICS` key to its
    spread, None where unknown (no static FLOPs, no peak)."""

    name: str
    header: Mapping[str, Any]
    num_segments: int
    num_steps: int
    num_warmup_steps: int
    num_failed_steps: int
    steps: tuple[StepRates, ...]
    metrics: Mapping[str, Spread | None] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.header["world_size"]

    def median(self, metric: str) -> float | None:
        spread = self.metrics.get(metric)
        return None if spread is None else spread.median


# ---- reading ------------------------------------------------------------------------------------


def read_trace(path: str | Path) -> Trace:
    """Parse a trace file; ``ValueError`` naming the file and line on anything malformed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
    return parse_trace(text, name=str(path))


def parse_trace(text: str, *, name: str) -> Trace:
    """Parse a trace's text. A last line cut short (the writer killed mid-line) is skipped with a
    note; any other line that is not a header or a step is an error."""
    lines = text.splitlines()
    torn = bool(lines) and not text.endswith("\n")
    segments: list[TraceSegment] = []
    header: dict[str, Any] | None = None
    header_line = 0
    steps: list[TraceStep] = []
    notes: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if torn and number == len(lines):
                notes.append(f"{name}: line {number} is cut short (the run was stopped while writing it); skipped")
                break
            raise ValueError(f"{name} line {number}: not JSON ({exc.msg})") from None
        where = f"{name} line {number}"
        if isinstance(obj, dict) and "run" in obj:
            if header is not None:
                segments.append(TraceSegment(header=header, line=header_line, steps=tuple(steps)))
            header, header_line, steps = _header(obj["run"], where), number, []
        elif header is None:
            raise ValueError(f"{where}: a step before any {{\"run\": ...}} header; is this a megatron-flops trace?")
        else:
            steps.append(_step(obj, where))
    if header is not None:
        segments.append(TraceSegment(header=header, line=header_line, steps=tuple(steps)))
    if not segments:
        raise ValueError(f"{name}: empty trace (no header, no steps)")
    return Trace(name=name, segments=tuple(segments), notes=tuple(notes))


def _header(run: Any, where: str) -> dict[str, Any]:
    if not isinstance(run, dict):
        raise ValueError(f"{where}: the \"run\" header must be an object")
    fmt = run.get("format")
    if not isinstance(fmt, str) or not fmt.startswith("megatron-flops-trace/"):
        raise ValueError(f"{where}: not a megatron-flops trace header (format {fmt!r}, expected {TRACE_FORMAT!r})")
    if fmt != TRACE_FORMAT:
        raise ValueError(f"{where}: trace format {fmt!r} is not {TRACE_FORMAT!r}; read it with the megatron-flops that wrote it")
    world = run.get("world_size")
    if not (_is_int(world) and world >= 1):
        raise ValueError(f"{where}: world_size must be an integer >= 1, got {world!r}")
    warmup = run.get("warmup_iterations")
    if warmup is not None and not (_is_int(warmup) and warmup >= 0):
        raise ValueError(f"{where}: warmup_iterations must be an integer >= 0, got {warmup!r}")
    peak = run.get("peak_flops_per_s")
    if peak is not None and (not _is_number(peak) or peak <= 0):
        raise ValueError(f"{where}: peak_flops_per_s must be positive or null, got {peak!r}")
    for key in ("model", "conventions"):
        if not isinstance(run.get(key, {}), dict):
            raise ValueError(f"{where}: {key} must be an object")
    return run


def _step(obj: Any, where: str) -> TraceStep:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a step must be a JSON object")
    missing = [k for k in (*_INT_FIELDS, "static_flops", "elapsed_s", "ok") if k not in obj]
    if missing:
        raise ValueError(f"{where}: step lacks {', '.join(missing)}")
    for key in _INT_FIELDS:
        if not _is_int(obj[key]) or obj[key] < 0:
            raise ValueError(f"{where}: {key} must be an integer >= 0, got {obj[key]!r}")
    static = obj["static_flops"]
    if static is not None and (not _is_int(static) or static < 0):
        raise ValueError(f"{where}: static_flops must be an integer >= 0 or null, got {static!r}")
    elapsed = obj["elapsed_s"]
    if not _is_number(elapsed) or not (math.isfinite(elapsed) and elapsed > 0):
        raise ValueError(f"{where}: elapsed_s must be a positive number, got {elapsed!r}")
    if not isinstance(obj["ok"], bool):
        raise ValueError(f"{where}: ok must be true or false, got {obj['ok']!r}")
    return TraceStep(
        iteration=obj["iteration"], flops=obj["flops"], executed_flops=obj["executed_flops"],
        static_flops=static, num_tokens=obj["num_tokens"], elapsed_s=float(elapsed), ok=obj["ok"],
    )


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- statistics ---------------------------------------------------------------------------------


def quantile(sorted_values: Sequence[float], p: float) -> float:
    """The ``p`` quantile of sorted values, interpolating linearly between closest ranks."""
    assert sorted_values and 0.0 <= p <= 1.0
    position = (len(sorted_values) - 1) * p
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def spread(values: Iterable[float]) -> Spread | None:
    """Median, quartiles and extremes; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return Spread(median=statistics.median(ordered), q1=quantile(ordered, 0.25), q3=quantile(ordered, 0.75),
                  min=ordered[0], max=ordered[-1], num=len(ordered))


def step_rates(step: TraceStep, *, world_size: int, peak_flops_per_s: float | None) -> dict[str, float | None]:
    """One step's per-GPU rates, keyed by :data:`METRICS` (the meter's, over a window of this one
    step); None where unknown."""
    report = IntervalReport(
        first_iteration=step.iteration, last_iteration=step.iteration, num_iterations=1,
        num_fallback_iterations=0 if step.ok else 1, elapsed_s=step.elapsed_s, flops=step.flops,
        executed_flops=step.executed_flops, static_flops=step.static_flops, num_tokens=step.num_tokens,
        world_size=world_size, peak_flops_per_s=peak_flops_per_s,
    )
    return {
        "tflops_per_gpu": report.tflops_per_s_per_gpu,
        "static_tflops_per_gpu": report.static_tflops_per_s_per_gpu,
        "tokens_per_s_per_gpu": report.tokens_per_s_per_gpu,
        "step_time_s": step.elapsed_s,
        "mfu_percent": report.mfu_percent,
        "hfu_percent": report.hfu_percent,
    }


def run_stats(
    trace: Trace,
    *,
    warmup: int | None = None,
    segments: str = "all",
    peak_flops_per_s: float | None = None,
) -> RunStats:
    """Steady-state statistics of one trace (see the module docstring for the rules).

    ``warmup``: steps left out at the start of every segment (None: each header's).
    ``peak_flops_per_s``: one GPU's peak for MFU/HFU, overriding the headers'.
    """
    if segments not in SEGMENT_CHOICES:
        raise ValueError(f"segments must be one of {SEGMENT_CHOICES}, got {segments!r}")
    if warmup is not None and warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    chosen = trace.segments[-1:] if segments == "last" else trace.segments
    first = chosen[0]
    for index, segment in enumerate(chosen[1:], start=2):
        differences = differing(first.header, segment.header)
        if differences:
            raise ValueError(
                f"{trace.name}: segment {index} (header at line {segment.line}) is another run "
                f"({'; '.join(differences)}); split the file, or pass --segments last to use the newest run only"
            )
    rates: list[StepRates] = []
    for index, segment in enumerate(chosen, start=1):
        skip = segment.warmup_iterations if warmup is None else warmup
        peak = peak_flops_per_s if peak_flops_per_s is not None else segment.peak_flops_per_s
        for position, step in enumerate(segment.steps):
            rates.append(StepRates(
                segment=index, iteration=step.iteration, warmup=position < skip, ok=step.ok,
                num_tokens=step.num_tokens,
                rates=step_rates(step, world_size=segment.world_size, peak_flops_per_s=peak),
            ))
    steady = [r for r in rates if not r.warmup and r.ok]
    num_warmup = sum(r.warmup for r in rates)
    num_failed = sum(not r.warmup and not r.ok for r in rates)
    if not rates:
        raise ValueError(f"{trace.name}: the trace has no steps")
    if num_warmup == len(rates):
        raise ValueError(f"{trace.name}: all {len(rates)} steps are warm-up; run longer or lower --warmup")
    if not steady:
        raise ValueError(f"{trace.name}: every step after warm-up ({num_failed}) fell back to the static number (ok: false)")
    metrics = {
        key: spread(v for v in (r.rates[key] for r in steady) if v is not None) for key in METRICS
    }
    return RunStats(name=trace.name, header=first.header, num_segments=len(chosen), num_steps=len(steady),
                    num_warmup_steps=num_warmup, num_failed_steps=num_failed, steps=tuple(rates), metrics=metrics)


# ---- comparability ------------------------------------------------------------------------------


def differing(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """What makes two run headers incomparable: world size, model fields, conventions."""
    out = []
    if a.get("world_size") != b.get("world_size"):
        out.append(f"world_size {a.get('world_size')} vs {b.get('world_size')}")
    for section in ("model", "conventions"):
        left, right = a.get(section) or {}, b.get(section) or {}
        for key in sorted(set(left) | set(right)):
            if left.get(key) != right.get(key):
                out.append(f"{section}.{key} {left.get(key)!r} vs {right.get(key)!r}")
    return out


def comparability(runs: Sequence[RunStats]) -> list[str]:
    """Warnings for every run that differs from the first (world size, model, conventions, tokens
    per step at the iterations both ran). ``ValueError`` when the FLOPs are not in the same units
    (the :data:`UNIT_CONVENTIONS` differ): their TFLOP/s cannot be compared at all."""
    if not runs:
        return []
    base = runs[0]
    warnings = []
    for run in runs[1:]:
        base_conv, conv = base.header.get("conventions") or {}, run.header.get("conventions") or {}
        units = [f"{k} {base_conv.get(k)!r} vs {conv.get(k)!r}" for k in UNIT_CONVENTIONS if base_conv.get(k) != conv.get(k)]
        if units:
            raise ValueError(
                f"{run.name} counts FLOPs under other conventions than {base.name} ({'; '.join(units)}): "
                "its TFLOP/s are not comparable; rerun with the same --flops-* conventions"
            )
        differences = differing(base.header, run.header)
        tokens = _tokens_difference(base, run)
        if tokens:
            differences.append(tokens)
        if differences:
            warnings.append(f"{run.name} differs from {base.name}: {'; '.join(differences)}")
    return warnings


def _tokens_difference(base: RunStats, run: RunStats) -> str | None:
    """Tokens per step at the iterations both runs completed (``ok``): the same data and global
    batch give the same counts."""
    left = {r.iteration: r.num_tokens for r in base.steps if r.ok}
    right = {r.iteration: r.num_tokens for r in run.steps if r.ok}
    common = sorted(set(left) & set(right))
    if not common:
        return "tokens per step not checked (no iteration in common)"
    for iteration in common:
        if left[iteration] != right[iteration]:
            return f"tokens per step {left[iteration]} vs {right[iteration]} at iteration {iteration} (other data or global batch)"
    return None


# ---- recommendation -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration of a sweep: its position in the sweep's order, whether every repeat
    succeeded, and its objective (higher is better; None when unknown)."""

    index: int
    params: Mapping[str, str]
    all_ok: bool
    value: float | None


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """The chosen configuration and the fastest one, with the chosen one's shortfall (a fraction)."""

    chosen: Candidate
    fastest: Candidate
    tolerance: float

    @property
    def shortfall(self) -> float:
        assert self.fastest.value is not None and self.chosen.value is not None
        return 0.0 if self.fastest.value == 0 else 1.0 - self.chosen.value / self.fastest.value


RULE = (
    "among configurations whose every repeat is ok, the first in sweep order (values in the order "
    "given, earlier --param first) whose median {objective} is within {tolerance:g}% of the best"
)


def recommend(candidates: Sequence[Candidate], *, tolerance: float = DEFAULT_TOLERANCE) -> Recommendation | None:
    """The first fully successful candidate (lowest ``index``) within ``tolerance`` (a fraction) of
    the best objective among fully successful candidates; None when no candidate succeeded."""
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    eligible = sorted((c for c in candidates if c.all_ok and c.value is not None), key=lambda c: c.index)
    if not eligible:
        return None
    fastest = max(eligible, key=lambda c: c.value)  # type: ignore[arg-type, return-value]
    assert fastest.value is not None
    chosen = next(c for c in eligible if c.value >= (1.0 - tolerance) * fastest.value)  # type: ignore[operator]
    return Recommendation(chosen=chosen, fastest=fastest, tolerance=tolerance)
