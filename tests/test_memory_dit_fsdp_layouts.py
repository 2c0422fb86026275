"""A WAN-like DiT under torch FSDP2 beside tensor, sequence and context parallelism
(:mod:`megatron_flops.memory.dit_fsdp_layouts`): a formula (Bridge's WanModel needs Transformer
Engine), checked exact against its derivation and consistent with the measured FSDP2 report over
DP alone (tests/test_memory_fsdp.py) and the megatron-core TP/CP layouts (tests/test_memory_dit_layouts.py)."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_flops.flops.dit import DiTSpec
from megatron_flops.memory.dit_fsdp_layouts import dit_fsdp_layout_report, tp_slice
from megatron_flops.memory.dit_layouts import dit_layout_report, dit_rank_states
from megatron_flops.memory.fsdp import dit_memory_report, fsdp_rank_memory
from megatron_flops.memory.layout import Parallelism, Training

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPEC = DiTSpec.from_mapping(json.loads((EXAMPLES / "wan_tiny_dit.json").read_text())["dit"])  # h 32, f 64, 2 blocks
TRAINING = Training(seq_length=16, micro_batch_size=1, num_microbatches=4)  # bf16, fp32 reduce, Adam


def test_tp1_cp1_is_the_measured_data_parallel_report():
    for dp in (2, 4):
        assert dit_fsdp_layout_report(SPEC, Parallelism(dp=dp, fsdp=True), TRAINING) == \
            dit_memory_report(SPEC, TRAINING, dp=dp)
    # Checkpointed blocks, one by one and in a group of 2 (measured in tests/test_memory_dit_activations.py).
    for blocks, group in ((1, 1), (2, 2)):
        assert dit_fsdp_layout_report(SPEC, Parallelism(dp=2, fsdp=True), TRAINING, checkpointed_blocks=blocks,
                                      checkpoint_group=group) == \
            dit_memory_report(SPEC, TRAINING, dp=2, checkpointed_blocks=blocks, checkpoint_group=group)


def test_tp2_dp2_exact():
    report = dit_fsdp_layout_report(SPEC, Parallelism(tp=2, dp=2, fsdp=True), TRAINING)
    # One block on a TP rank: column-parallel q/k/v (self, cross) [16, 32] + bias 16, row-parallel o
    # [32, 16] + whole bias 32, ffn.0 [32, 32] + 32, ffn.2 [32, 32] + 32, modulation [1, 6, 32] and six
    # 32-wide norms: 6 x 528 + 2 x 544 + 2 x 1,056 + 192 + 192 = 6,752. FSDP2 over DP 2, ceil(dim0 / 2)
    # rows: 6 x 264 + 2 x 272 + 2 x 528 + 192 (one row, padded on rank 1) + 6 x 16 = 3,472 per rank.
    # The root is whole on every TP rank: 10,928 elements, 5,496 per FSDP rank (head.modulation's one
    # row padded: 10,928 / 2 + 32). Rank 0 holds only real rows.
    shard = 2 * 3_472 + 5_496  # 12,440
    assert report["per_gpu"]["components"] == {
        "weights": 4 * shard, "gradients": 4 * shard, "optimizer/exp_avg": 4 * shard, "optimizer/exp_avg_sq": 4 * shard,
        # 4 micro-batches: whole fp32 gradients of the TP rank's 2 x 6,752 + 10,928 = 24,432 elements.
        "gradients/unsharded_accumulation": 4 * 24_432,
        "fsdp/unsharded_working_copies": 121_504,
    }
    comm = report["communication_per_step"]
    # Per micro-batch each block gathered twice, the root once (bf16); reduce-scattered once (fp32).
    assert comm["fsdp/all_gather"] == 4 * (2 * 2 * 2 * 3_472 + 2 * 5_496) * 2 == 310_144
    assert comm["fsdp/reduce_scatter"] == (2 * 2 * 3_472 + 2 * 5_496) * 4 == 99_520
    # FSDP2 TP 1: the measured report; TP 2 drops each block's split elements, 2 x (6,608 - 3,472) per rank.
    whole = dit_memory_report(SPEC, TRAINING, dp=2)["per_gpu"]["weights_bytes"]
    assert whole - report["per_gpu"]["weights_bytes"] == 4 * 2 * (6_608 - 3_472) == 25_088


def test_tp2_fsdp_versus_distributed_optimizer():
    fsdp = dit_fsdp_layout_report(SPEC, Parallelism(tp=2, dp=2, fsdp=True), TRAINING)
    dist = dit_layout_report(SPEC, Parallelism(tp=2, dp=2, distributed_optimizer=True), TRAINING)
    # Same activations and TP collectives; the dp/ buffer collectives become fsdp/ ones.
    assert fsdp["per_gpu"]["activations_bytes"] == dist["per_gpu"]["activations_bytes"]
    tp = {k: v for k, v in fsdp["communication_per_step"].items() if k.startswith("tp/")}
    assert tp == {k: v for k, v in dist["communication_per_step"].items() if k.startswith("tp/")}
    assert not any(k.startswith("dp/") for k in fsdp["communication_per_step"])
    # Adam moments: over the two DP ranks both hold one moment per element of the TP rank's 24,432.
    fsdp_moments = sum(fsdp_rank_memory(SPEC, TRAINING, dp=2, rank=r, shard=tp_slice(2)).states["optimizer/exp_avg"]
                       for r in range(2))
    dist_moments = sum(dit_rank_states(SPEC, Parallelism(tp=2, dp=2, distributed_optimizer=True), TRAINING,
                                       pp_rank=0, dp_rank=r)[0].components["optimizer/exp_avg"] for r in range(2))
    assert fsdp_moments == dist_moments == 4 * 24_432


def test_cp2_fsdp_versus_cp1():
    cp2 = dit_fsdp_layout_report(SPEC, Parallelism(cp=2, dp=2, fsdp=True), TRAINING)
    dp4 = dit_fsdp_layout_report(SPEC, Parallelism(dp=4, fsdp=True), TRAINING)
    # FSDP2 shards over DP x CP = 4 ranks either way: the same states and fsdp/ payloads; CP changes
    # the activations (half the clip, the flash convention) and adds the K/V ring, as without FSDP.
    for key in ("weights_bytes", "gradients_bytes", "optimizer_bytes"):
        assert cp2["per_gpu"][key] == dp4["per_gpu"][key]
    assert cp2["per_gpu"]["components"] == dp4["per_gpu"]["components"]
    ddp = dit_layout_report(SPEC, Parallelism(cp=2, dp=2, distributed_optimizer=True), TRAINING)
    assert cp2["per_gpu"]["activations_bytes"] == ddp["per_gpu"]["activations_bytes"] == 51_952
    assert cp2["communication_per_step"] == {**{k: v for k, v in dp4["communication_per_step"].items()
                                                if k != "total_bytes"},
                                             "cp/send_recv": ddp["communication_per_step"]["cp/send_recv"],
                                             "total_bytes": dp4["communication_per_step"]["total_bytes"] + 86_016}
    assert any(u.startswith("torch FSDP2 with TP 1 x CP 2") for u in cp2["unmeasured"])


def test_cli_reports_fsdp_beside_tp_sp_and_cp(capsys):
    from megatron_flops.cli import main

    for flags, label in ((["--tp", "2", "--sequence-parallel"], "torch FSDP2 with TP 2 x CP 1"),
                         (["--cp", "2"], "torch FSDP2 with TP 1 x CP 2")):
        assert main(["memory", "--model", str(EXAMPLES / "wan_tiny_dit.json"), "--seq-length", "16", "--dp", "2",
                     "--fsdp", *flags, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert "fsdp/all_gather" in report["communication_per_step"]
        assert any(u.startswith(label) for u in report["unmeasured"])
