"""What the real-framework tests share: skipping (or failing under CI) when a framework is not here,
and the trace assertions (test-only)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TypeVar

import pytest

from frameworks import envs
from frameworks.megatron_lm import log_lines
from frameworks.procs import Rank

T = TypeVar("T")
TRACE_FIELDS = ("iteration", "flops", "executed_flops", "static_flops", "num_tokens", "num_padded_tokens",
                "num_sequences", "num_microbatches")


def require(make: Callable[[], T]) -> T:
    """``make()``, or skip the test with the reason it cannot be had here; under CI (``CI`` set, as
    ``.ci/run`` runs) a missing framework is a failure instead: CI has ``../shared`` and PyPI."""
    try:
        return make()
    except envs.Unavailable as exc:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI must run the real frameworks: {exc}")
        pytest.skip(str(exc))


def traces(ranks: list[Rank]) -> dict[int, list[dict]]:
    """rank -> its trace lines, for every rank that wrote one (the rank that prints the log must)."""
    found = {r.rank: lines for r in ranks if (lines := r.trace()) is not None}
    assert found, "no rank wrote a trace although MEGATRON_FLOPS_TRACE was set on every rank"
    assert len(ranks) - 1 in found, "the last rank (it prints the log) wrote no trace"
    return found


def assert_trace(lines: list[dict], expected: list[dict[str, int]], *, framework: str, world_size: int) -> None:
    """A header ``{"run": {...}}`` naming the framework and the world size, then one line per
    iteration whose integer fields equal ``expected`` (and ``ok`` true)."""
    header, steps = lines[0], lines[1:]
    assert set(header) == {"run"}, header
    assert header["run"]["format"] == "megatron-flops-trace/1"
    assert (header["run"]["framework"], header["run"]["world_size"]) == (framework, world_size)
    got = [{key: step[key] for key in TRACE_FIELDS} for step in steps]
    assert got == expected
    assert all(step["ok"] is True for step in steps)
    assert all(isinstance(step["elapsed_s"], float) and step["elapsed_s"] > 0 for step in steps)


def assert_log_lines(output: str, num_iterations: int) -> None:
    """The rank that prints the log has one line per iteration with a finite loss, the stock
    throughput field and, beside it, the adapter's corrected one."""
    lines = log_lines(output)
    assert sorted(lines) == list(range(1, num_iterations + 1))
    for fields in lines.values():
        assert math.isfinite(float(fields["lm loss"]))
        assert "throughput per GPU (TFLOP/s/GPU)" in fields
        assert "corrected throughput per GPU (TFLOP/s/GPU)" in fields


def assert_model_inputs_agree(ranks: list[Rank]) -> None:
    """No rank's cross-check found the model's inputs contradicting the batch read (the stock
    forward steps must never fall back for it), and no rank fell back at all."""
    for r in ranks:
        assert "contradict the batch read" not in r.output, r.output[-4000:]
        assert "every rank reports the stock FLOPs" not in r.output, r.output[-4000:]

