"""DiTFlopsTracker: a step's FLOPs equal ``estimate --json`` over the same clips (host and device
lengths, ints, lists, tensors), no host sync on device lengths, bad input (ValueError when
validating, a fallback on every rank otherwise), ``FlopsTracker.from_model_file``, the session,
two gloo ranks, and the FSDP2 example end to end."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mcore_dist
from megatron_flops import FlopsTracker
from megatron_flops.tracking import batch_checks
from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec, DiTStats
from megatron_flops.flops.dit_passes import dit_recompute, dit_report, dit_setup, price_dit
from megatron_flops.tracking.dit_tracker import DiTFlopsTracker
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.reporting.session import install_session, uninstall_session

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
WAN14B = EXAMPLES / "wan21_14b_dit.json"
TINY_FILE = EXAMPLES / "wan_tiny_dit.json"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import wan_dit_fsdp2 as wan  # noqa: E402

I2V = DiTSpec(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=48, in_channels=6, out_channels=3,
              text_dim=24, text_len=7, image_dim=20, image_len=5)


def _estimate(model: Path, video: list[int], text: list[int], *extra: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "megatron_flops", "estimate", "--model", str(model), "--seqlens", json.dumps(video),
         "--kv-seqlens", json.dumps(text), "--json", *extra],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


@pytest.fixture
def device_path(monkeypatch):
    """CPU tensors take the device path (no host reads), as CUDA tensors do."""
    monkeypatch.setattr(batch_checks, "HOST_DEVICE_TYPES", frozenset())


# ---- a step equals estimate -----------------------------------------------------------------


def test_step_equals_cli_estimate():
    # Three micro-batches in three forms: a tensor and a list, an int for every sample
    # (num_samples=2), a one-sample int; 4 clips in all.
    tracker = FlopsTracker.from_model_file(WAN14B)
    assert isinstance(tracker, DiTFlopsTracker)
    tracker.record(video_seqlens=torch.tensor([32760, 8190]), text_seqlens=[512, 300])
    tracker.record(video_seqlens=16380, text_seqlens=100, num_samples=2)
    tracker.record(video_seqlens=[4096])
    result = tracker.end_step()
    video, text = [32760, 8190, 16380, 16380, 4096], [512, 300, 100, 100, 512]
    report = _estimate(WAN14B, video, text)
    assert result.ok and result.flops == report["total_flops"]
    assert result.executed_flops == report["executed_flops"]
    assert (result.num_tokens, result.num_sequences, result.num_microbatches) == (77_806, 5, 3)
    assert result.components == report["components"]


def test_lora_checkpointing_from_the_model_file_equals_cli():
    # The tiny model file carries LoRA (rank 4 on q, k, v, o, base frozen) and full recompute.
    tracker = FlopsTracker.from_model_file(TINY_FILE)
    tracker.record(video_seqlens=torch.tensor([12, 6, 3]), text_seqlens=torch.tensor([5, 12, 2]))
    result = tracker.end_step()
    report = _estimate(TINY_FILE, [12, 6, 3], [5, 12, 2])
    assert (result.flops, result.executed_flops) == (report["total_flops"], report["executed_flops"])
    assert report["recompute_flops"] > 0 and report["num_adapters"] == 16


def test_device_path_equals_host_path(device_path):
    spec = I2V
    host, device = DiTFlopsTracker(spec), DiTFlopsTracker(spec)
    batches = [([12, 6, 3], [5, 7, 2], [5, 4, 5]), ([20], [7], [5])]
    for video, text, image in batches:
        host.record(video_seqlens=video, text_seqlens=text, image_seqlens=image)
        device.record(video_seqlens=torch.tensor(video, dtype=torch.int32), text_seqlens=torch.tensor(text),
                      image_seqlens=torch.tensor(image))
    # A device tensor mixed with host lengths.
    host.record(video_seqlens=[8, 4], text_seqlens=[3, 3])
    device.record(video_seqlens=torch.tensor([8, 4]), text_seqlens=3)
    a, b = host.end_step(), device.end_step()
    assert a == b and a.ok
    stats = DiTStats.from_seqlens(spec, [12, 6, 3, 20, 8, 4], [5, 7, 2, 7, 3, 3], [5, 4, 5, 5, 5, 5])
    assert a.flops == price_dit(spec, stats).model.total
    # Static: every sample at its micro-batch's longest clip (12, 20, 8) with 7 text and 5 image tokens.
    static = DiTStats.full_context(spec, num_samples=6, num_video_tokens=3 * 12 + 20 + 2 * 8,
                                   sum_video_seqlen_squared=3 * 144 + 400 + 2 * 64)
    assert a.static_flops == price_dit(spec, static).model.total


def test_seq_length_sets_the_static_number():
    tracker = DiTFlopsTracker(I2V, seq_length=30)
    tracker.record(video_seqlens=[12, 6])
    result = tracker.end_step()
    static = DiTStats.full_context(I2V, num_samples=2, num_video_tokens=60, sum_video_seqlen_squared=1800)
    assert result.static_flops == price_dit(I2V, static).model.total


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_record_on_device_does_not_sync(device_path, monkeypatch):
    # _local_scalar_dense is what .item(), int() and bool() of a device tensor run, .tolist() a copy
    # to the host: each a host sync. The accumulator is allocated once and updated in place.
    def no_tolist(self):
        raise AssertionError("record() read a device tensor on the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_tolist)
    tracker = DiTFlopsTracker(I2V, peft=DiTPeftSpec(frozen=True, lora_rank=2), recompute=dit_recompute(I2V))
    tracker.record(video_seqlens=torch.tensor([3]), text_seqlens=torch.tensor([2]))
    acc = tracker._device.tensor
    ops = _Ops()
    with ops:
        tracker.record(video_seqlens=torch.tensor([12, 6]), text_seqlens=torch.tensor([5, 7]),
                       image_seqlens=torch.tensor([5, 5]))
        tracker.record(video_seqlens=torch.tensor([4, 4, 9]), text_seqlens=7)
    assert ops.names and not any("_local_scalar_dense" in n or "nonzero" in n for n in ops.names)
    monkeypatch.undo()  # end_step reads the reduced vector: the one host sync of the step
    assert tracker._device.tensor is acc and tracker.end_step().ok


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(video_seqlens=[12, 6], text_seqlens=[5]), "video_seqlens has 2 samples but text_seqlens has 1"),
        (dict(video_seqlens=[12, 0]), "video_seqlens must be positive, got 0"),
        (dict(video_seqlens=[12], text_seqlens=[-1]), "text_seqlens must be positive, got -1"),
        (dict(video_seqlens=torch.tensor([12, -4])), "video_seqlens must be positive, got -4"),
        (dict(video_seqlens=torch.tensor([1.5])), "video_seqlens must hold integers"),
        (dict(video_seqlens=12, num_samples=3, text_seqlens=[1, 2]), "num_samples has 3 samples but text_seqlens has 2"),
        (dict(video_seqlens=[]), "no samples"),
        (dict(text_seqlens=[5]), "record\\(\\) needs video_seqlens"),
        (dict(tokens=torch.zeros(1, 8), cu_seqlens=torch.tensor([0, 8])),
         "a DiT tracker records video_seqlens, .*cu_seqlens, tokens are decoder arguments"),
    ],
)
def test_bad_input_raises_when_validating(kwargs, message, device_path):
    tracker = DiTFlopsTracker(I2V, validate=True)
    with pytest.raises(ValueError, match=message):
        tracker.record(**kwargs)


def test_image_lengths_on_text_to_video():
    spec = DiTSpec(num_layers=1, hidden_size=8, num_heads=2, ffn_hidden_size=8)
    with pytest.raises(ValueError, match="image_seqlens given for a text-to-video DiT"):
        DiTFlopsTracker(spec, validate=True).record(video_seqlens=[4], image_seqlens=[257])


def test_failure_falls_back_with_one_warning(caplog):
    # Without validation a bad micro-batch is logged once and the step reports the static number,
    # flagged; the next good step is exact again.
    tracker = DiTFlopsTracker(I2V, seq_length=10)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(video_seqlens=[12, 6])
        tracker.record(video_seqlens=[12, 6], text_seqlens=[5])
        tracker.record(video_seqlens=[0])
        failed = tracker.end_step()
    assert not failed.ok and failed.flops == failed.executed_flops == failed.static_flops
    # The static number prices every sample at 10 tokens: the 2 good ones and the one with a bad
    # length (a micro-batch whose sample count is unclear adds none): 3 x 10.
    static = DiTStats.full_context(I2V, num_samples=3, num_video_tokens=30, sum_video_seqlen_squared=300)
    assert failed.static_flops == price_dit(I2V, static).model.total
    assert failed.fallback_reason == "1 rank(s) failed to record or reduce this step"
    assert sum("record() failed" in r.message for r in caplog.records) == 1
    tracker.record(video_seqlens=[12, 6])
    assert tracker.end_step().ok


def test_fallback_without_seq_length_is_the_latest_static(caplog):
    # No seq_length: a failed step cannot know its clips' lengths; it reports the latest exact
    # step's static number (none before the first: 0, flagged, with a warning).
    tracker = DiTFlopsTracker(I2V)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(video_seqlens=[0])
        first = tracker.end_step()
        tracker.record(video_seqlens=[12, 6])
        good = tracker.end_step()
        tracker.record(video_seqlens=[5], text_seqlens=[1, 2])
        later = tracker.end_step()
    assert (first.ok, first.flops, first.static_flops) == (False, 0, None)
    assert good.ok and (later.ok, later.flops, later.static_flops) == (False, good.static_flops, good.static_flops)
    assert any("no static number is known" in r.message for r in caplog.records)


def test_non_positive_device_lengths_fall_back_at_end_step(device_path, caplog):
    # A device length is not read in record() (that would sync): it is counted, and end_step
    # (after the all-reduce, so on every rank alike) falls back.
    tracker = DiTFlopsTracker(I2V)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        tracker.record(video_seqlens=torch.tensor([12, -6]))
        assert not tracker.end_step().ok
    assert any("non-positive clip lengths" in r.message for r in caplog.records)


def test_from_model_file_options_and_errors(tmp_path):
    tracker = FlopsTracker.from_model_file(TINY_FILE, peft=None, recompute=None, seq_length=8)
    assert tracker.peft is None and tracker.recompute is None and tracker.seq_length == 8
    with pytest.raises(ValueError, match=r"describes a DiT: option\(s\) attention do not apply"):
        FlopsTracker.from_model_file(TINY_FILE, attention="full")
    with pytest.raises(ValueError, match="a DiT checkpoints whole blocks"):
        FlopsTracker.from_model_file(TINY_FILE, recompute=RecomputeSpec(granularity="selective"))
    assert type(FlopsTracker.from_model_file(EXAMPLES / "llama3_8b.json")) is FlopsTracker
    vlm = FlopsTracker.from_model_file(EXAMPLES / "qwen2_5_vl_7b_config.json")
    assert type(vlm) is FlopsTracker and vlm.vision is not None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"dit": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 48},
                               "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="decoder-style key"):
        FlopsTracker.from_model_file(bad)


def test_session_with_a_dit_tracker():
    tracker = DiTFlopsTracker(I2V)
    session = install_session(tracker, world_size=1, peak_flops_per_s=10**15)
    try:
        session.begin_step()
        session.record(video_seqlens=[12, 6], text_seqlens=[5, 7])
        result = session.end_step()
        assert result.flops == dit_report(dit_setup({"dit": dataclasses.asdict(I2V)}), [12, 6], [5, 7])["total_flops"]
        # A decoder-style record (a Megatron adapter's) only flags the step.
        session.begin_step()
        session.record(model=None, tokens=torch.zeros(1, 4))
        assert not session.end_step().ok
    finally:
        uninstall_session()


# ---- two gloo ranks --------------------------------------------------------------------------


def _dit_worker(rank: int, world_size: int, fail_rank: int | None) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        tracker = DiTFlopsTracker(I2V)
        rng = random.Random(rank)
        clips = [[rng.randint(1, 40) for _ in range(rng.randint(1, 3))] for _ in range(3)]
        for video in clips:
            tracker.record(video_seqlens=torch.tensor(video), text_seqlens=[7] * len(video))
        good = tracker.end_step()
        tracker.record(video_seqlens=[0] if rank == fail_rank else [10])
        fallback = tracker.end_step()
        return {"clips": [s for video in clips for s in video], "good": good, "fallback": fallback}
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_two_ranks_sum_and_fall_back_together():
    results = mcore_dist.run_distributed(_dit_worker, 2, 1, timeout=180)
    video = results[0]["clips"] + results[1]["clips"]
    expected = price_dit(I2V, DiTStats.from_seqlens(I2V, video, [7] * len(video))).model.total
    assert [r["good"].flops for r in results] == [expected, expected]
    assert all(r["good"].ok for r in results)
    # Rank 1's bad length: both ranks report the same static number, flagged.
    assert [r["fallback"].ok for r in results] == [False, False]
    assert results[0]["fallback"] == results[1]["fallback"]


# ---- the FSDP2 example -----------------------------------------------------------------------


@pytest.mark.dist
def test_fsdp2_example(tmp_path):
    # 2 gloo ranks, FSDP2, LoRA on a frozen base, every block checkpointed, 3 steps of 2
    # micro-batches of 2 clips. Each step: executed FLOPs == FlopCounterMode on both ranks, and
    # the tracker's FLOPs == estimate over the clips both ranks trained on.
    trace = tmp_path / "trace.jsonl"
    done = subprocess.run([sys.executable, str(EXAMPLES / "wan_dit_fsdp2.py"), "--iterations", "3", "--check",
                           "--trace", str(trace)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "executed FLOPs == FlopCounterMode" in line]
    assert len(lines) == 3 and "over-report factor" in lines[0] and "steady state" in done.stdout
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    options = wan.Options(iterations=3)
    spec = DiTSpec.from_mapping(json.loads(TINY_FILE.read_text())["dit"])
    streams = [wan.microbatches(spec, options, rank) for rank in range(2)]
    for step in steps:
        batches = [next(stream)[0] for stream in streams for _ in range(options.micro_batches)]
        clips = [c for batch in batches for c in batch]
        report = _estimate(TINY_FILE, [wan.video_tokens(spec, c) for c in clips], [c.text.shape[0] for c in clips])
        assert step["ok"] and step["measured_flops"] == step["executed_flops"] == report["executed_flops"]
        assert step["flops"] == report["total_flops"] < step["static_flops"]
