"""Observation: the adapters count the micro-batches a stock forward_step pulls from its data
iterator, with no record() call, against the stand-ins of tests/test_adapters.py.

Every expectation is derived from test_adapters' model: T real tokens with sum s^2 = P cost
344,064*T + 384*P training FLOPs (see MODEL there).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from test_adapters import (  # noqa: F401 (fixtures)
    FIELDS,
    MLM_LINE,
    MODEL,
    SEQ_LENGTH,
    STEP_FLOPS,
    STOCK_FLOPS_PER_SAMPLE,
    _module,
    _no_session,
    _session,
    bridge,
    mlm,
)

from megatron_flops.tracking import ownership
from megatron_flops.adapters import _hooks, env, megatron_bridge, megatron_lm
from megatron_flops.reporting.session import get_session, install_session, record, uninstall_session
from megatron_flops.model.spec import ModelSpec
from megatron_flops.tracking.tracker import FlopsTracker
from megatron_flops.flops.vision import VisionSpec, VisionStats, vision_training_flops


def _flops(tokens: int, sum_squares: int) -> int:
    return 344_064 * tokens + 384 * sum_squares


def stock_forward_step(data_iterator, model):
    """What Megatron-LM's pretrain_gpt.forward_step does with the iterator: next(), no record()."""
    next(data_iterator)


def _packed():
    # Megatron-LM's collated SFT batch: micro-batch size 1, cu_seqlens [1, n] int32, max_seqlen [1].
    while True:
        yield {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long),
               "cu_seqlens": torch.tensor([[0, 4, 12, 16]], dtype=torch.int32),
               "max_seqlen": torch.tensor([8], dtype=torch.int32)}


def _plain():
    while True:
        yield {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long), "labels": torch.zeros(1, SEQ_LENGTH)}


CHUNK = SimpleNamespace(pre_process=True)


def _train_mlm(mlm, batches, num_iterations=2, eval_interval=None, forward_step=stock_forward_step, model=CHUNK):
    mlm.train(forward_step, model, batches, num_iterations, eval_interval=eval_interval)
    return mlm.PRINTED


def test_stock_forward_step_packed_rows_are_counted(mlm):
    megatron_lm.install()
    _session()
    # Evaluation after every iteration pulls batches outside train_step: not counted.
    assert _train_mlm(mlm, _packed(), eval_interval=1) == [MLM_LINE.format(fields=FIELDS)]
    report = get_session().report()
    assert report is None  # the interval was reported in the log line


def test_stock_forward_step_plain_rows_count_full_length_and_warn_once(mlm, caplog):
    megatron_lm.install()
    session = _session()
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        _train_mlm(mlm, _plain(), num_iterations=3)
    # Two full 16-token rows per step: the stock number, exactly.
    assert [m for m in caplog.messages if "no packed-sequence offsets" in m] == [
        "megatron-flops: the training batches carry no packed-sequence offsets (cu_seqlens): each row counts "
        "as one sequence of its full length (logged once)"]
    step = session._pending
    assert (step.result.flops, step.result.num_tokens, step.result.ok) == (2 * STOCK_FLOPS_PER_SAMPLE, 32, True)


def test_bridge_packed_sentinel_argmin_and_unpadded(bridge):
    # GPTSFTPackedDataset with pad_seq_to_mult > 1: cu_seqlens holds the padded offsets 4, 8, 4
    # and cu_seqlens_unpadded the real ones 3, 7, 4 (a zero-length tail when the pack was padded);
    # both end at their argmin, -1 after it.
    def batches():
        while True:
            yield {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long),
                   "cu_seqlens": torch.tensor([[0, 4, 12, 16, -1, -1]], dtype=torch.int32),
                   "cu_seqlens_argmin": torch.tensor([[4]]),
                   "cu_seqlens_unpadded": torch.tensor([[0, 3, 10, 14, 14, -1]], dtype=torch.int32),
                   "cu_seqlens_unpadded_argmin": torch.tensor([[5]]),
                   "max_seqlen": torch.tensor([[8]], dtype=torch.int32), "token_count": [16]}

    megatron_bridge.install()
    session = _session()
    bridge.train.train(stock_forward_step, CHUNK, batches(), bridge.state, 1)
    result = session._pending.result
    # Per micro-batch: real T = 14, P = 9 + 49 + 16 = 74; padded T = 16, P = 16 + 64 + 16 = 96.
    assert (result.num_tokens, result.num_padded_tokens, result.num_sequences) == (28, 32, 6)
    assert result.flops == 2 * _flops(14, 74) == 9_690_624
    assert result.executed_flops == 2 * _flops(16, 96) == 11_083_776


def test_bridge_packed_token_count_makes_the_tail_padding(bridge):
    # pad_seq_to_mult == 1: no unpadded offsets; the pack holds 13 real tokens (token_count), the
    # collate appended a padding segment up to 16: real lengths 4, 8, 1; run lengths 4, 8, 4.
    def batches():
        while True:
            yield {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long),
                   "cu_seqlens": torch.tensor([[0, 4, 12, 13, 16, -1]], dtype=torch.int32),
                   "cu_seqlens_argmin": torch.tensor([[5]]), "token_count": [13]}

    megatron_bridge.install()
    session = _session()
    bridge.train.train(stock_forward_step, CHUNK, batches(), bridge.state, 1)
    result = session._pending.result
    # Real: T = 13, P = 16 + 64 + 1 = 81 (the segment 13..16 has no real token);
    # run: T = 16, P = 16 + 64 + 1 + 9 = 90 (the sequence 12..13 and the padding 13..16).
    assert (result.num_tokens, result.num_sequences) == (26, 6)
    assert result.flops == 2 * _flops(13, 81)
    assert result.executed_flops == 2 * _flops(16, 90)


def _bridge_step(bridge, batch):
    megatron_bridge.install()
    session = _session()
    bridge.train.train(stock_forward_step, CHUNK, itertools.repeat(batch), bridge.state, 1)
    return session._pending.result


def test_bridge_062_packed_real_and_padded_offsets(bridge):
    # GPTSFTPackedDataset (Megatron-Bridge 0.6.2) with pad_seq_to_mult > 1: cu_seqlens_q holds the
    # real (logical) offsets 3, 7 and a zero-length entry for the 4-slot tail, cu_seqlens_q_padded
    # the physical ones 4, 8, 4; both extended by a repeated last entry (a zero-length segment).
    q = torch.tensor([[0, 3, 10, 10, 10]], dtype=torch.int32)
    q_padded = torch.tensor([[0, 4, 12, 16, 16]], dtype=torch.int32)
    result = _bridge_step(bridge, {
        "tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long), "token_count": [12], "attention_mask": None,
        "cu_seqlens_q": q, "cu_seqlens_kv": q, "cu_seqlens_q_padded": q_padded, "cu_seqlens_kv_padded": q_padded,
        "max_seqlen_q": torch.tensor([[8]], dtype=torch.int32), "max_seqlen_kv": torch.tensor([[8]])})
    # Per micro-batch: real T = 10, P = 9 + 49 = 58 (2 sequences); run T = 16, P = 16 + 64 + 16 = 96.
    assert (result.num_tokens, result.num_padded_tokens, result.num_sequences, result.ok) == (20, 32, 4, True)
    assert result.flops == 2 * _flops(10, 58)
    assert result.executed_flops == 2 * _flops(16, 96)


def test_bridge_062_packed_token_count_makes_the_tail_padding(bridge):
    # pad_seq_to_mult == 1: cu_seqlens_q only, the padding tail 13..16 appended as a segment, then a
    # zero-length one; token_count (a list) says 13 real tokens: as the legacy layout's test above.
    q = torch.tensor([[0, 4, 12, 13, 16, 16]], dtype=torch.int32)
    result = _bridge_step(bridge, {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long), "token_count": [13],
                                   "cu_seqlens_q": q, "cu_seqlens_kv": q, "max_seqlen_q": torch.tensor([[8]])})
    assert (result.num_tokens, result.num_sequences) == (26, 6)
    assert result.flops == 2 * _flops(13, 81)
    assert result.executed_flops == 2 * _flops(16, 90)


@pytest.mark.parametrize("keys", [
    {"cu_seqlens_q": None, "cu_seqlens_q_unpadded": None},  # a name of neither layout
    {"cu_seqlens_q": None, "cu_seqlens": None},  # both layouts at once
    {"cu_seqlens_q_local": None},  # no known offsets at all: not "unpacked"
])
def test_bridge_unknown_packed_layout_never_counts_as_ok(bridge, keys, caplog):
    cu = torch.tensor([[0, 4, 16]], dtype=torch.int32)
    batch = {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long), **{key: cu for key in keys}}
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        result = _bridge_step(bridge, batch)
    assert (result.ok, result.flops) == (False, 0)  # the log shows the stock number for it
    [message] = [m for m in caplog.messages if "layout megatron-flops does not know" in m]
    assert "not a layout megatron-flops reads" in message and "unknown" in message


def test_fallback_reason_passes_megatrons_warning_filter(bridge, caplog):
    # Megatron's setup_logging adds a filter dropping WARNING records to every existing logger; the
    # adapter removes that one filter from this package's logger at the first train step.
    def warning_filter(record):
        return record.levelno != logging.WARNING

    warning_filter.__module__ = "megatron.training.utils.log_utils"  # where Megatron defines it

    def module_filter(record):
        return True

    package_logger = logging.getLogger("megatron_flops")
    package_logger.addFilter(warning_filter)
    package_logger.addFilter(module_filter)
    monkey = megatron_bridge._ADAPTER
    try:
        monkey._unmuted = False
        with caplog.at_level(logging.WARNING, logger="megatron_flops"):
            _bridge_step(bridge, {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long),
                                  "cu_seqlens_q_local": torch.tensor([[0, 16]])})
        assert package_logger.filters == [module_filter]
        assert sum("layout megatron-flops does not know" in m for m in caplog.messages) == 1
    finally:
        package_logger.removeFilter(warning_filter)
        package_logger.removeFilter(module_filter)


VIT = VisionSpec(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, gated_mlp=False, patch_size=2,
                 out_hidden_size=64)


@pytest.mark.parametrize("where", ["visual_inputs", "batch"])
def test_vlm_grids_are_counted(bridge, where):
    grids = ([[1, 4, 4], [1, 2, 6]], [[2, 4, 4]])  # images of two sizes, then a 2-frame video

    def batches():
        for image, video in itertools.cycle([(torch.tensor(grids[0]), None), (None, torch.tensor(grids[1]))]):
            visual = SimpleNamespace(pixel_values=None, image_grid_thw=image, video_grid_thw=video)
            batch = {"input_ids": torch.zeros(1, SEQ_LENGTH, dtype=torch.long)}
            batch.update({"visual_inputs": visual} if where == "visual_inputs" else
                         {k: v for k, v in vars(visual).items() if v is not None})
            yield batch

    megatron_bridge.install()
    ticks = itertools.count()
    session = install_session(FlopsTracker(ModelSpec.from_mapping(MODEL), seq_length=SEQ_LENGTH, vision=VIT),
                              world_size=1, clock=lambda: next(ticks), peak_flops_per_s=10**15)
    bridge.train.train(stock_forward_step, CHUNK, batches(), bridge.state, 1)
    result = session._pending.result
    vision = vision_training_flops(VIT, VisionStats.from_grids(VIT, grids[0] + grids[1]))
    # Two full 16-token text rows plus the three images' vision tower.
    assert result.flops == 2 * STOCK_FLOPS_PER_SAMPLE + vision.total
    assert result.components["vit/mlp"] == vision.components["vit/mlp"]


VLM_STEP = '''
def pack_batch_sequences(*args, **kwargs):  # 0.3.1 to 0.5.x: vlm_step pads and packs rows itself
    raise NotImplementedError

def forward_step(state, data_iterator, model, return_schedule_plan=False):
    next(data_iterator)
'''
STEP_06 = '''
def forward_step(state, data_iterator, model, return_schedule_plan=False):
    next(data_iterator)
'''


@pytest.mark.parametrize("packing, pipelined, expected", [
    # Unpacked, no PP: rows of 40 slots padded to 128 (at most seq_length 200): 2 x 128 tokens.
    (False, False, dict(num_tokens=256, num_padded_tokens=256, num_sequences=2)),
    # Unpacked, PP: padded to seq_length 200.
    (False, True, dict(num_tokens=400, num_padded_tokens=400, num_sequences=2)),
    # In-batch packing: real lengths to the last non-zero id, 7 and 30; the all-zero row is dropped.
    (True, False, dict(num_tokens=37, num_padded_tokens=37, num_sequences=2)),
])
def test_bridge_vlm_step_reshapes_rows(bridge, monkeypatch, packing, pipelined, expected):
    vlm = _module("megatron.bridge.training.vlm_step", VLM_STEP)
    monkeypatch.setitem(sys.modules, vlm.__name__, vlm)
    tokens = torch.zeros(3, 40, dtype=torch.long) if packing else torch.zeros(2, 40, dtype=torch.long)
    if packing:
        tokens[0, :7] = 5
        tokens[1, 10:30] = 9  # a row whose last real token is at 29: length 30
    cfg = bridge.state.cfg
    cfg.model.seq_length, cfg.model.pipeline_model_parallel_size = 200, 2 if pipelined else 1
    cfg.dataset = SimpleNamespace(pack_sequences_in_batch=packing)
    megatron_bridge.install()
    session = _session()
    bridge.train.train(functools.partial(vlm.forward_step, bridge.state), CHUNK,
                       itertools.repeat({"input_ids": tokens, "visual_inputs": None}), bridge.state, 1)
    result = session._pending.result
    assert {k: getattr(result, k) for k in expected} == {k: 2 * v for k, v in expected.items()}


def _train_step_module(bridge, monkeypatch, name, batch):
    step = _module(name, STEP_06)
    monkeypatch.setitem(sys.modules, step.__name__, step)
    megatron_bridge.install()
    session = _session()
    bridge.train.train(functools.partial(step.forward_step, bridge.state), CHUNK, itertools.repeat(batch),
                       bridge.state, 1)
    return session._pending.result


def test_bridge_06_vlm_step_runs_rows_as_delivered(bridge, monkeypatch):
    # Megatron-Bridge 0.6's vlm_step pads nothing: rows of 48 slots (its collate pads to a multiple of
    # 16) run as 48 tokens each, not re-padded to 128 (capped at seq_length 200) as 0.3.1 did.
    bridge.state.cfg.model.seq_length = 200
    bridge.state.cfg.dataset = SimpleNamespace(enable_in_batch_packing=False)
    result = _train_step_module(bridge, monkeypatch, "megatron.bridge.training.vlm_step",
                                {"input_ids": torch.zeros(2, 48, dtype=torch.long), "visual_inputs": None})
    assert (result.num_tokens, result.num_padded_tokens, result.num_sequences) == (2 * 96, 2 * 96, 2 * 2)


def test_bridge_06_vlm_step_collate_time_packing(bridge, monkeypatch):
    # enable_in_batch_packing (0.6): the collate function packs the rows into one and gives
    # cu_seqlens_q (real 7 and 30, each padded to a multiple of 16: 16 and 32) and cu_seqlens_q_padded.
    bridge.state.cfg.dataset = SimpleNamespace(enable_in_batch_packing=True)
    q, q_padded = torch.tensor([[0, 7, 37]], dtype=torch.int32), torch.tensor([[0, 16, 48]], dtype=torch.int32)
    result = _train_step_module(bridge, monkeypatch, "megatron.bridge.training.vlm_step", {
        "input_ids": torch.zeros(1, 48, dtype=torch.long), "visual_inputs": None, "cu_seqlens_q": q,
        "cu_seqlens_kv": q, "cu_seqlens_q_padded": q_padded, "cu_seqlens_kv_padded": q_padded})
    assert (result.num_tokens, result.num_padded_tokens, result.num_sequences) == (2 * 37, 2 * 48, 2 * 2)
    assert result.flops == 2 * _flops(37, 7 * 7 + 30 * 30)
    assert result.executed_flops == 2 * _flops(48, 16 * 16 + 32 * 32)


@pytest.mark.parametrize("pipelined, expected_length", [(False, 48), (True, 200)])
def test_bridge_qwen3_vl_step_pads_rows_to_16_or_seq_length(bridge, monkeypatch, pipelined, expected_length):
    # qwen3_vl_step pads each row to a multiple of lcm(TP, 16) (TP 1: 16), or to seq_length under PP;
    # each row runs as one sequence of that length.
    cfg = bridge.state.cfg
    cfg.model.seq_length, cfg.model.pipeline_model_parallel_size = 200, 2 if pipelined else 1
    cfg.dataset = SimpleNamespace(enable_in_batch_packing=False)
    result = _train_step_module(bridge, monkeypatch, "megatron.bridge.models.qwen_vl.qwen3_vl_step",
                                {"input_ids": torch.zeros(2, 40, dtype=torch.long), "visual_inputs": None})
    assert (result.num_tokens, result.num_sequences) == (2 * 2 * expected_length, 2 * 2)
    assert result.flops == 2 * _flops(2 * expected_length, 2 * expected_length ** 2)


def test_vpp_lists_of_iterators_count_each_batch_once(mlm):
    def interleaved(*, forward_step_func, data_iterator, model, num_microbatches, forward_only):
        # Megatron's interleaved schedule: each micro-batch runs through every chunk, each chunk
        # pulling from its own iterator (the later chunk is not the first stage).
        for _ in range(num_microbatches):
            for chunk in range(len(model)):
                forward_step_func(data_iterator[chunk], model[chunk])

    mlm.forward_backward_func = interleaved
    megatron_lm.install()
    _session()
    chunks = [SimpleNamespace(pre_process=True), SimpleNamespace(pre_process=False)]
    assert _train_mlm(mlm, [_packed(), _packed()], model=chunks) == [MLM_LINE.format(fields=FIELDS)]


class _Group:
    def __init__(self, rank):
        self.rank = rank


@pytest.mark.parametrize("attribute", ["pg_collection", "model_comm_pgs", None])
def test_tensor_parallel_rank_one_does_not_count(mlm, monkeypatch, attribute):
    # megatron-core 0.16 names the model's groups pg_collection, 0.14 model_comm_pgs; a model
    # with neither falls back to a loaded megatron.core.parallel_state.
    monkeypatch.setattr(ownership, "_group_rank", lambda group: 0 if group is None else group.rank)

    def chunk(tp_rank):
        inner = SimpleNamespace(pre_process=True)
        if attribute is None:
            state = types.SimpleNamespace(
                model_parallel_is_initialized=lambda: True, get_tensor_model_parallel_rank=lambda: tp_rank,
                get_context_parallel_rank=lambda: 0, get_context_parallel_world_size=lambda: 1)
            monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
        else:
            setattr(inner, attribute, SimpleNamespace(tp=_Group(tp_rank), cp=None))
        return SimpleNamespace(module=inner)  # wrapped, like megatron DDP

    megatron_lm.install()
    session = _session()
    _train_mlm(mlm, _packed(), num_iterations=1, model=chunk(1))
    assert session._pending.result.num_microbatches == 0 and not session._pending.result.ok
    install_session(FlopsTracker(ModelSpec.from_mapping(MODEL), seq_length=SEQ_LENGTH), world_size=1,
                    peak_flops_per_s=10**15)
    session = get_session()
    _train_mlm(mlm, _packed(), num_iterations=1, model=chunk(0))
    assert (session._pending.result.flops, session._pending.result.ok) == (STEP_FLOPS, True)


def test_explicit_record_wins_over_observation(mlm):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        # This forward_step prices its rows as one 16-token sequence each, not by cu_seqlens.
        record(model=model, tokens=batch["tokens"])

    megatron_lm.install()
    session = _session()
    _train_mlm(mlm, _packed(), num_iterations=1, forward_step=forward_step)
    result = session._pending.result
    assert (result.flops, result.num_microbatches) == (2 * STOCK_FLOPS_PER_SAMPLE, 2)


def test_a_raising_train_step_closes_the_step(mlm):
    megatron_lm.install()
    session = _session()
    error = RuntimeError("rank lost")
    calls = itertools.count()

    def flaky(data_iterator, model):
        next(data_iterator)
        if next(calls) == 1:  # the second micro-batch of the first step
            raise error

    with pytest.raises(RuntimeError) as raised:
        mlm.train_step(flaky, _packed(), CHUNK, None, None, None, mlm.forward_backward_func)
    assert raised.value is error
    stock_forward_step(_packed(), CHUNK)  # an evaluation pass between the two steps
    mlm.train_step(flaky, _packed(), CHUNK, None, None, None, mlm.forward_backward_func)
    result = session._pending.result
    # Only the second step's two micro-batches: the failed step's first one is gone.
    assert (result.flops, result.num_microbatches, result.ok) == (STEP_FLOPS, 2, True)


def test_a_batch_in_an_unknown_layout_falls_back_without_raising(mlm, caplog):
    megatron_lm.install()
    session = _session()
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        printed = _train_mlm(mlm, itertools.repeat((torch.zeros(1, 16), None)), num_iterations=3)
    assert sum("layout megatron-flops does not know" in m for m in caplog.messages) == 1
    # Iterations 1-2 were logged with the stock number as the corrected one; 3 is pending.
    assert "corrected throughput per GPU (TFLOP/s/GPU): 5.6 |" in printed[0]
    report = session.report()
    assert (report.num_iterations, report.num_fallback_iterations, report.flops) == (1, 1, 2 * STOCK_FLOPS_PER_SAMPLE)


def test_rerun_replays_are_not_observed_again(mlm):
    class Replaying:  # Megatron's RerunDataIterator while it replays a step
        replaying = False

        def __init__(self):
            self.batches = _packed()

        def __next__(self):
            return next(self.batches)

    iterator = Replaying()

    def twice(*, forward_step_func, data_iterator, model, num_microbatches, forward_only):
        for replay in (False, True):
            data_iterator.replaying = replay
            for _ in range(num_microbatches):
                forward_step_func(data_iterator, model)

    mlm.forward_backward_func = twice
    megatron_lm.install()
    session = _session()
    _train_mlm(mlm, iterator, num_iterations=1)
    assert session._pending.result.flops == STEP_FLOPS


def test_observed_iterator_passes_other_attributes_through(mlm):
    seen = []

    def forward_step(data_iterator, model):
        seen.append(data_iterator.tag)
        next(data_iterator)

    class Tagged:
        tag = "rerun-state"

        def __init__(self):
            self.batches = _packed()

        def __next__(self):
            return next(self.batches)

    megatron_lm.install()
    _session()
    _train_mlm(mlm, Tagged(), num_iterations=1, forward_step=forward_step)
    assert seen == ["rerun-state", "rerun-state"]


# ---- the trace -----------------------------------------------------------------------------


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trace_lines_hold_the_exact_integers(mlm, tmp_path):
    path = tmp_path / "trace.jsonl"
    megatron_lm.install()
    _session(trace=path)
    _train_mlm(mlm, _packed(), num_iterations=3)
    uninstall_session()  # the last step is written when the session closes (at exit otherwise)
    header, *steps = _lines(path)
    run = header["run"]
    assert (run["format"], run["framework"], run["world_size"], run["warmup_iterations"]) == (
        "megatron-flops-trace/1", "custom", 1, 2)
    assert run["model"]["hidden_size"] == 64 and run["model"]["num_layers"] == 1
    assert run["model"]["layer_runs"] == [[["attention", "mlp"], 1]]
    assert run["conventions"] == {"attention": "causal", "model_flops": "needed", "recompute": None, "peft": None}
    assert run["peak_flops_per_s"] == 11_083_776_000_000 and run["started_at"].endswith("+00:00")
    # Each step: 2 packed rows (sub-sequences 4, 8, 4); the static number (2 full 16-token rows) and
    # the framework's (num_floating_point_operations) both 2 x 5,603,328; 2e-6 s of the session's clock.
    assert [step.pop("elapsed_s") for step in steps] == pytest.approx([2e-6] * 3, rel=1e-9)
    assert steps == [
        {"iteration": i, "flops": STEP_FLOPS, "executed_flops": STEP_FLOPS, "static_flops": 2 * STOCK_FLOPS_PER_SAMPLE,
         "framework_flops": 2 * STOCK_FLOPS_PER_SAMPLE, "num_tokens": 32, "num_padded_tokens": 32, "num_sequences": 6, "num_microbatches": 2, "ok": True}
        for i in (1, 2, 3)
    ]


def test_trace_appends_a_segment_per_run_and_writes_fallbacks(mlm, tmp_path):
    path = tmp_path / "runs" / "trace.jsonl"
    megatron_lm.install()
    _session(trace=path)
    _train_mlm(mlm, _packed(), num_iterations=1)
    uninstall_session()
    _session(trace=path)  # a restart appends its own header
    _train_mlm(mlm, itertools.repeat("not a batch"), num_iterations=1)
    uninstall_session()
    lines = _lines(path)
    assert [("run" in line) for line in lines] == [True, False, True, False]
    # The fallen-back step reports the framework's number as its FLOPs, ok false; no batch shape
    # arrived, so the static number is unknown.
    assert {k: lines[3][k] for k in ("flops", "executed_flops", "static_flops", "framework_flops", "ok")} == {
        "flops": 2 * STOCK_FLOPS_PER_SAMPLE, "executed_flops": 2 * STOCK_FLOPS_PER_SAMPLE,
        "static_flops": None, "framework_flops": 2 * STOCK_FLOPS_PER_SAMPLE, "ok": False}


def test_trace_from_the_flag_env_and_bridge_config(mlm, bridge, tmp_path):
    flag = tmp_path / "flag.jsonl"
    parser = megatron_lm.extra_args_provider(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--flops-trace", str(flag), "--flops-peak-tflops", "1000"])
    mlm.ARGS.flops_trace, mlm.ARGS.flops_peak_tflops = args.flops_trace, args.flops_peak_tflops
    assert megatron_lm.maybe_install_from_args(mlm.ARGS) is False  # flops_accounting absent: off
    mlm.ARGS.flops_accounting = "corrected"
    assert megatron_lm.maybe_install_from_args(mlm.ARGS) is True
    _train_mlm(mlm, _packed(), num_iterations=1)
    uninstall_session()
    header, step = _lines(flag)
    assert header["run"]["framework"] == "megatron-lm" and step["flops"] == STEP_FLOPS

    from_env = tmp_path / "env.jsonl"
    env.install_from_env({env.ACCOUNTING: "corrected", env.FRAMEWORK: "megatron-bridge", env.TRACE: str(from_env),
                          env.PEAK_TFLOPS: "1000"})
    bridge.train.train(stock_forward_step, CHUNK, _packed(), bridge.state, 1)
    uninstall_session()
    header, step = _lines(from_env)
    assert header["run"]["framework"] == "megatron-bridge" and step["flops"] == STEP_FLOPS

    config = tmp_path / "cfg.jsonl"
    bridge.state.cfg.logger.flops_accounting, bridge.state.cfg.logger.flops_trace = "corrected", str(config)
    bridge.state.cfg.logger.flops_peak_tflops = 1000
    megatron_bridge.maybe_install_from_config(bridge.state.cfg)
    bridge.train.train(stock_forward_step, CHUNK, _packed(), bridge.state, 1)
    uninstall_session()
    assert [("run" in line) for line in _lines(config)] == [True, False]


def test_trace_written_by_the_last_rank_or_per_rank(tmp_path):
    from megatron_flops.reporting.trace import trace_path

    assert trace_path(tmp_path / "t.jsonl", rank=3, world_size=4) == str(tmp_path / "t.jsonl")
    assert trace_path(tmp_path / "t.jsonl", rank=0, world_size=4) is None
    assert trace_path(tmp_path / "t-{rank}.jsonl", rank=0, world_size=4) == str(tmp_path / "t-0.jsonl")
    with pytest.raises(ValueError, match="trace"):
        megatron_lm.install(trace=3)


def test_static_accounting_leaves_the_forward_step_untouched(mlm):
    seen = []
    iterator = _packed()

    def forward_step(data_iterator, model):
        seen.append(data_iterator)
        next(data_iterator)

    parser = megatron_lm.extra_args_provider(__import__("argparse").ArgumentParser())
    assert megatron_lm.maybe_install_from_args(parser.parse_args([])) is False
    _train_mlm(mlm, iterator, num_iterations=1, forward_step=forward_step)
    assert seen == [iterator, iterator] and not _hooks.is_wrapped(mlm.train_step)


def test_a_dit_session_traces_and_aborts(tmp_path):
    # The session with a DiT tracker: the trace header reads its spec and conventions; an aborted
    # step leaves nothing behind; nothing is observed (a DiT tracker records explicitly).
    from megatron_flops.flops.dit import DiTSpec
    from megatron_flops.tracking.dit_tracker import DiTFlopsTracker

    spec = DiTSpec(num_layers=1, hidden_size=8, num_heads=2, ffn_hidden_size=8)
    session = install_session(DiTFlopsTracker(spec), world_size=1, peak_flops_per_s=10**15,
                              trace=tmp_path / "dit.jsonl", framework="demo")
    assert not session.observing(CHUNK)
    session.begin_step()
    record(video_seqlens=[4, 6])
    session.abort_step()
    session.begin_step()
    record(video_seqlens=[4])
    clean = session.end_step(elapsed_s=1.0)
    uninstall_session()
    header, step = _lines(tmp_path / "dit.jsonl")
    assert header["run"]["framework"] == "demo" and header["run"]["conventions"]["attention"] == "full"
    assert header["run"]["model"]["hidden_size"] == 8
    # Only the second step's one clip of 4 video tokens.
    assert (clean.num_tokens, clean.num_microbatches, clean.ok) == (4, 1, True)
    assert (step["num_tokens"], step["flops"]) == (4, clean.flops)
