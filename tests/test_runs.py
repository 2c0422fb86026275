"""The trace reader, steady-state statistics, comparability and the recommendation rule
(``megatron_flops.reporting.runs``, stdlib only), on traces written here."""

from __future__ import annotations

import json

import pytest

from fake_train import header, step
from megatron_flops.reporting.runs import (
    Candidate,
    parse_trace,
    quantile,
    recommend,
    run_stats,
    comparability,
    spread,
)


def _text(*objs: dict) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def _trace(*objs: dict, name: str = "t.jsonl"):
    return parse_trace(_text(*objs), name=name)


def test_step_rates_are_per_gpu_per_second() -> None:
    trace = _trace(header(world_size=4, warmup=0),
                   step(1, flops=6 * 10**12, tokens=8000, elapsed_s=2.0, static=12 * 10**12))
    stats = run_stats(trace)
    # 6e12 FLOPs / 2 s / 4 GPUs = 0.75e12; static 12e12 / 8 = 1.5e12; 8000 tokens / 8 = 1000.
    assert stats.median("tflops_per_gpu") == 0.75
    assert stats.median("static_tflops_per_gpu") == 1.5
    assert stats.median("tokens_per_s_per_gpu") == 1000.0
    assert stats.median("step_time_s") == 2.0
    assert stats.metrics["mfu_percent"] is None  # no peak in the header
    # With a peak of 1.5e12 FLOP/s: 0.75e12 / 1.5e12 = 50 %.
    assert run_stats(trace, peak_flops_per_s=1.5e12).median("mfu_percent") == 50.0


def test_quartiles_interpolate_between_closest_ranks() -> None:
    # [1, 2, 3, 4]: q1 at position 0.75 -> 1.75, median 2.5, q3 at position 2.25 -> 3.25.
    s = spread([4.0, 1.0, 3.0, 2.0])
    assert (s.q1, s.median, s.q3, s.min, s.max, s.num) == (1.75, 2.5, 3.25, 1.0, 4.0, 4)
    assert quantile([5.0], 0.25) == 5.0
    assert spread([]) is None


def test_warmup_and_fallen_back_steps_are_left_out_and_counted() -> None:
    elapsed = [9.0, 8.0, 1.0, 2.0, 4.0, 0.5]  # the first two are warm-up (header: 2)
    steps = [step(i + 1, flops=10**12, tokens=100, elapsed_s=e, ok=i != 4) for i, e in enumerate(elapsed)]
    stats = run_stats(_trace(header(warmup=2), *steps))
    # Used: iterations 3, 4, 6 (5 fell back) -> 1e12 / [1, 2, 0.5] s = [1, 0.5, 2] TFLOP/s; median 1.
    assert (stats.num_steps, stats.num_warmup_steps, stats.num_failed_steps) == (3, 2, 1)
    assert stats.median("tflops_per_gpu") == 1.0
    # --warmup 0 overrides the header: iterations 1-4 and 6 -> [1/9, 1/8, 1, 0.5, 2], median 0.5.
    assert run_stats(_trace(header(warmup=2), *steps), warmup=0).median("tflops_per_gpu") == 0.5


def test_restart_segments_pool_with_their_own_warmup() -> None:
    first = [step(i, flops=10**12, tokens=100, elapsed_s=e) for i, e in [(1, 9.0), (2, 1.0), (3, 1.0)]]
    # The restart replays iteration 3 and goes on; its first step is warm-up again.
    second = [step(i, flops=10**12, tokens=100, elapsed_s=e) for i, e in [(3, 7.0), (4, 0.5), (5, 0.5)]]
    trace = _trace(header(warmup=1), *first, header(warmup=1), *second)
    stats = run_stats(trace)
    # Used: 1, 1 (segment 1), 0.5, 0.5 (segment 2) s -> TFLOP/s [1, 1, 2, 2]; median 1.5.
    assert (stats.num_segments, stats.num_steps, stats.num_warmup_steps) == (2, 4, 2)
    assert stats.median("tflops_per_gpu") == 1.5
    last = run_stats(trace, segments="last")
    assert (last.num_segments, last.num_steps, last.median("tflops_per_gpu")) == (1, 2, 2.0)


def test_segments_of_different_runs_are_refused_unless_only_the_last_is_asked() -> None:
    trace = _trace(header(world_size=8), *[step(i, flops=1, tokens=1, elapsed_s=1.0) for i in range(1, 5)],
                   header(world_size=16), *[step(i, flops=1, tokens=1, elapsed_s=1.0) for i in range(1, 5)])
    with pytest.raises(ValueError, match=r"segment 2 \(header at line 6\) is another run \(world_size 8 vs 16\).*--segments last"):
        run_stats(trace)
    assert run_stats(trace, segments="last").world_size == 16


@pytest.mark.parametrize("objs, message", [
    ((header(),), "has no steps"),
    ((header(warmup=2), step(1, flops=1, tokens=1, elapsed_s=1.0)), "all 1 steps are warm-up"),
    ((header(warmup=0), step(1, flops=1, tokens=1, elapsed_s=1.0, ok=False)), r"every step after warm-up \(1\) fell back"),
])
def test_traces_without_usable_steps_are_refused(objs, message) -> None:
    with pytest.raises(ValueError, match=message):
        run_stats(_trace(*objs))


@pytest.mark.parametrize("text, message", [
    ("", "empty trace"),
    (_text(step(1, flops=1, tokens=1, elapsed_s=1.0)), r"line 1: a step before any \{\"run\": ...\} header"),
    (_text({"run": {"format": "other/1"}}), "not a megatron-flops trace header"),
    (_text({"run": {**header()["run"], "format": "megatron-flops-trace/2"}}), "trace format 'megatron-flops-trace/2' is not"),
    (_text({"run": {**header()["run"], "world_size": 0}}), "world_size must be an integer >= 1"),
    (_text(header(), {**step(1, flops=1, tokens=1, elapsed_s=1.0), "flops": True}), r"line 2: flops must be an integer"),
    (_text(header(), {**step(1, flops=1, tokens=1, elapsed_s=1.0), "flops": 1.5}), r"line 2: flops must be an integer"),
    (_text(header(), step(1, flops=1, tokens=1, elapsed_s=0.0)), r"line 2: elapsed_s must be a positive number"),
    (_text(header(), {**step(1, flops=1, tokens=1, elapsed_s=1.0), "ok": 1}), "ok must be true or false"),
    (_text(header(), {"iteration": 1}), r"line 2: step lacks flops, executed_flops, num_tokens, static_flops"),
    (_text(header()) + "{not json\n" + _text(step(1, flops=1, tokens=1, elapsed_s=1.0)), r"line 2: not JSON"),
])
def test_malformed_traces_name_the_line(text, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_trace(text, name="t.jsonl")


def test_a_torn_last_line_is_skipped_with_a_note() -> None:
    text = _text(header(warmup=0), step(1, flops=10**12, tokens=1, elapsed_s=1.0)) + '{"iteration": 2, "flo'
    trace = parse_trace(text, name="t.jsonl")
    assert len(trace.segments[0].steps) == 1
    assert trace.notes == ("t.jsonl: line 3 is cut short (the run was stopped while writing it); skipped",)


def test_unknown_keys_are_tolerated() -> None:
    trace = _trace({"run": {**header(warmup=0)["run"], "new_key": 1}},
                   {**step(1, flops=10**12, tokens=1, elapsed_s=1.0), "num_experts_tokens": 3})
    assert run_stats(trace).median("tflops_per_gpu") == 1.0


def _stats(*, tokens=(100, 100, 100), attention="causal", world_size=1, num_layers=4, name="t"):
    steps = [step(i, flops=10**12, tokens=n, elapsed_s=1.0) for i, n in enumerate(tokens, start=1)]
    return run_stats(parse_trace(_text(header(world_size=world_size, warmup=0, attention=attention,
                                              num_layers=num_layers), *steps), name=name))


def test_comparable_runs_give_no_warning() -> None:
    assert comparability([_stats(), _stats()]) == []


def test_differences_are_named() -> None:
    warnings = comparability([_stats(), _stats(num_layers=8, world_size=2, tokens=(100, 200), name="b")])
    assert warnings == [
        "b differs from t: world_size 1 vs 2; model.num_layers 4 vs 8; "
        "tokens per step 100 vs 200 at iteration 2 (other data or global batch)"
    ]


def test_other_flops_conventions_are_an_error() -> None:
    with pytest.raises(ValueError, match=r"b counts FLOPs under other conventions than t "
                                         r"\(attention 'causal' vs 'full'\)"):
        comparability([_stats(), _stats(attention="full", name="b")])


def _candidates(values, ok=None):
    ok = ok or [True] * len(values)
    return [Candidate(index=i, params={"x": str(i)}, all_ok=o, value=v) for i, (v, o) in enumerate(zip(values, ok))]


def test_recommendation_is_the_first_within_tolerance_of_the_fastest() -> None:
    # The fastest fully ok is 101 (index 3); 3 % below it is 97.97: index 1 (98.0) is the first within.
    # Index 0 (200) is faster but one of its repeats failed.
    rec = recommend(_candidates([200.0, 98.0, 99.5, 101.0], ok=[False, True, True, True]))
    assert (rec.chosen.index, rec.fastest.index) == (1, 3)
    assert rec.shortfall == pytest.approx(3.0 / 101.0)
    assert recommend(_candidates([200.0, 98.0, 99.5, 101.0], ok=[False, True, True, True]), tolerance=0.0).chosen.index == 3
    # 1 % tolerance: threshold 99.99, so only 101 (index 3) qualifies.
    assert recommend(_candidates([98.0, 99.5, 101.0]), tolerance=0.01).chosen.index == 2


def test_no_recommendation_without_a_fully_successful_configuration() -> None:
    assert recommend(_candidates([1.0, None], ok=[False, True])) is None
    with pytest.raises(ValueError, match="tolerance"):
        recommend(_candidates([1.0]), tolerance=1.5)
