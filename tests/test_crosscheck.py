"""The cross-check: what a model chunk receives (its ``PackedSeqParams`` or none, its token tensor)
against what the batch reader found in the same micro-batch, with the stand-ins of
tests/test_adapters.py and a real ``nn.Module`` chunk called the way Megatron-LM's ``forward_step``
(positional tokens) and Megatron-Bridge's ``gpt_step`` (``input_ids=``) call it.

Every FLOPs expectation is derived from test_adapters' model: T real tokens with sum s^2 = P cost
344,064*T + 384*P training FLOPs (see MODEL there).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from test_adapters import SEQ_LENGTH, STOCK_FLOPS_PER_SAMPLE, _no_session, _session, bridge, mlm  # noqa: F401

from megatron_flops.adapters import _setup, megatron_bridge, megatron_lm
from megatron_flops.adapters._crosscheck import Shapes, batch_shapes, disagreement, model_shapes


@pytest.fixture(autouse=True)
def _fresh_adapters():
    """Each test gets fresh batch readers (their warn-once) and cross-checks, and leaves none behind."""
    adapters = (megatron_lm._ADAPTER, megatron_bridge._ADAPTER)
    for adapter in adapters:
        adapter._reader = adapter._check = None
        adapter._unmuted = False
    yield
    for adapter in adapters:
        adapter._reader = adapter._check = None


class Chunk(torch.nn.Module):
    """The first pipeline stage's model chunk: it owns its micro-batches and records its calls."""

    pre_process = True

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, position_ids=None, attention_mask=None, *, labels=None, packed_seq_params=None):
        self.calls += 1
        return input_ids


def psp(offsets: list[int] | None):
    """A megatron-core PackedSeqParams stand-in (the attributes the cross-check reads)."""
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    return SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=None)


def mlm_forward_step(params=lambda batch: None, tokens=lambda batch: batch["tokens"]):
    """pretrain_gpt.forward_step: next(), build the packed params, model(tokens, ..., packed_seq_params=)."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return model(tokens(batch), None, None, labels=None, packed_seq_params=params(batch))

    return forward_step


def _packed_batches(cu=(0, 4, 12, 16)):
    while True:
        yield {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long), "cu_seqlens": torch.tensor([list(cu)])}


def _bridge_062_batches():
    # Megatron-Bridge 0.6.2's collate keys.
    while True:
        yield {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long),
               "cu_seqlens_q": torch.tensor([[0, 4, 12, 16]]), "cu_seqlens_q_padded": torch.tensor([[0, 4, 12, 16]])}


def _unknown_layout_batches():
    # A future release that hands the forward step its document boundaries under a key no reader knows.
    while True:
        yield {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long), "document_starts": torch.tensor([[0, 4, 12]])}


def _train(mlm, forward_step, batches, chunk, num_iterations=1, eval_interval=None):
    mlm.train(forward_step, chunk, batches, num_iterations, eval_interval=eval_interval)


def test_agreeing_inputs_are_checked_once_per_micro_batch_and_stay_exact(mlm):
    megatron_lm.install()
    session = _session()
    chunk = Chunk()
    forward = mlm_forward_step(params=lambda b: psp(b["cu_seqlens"][0].tolist()))
    _train(mlm, forward, _packed_batches(), chunk, num_iterations=1, eval_interval=1)
    result = session._pending.result
    # 2 micro-batches of sub-sequences 4, 8, 4: T = 16, P = 96 each.
    assert result.ok and result.flops == 2 * (344_064 * 16 + 384 * 96) == 11_083_776
    # The step's 2 micro-batches are checked; the evaluation call (outside train_step) is not.
    assert megatron_lm._ADAPTER.check().num_checked == 2 and chunk.calls == 3


@pytest.mark.parametrize(("batches", "forward", "reason"), [
    # The reader finds no offsets (an unknown key) but the model runs THD: the full-row price is wrong.
    (_unknown_layout_batches, mlm_forward_step(params=lambda b: psp([0, 4, 12, 16])),
     "received packed sequences (PackedSeqParams, qkv_format 'thd', 3 sub-sequences) but the batch carried no "
     "offsets that megatron-flops reads (1 whole rows)"),
    # Offsets read, but the forward step ran whole rows.
    (_packed_batches, mlm_forward_step(), "received no PackedSeqParams"),
    # More sub-sequences than the batch's 4 offset entries can delimit.
    (_packed_batches, mlm_forward_step(params=lambda b: psp([0, 2, 4, 8, 12, 16])),
     "received 5 packed sub-sequences, more than the 3"),
    # The forward step re-padded the row to 32 slots: priced 16.
    (_packed_batches, mlm_forward_step(params=lambda b: psp([0, 4, 12, 16]),
                                       tokens=lambda b: torch.zeros(1, 32, dtype=torch.long)),
     "received 32 token slots (context-parallel slices included) but megatron-flops priced 16"),
])
def test_disagreement_falls_back_with_the_reason_logged_once(mlm, caplog, batches, forward, reason):
    megatron_lm.install()
    session = _session()
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        _train(mlm, forward, batches(), Chunk(), num_iterations=3)
    result = session._pending.result
    assert not result.ok
    messages = [m for m in caplog.messages if "contradict" in m]
    assert len(messages) == 1 and reason in messages[0], caplog.messages
    assert "every rank reports the stock FLOPs for such steps" in messages[0]
    # The meter counts the framework's own number for the fallen-back steps (2 x 5,603,328 each).
    report = session.report()
    assert report.num_fallback_iterations == 1 and report.flops == 2 * STOCK_FLOPS_PER_SAMPLE


def _gpt_step(data_iterator, model):  # Megatron-Bridge's gpt_step: model(**forward_args)
    batch = next(data_iterator)
    return model(input_ids=batch["tokens"], position_ids=None, attention_mask=None, packed_seq_params=psp([0, 4, 12, 16]))


def test_bridge_gpt_step_keyword_call_is_checked(bridge):
    megatron_bridge.install()
    session = _session()
    bridge.train.train(_gpt_step, Chunk(), _unknown_layout_batches(), bridge.state, 1)
    assert not session._pending.result.ok  # read as unpacked, run packed


def test_bridge_062_keys_agree_with_the_keyword_call(bridge):
    megatron_bridge.install()
    session = _session()
    bridge.train.train(_gpt_step, Chunk(), _bridge_062_batches(), bridge.state, 1)
    assert session._pending.result.ok  # cu_seqlens_q read: the PackedSeqParams agree


def test_bridge_warning_filter_is_taken_off_our_logger(bridge, capsys):
    # Megatron-Bridge's setup_logging(filter_warnings=True, its default) adds a filter dropping
    # every WARNING record to every logger that exists then, ours included.
    def warning_filter(record):
        return record.levelno != logging.WARNING

    warning_filter.__module__ = "megatron.bridge.training.utils.log_utils"
    ours = logging.getLogger("megatron_flops")
    ours.addFilter(warning_filter)
    try:
        megatron_bridge.install()
        _session()  # installed by hand: the filter goes when the adapter first sees the step
        bridge.train.train(mlm_forward_step(params=lambda b: psp([0, 16])), Chunk(), _bridge_062_batches(),
                           bridge.state, 1)
        assert warning_filter not in ours.filters
    finally:
        ours.removeFilter(warning_filter)


# ---- the shapes, unit by unit ------------------------------------------------------------------


def test_batch_shapes_bound_sub_sequences_per_row_of_offsets():
    # core_v0.19.0 with micro-batch size 2: [mbs, S+1] row-local offsets, each row 16 slots:
    # at most 2 x 16 sub-sequences; 1-D offsets of 6 entries: at most 5; no offsets: one per row.
    rows = torch.zeros(2, 17, dtype=torch.int32)
    assert batch_shapes({"num_rows": 2, "row_length": 16, "cu_seqlens": rows}) == Shapes(
        token_slots=32, packed=True, num_subsequences=32, num_rows=2)
    fields = {"num_rows": 1, "row_length": 16, "cu_seqlens": torch.zeros(4), "cu_seqlens_padded": torch.zeros(6)}
    assert batch_shapes(fields).num_subsequences == 5
    assert batch_shapes({"num_rows": 4, "row_length": 8}) == Shapes(token_slots=32, packed=False, num_subsequences=4,
                                                                      num_rows=4)


def test_model_shapes_positional_keyword_and_context_parallel():
    tokens = torch.zeros(2, 8, dtype=torch.long)
    assert model_shapes((tokens,), {}, 1) == Shapes(token_slots=16, packed=False, whole_slots=16)
    # CP 2: the chunk holds half of each row (or, as Qwen3-VL's step passes them, whole rows).
    got = model_shapes((), {"input_ids": tokens, "packed_seq_params": psp([0, 5, 16])}, 2)
    assert got == Shapes(token_slots=32, packed=True, num_subsequences=2, whole_slots=16, qkv_format="thd")
    assert model_shapes((), {"packed_seq_params": psp([0, 16])}, 1) is None  # no token tensor: unchecked
    assert model_shapes((tokens,), {"packed_seq_params": psp(None)}, 1).packed is False


def test_disagreement_accepts_trimmed_and_merged_offsets():
    batch = Shapes(token_slots=32, packed=True, num_subsequences=32, num_rows=2)
    assert disagreement(batch, Shapes(token_slots=32, packed=True, num_subsequences=7)) is None
    unpacked = Shapes(token_slots=32, packed=False, num_subsequences=2, num_rows=2)
    assert disagreement(unpacked, Shapes(token_slots=32, packed=False)) is None


def test_one_sub_sequence_per_row_is_an_unpacked_row():
    # Qwen3-VL's step (Megatron-Bridge 0.6.2) runs [B, S] rows as THD with offsets 0, S, 2S, ...:
    # B full-length sub-sequences, what the reader prices for B unpacked rows. Under CP 2 it hands
    # the model whole rows (the model slices them).
    rows = batch_shapes({"num_rows": 2, "row_length": 16})
    tokens = torch.zeros(2, 16, dtype=torch.long)
    assert disagreement(rows, model_shapes((), {"input_ids": tokens, "packed_seq_params": psp([0, 16, 32])}, 2)) is None
    # One more sub-sequence than rows: packing the reader did not see.
    three = model_shapes((), {"input_ids": tokens, "packed_seq_params": psp([0, 8, 16, 32])}, 1)
    assert "3 sub-sequences" in disagreement(rows, three)
    # Offsets of one sub-sequence per row, run as whole rows: the same FLOPs.
    one_each = batch_shapes({"num_rows": 1, "row_length": 16, "cu_seqlens": torch.tensor([0, 16])})
    assert disagreement(one_each, model_shapes((torch.zeros(1, 16),), {}, 1)) is None


def test_a_chunk_that_cannot_be_hooked_is_said_once(mlm, caplog):
    megatron_lm.install()
    _session()
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        _train(mlm, lambda it, model: next(it), _packed_batches(), SimpleNamespace(pre_process=True), 2)
    assert sum("cannot be hooked" in m for m in caplog.messages) == 1
    assert megatron_lm._ADAPTER.check().num_checked == 0


# ---- a release outside the tested list ---------------------------------------------------------


def test_an_untested_release_warns_once_and_still_installs(mlm, monkeypatch, caplog):
    monkeypatch.setattr(_setup, "framework_version", lambda distribution: "0.17.0")
    monkeypatch.setattr(_setup, "_warned_releases", set())
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        assert megatron_lm.install() is True
        assert megatron_lm.install() is True  # a second install: no second warning
    assert [m for m in caplog.messages if "not a tested release" in m] == [
        "megatron-flops: Megatron-LM with megatron-core 0.17.0 is not a tested release (tested: megatron-core "
        "0.14.0, 0.16.1, 0.19.0); accounting is installed with the same guarantees: what each model chunk "
        "receives is cross-checked against the batch read, and a step that cannot be priced exactly reports "
        "the framework's own number, logged once"]
    # The same guarantees: a batch the reader misreads still falls back, training goes on.
    session = _session()
    _train(mlm, mlm_forward_step(params=lambda b: psp([0, 4, 12, 16])), _unknown_layout_batches(), Chunk())
    assert not session._pending.result.ok


@pytest.mark.parametrize(("version", "warns"), [("0.6.2", False), ("0.6.2+cu12", False), ("0.6.3", True),
                                                ("unknown", True)])
def test_bridge_releases_tested_or_not(monkeypatch, caplog, version, warns):
    monkeypatch.setattr(_setup, "framework_version", lambda distribution: version)
    monkeypatch.setattr(_setup, "_warned_releases", set())
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        _setup.warn_untested_release("Megatron-Bridge", "megatron-bridge")
    assert any("(tested: megatron-bridge 0.3.1, 0.6.2)" in m for m in caplog.messages) is warns
