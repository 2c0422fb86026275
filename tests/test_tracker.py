"""FlopsTracker in one process: statistics, conventions, bad input, fallback, sync-freedom."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_flops.tracking import batch_checks
from megatron_flops.tracking.host_stats import HostBatches
from megatron_flops.flops.formulas import SeqStats, parse_rows, training_flops
from megatron_flops.flops.passes import price
from megatron_flops.model.spec import ModelSpec
from megatron_flops.tracking.tracker import FlopsTracker

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128)


def _spec(**kw) -> ModelSpec:
    return ModelSpec.from_mapping({**BASE, **kw})


def _tok(b: int, s: int) -> torch.Tensor:
    return torch.zeros(b, s, dtype=torch.long)


@pytest.fixture(params=["host", "device"])
def path(request, monkeypatch):
    """Both statistics paths on CPU tensors: the host one (priced at end_step) and the device one
    (host tensors then count as device tensors)."""
    if request.param == "device":
        monkeypatch.setattr(batch_checks, "HOST_DEVICE_TYPES", frozenset())
    return request.param


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setattr(batch_checks, "HOST_DEVICE_TYPES", frozenset())


def test_hand_derived_packed_row(path):
    # One packed row of 32 slots holding sub-sequences 5, 7, 18 (2 tail slots of padding).
    # Real tokens 30, sum s^2 = 25 + 49 + 324 = 398; padded tokens 32, padded sum s^2 = 398.
    tracker = FlopsTracker(_spec(), seq_length=32)
    tracker.record(tokens=_tok(1, 32), cu_seqlens=torch.tensor([0, 5, 12, 30], dtype=torch.int32))
    r = tracker.end_step()
    assert (r.num_tokens, r.num_padded_tokens, r.num_sequences, r.sum_seqlen_squared) == (30, 32, 3, 398)
    # Per layer (h=64, 4 heads of 16, ffn 256), forward, T tokens: qkv 2*T*64*192, out 2*T*64*64,
    # mlp 2*T*64*256*2, core (causal) 2*4*(16+16)*398/2 = 50,944; logits 2*T*64*128 once. x3 for training.
    t = 30
    fwd = 2 * (2 * t * 64 * 192 + 2 * t * 64 * 64 + 4 * t * 64 * 256 + 2 * 4 * 32 * 398 // 2) + 2 * t * 64 * 128
    assert r.flops == 3 * fwd == 19_474_944
    # Static: one row priced as a full 32-token sequence.
    fwd_static = 2 * (2 * 32 * 64 * 192 + 2 * 32 * 64 * 64 + 4 * 32 * 64 * 256 + 2 * 4 * 32 * 1024 // 2) + 2 * 32 * 64 * 128
    assert r.static_flops == 3 * fwd_static


ROWS_AND_CALLS = [
    # (rows for the pure oracle, record() kwargs)
    ([32, 32], dict(tokens=_tok(2, 32))),
    ([{"seqlens": [5, 7, 18], "pad_to": 32}], dict(tokens=_tok(1, 32), cu_seqlens=torch.tensor([0, 5, 12, 30]))),
    (
        # Dynamic padding: unpacked sequences (ints) padded to the batch length, attended over it.
        [{"seqlens": 4, "pad_to": 20}, {"seqlens": 20}, {"seqlens": 9, "pad_to": 20}],
        dict(tokens=_tok(3, 20), seq_lengths=torch.tensor([4, 20, 9])),
    ),
    (
        [{"seqlens": [5, 7, 18], "padded_seqlens": [6, 8, 18], "pad_to": 40}],
        dict(
            tokens=_tok(1, 40),
            cu_seqlens=torch.tensor([0, 5, 12, 30, -1, -1]),
            cu_seqlens_padded=torch.tensor([0, 6, 14, 32, -1, -1]),
            cu_seqlens_argmin=4,
        ),
    ),
]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("attention", ["causal", "full"])
def test_totals_equal_pure_statistics(window, attention, path):
    kw = {} if window is None else dict(window_size=[window, 0], window_attn_skip_freq=2)
    spec = _spec(**kw)
    tracker = FlopsTracker(spec, attention=attention, seq_length=32)
    rows = []
    for row_list, call in ROWS_AND_CALLS:
        rows += row_list
        tracker.record(**call)
    r = tracker.end_step()
    stats = SeqStats.from_rows(parse_rows(rows), window=spec.window_size)
    assert r.flops == training_flops(spec, stats, attention=attention).total
    assert r.executed_flops == training_flops(spec, stats, attention=attention, include_padding=True).total
    assert (r.num_tokens, r.num_padded_tokens, r.num_microbatches) == (stats.num_tokens, stats.num_padded_tokens, 4)
    # The step is over: the next one starts from zero and still reports.
    empty = tracker.end_step()
    assert (empty.flops, empty.num_tokens, empty.num_microbatches, empty.ok) == (0, 0, 0, True)


def test_packed_seq_params_object(path):
    class Params:  # duck-typed megatron.core.packed_seq_params.PackedSeqParams
        cu_seqlens_q = torch.tensor([0, 10, 14], dtype=torch.int32)
        cu_seqlens_q_padded = torch.tensor([0, 12, 16], dtype=torch.int32)

    tracker = FlopsTracker(_spec())
    tracker.record(tokens=_tok(1, 16), packed_seq_params=Params())
    r = tracker.end_step()
    # Real 10 + 4 = 14 tokens, sum s^2 = 116; padded lengths 12, 4 over 16 slots.
    assert (r.num_tokens, r.num_padded_tokens, r.sum_seqlen_squared) == (14, 16, 116)
    stats = SeqStats.from_rows(parse_rows([{"seqlens": [10, 4], "padded_seqlens": [12, 4]}]))
    assert r.executed_flops == training_flops(_spec(), stats, include_padding=True).total


def test_only_the_owner_records():
    class Chunk(torch.nn.Module):
        def __init__(self, pre_process):
            super().__init__()
            self.pre_process = pre_process

    class Wrapper(torch.nn.Module):  # like megatron DDP / Float16Module: .module
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    tracker = FlopsTracker(_spec())
    tracker.record(model=Wrapper(Chunk(False)), tokens=_tok(4, 8))  # a later virtual chunk: no-op
    tracker.record(model=Wrapper(Chunk(True)), tokens=_tok(2, 8))
    tracker.record(vp_stage=1, tokens=_tok(4, 8))
    tracker.record(vp_stage=0, tokens=_tok(1, 8))
    assert tracker.end_step().num_tokens == 24


def test_context_parallel_rows_are_local(path):
    # Under CP=2 an unpacked row holds half of each sequence; packed cu_seqlens stay global.
    tracker = FlopsTracker(_spec(), context_parallel_size=2)
    tracker.record(tokens=_tok(1, 16))
    tracker.record(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0, 6, 16]))
    r = tracker.end_step()
    assert (r.num_tokens, r.num_padded_tokens, r.sum_seqlen_squared) == (32 + 16, 32 + 16, 32 * 32 + 36 + 100)


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor([1, 4, 8])), "start at 0"),
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0, 5, 4])), "non-decreasing"),
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0, 4, 9])), "holds 8 tokens"),
        (dict(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0.0, 8.0])), "integers"),
        (dict(tokens=torch.zeros(8, dtype=torch.long)), r"\[batch, seq\]"),
        (dict(tokens=_tok(2, 8), seq_lengths=torch.tensor([3, 9])), r"lie in \[0, 8\]"),
        (dict(tokens=None), "needs tokens"),
    ],
)
def test_validation_mode_raises(call, message):
    tracker = FlopsTracker(_spec(), validate=True)
    with pytest.raises(ValueError, match=message):
        tracker.record(**call)


def test_bad_input_without_validation_falls_back_once(caplog):
    tracker = FlopsTracker(_spec(), seq_length=8)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0.0, 8.0]))
        tracker.record(tokens=torch.zeros(8, dtype=torch.long))
        r = tracker.end_step()
    assert not r.ok and r.flops == r.static_flops
    assert len([m for m in caplog.messages if "megatron-flops" in m]) == 1
    # Recovery: the next step is exact again.
    tracker.record(tokens=_tok(1, 8))
    assert tracker.end_step().ok


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(attention="half"), "attention"), (dict(seq_length=0), "seq_length"), (dict(context_parallel_size=0), "context")],
)
def test_bad_options_at_setup(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FlopsTracker(_spec(), **kwargs)


# ---- sync-freedom: mechanically, with a mode that fails on every sync-forcing operation ----------

_SYNC_METHODS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.Tensor.numpy,
    torch.Tensor.cpu, torch.nonzero, torch.argwhere, torch.masked_select, torch.unique,
    torch.Tensor.unique, torch.Tensor.masked_select,
}


class SyncGuard(TorchFunctionMode):
    """Fails on host-syncing ops and boolean-mask indexing; counts the tensor ops that run."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_METHODS:
            raise AssertionError(f"sync-forcing op in the per-micro-batch path: {func.__name__}")
        if func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            raise AssertionError("boolean-mask indexing (data-dependent shape)")
        self.ops.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("window", [None, 6])
def test_record_is_sync_free_and_allocation_free(window, device_path):
    spec = _spec(**({} if window is None else dict(window_size=[window, 0])))
    tracker = FlopsTracker(spec)
    packed = dict(tokens=_tok(1, 64), cu_seqlens=torch.tensor([0, 5, 12, 30, 64], dtype=torch.int32))
    padded = dict(
        tokens=_tok(1, 64),
        cu_seqlens=torch.tensor([0, 5, 12, 30, -1]),
        cu_seqlens_padded=torch.tensor([0, 8, 16, 32, -1]),
        cu_seqlens_argmin=4,
    )
    dynamic = dict(tokens=_tok(3, 20), seq_lengths=torch.tensor([4, 20, 9]))
    tracker.record(**packed)  # the first call allocates the accumulator
    acc_ptr = tracker._device.tensor.data_ptr()
    for call in (packed, padded, dynamic, dict(tokens=_tok(2, 32))):
        with SyncGuard() as guard:
            tracker.record(**call)
        assert not any(op in ("zeros", "empty", "tensor") for op in guard.ops), guard.ops
    assert tracker._device.tensor.data_ptr() == acc_ptr
    assert tracker.end_step().ok


_VIEWS_AND_METADATA = {"__get__", "dim", "numel", "size", "reshape", "view", "unsqueeze", "expand", "__getitem__"}


@pytest.mark.parametrize(
    "window, expected",
    [
        # diff of cu_seqlens (real and padded stacked), the sequences (non-zero lengths) counted and
        # added, (s, s^2) powers, sum, add into the accumulator: the four kernels of the upstream
        # reference (diff, square, sum, add) and the count.
        (None, ["diff", "count_nonzero", "add_", "pow", "sum", "add_"]),
        # plus the window excess max(s - w, 0) and its (x, x^2) sums.
        (6, ["diff", "count_nonzero", "add_", "pow", "sum", "add_", "sub", "clamp_", "pow", "sum", "add_"]),
    ],
)
def test_kernel_ops_per_packed_call(window, expected, device_path):
    tracker = FlopsTracker(_spec(**({} if window is None else dict(window_size=[window, 0]))))
    call = dict(tokens=_tok(1, 64), cu_seqlens=torch.tensor([0, 5, 12, 30, 64], dtype=torch.int32))
    tracker.record(**call)
    with SyncGuard() as guard:
        tracker.record(**call)
    assert [op for op in guard.ops if op not in _VIEWS_AND_METADATA] == expected
    # Full-length unpacked rows are priced from the shape alone: no kernel at all.
    tokens = _tok(2, 32)
    with SyncGuard() as plain:
        tracker.record(tokens=tokens)
    assert [op for op in plain.ops if op not in _VIEWS_AND_METADATA] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_record_has_no_cuda_sync():
    tracker = FlopsTracker(_spec(window_size=[6, 0]))
    dev = torch.device("cuda")
    calls = [
        dict(tokens=torch.zeros(1, 64, dtype=torch.long, device=dev),
             cu_seqlens=torch.tensor([0, 5, 12, 30, 64], dtype=torch.int32, device=dev)),
        dict(tokens=torch.zeros(3, 20, dtype=torch.long, device=dev), seq_lengths=torch.tensor([4, 20, 9], device=dev)),
        dict(tokens=torch.zeros(2, 32, dtype=torch.long, device=dev)),
        # Row-local offsets [mbs, S + 1] (Megatron-LM core_v0.19.0 packed, micro-batch size 2).
        dict(tokens=torch.zeros(2, 8, dtype=torch.long, device=dev), cu_seqlens=_row_local([3, 5], [8]).to(dev)),
    ]
    tracker.record(**calls[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for call in calls:
                tracker.record(**call)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tracker.end_step().ok


def test_vision_grids_share_the_step_and_the_collective():
    from megatron_flops.flops.vision import VisionSpec, VisionStats, vision_training_flops

    vit = VisionSpec(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, gated_mlp=True,
                     patch_size=2, out_hidden_size=64, window_size=8, fullatt_block_indexes=(1,))
    grids = [[1, 8, 6], [2, 4, 4]]
    tracker = FlopsTracker(_spec(), vision=vit)
    tokens, grid = _tok(1, 32), torch.tensor(grids)
    tracker.record(tokens=tokens, grid_thw=grid)
    with SyncGuard():
        tracker.record(tokens=tokens, grid_thw=grid)
    r = tracker.end_step()
    text = training_flops(_spec(), SeqStats.from_rows(parse_rows([32, 32]))).total
    vision = vision_training_flops(vit, VisionStats.from_grids(vit, grids + grids))
    assert r.flops == text + vision.total and r.components["vit/mlp"] == vision.components["vit/mlp"]
    with pytest.raises(ValueError, match="needs FlopsTracker"):
        FlopsTracker(_spec(), validate=True).record(tokens=tokens, grid_thw=grid)


def test_grids_without_a_vision_spec_count_the_text_and_warn_once(caplog):
    tracker = FlopsTracker(_spec())
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        for _ in range(2):
            tracker.record(tokens=_tok(1, 32), grid_thw=torch.tensor([[1, 4, 4]]))
        r = tracker.end_step()
    assert r.ok and r.flops == training_flops(_spec(), SeqStats.from_rows(parse_rows([32, 32]))).total
    assert sum("vision tower not counted" in m for m in caplog.messages) == 1


def test_recompute_moves_executed_flops_only():
    from megatron_flops.flops.formulas import forward_flops
    from megatron_flops.flops.passes import RecomputeSpec

    recompute = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
    plain, redo = FlopsTracker(_spec()), FlopsTracker(_spec(), recompute=recompute)
    for tracker in (plain, redo):
        tracker.record(tokens=_tok(2, 16))
    a, b = plain.end_step(), redo.end_step()
    fwd = forward_flops(_spec(), SeqStats.from_rows(parse_rows([16, 16])))
    # Full recompute re-runs every decoder GEMM's forward once; never the output layer.
    assert b.flops == a.flops and b.executed_flops - a.executed_flops == sum(fwd.values()) - fwd["logits"]


def test_impossible_peft_setup_fails_at_setup():
    from megatron_flops.flops.passes import PeftSpec

    with pytest.raises(ValueError, match="linear_q_proj"):
        FlopsTracker(_spec(), peft=PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_q_proj",)))
    with pytest.raises(ValueError, match="convention"):
        FlopsTracker(_spec(), convention="6N")


# ---- the host path: CPU tensors cost no tensor operation per micro-batch --------------------------


def test_host_micro_batches_run_no_tensor_op_until_end_step():
    from megatron_flops.flops.vision import VisionSpec, VisionStats, vision_training_flops

    vit = VisionSpec(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, gated_mlp=False, patch_size=2,
                     out_hidden_size=64)
    tracker = FlopsTracker(_spec(window_size=[6, 0]), vision=vit)
    calls = [
        dict(tokens=_tok(1, 64), cu_seqlens=torch.tensor([[0, 5, 12, 30, 64]], dtype=torch.int32)),
        dict(tokens=_tok(1, 40), cu_seqlens=torch.tensor([[0, 6, 14, 32, -1]]),
             cu_seqlens_argmin=torch.tensor([[4]]), cu_seqlens_padded=torch.tensor([[0, 8, 16, 40, -1]])),
        dict(tokens=_tok(3, 20), seq_lengths=torch.tensor([4, 20, 9]), grid_thw=torch.tensor([[1, 4, 4]])),
        dict(tokens=_tok(2, 32)),
    ]
    for call in calls:
        with SyncGuard() as guard:
            tracker.record(**call)
        assert [op for op in guard.ops if op not in _VIEWS_AND_METADATA] == [], guard.ops
    assert tracker._device.tensor is None  # no device accumulator either
    r = tracker.end_step()
    # Real: 5, 7, 18, 34 | 6, 8, 18 | 4, 20, 9 | 32, 32; padded: 5, 7, 18, 34 | 8, 8, 24 | 3 x 20 | 32, 32.
    rows = [[5, 7, 18, 34], {"seqlens": [6, 8, 18], "padded_seqlens": [8, 8, 24]},
            {"seqlens": [4], "pad_to": 20}, 20, {"seqlens": [9], "pad_to": 20}, 32, 32]
    stats = SeqStats.from_rows(parse_rows(rows), window=6)
    assert (r.num_tokens, r.num_padded_tokens, r.num_sequences) == (stats.num_tokens, stats.num_padded_tokens, 12)
    vision = vision_training_flops(vit, VisionStats.from_grids(vit, [[1, 4, 4]])).total
    assert r.flops == training_flops(_spec(window_size=[6, 0]), stats).total + vision


def test_host_offsets_real_token_limit_and_zero_length_segments():
    # Megatron-Bridge without unpadded offsets: 13 real tokens (token_count) in a 16-slot pack whose
    # offsets end with a padding segment and a zero-length pad entry (pad_cu_seqlens).
    tracker = FlopsTracker(_spec())
    tracker.record(tokens=_tok(1, 16), cu_seqlens=torch.tensor([0, 4, 12, 13, 16, 16, -1], dtype=torch.int32),
                   cu_seqlens_argmin=torch.tensor([6]), num_real_tokens=[13])
    r = tracker.end_step()
    # Real lengths 4, 8, 1 (the padding segment and the empty one hold no real token): 3 sequences,
    # sum s^2 = 81; run lengths 4, 8, 1, 3.
    assert (r.num_tokens, r.num_sequences, r.sum_seqlen_squared) == (13, 3, 81)
    stats = SeqStats(num_rows=1, num_sequences=3, num_tokens=13, num_padded_tokens=16, sum_seqlen_squared=81,
                     sum_padded_seqlen_squared=16 + 64 + 1 + 9)
    assert r.flops == training_flops(_spec(), stats).total
    assert r.executed_flops == training_flops(_spec(), stats, include_padding=True).total


def _row_local(*rows: list[int], seq: int = 8) -> torch.Tensor:
    """Megatron-LM core_v0.19.0's collated offsets: per row the document boundaries, padded to
    ``seq + 1`` entries with copies of the last one (``seq`` when the documents fill the row, as
    core_v0.19.0's datasets make them) (``[b, seq + 1]``, int32)."""
    out = torch.zeros((len(rows), seq + 1), dtype=torch.int32)
    for i, docs in enumerate(rows):
        bounds = torch.tensor([0, *docs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out[i] = bounds[-1]
        out[i, : len(bounds)] = bounds
    return out


def test_row_local_offsets_of_micro_batches_of_two_rows(path):
    # Two micro-batches of 2 rows x 8 tokens, offsets [2, 9] as core_v0.19.0 collates them:
    # documents 3+5 | 8 and 1+2+5 | 4+4. 32 tokens in 8 sequences; sum s^2 = 9 + 25 + 64 + 1 + 4
    # + 25 + 16 + 16 = 160 (the padding entries are zero lengths: no sequence, no square). A
    # row-local offset is never read across rows (row 1 restarts at 0 after row 0's 8s).
    tracker = FlopsTracker(_spec(), seq_length=8)
    tracker.record(tokens=_tok(2, 8), cu_seqlens=_row_local([3, 5], [8]))
    tracker.record(tokens=_tok(2, 8), cu_seqlens=_row_local([1, 2, 5], [4, 4]))
    r = tracker.end_step()
    assert r.ok
    assert (r.num_tokens, r.num_padded_tokens, r.num_sequences, r.sum_seqlen_squared) == (32, 32, 8, 160)
    # As test_hand_derived_packed_row, T = 32 tokens: 2 layers x (qkv 2*T*64*192 + out 2*T*64*64
    # + mlp 4*T*64*256 + causal core 2*4*32*160/2) + logits 2*T*64*128, x3.
    t = 32
    fwd = 2 * (2 * t * 64 * 192 + 2 * t * 64 * 64 + 4 * t * 64 * 256 + 2 * 4 * 32 * 160 // 2) + 2 * t * 64 * 128
    assert r.flops == r.executed_flops == 3 * fwd == 20_570_112
    # Static: four full 8-token rows (sum s^2 = 4 * 64).
    fwd_static = 2 * (2 * t * 64 * 192 + 2 * t * 64 * 64 + 4 * t * 64 * 256 + 2 * 4 * 32 * 256 // 2) + 2 * t * 64 * 128
    assert r.static_flops == 3 * fwd_static == 20_643_840


def test_row_local_real_and_padded_offsets(path):
    # Real and padded offsets, both row-local [2, 9]: real 3+4 | 6 (1 + 2 slots of padding), run as
    # 4+4 | 8. Real: 13 tokens, 3 sequences, 9 + 16 + 36 = 61; padded: 16 + 16 + 64 = 96.
    tracker = FlopsTracker(_spec(), seq_length=8)
    tracker.record(tokens=_tok(2, 8), cu_seqlens=_row_local([3, 4], [6]), cu_seqlens_padded=_row_local([4, 4], [8]))
    r = tracker.end_step()
    assert (r.num_tokens, r.num_padded_tokens, r.num_sequences, r.sum_seqlen_squared) == (13, 16, 3, 61)
    stats = SeqStats(num_rows=2, num_sequences=3, num_tokens=13, num_padded_tokens=16, sum_seqlen_squared=61,
                     sum_padded_seqlen_squared=96)
    assert r.ok and r.flops == training_flops(_spec(), stats).total
    assert r.executed_flops == training_flops(_spec(), stats, include_padding=True).total


@pytest.mark.parametrize("call, message", [
    (dict(cu_seqlens=_row_local([8], [8], [8])), r"\[n\] or \[1, n\] .* or \[2, n\]"),  # 3 rows of offsets, 2 of tokens
    (dict(cu_seqlens=_row_local([8], [8]), cu_seqlens_argmin=2), "applies to one row"),
    (dict(cu_seqlens=_row_local([8], [8]), num_real_tokens=13), "applies to one packed row"),
])
def test_row_local_offsets_that_do_not_fit_fall_back(call, message, caplog):
    tracker = FlopsTracker(_spec(), seq_length=8)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(tokens=_tok(2, 8), **call)
        r = tracker.end_step()
    assert not r.ok and r.flops == r.static_flops
    assert any(re.search(message, m) for m in caplog.messages)
    with pytest.raises(ValueError, match=message):
        FlopsTracker(_spec(), validate=True).record(tokens=_tok(2, 8), **call)


def test_row_local_offsets_validated_per_row():
    # validate=True reads each row: a row may end at its own 8 tokens, not at the micro-batch's 16.
    tracker = FlopsTracker(_spec(), validate=True)
    tracker.record(tokens=_tok(2, 8), cu_seqlens=_row_local([3, 5], [8]))
    assert tracker.end_step().num_sequences == 3
    with pytest.raises(ValueError, match="ends at 12 but a row holds 8 tokens"):
        tracker.record(tokens=_tok(2, 8), cu_seqlens=torch.tensor([[0, 8, 8], [0, 4, 12]], dtype=torch.int32))


def test_host_offsets_of_many_rows_in_one_pass(caplog):
    # Whole rows of three sizes, [n] int64 and [1, n] int32, beside a trimmed row, in one step.
    tracker = FlopsTracker(_spec())
    tracker.record(tokens=_tok(1, 12), cu_seqlens=torch.tensor([0, 5, 12]))
    tracker.record(tokens=_tok(1, 10), cu_seqlens=torch.tensor([[0, 0, 3, 3, 9]], dtype=torch.int32))
    tracker.record(tokens=_tok(1, 16), cu_seqlens=torch.tensor([0, 16]))
    tracker.record(tokens=_tok(1, 8), cu_seqlens=torch.tensor([0, 4, 8, -1]), cu_seqlens_argmin=3)
    r = tracker.end_step()
    # Lengths 5, 7 | 0, 3, 0, 6 | 16 | 4, 4: 7 sequences (empty segments are none), 45 tokens in
    # 12 + 10 + 16 + 8 = 46 slots, sum s^2 = 25 + 49 + 9 + 36 + 256 + 16 + 16 = 407 in both channels.
    assert (r.num_sequences, r.num_tokens, r.num_padded_tokens, r.sum_seqlen_squared) == (7, 45, 46, 407)
    stats = SeqStats(num_rows=4, num_sequences=7, num_tokens=45, num_padded_tokens=46, sum_seqlen_squared=407,
                     sum_padded_seqlen_squared=407)
    assert r.ok and r.flops == training_flops(_spec(), stats).total
    # A row that does not start at 0 is found after another row, too: the step falls back.
    tracker.record(tokens=_tok(1, 9), cu_seqlens=torch.tensor([0, 9]))
    tracker.record(tokens=_tok(1, 9), cu_seqlens=torch.tensor([2, 9]))
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        assert not tracker.end_step().ok
    assert any("start at 0" in m for m in caplog.messages)


@pytest.mark.parametrize("call, message", [
    (dict(cu_seqlens=torch.tensor([0, 9, 4, 16])), "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([2, 9, 16])), "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 4, -1]), cu_seqlens_argmin=torch.tensor([1])), "at least two entries"),
    (dict(cu_seqlens=torch.tensor([0])), "at least two entries"),
    (dict(cu_seqlens=torch.tensor([[0, 8], [0, 8]])), "one packed stream"),
    (dict(seq_lengths=torch.tensor([-3])), "non-negative"),
])
def test_malformed_host_values_fall_back_once(call, message, caplog):
    tracker = FlopsTracker(_spec(), seq_length=16)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        for _ in range(2):
            tracker.record(tokens=_tok(1, 16), **call)
            r = tracker.end_step()
            assert not r.ok and r.flops == r.static_flops
    [warning] = [m for m in caplog.messages if "megatron-flops" in m]
    assert re.search(message, warning)


def test_host_sums_of_squares_never_wrap(monkeypatch):
    # A length past 3.04e9 tokens would wrap int64 squares: the sums are then exact Python integers.
    monkeypatch.setattr("megatron_flops.tracking.host_stats._SQUARE_SAFE", 10)
    monkeypatch.setattr("megatron_flops.tracking.host_stats._PYTHON_PASS", 0)  # the numpy pass
    tracker = FlopsTracker(_spec())
    tracker.record(tokens=_tok(1, 16), cu_seqlens=torch.tensor([0, 7, 16]))
    r = tracker.end_step()
    assert (r.num_tokens, r.sum_seqlen_squared) == (16, 49 + 81)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("offsets", [
    [torch.tensor([0, 5, 9, 16])] * 3,  # 1-D streams
    [torch.tensor([[0, 3, 3, 16]], dtype=torch.int32), torch.tensor([[0, 16]], dtype=torch.int32)],  # [1, n]
    [_row_local([2, 6], [8])] * 2,  # row-local [b, n], zero-length padding entries
])
def test_whole_offsets_python_and_numpy_passes_agree(monkeypatch, offsets, window):
    # Up to _PYTHON_PASS entries a step's whole rows of offsets are summed in Python, beyond in numpy.
    def settle(limit: int) -> dict[str, int]:
        monkeypatch.setattr("megatron_flops.tracking.host_stats._PYTHON_PASS", limit)
        step = HostBatches(window=window, vision=None)
        for cu in offsets:
            step.add_offsets(cu, None, None, real=True, padded=True)
        return step.settle()

    python, numpy = settle(512), settle(0)
    assert python == numpy
    if offsets[0].dim() == 1:  # 3 rows of lengths 5, 4, 7: 9 sequences, 48 tokens, 3 * (25 + 16 + 49) squared
        assert (python["num_sequences"], python["num_tokens"], python["sum_seqlen_squared"]) == (9, 48, 270)


@pytest.mark.parametrize("window", [None, 3])
def test_trimmed_offsets_python_and_numpy_passes_agree(monkeypatch, window):
    # Sentinel-padded rows (tensor and int argmins), a real-token limit, one-channel rows.
    def settle(limit: int) -> dict[str, int]:
        monkeypatch.setattr("megatron_flops.tracking.host_stats._PYTHON_PASS", limit)
        step = HostBatches(window=window, vision=None)
        step.add_offsets(torch.tensor([0, 4, 9, 16, -1, -1]), torch.tensor([4]), None, real=True, padded=True)
        step.add_offsets(torch.tensor([[0, 5, 12, 16]]), 3, None, real=True, padded=False)
        step.add_offsets(torch.tensor([0, 6, 12, 16]), None, 10, real=True, padded=False)
        step.add_offsets(torch.tensor([0, 6, 12, 16]), None, None, real=False, padded=True)
        return step.settle()

    python, numpy = settle(512), settle(0)
    assert python == numpy
    # Real: 4, 5, 7 | 5, 7 | 6, 4 (clipped at 10): 7 sequences, 38 tokens.
    assert (python["num_sequences"], python["num_tokens"]) == (7, 38)


@pytest.mark.parametrize("cu, message", [(torch.tensor([1, 4, 8]), "start at 0"),
                                         (torch.tensor([0, 6, 4, 8]), "non-decreasing")])
@pytest.mark.parametrize("limit", [512, 0])
def test_whole_offsets_both_passes_refuse_malformed_values(monkeypatch, cu, message, limit):
    monkeypatch.setattr("megatron_flops.tracking.host_stats._PYTHON_PASS", limit)
    step = HostBatches(window=None, vision=None)
    step.add_offsets(torch.tensor([0, 8]), None, None, real=True, padded=True)
    step.add_offsets(cu, None, None, real=True, padded=True)
    with pytest.raises(ValueError, match=message):
        step.settle()


def test_observed_micro_batches_yield_to_recorded_ones():
    tracker = FlopsTracker(_spec())
    tracker.observe(num_rows=1, row_length=16, cu_seqlens=torch.tensor([[0, 4, 16]]))
    assert tracker.end_step().sum_seqlen_squared == 16 + 144  # observed only: counted
    tracker.observe(num_rows=1, row_length=16, cu_seqlens=torch.tensor([[0, 4, 16]]))
    tracker.record(tokens=_tok(1, 16))
    r = tracker.end_step()
    assert (r.num_microbatches, r.sum_seqlen_squared) == (1, 256)  # recorded wins
    tracker.observe_failed(ValueError("unknown layout"))
    tracker.record(tokens=_tok(1, 16))
    assert tracker.end_step().ok  # the observed failure went with the observed batches


def test_discard_step_forgets_everything():
    tracker = FlopsTracker(_spec())
    tracker.record(tokens=_tok(1, 16), cu_seqlens=torch.tensor([0, 16]))
    tracker.observe(num_rows=2, row_length=16)
    tracker.discard_step()
    r = tracker.end_step()
    assert (r.num_microbatches, r.num_tokens) == (0, 0)


def test_observed_device_batches_are_deferred(device_path):
    tracker = FlopsTracker(_spec())
    tracker.observe(num_rows=1, row_length=16, cu_seqlens=torch.tensor([[0, 4, 16]]))
    assert tracker._device.tensor is None  # nothing runs until the step is priced
    r = tracker.end_step()
    assert (r.num_tokens, r.sum_seqlen_squared, r.num_sequences) == (16, 160, 2)


@pytest.mark.parametrize("rows", [[[5, 11]], [{"seqlens": [5, 11], "padded_seqlens": [8, 16]}]])
def test_price_without_padding_reuses_the_real_gemms(rows):
    # With no padding the executed GEMMs are the real ones: price() builds them once, the same numbers.
    stats = SeqStats.from_rows(parse_rows(rows), window=None)
    priced = price(_spec(), stats)
    assert priced.executed == training_flops(_spec(), stats, include_padding=True)
    assert priced.model == training_flops(_spec(), stats)
