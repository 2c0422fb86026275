"""Interval and steady-state throughput from per-iteration StepResults (stdlib only).

Rates are ratios of totals over a window: TFLOP/s/GPU is the sum of every iteration's FLOPs
divided by the sum of their wall times and by the world size. Megatron-LM instead divides
the last iteration's FLOPs by the mean iteration time, which is wrong whenever iterations
differ (variable-length packing, changing batch size).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from datetime import datetime

from megatron_flops.tracking.result import StepResult


@dataclass(frozen=True, kw_only=True)
class IntervalReport:
    """Totals over a window of iterations and the per-GPU rates derived from them.

    Three FLOPs numbers, named: ``flops`` is ours, the corrected model FLOPs (MFU;
    ``executed_flops``: hardware FLOPs, HFU); ``static_flops`` is the stock full-row formula's
    total (every row one ``seq_length`` sequence), None unless every iteration in the window
    supplied it; ``framework_flops`` is the framework's own per-step number (packed-aware in
    Megatron-LM core_v0.19 and Megatron-Bridge 0.6), likewise None unless every iteration had
    one. Iterations whose tracker failed (``ok=False``) count with the framework's number, else
    the static one, and are tallied in ``num_fallback_iterations``. Rates needing a peak are None
    without one.
    """

    first_iteration: int
    last_iteration: int
    num_iterations: int
    num_fallback_iterations: int
    elapsed_s: float
    flops: int
    executed_flops: int
    static_flops: int | None
    framework_flops: int | None = None
    num_tokens: int
    world_size: int
    peak_flops_per_s: float | None

    @property
    def fell_back(self) -> bool:
        """Whether any iteration in the window was counted with the stock formula's FLOPs."""
        return self.num_fallback_iterations > 0

    @property
    def tflops_per_s_per_gpu(self) -> float:
        """Corrected model TFLOP/s per GPU."""
        return self._per_gpu_per_s(self.flops) / 1e12

    @property
    def static_tflops_per_s_per_gpu(self) -> float | None:
        """The stock formula's TFLOP/s per GPU over the same window."""
        return None if self.static_flops is None else self._per_gpu_per_s(self.static_flops) / 1e12

    @property
    def framework_tflops_per_s_per_gpu(self) -> float | None:
        """The framework's own TFLOP/s per GPU over the same window."""
        return None if self.framework_flops is None else self._per_gpu_per_s(self.framework_flops) / 1e12

    @property
    def over_report_factor(self) -> float | None:
        """The over-report factor vs static: the stock full-row formula's FLOPs over ours, how many
        times the stock number overstates throughput."""
        if self.static_flops is None or self.flops == 0:
            return None
        return self.static_flops / self.flops

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Real (unpadded) tokens per second per GPU."""
        return self._per_gpu_per_s(self.num_tokens)

    @property
    def mfu_percent(self) -> float | None:
        """Model FLOP/s per GPU as a percentage of the device's dense peak."""
        return self._percent_of_peak(self.flops)

    @property
    def hfu_percent(self) -> float | None:
        """Executed FLOP/s per GPU as a percentage of the device's dense peak."""
        return self._percent_of_peak(self.executed_flops)

    def scalars(self) -> dict[str, float]:
        """Metrics keyed by name with unit, for TensorBoard/W&B; keys whose value is None are omitted."""
        values: dict[str, float | None] = {
            "throughput/tflops_per_s_per_gpu": self.tflops_per_s_per_gpu,
            "throughput/static_tflops_per_s_per_gpu": self.static_tflops_per_s_per_gpu,
            "throughput/framework_tflops_per_s_per_gpu": self.framework_tflops_per_s_per_gpu,
            "throughput/over_report_factor_vs_static": self.over_report_factor,
            "throughput/tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "throughput/mfu_percent": self.mfu_percent,
            "throughput/hfu_percent": self.hfu_percent,
            "throughput/num_fallback_iterations": float(self.num_fallback_iterations),
        }
        return {key: value for key, value in values.items() if value is not None}

    def _per_gpu_per_s(self, total: int) -> float:
        return total / self.elapsed_s / self.world_size

    def _percent_of_peak(self, total: int) -> float | None:
        if self.peak_flops_per_s is None:
            return None
        return 100.0 * self._per_gpu_per_s(total) / self.peak_flops_per_s


@dataclass(frozen=True, kw_only=True)
class _Totals:
    first_iteration: int
    last_iteration: int
    num_iterations: int
    num_fallback_iterations: int
    num_static_iterations: int
    num_framework_iterations: int
    elapsed_s: float
    flops: int
    executed_flops: int
    static_flops: int
    framework_flops: int
    num_tokens: int

    def add(self, other: _Totals) -> _Totals:
        return _Totals(  # NB: built directly, not with dataclasses.replace (3x its cost, once per step)
            first_iteration=self.first_iteration,
            last_iteration=other.last_iteration,
            num_iterations=self.num_iterations + other.num_iterations,
            num_fallback_iterations=self.num_fallback_iterations + other.num_fallback_iterations,
            num_static_iterations=self.num_static_iterations + other.num_static_iterations,
            num_framework_iterations=self.num_framework_iterations + other.num_framework_iterations,
            elapsed_s=self.elapsed_s + other.elapsed_s,
            flops=self.flops + other.flops,
            executed_flops=self.executed_flops + other.executed_flops,
            static_flops=self.static_flops + other.static_flops,
            framework_flops=self.framework_flops + other.framework_flops,
            num_tokens=self.num_tokens + other.num_tokens,
        )


class ThroughputMeter:
    """Accumulates iterations into logging intervals and a steady-state summary.

    ``world_size`` is the number of GPUs the StepResults' global totals are spread over;
    ``peak_flops_per_s`` is one GPU's dense peak (None: no MFU/HFU). The first
    ``warmup_iterations`` recorded iterations are left out of ``summary()`` but not of
    ``interval()``.
    """

    def __init__(self, *, world_size: int, peak_flops_per_s: int | None, warmup_iterations: int = 2) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if peak_flops_per_s is not None and peak_flops_per_s <= 0:
            raise ValueError(f"peak_flops_per_s must be positive or None, got {peak_flops_per_s}")
        if warmup_iterations < 0:
            raise ValueError(f"warmup_iterations must be >= 0, got {warmup_iterations}")
        if peak_flops_per_s is None:
            warnings.warn("no peak FLOP/s for this device: MFU and HFU will not be reported", stacklevel=2)
        self._world_size = world_size
        self._peak_flops_per_s = peak_flops_per_s
        self._warmup_iterations = warmup_iterations
        self._num_recorded = 0
        self._last_iteration: int | None = None
        self._interval: _Totals | None = None
        self._steady: _Totals | None = None
        self._warned_partial: set[str] = set()

    def record(self, *, iteration: int, result: StepResult, elapsed_s: float, static_flops: int | None = None,
               framework_flops: int | None = None) -> None:
        """Add one iteration: its StepResult, its wall time, the stock full-row formula's FLOPs
        (default: ``result.static_flops``) and the framework's own number, if it has one.

        With ``result.ok`` False the iteration's model and executed FLOPs are ``framework_flops``,
        else ``static_flops`` (else the result's own, which then already hold the fallback).
        """
        if static_flops is None:
            static_flops = result.static_flops
        if not (math.isfinite(elapsed_s) and elapsed_s > 0):
            raise ValueError(f"elapsed_s must be a positive finite number, got {elapsed_s!r}")
        if self._last_iteration is not None and iteration <= self._last_iteration:
            raise ValueError(f"iteration must increase: got {iteration} after {self._last_iteration}")
        for name, value in (("static_flops", static_flops), ("framework_flops", framework_flops)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        # A failed step counts with what the framework would have reported: its number, else the stock one.
        stock = framework_flops if framework_flops is not None else static_flops
        model_flops = stock if not result.ok and stock is not None else result.flops
        executed_flops = stock if not result.ok and stock is not None else result.executed_flops
        step = _Totals(
            first_iteration=iteration,
            last_iteration=iteration,
            num_iterations=1,
            num_fallback_iterations=0 if result.ok else 1,
            num_static_iterations=0 if static_flops is None else 1,
            num_framework_iterations=0 if framework_flops is None else 1,
            elapsed_s=elapsed_s,
            flops=model_flops,
            executed_flops=executed_flops,
            static_flops=0 if static_flops is None else static_flops,
            framework_flops=0 if framework_flops is None else framework_flops,
            num_tokens=result.num_tokens,
        )
        self._interval = step if self._interval is None else self._interval.add(step)
        if self._num_recorded >= self._warmup_iterations:
            self._steady = step if self._steady is None else self._steady.add(step)
        self._num_recorded += 1
        self._last_iteration = iteration

    def interval(self) -> IntervalReport:
        """Report the iterations recorded since the previous call, then start a new interval."""
        if self._interval is None:
            raise ValueError("interval() called with no iteration recorded since the last interval")
        report = self._report(self._interval)
        self._interval = None
        return report

    def summary(self) -> IntervalReport | None:
        """Report every iteration after warm-up; None if no iteration got past warm-up."""
        return None if self._steady is None else self._report(self._steady)

    def _report(self, totals: _Totals) -> IntervalReport:
        static = self._whole(totals.static_flops, totals.num_static_iterations, totals, "static_flops",
                             "static TFLOP/s and the over-report factor are")
        framework = self._whole(totals.framework_flops, totals.num_framework_iterations, totals, "framework_flops",
                                "the framework's TFLOP/s is")
        return IntervalReport(
            first_iteration=totals.first_iteration,
            last_iteration=totals.last_iteration,
            num_iterations=totals.num_iterations,
            num_fallback_iterations=totals.num_fallback_iterations,
            elapsed_s=totals.elapsed_s,
            flops=totals.flops,
            executed_flops=totals.executed_flops,
            static_flops=static,
            framework_flops=framework,
            num_tokens=totals.num_tokens,
            world_size=self._world_size,
            peak_flops_per_s=self._peak_flops_per_s,
        )

    def _whole(self, total: int, num_given: int, totals: _Totals, name: str, omitted: str) -> int | None:
        """``total`` when every iteration of the window gave it, else None (a mix warns once)."""
        if num_given == totals.num_iterations:
            return total
        if num_given and name not in self._warned_partial:
            warnings.warn(f"{name} was given for only some iterations: {omitted} omitted for windows that mix "
                          "them", stacklevel=4)
            self._warned_partial.add(name)
        return None


def format_tflops(value: float) -> str:
    """Megatron's one decimal from 10 TFLOP/s up; three significant digits below (small or CPU runs)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def format_log_fields(report: IntervalReport, *, stock: str | None = None) -> str:
    """The fields this package adds to a Megatron log line, each as `` name: value |``: the three
    numbers, named (``corrected``: ours; ``static``: the stock full-row formula; ``framework``:
    the framework's own, when it has one), the over-report factor vs static, tokens, MFU, HFU.

    ``stock``: the one of ``static``/``framework`` that the line's stock "throughput per GPU"
    field already shows over the same window (left out here). A framework's own stock field
    (its own averaging) is not one of them.
    """
    fields = [f" corrected throughput per GPU (TFLOP/s/GPU): {format_tflops(report.tflops_per_s_per_gpu)} |"]
    for name, value in (("static", report.static_tflops_per_s_per_gpu),
                        ("framework", report.framework_tflops_per_s_per_gpu)):
        if value is not None and name != stock:
            fields.append(f" {name} throughput per GPU (TFLOP/s/GPU): {format_tflops(value)} |")
    if report.over_report_factor is not None:
        fields.append(f" over-report factor vs static: {report.over_report_factor:.2f}x |")
    fields.append(f" tokens per GPU (tokens/s/GPU): {report.tokens_per_s_per_gpu:.1f} |")
    if report.mfu_percent is not None:
        fields.append(f" MFU (%): {report.mfu_percent:.1f} |")
    if report.hfu_percent is not None:
        fields.append(f" HFU (%): {report.hfu_percent:.1f} |")
    if report.fell_back:
        fields.append(f" FLOPs fallback iterations: {report.num_fallback_iterations} |")
    return "".join(fields)


def format_log_line(
    report: IntervalReport,
    *,
    iteration: int,
    train_iters: int | None,
    elapsed_ms_per_iter: float,
    timestamp: datetime | None = None,
) -> str:
    """A full Megatron-style log line: time, iteration, time per iteration, stock and corrected throughput.

    The stock throughput is the report's framework TFLOP/s, else its static TFLOP/s (a ratio of
    totals, not Megatron's last-iteration figure), and is left out when the report has neither.
    """
    when = (timestamp or datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
    line = f" [{when}] iteration {iteration:8d}"
    if train_iters is not None:
        line += f"/{train_iters:8d}"
    line += f" | elapsed time per iteration (ms): {elapsed_ms_per_iter:.1f} |"
    stock, value = "framework", report.framework_tflops_per_s_per_gpu
    if value is None:
        stock, value = "static", report.static_tflops_per_s_per_gpu
    if value is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {format_tflops(value)} |"
    return line + format_log_fields(report, stock=stock)


def format_summary(report: IntervalReport | None, *, warmup_iterations: int) -> str:
    """A multi-line steady-state summary (``ThroughputMeter.summary()``), for the end of a run."""
    if report is None:
        return f"steady state: no iteration after the {warmup_iterations} warm-up iterations"
    rows = [
        ("elapsed time per iteration (ms)", f"{1000 * report.elapsed_s / report.num_iterations:.1f}"),
        ("static throughput per GPU (TFLOP/s/GPU)",
         "n/a" if report.static_tflops_per_s_per_gpu is None else format_tflops(report.static_tflops_per_s_per_gpu)),
        ("corrected throughput per GPU (TFLOP/s/GPU)", format_tflops(report.tflops_per_s_per_gpu)),
        ("over-report factor (static / corrected)",
         "n/a" if report.over_report_factor is None else f"{report.over_report_factor:.2f}x"),
        ("tokens per GPU (tokens/s/GPU)", f"{report.tokens_per_s_per_gpu:.1f}"),
        ("real tokens, all GPUs", f"{report.num_tokens}"),
    ]
    if report.framework_tflops_per_s_per_gpu is not None:
        rows.insert(2, ("framework throughput per GPU (TFLOP/s/GPU)", format_tflops(report.framework_tflops_per_s_per_gpu)))
    if report.mfu_percent is not None:
        rows.append(("MFU (%)", f"{report.mfu_percent:.2f}"))
    if report.hfu_percent is not None:
        rows.append(("HFU (%)", f"{report.hfu_percent:.2f}"))
    if report.fell_back:
        rows.append(("iterations priced with the static fallback", f"{report.num_fallback_iterations}"))
    head = (f"steady state: iterations {report.first_iteration}-{report.last_iteration} "
            f"({report.num_iterations} iterations, the first {warmup_iterations} left out as warm-up); "
            "overall rates: totals over total time (megatron-flops compare also gives the median step)")
    return "\n".join([head, *(f"  {name + ':':<46}{value}" for name, value in rows)])
