"""The per-step reduction in one process: the exact int64 range, overflow, malformed shapes, the
static fallback, and how mis-paired steps are told apart (multi-rank faults: test_faults_dist)."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_flops.flops.formulas import SeqStats, parse_rows, training_flops
from megatron_flops.tracking.reduction import STEP_WINDOW, StepReducer, _lag
from megatron_flops.model.spec import ModelSpec
from megatron_flops.tracking.tracker import FlopsTracker

SPEC = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                                   vocab_size=128))
# floor(sqrt(2^63 - 1)): a rank whose token slots in one step stay at or below this is exact.
EXACT_SLOTS = 3_037_000_499


def _tok(b: int, s: int) -> torch.Tensor:
    return torch.zeros(b, s, dtype=torch.long)


def _huge(num_tokens: int, *, packed: bool) -> dict:
    tokens = torch.zeros(1, 1, dtype=torch.long).expand(1, num_tokens)  # no memory
    return dict(tokens=tokens, cu_seqlens=torch.tensor([0, num_tokens])) if packed else dict(tokens=tokens)


def _warnings(caplog) -> list[str]:
    return [m for m in caplog.messages if "megatron-flops" in m]


@pytest.mark.parametrize("packed", [True, False])
def test_the_exact_range_ends_at_sqrt_2_63(packed, caplog):
    assert EXACT_SLOTS**2 < 2**63 <= (EXACT_SLOTS + 1) ** 2
    tracker = FlopsTracker(SPEC)
    tracker.record(**_huge(EXACT_SLOTS, packed=packed))
    r = tracker.end_step()
    # One sequence of EXACT_SLOTS tokens: sum s^2 = EXACT_SLOTS^2, priced exactly.
    assert r.ok and r.sum_seqlen_squared == EXACT_SLOTS**2
    assert r.flops == training_flops(SPEC, SeqStats.from_rows(parse_rows([EXACT_SLOTS]))).total
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(**_huge(EXACT_SLOTS + 1, packed=packed))
        r = tracker.end_step()
    # One more token could wrap the int64 sum of squares (the host's Python int for an unpacked
    # row would not even fit int64): the step falls back to the static number, said once.
    static = training_flops(SPEC, SeqStats.full_length(1, EXACT_SLOTS + 1)).total
    assert not r.ok and r.flops == r.executed_flops == r.static_flops == static
    assert "2^63" in r.fallback_reason and len(_warnings(caplog)) == 1


def test_a_rank_over_the_range_across_micro_batches_falls_back():
    # Two micro-batches of 2^31 tokens: each alone is exact, but the rank's slots in the step,
    # 2^32, squared pass 2^63: the bound is the rank's whole step.
    tracker = FlopsTracker(SPEC, seq_length=4096)
    for _ in range(2):
        tracker.record(**_huge(2**31, packed=True))
    r = tracker.end_step()
    assert not r.ok and r.flops == training_flops(SPEC, SeqStats.full_length(2, 4096)).total


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor([], dtype=torch.int32)), "at least two entries"),
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0], dtype=torch.int32)), "at least two entries"),
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor(0)), "one packed stream"),
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor([[0, 3, 8], [0, 5, 8]])), "one packed stream"),
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0, 3, 8, -1]), cu_seqlens_argmin=1), "at least two"),
        (dict(tokens=_tok(2, 8), seq_lengths=torch.tensor([3, 4, 5])), "one length per row"),
    ],
)
def test_malformed_shapes_fall_back_with_one_warning(call, message, caplog):
    tracker = FlopsTracker(SPEC, seq_length=8)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(tokens=_tok(1, 8))
        tracker.record(**call)
        tracker.record(**call)
        r = tracker.end_step()
    # The malformed micro-batch's rows still count for the static number: 1 + 2 x rows rows of 8.
    rows = 1 + 2 * call["tokens"].shape[0]
    assert not r.ok and r.flops == training_flops(SPEC, SeqStats.full_length(rows, 8)).total
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and message in warnings[0]
    with pytest.raises(ValueError, match=message):
        FlopsTracker(SPEC, validate=True).record(**call)


def test_a_batch_dimension_of_one_is_not_malformed():
    tracker = FlopsTracker(SPEC)
    tracker.record(tokens=_tok(1, 8), cu_seqlens=torch.tensor([[0, 3, 8]]))
    r = tracker.end_step()
    assert r.ok and (r.num_sequences, r.sum_seqlen_squared) == (2, 9 + 25)


def test_negative_statistics_fall_back(monkeypatch):
    # A malformed cu_seqlens that ends below 0 gives negative token counts: never priced. On the
    # device path (host tensors catch it earlier, as decreasing offsets) the reduction sees it.
    monkeypatch.setattr("megatron_flops.tracking.batch_checks.HOST_DEVICE_TYPES", frozenset())
    tracker = FlopsTracker(SPEC, seq_length=8)
    tracker.record(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0, 4, -4]))
    r = tracker.end_step()
    assert not r.ok and "negative" in r.fallback_reason and r.flops == r.static_flops


def test_the_fallback_is_the_latest_static_number_and_zero_only_when_none_is_known(caplog):
    tracker = FlopsTracker(SPEC, seq_length=8)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(tokens=torch.zeros(8, dtype=torch.long))  # 1-D: nothing is known of this step
        first = tracker.end_step()
    assert (first.ok, first.flops, first.static_flops) == (False, 0, None)
    assert any("no static number is known" in m for m in _warnings(caplog))
    tracker.record(tokens=_tok(3, 8))
    good = tracker.end_step()
    assert good.ok and good.static_flops == training_flops(SPEC, SeqStats.full_length(3, 8)).total
    tracker.record(tokens=torch.zeros(8, dtype=torch.long))
    later = tracker.end_step()
    assert not later.ok and later.flops == later.static_flops == good.static_flops


def test_an_accumulator_that_cannot_move_still_gives_the_static_number(caplog):
    tracker = FlopsTracker(SPEC, seq_length=16)
    meta = dict(tokens=_tok(2, 16), seq_lengths=torch.tensor([3, 9], device="meta"))
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(**meta)
        r = tracker.end_step()
    assert not r.ok and r.flops == training_flops(SPEC, SeqStats.full_length(2, 16)).total
    assert any("Cannot copy out of meta" in m for m in _warnings(caplog))


@pytest.mark.parametrize(
    "steps, lags",
    [
        ([5, 5, 5], [0, 0, 0]),
        ([2, 2, 3], [0, 0, 1]),  # the last rank skipped an end_step: it runs one filler
        ([3, 2, 3], [1, 0, 1]),  # the middle rank repeated one: the others run one filler
        ([14, 15, 16, 17], [0, 1, 2, 3]),  # across a residue wrap
        ([1, 1, 1 + STEP_WINDOW // 2], [None] * 3),  # too far apart to tell who is ahead
        ([1, 1, 1 + STEP_WINDOW], [None] * 3),  # same residue, told apart by the exact sums
        ([1, 2, 2 + STEP_WINDOW], [None] * 3),
    ],
)
def test_lag_pins_every_rank_down_or_refuses(steps, lags):
    residues = [0] * STEP_WINDOW
    for s in steps:
        residues[s % STEP_WINDOW] += 1
    total, squares = sum(steps), sum(s * s for s in steps)
    assert [_lag(residues, total, squares, s) for s in steps] == lags


def test_host_counts_are_read_exactly_whatever_their_int_type():
    np = pytest.importorskip("numpy")
    reducer = StepReducer(("num_rows", "sum"), shape_slots=("num_rows",))
    # numpy int64 counts near 2^62 are read exactly (no float round trip, no wrap).
    r = reducer.reduce(None, [np.int64(3), np.int64(2**62 + 1)], step=1, failed=False, token_slots=np.int64(3))
    assert r.problem is None and dict(r.totals) == {"num_rows": 3, "sum": 2**62 + 1}
    # A float is no count: the rank's step fails (its shapes still travel), nothing raises.
    r = reducer.reduce(None, [np.int64(3), 1.5], step=2, failed=False, token_slots=3)
    assert r.problem is not None and r.totals is None and dict(r.shapes) == {"num_rows": 3}
    assert isinstance(r.local_error, TypeError)


def test_a_step_index_that_is_no_integer_falls_back_without_raising(caplog):
    tracker = FlopsTracker(SPEC, seq_length=8)
    tracker.record(tokens=_tok(1, 8))
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        r = tracker.end_step(step=1.5)
    assert not r.ok and "does not add up" in r.fallback_reason
    assert any("TypeError" in m for m in _warnings(caplog))
    tracker.record(tokens=_tok(1, 8))
    assert tracker.end_step(step=2).ok
