"""ThroughputMeter: totals-over-interval rates, warm-up, reset, world size, fallback, log lines.

Numbers are chosen so every expected value is exact in binary floating point.
"""

from __future__ import annotations

import warnings
from datetime import datetime

import pytest

from megatron_flops.reporting.meter import IntervalReport, ThroughputMeter, format_log_fields, format_log_line
from megatron_flops.tracking.result import StepResult

PF = 10**15  # one peta-FLOP


def _result(*, flops: int, executed_flops: int, num_tokens: int, ok: bool = True) -> StepResult:
    return StepResult(
        flops=flops,
        executed_flops=executed_flops,
        num_tokens=num_tokens,
        num_padded_tokens=num_tokens,
        num_sequences=1,
        sum_seqlen_squared=num_tokens**2,
        num_microbatches=1,
        ok=ok,
    )


def _two_iteration_meter() -> ThroughputMeter:
    meter = ThroughputMeter(world_size=4, peak_flops_per_s=2 * PF, warmup_iterations=0)
    meter.record(
        iteration=10,
        result=_result(flops=6 * PF, executed_flops=8 * PF, num_tokens=3000),
        elapsed_s=1.5,
        static_flops=16 * PF,
    )
    meter.record(
        iteration=11,
        result=_result(flops=2 * PF, executed_flops=4 * PF, num_tokens=1000),
        elapsed_s=0.5,
        static_flops=8 * PF,
    )
    return meter


def test_interval_rates_are_ratios_of_totals() -> None:
    report = _two_iteration_meter().interval()
    # Totals: flops 8 PF, executed 12 PF, static 24 PF, 4000 tokens, 2.0 s, 4 GPUs, peak 2 PF/s.
    # corrected: 8e15 / 2.0 / 4 / 1e12 = 1000 TFLOP/s/GPU   (Megatron: last 2e15 / mean 1.0 / 4 = 500)
    # static:   24e15 / 2.0 / 4 / 1e12 = 3000;  over-report 24 / 8 = 3
    # tokens:    4000 / 2.0 / 4        = 500 tokens/s/GPU
    # MFU: 1e15 / 2e15 = 50 %;  HFU: 12e15 / 2.0 / 4 = 1.5e15 -> 75 %
    assert report.scalars() == {
        "throughput/tflops_per_s_per_gpu": 1000.0,
        "throughput/static_tflops_per_s_per_gpu": 3000.0,
        "throughput/over_report_factor_vs_static": 3.0,
        "throughput/tokens_per_s_per_gpu": 500.0,
        "throughput/mfu_percent": 50.0,
        "throughput/hfu_percent": 75.0,
        "throughput/num_fallback_iterations": 0.0,
    }
    assert (report.first_iteration, report.last_iteration, report.num_iterations) == (10, 11, 2)
    assert (report.flops, report.executed_flops, report.static_flops) == (8 * PF, 12 * PF, 24 * PF)
    assert report.num_tokens == 4000 and report.elapsed_s == 2.0
    assert not report.fell_back


def test_interval_resets_after_each_call() -> None:
    meter = _two_iteration_meter()
    meter.interval()
    with pytest.raises(ValueError, match="no iteration"):
        meter.interval()
    meter.record(
        iteration=12,
        result=_result(flops=1 * PF, executed_flops=1 * PF, num_tokens=500),
        elapsed_s=0.25,
        static_flops=2 * PF,
    )
    report = meter.interval()
    # Only iteration 12: 1e15 / 0.25 / 4 = 1e15 -> 1000 TFLOP/s/GPU; static 2000; 500 / 0.25 / 4 = 500 tok/s.
    assert report.scalars() == {
        "throughput/tflops_per_s_per_gpu": 1000.0,
        "throughput/static_tflops_per_s_per_gpu": 2000.0,
        "throughput/over_report_factor_vs_static": 2.0,
        "throughput/tokens_per_s_per_gpu": 500.0,
        "throughput/mfu_percent": 50.0,
        "throughput/hfu_percent": 50.0,
        "throughput/num_fallback_iterations": 0.0,
    }
    assert (report.first_iteration, report.last_iteration, report.num_iterations) == (12, 12, 1)


def test_summary_excludes_warmup_but_intervals_do_not() -> None:
    meter = ThroughputMeter(world_size=2, peak_flops_per_s=4 * PF, warmup_iterations=2)
    # Two slow warm-up iterations (compilation, allocator growth) ...
    for iteration in (1, 2):
        meter.record(
            iteration=iteration,
            result=_result(flops=1 * PF, executed_flops=1 * PF, num_tokens=100),
            elapsed_s=8.0,
        )
    assert meter.summary() is None
    # ... then two steady ones.
    for iteration in (3, 4):
        meter.record(
            iteration=iteration,
            result=_result(flops=4 * PF, executed_flops=6 * PF, num_tokens=2000),
            elapsed_s=1.0,
        )
    summary = meter.summary()
    assert summary is not None
    # Steady totals: 8 PF, 12 PF executed, 4000 tokens, 2.0 s, 2 GPUs, peak 4 PF/s.
    # 8e15 / 2.0 / 2 = 2e15 -> 2000 TFLOP/s/GPU, MFU 50 %; 12e15 / 2.0 / 2 = 3e15 -> HFU 75 %; 4000 / 2 / 2 = 1000.
    assert summary.scalars() == {
        "throughput/tflops_per_s_per_gpu": 2000.0,
        "throughput/tokens_per_s_per_gpu": 1000.0,
        "throughput/mfu_percent": 50.0,
        "throughput/hfu_percent": 75.0,
        "throughput/num_fallback_iterations": 0.0,
    }
    assert (summary.first_iteration, summary.last_iteration, summary.num_iterations) == (3, 4, 2)
    # The interval holds all four: 10 PF / 18.0 s is not exact, so compare totals.
    interval = meter.interval()
    assert (interval.first_iteration, interval.num_iterations) == (1, 4)
    assert (interval.flops, interval.elapsed_s) == (10 * PF, 18.0)
    # Closing an interval does not touch the summary.
    assert meter.summary() == summary


def test_world_size_divides_throughput() -> None:
    reports = []
    for world_size in (1, 8):
        meter = ThroughputMeter(world_size=world_size, peak_flops_per_s=10 * PF, warmup_iterations=0)
        meter.record(iteration=1, result=_result(flops=8 * PF, executed_flops=8 * PF, num_tokens=8192), elapsed_s=1.0)
        reports.append(meter.interval())
    one, eight = reports
    # 8e15 FLOPs in 1 s: 8000 TFLOP/s on one GPU, 1000 per GPU on eight; tokens 8192 vs 1024; MFU 80 % vs 10 %.
    assert (one.tflops_per_s_per_gpu, one.tokens_per_s_per_gpu, one.mfu_percent) == (8000.0, 8192.0, 80.0)
    assert (eight.tflops_per_s_per_gpu, eight.tokens_per_s_per_gpu, eight.mfu_percent) == (1000.0, 1024.0, 10.0)


def test_failed_tracker_counts_static_flops_and_is_flagged() -> None:
    meter = ThroughputMeter(world_size=1, peak_flops_per_s=10 * PF, warmup_iterations=0)
    meter.record(
        iteration=1,
        result=_result(flops=2 * PF, executed_flops=3 * PF, num_tokens=1000),
        elapsed_s=1.0,
        static_flops=4 * PF,
    )
    meter.record(
        iteration=2,
        result=_result(flops=123, executed_flops=456, num_tokens=1000, ok=False),
        elapsed_s=1.0,
        static_flops=4 * PF,
    )
    report = meter.interval()
    # Iteration 2 counts 4 PF (its static FLOPs) for model and executed FLOPs, not 123 / 456.
    # flops 6 PF, executed 7 PF, static 8 PF over 2.0 s on 1 GPU, peak 10 PF/s:
    # 3000 TFLOP/s, static 4000, over-report 8/6, 1000 tok/s, MFU 30 %, HFU 35 %.
    assert report.scalars() == {
        "throughput/tflops_per_s_per_gpu": 3000.0,
        "throughput/static_tflops_per_s_per_gpu": 4000.0,
        "throughput/over_report_factor_vs_static": 4 / 3,
        "throughput/tokens_per_s_per_gpu": 1000.0,
        "throughput/mfu_percent": 30.0,
        "throughput/hfu_percent": 35.0,
        "throughput/num_fallback_iterations": 1.0,
    }
    assert report.fell_back and report.num_fallback_iterations == 1
    assert " FLOPs fallback iterations: 1 |" in format_log_fields(report)


def test_failed_tracker_without_static_counts_the_results_own_fallback() -> None:
    meter = ThroughputMeter(world_size=1, peak_flops_per_s=10 * PF, warmup_iterations=0)
    fallback = _result(flops=5 * PF, executed_flops=5 * PF, num_tokens=10, ok=False)
    meter.record(iteration=1, result=fallback, elapsed_s=1.0)
    report = meter.interval()
    assert (report.flops, report.executed_flops, report.static_flops) == (5 * PF, 5 * PF, None)
    assert report.fell_back


def test_no_peak_omits_mfu_and_hfu_and_warns() -> None:
    with pytest.warns(UserWarning, match="MFU and HFU"):
        meter = ThroughputMeter(world_size=2, peak_flops_per_s=None, warmup_iterations=0)
    meter.record(iteration=1, result=_result(flops=4 * PF, executed_flops=4 * PF, num_tokens=64), elapsed_s=2.0)
    report = meter.interval()
    # 4e15 / 2.0 / 2 = 1e15 -> 1000 TFLOP/s/GPU; 64 / 2.0 / 2 = 16 tok/s; no static, no peak.
    assert report.scalars() == {
        "throughput/tflops_per_s_per_gpu": 1000.0,
        "throughput/tokens_per_s_per_gpu": 16.0,
        "throughput/num_fallback_iterations": 0.0,
    }
    assert report.mfu_percent is None and report.hfu_percent is None


def test_partial_static_flops_omits_static_rates_and_warns_once() -> None:
    meter = ThroughputMeter(world_size=1, peak_flops_per_s=PF, warmup_iterations=0)
    meter.record(iteration=1, result=_result(flops=PF, executed_flops=PF, num_tokens=1), elapsed_s=1.0, static_flops=PF)
    meter.record(iteration=2, result=_result(flops=PF, executed_flops=PF, num_tokens=1), elapsed_s=1.0)
    with pytest.warns(UserWarning, match="only some iterations"):
        report = meter.interval()
    assert report.static_flops is None
    assert "throughput/static_tflops_per_s_per_gpu" not in report.scalars()
    assert "throughput/over_report_factor_vs_static" not in report.scalars()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meter.summary()  # same mix, no second warning


def test_format_log_line_megatron_style() -> None:
    report = _two_iteration_meter().interval()
    line = format_log_line(
        report,
        iteration=10,
        train_iters=100,
        elapsed_ms_per_iter=1000.0,
        timestamp=datetime(2026, 11, 30, 12, 0, 0),
    )
    assert line == (
        " [2026-11-30 12:00:00] iteration       10/     100 |"
        " elapsed time per iteration (ms): 1000.0 |"
        " throughput per GPU (TFLOP/s/GPU): 3000.0 |"
        " corrected throughput per GPU (TFLOP/s/GPU): 1000.0 |"
        " over-report factor vs static: 3.00x |"
        " tokens per GPU (tokens/s/GPU): 500.0 |"
        " MFU (%): 50.0 |"
        " HFU (%): 75.0 |"
    )
    assert line.endswith(format_log_fields(report, stock="static"))
    # An adapter's line, whose stock field is the framework's own, gains the static number by name.
    assert " static throughput per GPU (TFLOP/s/GPU): 3000.0 |" in format_log_fields(report)
    # The added fields leave out the stock throughput, which Megatron's own line already prints.
    assert format_log_fields(report).startswith(" corrected throughput per GPU")


def test_format_log_line_without_train_iters_static_or_peak() -> None:
    report = IntervalReport(
        first_iteration=7,
        last_iteration=7,
        num_iterations=1,
        num_fallback_iterations=0,
        elapsed_s=0.5,
        flops=PF,
        executed_flops=PF,
        static_flops=None,
        num_tokens=1024,
        world_size=2,
        peak_flops_per_s=None,
    )
    line = format_log_line(
        report, iteration=7, train_iters=None, elapsed_ms_per_iter=500.0, timestamp=datetime(2026, 1, 2, 3, 4, 5)
    )
    # 1e15 / 0.5 / 2 = 1e15 -> 1000.0 TFLOP/s/GPU; 1024 / 0.5 / 2 = 1024.0 tok/s.
    assert line == (
        " [2026-01-02 03:04:05] iteration        7 |"
        " elapsed time per iteration (ms): 500.0 |"
        " corrected throughput per GPU (TFLOP/s/GPU): 1000.0 |"
        " tokens per GPU (tokens/s/GPU): 1024.0 |"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world_size": 0, "peak_flops_per_s": PF},
        {"world_size": 1, "peak_flops_per_s": 0},
        {"world_size": 1, "peak_flops_per_s": PF, "warmup_iterations": -1},
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ThroughputMeter(**kwargs)


@pytest.mark.parametrize("elapsed_s", [0.0, -1.0, float("nan"), float("inf")])
def test_record_rejects_bad_elapsed(elapsed_s: float) -> None:
    meter = ThroughputMeter(world_size=1, peak_flops_per_s=PF)
    with pytest.raises(ValueError, match="elapsed_s"):
        meter.record(iteration=1, result=_result(flops=1, executed_flops=1, num_tokens=1), elapsed_s=elapsed_s)


def test_record_rejects_non_increasing_iteration() -> None:
    meter = ThroughputMeter(world_size=1, peak_flops_per_s=PF)
    meter.record(iteration=5, result=_result(flops=1, executed_flops=1, num_tokens=1), elapsed_s=1.0)
    with pytest.raises(ValueError, match="iteration must increase"):
        meter.record(iteration=5, result=_result(flops=1, executed_flops=1, num_tokens=1), elapsed_s=1.0)


def test_small_rates_keep_three_significant_digits_and_summary() -> None:
    from megatron_flops.reporting.meter import format_summary, format_tflops

    assert (format_tflops(412.345), format_tflops(9.876), format_tflops(0.01734)) == ("412.3", "9.88", "0.0173")
    meter = _two_iteration_meter()
    summary = format_summary(meter.summary(), warmup_iterations=0)
    assert summary.splitlines()[0] == ("steady state: iterations 10-11 (2 iterations, the first 0 left out as warm-up); "
                                       "overall rates: totals over total time (megatron-flops compare also gives the "
                                       "median step)")
    assert "  corrected throughput per GPU (TFLOP/s/GPU):   1000.0" in summary
    assert format_summary(None, warmup_iterations=5) == "steady state: no iteration after the 5 warm-up iterations"


def test_three_numbers_named_and_a_fallback_counts_the_frameworks() -> None:
    meter = ThroughputMeter(world_size=2, peak_flops_per_s=8 * PF, warmup_iterations=0)
    # Iteration 1 exact: corrected 2 PF, static 4 PF, framework 3 PF. Iteration 2 fell back: its
    # tracker's own fallback holds the static 4 PF, but the framework's 3 PF is what is counted.
    meter.record(iteration=1, result=_result(flops=2 * PF, executed_flops=2 * PF, num_tokens=8), elapsed_s=1.0,
                 static_flops=4 * PF, framework_flops=3 * PF)
    fallback = _result(flops=4 * PF, executed_flops=4 * PF, num_tokens=8, ok=False)
    meter.record(iteration=2, result=fallback, elapsed_s=1.0, static_flops=4 * PF, framework_flops=3 * PF)
    report = meter.interval()
    assert (report.flops, report.static_flops, report.framework_flops) == (5 * PF, 8 * PF, 6 * PF)
    # Over 2.0 s and 2 GPUs: corrected 5e15 / 4 = 1250 TFLOP/s/GPU, static 2000, framework 1500;
    # over-report vs static 8 / 5 = 1.6.
    scalars = report.scalars()
    assert {k: scalars[k] for k in ("throughput/tflops_per_s_per_gpu", "throughput/static_tflops_per_s_per_gpu",
                                    "throughput/framework_tflops_per_s_per_gpu",
                                    "throughput/over_report_factor_vs_static")} == {
        "throughput/tflops_per_s_per_gpu": 1250.0, "throughput/static_tflops_per_s_per_gpu": 2000.0,
        "throughput/framework_tflops_per_s_per_gpu": 1500.0, "throughput/over_report_factor_vs_static": 1.6}
    assert format_log_fields(report).startswith(
        " corrected throughput per GPU (TFLOP/s/GPU): 1250.0 | static throughput per GPU (TFLOP/s/GPU): 2000.0 |"
        " framework throughput per GPU (TFLOP/s/GPU): 1500.0 | over-report factor vs static: 1.60x |")
    with pytest.raises(ValueError, match="framework_flops must be >= 0"):
        meter.record(iteration=3, result=fallback, elapsed_s=1.0, framework_flops=-1)
