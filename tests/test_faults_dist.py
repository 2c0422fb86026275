"""Faults in the per-step reduction, in 3 local gloo processes (plain torch.distributed).

Every rank records its own deterministic data each step; the truth of step k is the pure
estimator's total over every rank's data of step k. In each scenario one rank misbehaves
(its vector cannot be built, its accumulator cannot be moved, it overflows int64, it feeds
malformed shapes, it skips or repeats end_step, it dies). Checked: no result marked ok differs
from its step's truth, every rank agrees on every step, fallbacks carry the static number, and
nobody hangs (the launcher kills a straggler after a generous bound and the test then fails).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import random
import tempfile
import time
import traceback

import pytest
import torch

import mcore_cpu
from megatron_flops.flops.formulas import SeqStats, parse_rows, training_flops
from megatron_flops.model.spec import ModelSpec

pytestmark = pytest.mark.dist

WORLD = 3
STEPS = 5
SEQ = 64
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128)
# Past this many token slots in one step a rank's sum of squares may reach 2^63: floor(sqrt(2^63 - 1)).
EXACT_SLOTS = 3_037_000_499


def _rows(rank: int, step: int) -> tuple[list[int], list[int]]:
    """(documents of one packed [1, SEQ] row, real lengths of two [2, SEQ // 2] padded rows)."""
    rng = random.Random(f"{rank}/{step}")
    docs, left = [], SEQ - rng.randint(0, 6)
    while left > 0:
        docs.append(min(left, rng.randint(1, 20)))
        left -= docs[-1]
    return docs, [rng.randint(1, SEQ // 2) for _ in range(2)]


def _oracle_rows(rank: int, step: int) -> list:
    docs, lengths = _rows(rank, step)
    return [{"seqlens": docs, "pad_to": SEQ}] + [{"seqlens": s, "pad_to": SEQ // 2} for s in lengths]


def _truth(step: int, extra: list | None = None) -> int:
    rows = [row for rank in range(WORLD) for row in _oracle_rows(rank, step)] + (extra or [])
    return training_flops(ModelSpec.from_mapping(MODEL), SeqStats.from_rows(parse_rows(rows))).total


# 3 rows per rank and step: the stock formula prices 9 rows of SEQ tokens.
STATIC = training_flops(ModelSpec.from_mapping(MODEL), SeqStats.full_length(3 * WORLD, SEQ)).total


def _record(tracker, rank: int, step: int, **override) -> None:
    docs, lengths = _rows(rank, step)
    cu = torch.tensor([0] + [sum(docs[: i + 1]) for i in range(len(docs))], dtype=torch.int32)
    tracker.record(tokens=torch.zeros(1, SEQ, dtype=torch.long), cu_seqlens=override.get("cu_seqlens", cu))
    tracker.record(tokens=torch.zeros(2, SEQ // 2, dtype=torch.long), seq_lengths=torch.tensor(lengths))


def _huge_row(num_tokens: int) -> dict:
    """record() arguments of one packed row of ``num_tokens`` tokens (expanded: no memory)."""
    tokens = torch.zeros(1, 1, dtype=torch.long).expand(1, num_tokens)
    return dict(tokens=tokens, cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int64))


# ---- scenarios (run on every rank; each returns [(step label, result fields), ...]) --------------


def _fields(r) -> dict:
    return dict(ok=r.ok, flops=r.flops, static=r.static_flops, tokens=r.num_tokens, sum_sq=r.sum_seqlen_squared,
                reason=r.fallback_reason)


def _run_steps(tracker, rank: int, fault=None) -> list:
    """STEPS steps of every rank's data; ``fault(step, end)`` may take a step over (returns True)."""
    out = []

    def end(step: int, *, index: int | None = None, label: float | None = None) -> None:
        r = tracker.end_step(step=step if index is None else index)
        out.append((step if label is None else label, _fields(r)))

    for step in range(1, STEPS + 1):
        if fault is None or not fault(step, end):
            _record(tracker, rank, step)
            end(step)
    return out


def scenario_clean(tracker, rank):
    return _run_steps(tracker, rank)


def scenario_vector_raises(tracker, rank):
    # Rank 1 cannot build its vector at step 2 (any exception: here injected at that seam).
    def fault(step, end):
        if rank == 1 and step == 2:
            _record(tracker, rank, step)
            tracker._reducer._local_vector = lambda *a, **k: 1 / 0
            end(step)
            del tracker._reducer._local_vector
            return True
        return False
    return _run_steps(tracker, rank, fault)


def scenario_accumulator_elsewhere(tracker, rank):
    # Rank 2's statistics live on the meta device (say, a model not materialised yet): its
    # accumulator cannot be moved to the collective's device, every step.
    def fault(step, end):
        if rank == 2:
            docs, lengths = _rows(rank, step)
            cu = torch.tensor([0] + [sum(docs[: i + 1]) for i in range(len(docs))], device="meta")
            tracker.record(tokens=torch.zeros(1, SEQ, dtype=torch.long), cu_seqlens=cu)
            tracker.record(tokens=torch.zeros(2, SEQ // 2, dtype=torch.long),
                           seq_lengths=torch.tensor(lengths, device="meta"))
            end(step)
            return True
        return False
    return _run_steps(tracker, rank, fault)


def scenario_overflow(tracker, rank):
    # Step 2: rank 0 adds a row of EXACT_SLOTS + 1 tokens (its slots squared pass 2^63).
    # Step 3: ranks 0 and 1 each add a row of EXACT_SLOTS - 2 * SEQ tokens: each rank's slots are
    # EXACT_SLOTS, in the exact range, and the sum over ranks (past 2^63) is exact too.
    def fault(step, end):
        if step == 2 and rank == 0:
            tracker.record(**_huge_row(EXACT_SLOTS + 1))
        if step == 3 and rank in (0, 1):
            tracker.record(**_huge_row(EXACT_SLOTS - 2 * SEQ))
        return False
    return _run_steps(tracker, rank, fault)


def scenario_malformed(tracker, rank):
    # Rank 1 feeds an empty (step 2), a one-element (step 3) and a 2-D [2, 3] (step 4) cu_seqlens.
    bad = {2: torch.tensor([], dtype=torch.int32), 3: torch.tensor([0], dtype=torch.int32),
           4: torch.tensor([[0, 5, 9], [0, 7, 9]], dtype=torch.int32)}

    def fault(step, end):
        if rank == 1 and step in bad:
            _record(tracker, rank, step, cu_seqlens=bad[step])
            end(step)
            return True
        return False
    return _run_steps(tracker, rank, fault)


def scenario_skip(tracker, rank):
    # Rank 2 does not call end_step at step 2: its step 2 and 3 data go into its step 3.
    def fault(step, end):
        if rank == 2 and step == 2:
            _record(tracker, rank, step)
            return True
        return False
    return _run_steps(tracker, rank, fault)


def scenario_double(tracker, rank):
    # Rank 1 calls end_step(step=2) twice (the second result is labelled 2.5 here).
    def fault(step, end):
        if rank == 1 and step == 2:
            _record(tracker, rank, step)
            end(step)
            end(step, label=2.5)
            return True
        return False
    return _run_steps(tracker, rank, fault)


def scenario_far(tracker, rank):
    # Rank 2 labels its steps 8 (STEP_WINDOW // 2) ahead from the start.
    def fault(step, end):
        if rank == 2:
            _record(tracker, rank, step)
            end(step, index=step + 8)
            return True
        return False
    return _run_steps(tracker, rank, fault)


def scenario_session_skip(tracker, rank):
    # Through the session (what the adapters use): rank 0 opens step 3 but never closes it.
    from megatron_flops.reporting.session import Session

    session = Session(tracker, peak_flops_per_s=None, warmup_iterations=0, world_size=WORLD, clock=time.monotonic)
    out = []
    for step in range(1, STEPS + 1):
        session.begin_step()
        _record(session, rank, step)
        if rank == 0 and step == 3:
            continue
        out.append((step, _fields(session.end_step())))
    return out


def scenario_session_record_raises(tracker, rank):
    # Through the session: rank 1's record() at step 2 raises before the tracker sees it (a typo'd
    # keyword); the session never raises, and the step must fall back on every rank, not only there.
    from megatron_flops.reporting.session import Session

    session = Session(tracker, peak_flops_per_s=None, warmup_iterations=0, world_size=WORLD, clock=time.monotonic)
    out = []
    for step in range(1, STEPS + 1):
        session.begin_step()
        _record(session, rank, step)
        if rank == 1 and step == 2:
            session.record(tokens=torch.zeros(1, SEQ, dtype=torch.long), cu_seqlen=None)
        out.append((step, _fields(session.end_step())))
    return out


def scenario_trace_unwritable(tracker, rank):
    # Through the adapters' train_step wrapper: the trace path is a directory, so the last rank
    # (the one that writes it) cannot open it. Every rank must still install its session and
    # join every step's reduction, which alternates with the framework's own collective.
    import tempfile

    import torch.distributed as dist

    from megatron_flops.adapters._hooks import Adapter, wrap_train_step
    from megatron_flops.reporting.session import get_session, install_session, uninstall_session

    class _Adapter(Adapter):
        def new_session(self, bound):
            return install_session(tracker, world_size=WORLD, warmup_iterations=0, peak_flops_per_s=10**15,
                                   trace=tempfile.gettempdir())

    def train_step(step):
        _record(get_session(), rank, step)
        dist.all_reduce(torch.ones(7))  # the framework's own collective, another shape

    wrapped = wrap_train_step(train_step, _Adapter())
    out = []
    for step in range(1, STEPS + 1):
        wrapped(step)
        session = get_session()
        report = None if session is None else session.report()
        out.append((step, None if report is None else dict(ok=report.num_fallback_iterations == 0, flops=report.flops)))
    uninstall_session()
    return out


def scenario_dying(tracker, rank):
    # Rank 2 dies at step 3 before its end_step; the others go on with steps 3 and 4.
    out = []
    for step in range(1, 5):
        if rank == 2 and step == 3:
            os._exit(3)
        _record(tracker, rank, step)
        out.append((step, _fields(tracker.end_step(step=step))))
    return out


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


# ---- launcher --------------------------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def fault_worker(rank: int, port: int, result_dir: str, names: list[str]) -> None:
    import torch.distributed as dist

    from megatron_flops.tracking.tracker import FlopsTracker

    torch.set_num_threads(1)
    results: dict = {}
    os.environ.update(mcore_cpu.AGENT_STORE_ENV)  # join the parent's store
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        for name in names:
            capture = _Capture()
            logging.getLogger("megatron_flops").addHandler(capture)
            tracker = FlopsTracker(ModelSpec.from_mapping(MODEL), seq_length=SEQ)
            results[name] = dict(steps=SCENARIOS[name](tracker, rank), warnings=capture.messages)
            logging.getLogger("megatron_flops").removeHandler(capture)
            if name != "dying":
                dist.barrier()
    except BaseException:
        results["error"] = traceback.format_exc()
    with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    os._exit(0)  # no teardown: a dead peer can hang it


def _launch(names: list[str], bound_s: float = 300.0) -> list[dict | None]:
    """Run the scenarios in WORLD spawned processes; kill any still alive after ``bound_s``."""
    import multiprocessing

    store = mcore_cpu.rendezvous_store(WORLD)  # held until the workers are done
    port = store.port
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=fault_worker, args=(rank, port, tmp, names)) for rank in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + bound_s
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        for p in procs:
            if p.is_alive():
                p.kill()  # this worker's pid only
                p.join(10)
        results = []
        for rank in range(WORLD):
            path = os.path.join(tmp, f"{rank}.pkl")
            results.append(pickle.load(open(path, "rb")) if os.path.exists(path) else None)
    for rank, r in enumerate(results):
        assert r is None or "error" not in r, f"rank {rank}:\n{r['error']}"
    return results


@pytest.fixture(scope="module")
def runs():
    return _launch([name for name in SCENARIOS if name != "dying"])


def _steps(runs, name: str) -> list[list]:
    assert all(r is not None for r in runs), "a rank hung and was killed"
    return [r[name]["steps"] for r in runs]


def _check_agreement(per_rank: list[list], truth: dict[int, int]) -> None:
    """No ok result differs from its step's truth; every rank's result of a step label is the same."""
    by_step: dict[int, set] = {}
    for steps in per_rank:
        for step, got in steps:
            if got["ok"]:
                assert got["flops"] == truth[step], (step, got)
            else:
                assert got["flops"] == got["static"] == STATIC, (step, got)
            by_step.setdefault(step, set()).add((got["ok"], got["flops"]))
    for step, outcomes in by_step.items():
        assert len(outcomes) == 1, (step, outcomes)


def _oks(per_rank: list[list]) -> list[list]:
    return [[(step, got["ok"]) for step, got in steps] for steps in per_rank]


TRUTH = {step: _truth(step) for step in range(1, STEPS + 1)}
EVERY_STEP_OK = [(step, True) for step in range(1, STEPS + 1)]


def test_clean_run_is_exact_on_every_rank(runs):
    per_rank = _steps(runs, "clean")
    _check_agreement(per_rank, TRUTH)
    assert _oks(per_rank) == [EVERY_STEP_OK] * WORLD
    assert not any(r["clean"]["warnings"] for r in runs)


def _step_falls_back(bad_steps: set[int]) -> list[tuple[int, bool]]:
    return [(step, step not in bad_steps) for step in range(1, STEPS + 1)]


def test_a_rank_whose_vector_cannot_be_built_still_joins(runs):
    # Rank 1's step 2 travels as a zeroed payload flagged failed, with its shape counts: step 2
    # falls back to the static number on every rank, the other steps are exact.
    per_rank = _steps(runs, "vector_raises")
    _check_agreement(per_rank, TRUTH)
    assert _oks(per_rank) == [_step_falls_back({2})] * WORLD
    assert any("ZeroDivisionError" in m for m in runs[1]["vector_raises"]["warnings"])


def test_an_accumulator_that_cannot_move_falls_back_every_step(runs):
    # Rank 2's meta-device accumulator fails every step; its host shapes still travel, so the
    # static number is known from step 1 on.
    per_rank = _steps(runs, "accumulator_elsewhere")
    _check_agreement(per_rank, TRUTH)
    assert _oks(per_rank) == [_step_falls_back(set(range(1, STEPS + 1)))] * WORLD


def test_overflow_is_detected_and_the_exact_range_is_exact(runs):
    per_rank = _steps(runs, "overflow")
    big = EXACT_SLOTS - 2 * SEQ
    truth_3 = _truth(3, [{"seqlens": [big]}, {"seqlens": [big]}])
    # Step 2's extra row makes 10 rows: the stock formula prices 10 rows of SEQ tokens.
    static_10 = training_flops(ModelSpec.from_mapping(MODEL), SeqStats.full_length(3 * WORLD + 1, SEQ)).total
    for steps in per_rank:
        got = dict(steps)
        assert not got[2]["ok"] and got[2]["flops"] == got[2]["static"] == static_10
        assert "2^63" in got[2]["reason"]
        # Step 3: sum of squares 2 * big^2 + small > 2^63, exact; ranks 1-2 agree with rank 0.
        assert got[3]["ok"] and got[3]["flops"] == truth_3 and got[3]["sum_sq"] > 2**63
        assert all(got[s]["ok"] and got[s]["flops"] == TRUTH[s] for s in (1, 4, 5))
    assert len({tuple((s, g["flops"]) for s, g in steps) for steps in per_rank}) == 1


def test_malformed_shapes_fall_back_with_one_warning(runs):
    per_rank = _steps(runs, "malformed")
    _check_agreement(per_rank, TRUTH)
    assert _oks(per_rank) == [_step_falls_back({2, 3, 4})] * WORLD
    for r in runs:  # one line per rank for the whole run: why on rank 1, that it fell back elsewhere
        assert len(r["malformed"]["warnings"]) == 1, r["malformed"]["warnings"]
    assert "at least two entries" in runs[1]["malformed"]["warnings"][0]


def test_a_skipped_end_step_is_detected_and_resynchronised(runs):
    # Collective 2 pairs ranks 0-1's step 2 with rank 2's step 3 (labels differ: fall back; rank 2
    # is 1 step ahead and runs 1 filler), collective 3 pairs ranks 0-1's step 3 with that filler
    # (fall back); from step 4 on every rank is on the same step again and exact.
    per_rank = _steps(runs, "skip")
    _check_agreement(per_rank, TRUTH)
    assert _oks(per_rank) == [_step_falls_back({2, 3})] * 2 + [[(1, True), (3, False), (4, True), (5, True)]]


def test_a_repeated_end_step_is_detected_and_resynchronised(runs):
    # Rank 1's second end_step(step=2) pairs with ranks 0 and 2's step 3 (fall back; they are 1
    # ahead and run 1 filler), rank 1's step 3 pairs with those fillers (fall back); steps 4-5 exact.
    per_rank = _steps(runs, "double")
    _check_agreement(per_rank, TRUTH)
    rank1 = [(1, True), (2, True), (2.5, False), (3, False), (4, True), (5, True)]
    assert _oks(per_rank) == [_step_falls_back({3}), rank1, _step_falls_back({3})]


def test_ranks_too_far_apart_stay_in_fallback(runs):
    # Mis-paired from the first step on: no step's shapes are trusted, so no static number is
    # ever known: 0 FLOPs, ok=False, and a warning says so.
    per_rank = _steps(runs, "far")
    assert all(not got["ok"] and got["flops"] == 0 and got["static"] is None for steps in per_rank for _, got in steps)
    assert [len(steps) for steps in per_rank] == [STEPS] * WORLD
    assert all(any("no static number" in m for m in r["far"]["warnings"]) for r in runs)


def test_the_session_supplies_the_step_index(runs):
    # Rank 0 opens step 3 without closing it: its step 4 closes with index 4 against the others'
    # 3 (fall back, rank 0 runs 1 filler), the others' step 4 meets that filler (fall back).
    per_rank = _steps(runs, "session_skip")
    _check_agreement(per_rank, TRUTH)
    assert _oks(per_rank) == [[(1, True), (2, True), (4, False), (5, True)]] + [_step_falls_back({3, 4})] * 2


def test_a_record_that_raises_in_the_session_falls_back_on_every_rank(runs):
    per_rank = _steps(runs, "session_record_raises")
    _check_agreement(per_rank, TRUTH)
    assert _oks(per_rank) == [_step_falls_back({2})] * WORLD
    assert any("record() failed (TypeError" in m for m in runs[1]["session_record_raises"]["warnings"])


def test_an_unwritable_trace_on_the_writing_rank_never_desynchronises(runs):
    # Only rank 2 (the last) opens the trace and fails: it warns, and every rank still counts
    # every step exactly (before: rank 2 had no session and gloo aborted on mismatched collectives).
    for rank, r in enumerate(runs):
        assert r["trace_unwritable"]["steps"] == [(s, dict(ok=True, flops=_truth(s))) for s in range(1, STEPS + 1)]
        warned = [m for m in r["trace_unwritable"]["warnings"] if "no per-step trace" in m]
        assert len(warned) == (1 if rank == WORLD - 1 else 0)


def test_a_dying_rank_never_yields_an_ok_number():
    runs = _launch(["dying"], bound_s=240.0)
    assert runs[2] is None  # it died
    for r in runs[:2]:
        assert r is not None, "a survivor hung and was killed"
        steps = dict(r["dying"]["steps"])
        assert steps[1]["ok"] and steps[1]["flops"] == TRUTH[1]
        assert steps[2]["ok"] and steps[2]["flops"] == TRUTH[2]
        # From step 3 on the all-reduce fails: the static number of step 2, ok=False.
        for step in (3, 4):
            assert not steps[step]["ok"] and steps[step]["flops"] == STATIC, steps[step]
            assert "all-reduce failed" in steps[step]["reason"]
