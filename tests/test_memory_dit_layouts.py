"""A WAN-like DiT under megatron-core's DistributedDataParallel, with and without its distributed
optimizer (as Megatron-Bridge's WAN recipe trains it), in 2 gloo processes: the example's module
(``examples/wan_dit_fsdp2.py``) wrapped as Megatron-LM's ``get_model`` wraps a model
(``Float16Module`` for bf16, then DDP) with ``get_megatron_optimizer``; one step of two
micro-batches (``no_sync`` but for the last, then ``finalize_model_grads`` and the optimizer step).
Measured per rank (tests/mcore_memory): weights, gradient buffer, optimizer state and the payload of
every collective, against :mod:`megatron_flops.memory.dit_layouts` to the byte. Then the tensor,
pipeline and context parallel formulas (unmeasured: Bridge's WanModel needs Transformer Engine):
consistent with the measured data-parallel report."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path

import pytest

import mcore_cpu
import mcore_dist
from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec, dit_parameter_counts
from megatron_flops.memory.dit_activations import DiTBatch, dit_activations
from megatron_flops.memory.dit_layouts import (
    dit_layout_report,
    dit_rank_params,
    dit_rank_states,
    dit_step_communication,
)
from megatron_flops.memory.layout import Parallelism, Training

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORLD = 2
RAW = json.loads((EXAMPLES / "wan_tiny_dit.json").read_text())
I2V = {"image_dim": 20, "image_len": 5}
LORA = {"dim": 4, "target_modules": ["q", "k", "v", "o"]}

# name -> (dit overrides, lora section or None, params dtype, distributed optimizer, micro-batches,
# DDP options: grad_reduce_in_fp32, bucket_size)
RUNS = {
    "DDP, full training, bf16": ({}, None, "bf16", False, 2, (True, None)),
    "distributed optimizer, full training, image-to-video (widths not multiples of 64), bf16": (
        I2V, None, "bf16", True, 2, (True, None)),
    "distributed optimizer, LoRA rank 4 on q,k,v,o, frozen base, fp32": ({}, LORA, "fp32", True, 2, (True, None)),
    "distributed optimizer, bf16, gradients reduced in bf16 (Bridge's WAN recipe), buckets of 15,000": (
        {}, None, "bf16", True, 1, (False, 15_000)),
}


def _raw(name: str) -> dict:
    dit, lora, *_ = RUNS[name]
    raw = copy.deepcopy(RAW)
    raw["dit"].update(dit)
    raw.pop("lora")
    raw.pop("recompute_granularity")
    if lora is not None:
        raw["lora"] = lora
    return raw


def ddp_worker(rank: int, world_size: int, runs: dict) -> dict:
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    import mcore_memory

    sys.path.insert(0, str(EXAMPLES))
    import wan_dit_fsdp2 as example

    mcore_dist.init_worker()
    out = {}
    for name, (raw, dtype, distributed, num_mb, (fp32_grads, bucket)) in runs.items():
        spec = DiTSpec.from_mapping(raw["dit"])
        bf16 = dtype == "bf16"
        params_dtype = torch.bfloat16 if bf16 else torch.float32
        config = mcore_cpu.make_config(dict(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                                            num_attention_heads=spec.num_heads, ffn_hidden_size=spec.ffn_hidden_size,
                                            params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=bf16))
        model = example.build_model(raw)
        if bf16:
            model = Float16Module(config, model)
        ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=fp32_grads, use_distributed_optimizer=distributed, bucket_size=bucket,
            overlap_grad_reduce=bucket is not None))
        with mcore_memory.on_cpu():
            optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=1e-4, bf16=bf16, params_dtype=params_dtype, use_distributed_optimizer=distributed,
                clip_grad=1.0), [ddp])
        stream = example.microbatches(spec, example.Options(), rank)
        comm = mcore_memory.CommMeter(mcore_memory.megatron_groups())
        with comm:
            ddp.zero_grad_buffer()
            for m in range(num_mb):
                batch, t = next(stream)
                with ddp.no_sync() if m < num_mb - 1 else contextlib.nullcontext():
                    pred = ddp([c.latent for c in batch], t, [c.text for c in batch],
                               None if spec.image_dim is None else [c.image for c in batch])
                    torch.nn.functional.mse_loss(pred.float(), torch.cat([c.target for c in batch])).backward()
            finalize_model_grads([ddp])
            with mcore_memory.on_cpu():
                optimizer.step()
        inner = ddp.module.module if bf16 else ddp.module
        out[name] = dict(names=[(n, p.numel()) for n, p in inner.named_parameters()],
                         states=mcore_memory.state_bytes([ddp], optimizer), comm=dict(comm.bytes))
    return out


@pytest.fixture(scope="module")
def measured():
    if not mcore_cpu.HAVE_MCORE:
        pytest.skip(mcore_cpu.SKIP_REASON)
    runs = {name: (_raw(name), *RUNS[name][2:]) for name in RUNS}
    return mcore_dist.run_by_name(ddp_worker, WORLD, runs, timeout=600)


def _setup(name: str):
    raw = _raw(name)
    spec = DiTSpec.from_mapping(raw["dit"])
    lora = raw.get("lora")
    peft = DiTPeftSpec(frozen=True, lora_rank=lora["dim"], lora_targets=tuple(lora["target_modules"])) if lora else None
    _, _, dtype, distributed, num_mb, (fp32_grads, bucket) = RUNS[name]
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=num_mb, params_dtype=dtype,
                        grad_reduce_in_fp32=fp32_grads, bucket_size=bucket)
    return spec, peft, Parallelism(dp=WORLD, distributed_optimizer=distributed), training


@pytest.mark.dist
@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_in_module_order(measured, name):
    spec, peft, par, _ = _setup(name)
    want = [(p.name, p.numel) for p in dit_rank_params(spec, par, pp_rank=0, peft=peft)]
    assert [tuple(x) for x in measured[name][0]["names"]] == want


@pytest.mark.dist
@pytest.mark.parametrize("name", list(RUNS))
def test_states_and_communication_every_rank(measured, name):
    spec, peft, par, training = _setup(name)
    for rank, result in enumerate(measured[name]):
        states, buffers, params = dit_rank_states(spec, par, training, pp_rank=0, dp_rank=rank, peft=peft)
        assert states.components == result["states"], rank
        assert dit_step_communication(spec, par, training, pp_rank=0, buffers=buffers, params=params,
                                      peft=peft) == result["comm"], rank


def test_buckets_of_the_bridge_recipe_run():
    # Buckets close once they reach 15,000 elements (in reverse named_parameters() order), each padded
    # to a multiple of lcm(2, 128): 16,256 + 17,792 + 4,224 = 38,272 elements, 128 more than one bucket
    # (38,144); bf16 weights and, reduced in bf16, bf16 gradients: 2 B each.
    spec, peft, par, training = _setup("distributed optimizer, bf16, gradients reduced in bf16 (Bridge's WAN "
                                       "recipe), buckets of 15,000")
    states, buffers, _ = dit_rank_states(spec, par, training, pp_rank=0, peft=peft)
    assert [b.numel for b in buffers] == [16_256, 17_792, 4_224]
    assert states.components["weights"] == states.components["gradients"] == 2 * 38_272


SPEC = DiTSpec.from_mapping(RAW["dit"])  # h 32, f 64, 2 blocks, text_dim 24: 36,976 parameters
TRAINING = Training(seq_length=16, micro_batch_size=1, num_microbatches=4)


def test_ddp_and_distributed_optimizer_exact():
    n = dit_parameter_counts(SPEC).num_params
    assert n == 36_976
    ddp = dit_layout_report(SPEC, Parallelism(dp=2), TRAINING)
    # DDP: bf16 weights 2n, fp32 gradient buffer 4n, fp32 main copies and two Adam moments 3 x 4n;
    # once per step the fp32 buffer all-reduced: 4n.
    assert ddp["per_gpu"]["components"] == {"weights": 73_952, "gradients": 147_904, "optimizer/main_params": 147_904,
                                            "optimizer/exp_avg": 147_904, "optimizer/exp_avg_sq": 147_904,
                                            "activations": ddp["per_gpu"]["activations_bytes"]}
    assert ddp["communication_per_step"] == {"dp/all_reduce": 147_904, "total_bytes": 147_904}
    dist = dit_layout_report(SPEC, Parallelism(dp=2, distributed_optimizer=True), TRAINING)
    # Every parameter at a multiple of 64 elements: 35 of the 69 tensors (the 32-wide biases and norm
    # weights: 5 outside the blocks, 15 per block) have 32 mod 64 elements (+32 each), head.head.bias 16 (+48):
    # 36,976 + 1,120 + 48 = 38,144 = 298 x 128, a multiple of lcm(2, 128) already; each rank keeps main
    # copies and moments for the real elements of its half: rank 0's [0, 19,072) holds 18,416 (in reverse
    # named_parameters() order), rank 1's the other 36,976 - 18,416 = 18,560: the most loaded GPU is rank 1.
    assert dist["per_gpu"]["weights_bytes"] == 2 * 38_144
    assert dist["per_gpu"]["gradients_bytes"] == 4 * 38_144
    assert dist["per_gpu"]["components"]["optimizer/exp_avg"] == 4 * 18_560
    assert dit_rank_states(SPEC, Parallelism(dp=2, distributed_optimizer=True), TRAINING, pp_rank=0,
                           dp_rank=0)[0].components["optimizer/exp_avg"] == 4 * 18_416
    assert dist["communication_per_step"] == {"dp/reduce_scatter": 4 * 38_144, "dp/all_gather": 2 * 38_144,
                                              "total_bytes": 6 * 38_144}


def test_activations_per_rank_are_one_gpus():
    # No pipeline: one micro-batch at a time, each rank's activations those of one GPU (measured in
    # tests/test_memory_dit_activations.py).
    batch = DiTBatch.uniform(SPEC, video_tokens=16, num_clips=1)
    one = dit_activations(SPEC, batch, act_bytes=2).total
    for par in (Parallelism(dp=2), Parallelism(dp=4, distributed_optimizer=True)):
        assert dit_layout_report(SPEC, par, TRAINING)["per_gpu"]["activations_bytes"] == one


@pytest.mark.parametrize("distributed", [False, True])
def test_tp1_pp1_cp1_is_the_data_parallel_report(distributed):
    plain = dit_layout_report(SPEC, Parallelism(dp=4, distributed_optimizer=distributed), TRAINING)
    states, buffers, params = dit_rank_states(SPEC, Parallelism(dp=4, distributed_optimizer=distributed), TRAINING,
                                              pp_rank=0)
    # TP 1 x PP 1 x CP 1: the measured functions' figures, nothing labelled but the attention kernel.
    assert {k: v for k, v in plain["per_gpu"]["components"].items() if k != "activations"} == states.components
    comm = dit_step_communication(SPEC, Parallelism(dp=4, distributed_optimizer=distributed), TRAINING, pp_rank=0,
                                  buffers=buffers, params=params)
    assert plain["communication_per_step"] == {**comm, "total_bytes": sum(comm.values())}
    assert plain["not_modelled"] == [] and len(plain["unmeasured"]) == 1
    local = dit_layout_report(SPEC, Parallelism(dp=4, distributed_optimizer=distributed), TRAINING, attention="local")
    assert local["unmeasured"] == []
    # CP 2 x DP 2 shares one gradient buffer over 4 ranks: the states of DP 4.
    cp = dit_layout_report(SPEC, Parallelism(dp=2, cp=2, distributed_optimizer=distributed), TRAINING)
    for key in ("weights_bytes", "gradients_bytes", "optimizer_bytes"):
        assert cp["per_gpu"][key] == plain["per_gpu"][key]
    assert {k: v for k, v in cp["communication_per_step"].items() if k.startswith("dp/")} == \
        {k: v for k, v in plain["communication_per_step"].items() if k.startswith("dp/")}


def test_tensor_parallel_ranks_sum_to_the_model():
    whole = dit_parameter_counts(SPEC).num_params  # 36,976
    tp2 = dit_rank_params(SPEC, Parallelism(tp=2), pp_rank=0)
    row_biases = sum(p.numel for p in tp2 if p.name.endswith(("self_attn.o.bias", "cross_attn.o.bias", "ffn.2.bias")))
    replicated = sum(p.numel for p in tp2 if p.tp_replicated)
    split = sum(p.numel for p in tp2) - row_biases - replicated
    # Per block: q,k,v,o and the cross q,k,v,o weights 8 x 32 x 32, six column biases 6 x 32, the FFN
    # 2 x 32 x 64 and ffn.0's bias 64: 12,544, half on each TP rank; whole on each: the row biases
    # (3 x 32 per block, all-reduced only under sequence parallelism) and the rest (11,696: embeddings,
    # head, norms, adaLN tables), whose gradients are all-reduced over TP once per step.
    assert (split, row_biases, replicated) == (2 * 12_544 // 2, 2 * 3 * 32, 11_696)
    assert 2 * split + row_biases + replicated == whole
    comm = dit_layout_report(SPEC, Parallelism(tp=2), TRAINING)["communication_per_step"]
    # tp/all_reduce: 11,696 fp32 gradients once (46,784 B); per block and micro-batch the o, cross o
    # and ffn.2 outputs [16, 32] (forward) and the q/k/v, cross q and ffn.0 input gradients [16, 32]
    # and the cross k/v input gradient [12, 32] (backward): (3 x 16 + 3 x 16 + 12) x 32 x 2 B = 6,912 B,
    # x 2 blocks x 4 micro-batches. tp/all_gather: q, k, cross q [16, 32] and cross k [12, 32] for the
    # norms across heads, forward and backward: 2 x (3 x 16 + 12) x 32 x 2 B x 2 x 4.
    assert comm["tp/all_reduce"] == 46_784 + 6_912 * 2 * 4
    assert comm["tp/all_gather"] == 2 * (3 * 16 + 12) * 32 * 2 * 2 * 4


def test_tensor_parallel_activations_split_what_the_heads_and_ffn_hold():
    # TP 2, bf16, flash, 16 video and 12 text tokens, h 32, f 64, 4 heads: per block the norms' fp32
    # copies over the gathered q and k stay whole; the split q, k, v and attention output [16, 16]
    # (4 x 512 B) and half the log-sum-exp (2 heads x 16 x 4 B) leave self-attention (-2,176 B); the
    # cross q and output [16, 16], k and v [12, 16] and half its log-sum-exp leave cross-attention
    # (-1,920 B); half of ffn.0's output and of GELU's [16, 64] leave the FFN (-2,048 B). Embeddings,
    # head and loss are whole on every TP rank.
    batch = DiTBatch.uniform(SPEC, video_tokens=16, num_clips=1)
    one, tp2 = (dit_activations(SPEC, batch, act_bytes=2, tp=tp) for tp in (1, 2))
    assert {k: one.block[k] - tp2.block[k] for k in one.block} == {"adaln": 0, "norm": 0, "self_attn": 2_176,
                                                                   "cross_attn": 1_920, "ffn": 2_048}
    assert one.total - tp2.total == 2 * (2_176 + 1_920 + 2_048)
    assert dit_layout_report(SPEC, Parallelism(tp=2), TRAINING)["per_gpu"]["activations_bytes"] == tp2.total


def test_tensor_parallel_lora_collectives():
    # TP 2, LoRA rank 4 on q,k,v,o (self and cross), frozen base, bf16, one micro-batch of 16 video and
    # 12 text tokens, h 32. No whole weight trains: no per-step all-reduce. Per block:
    # - base: o, cross o, ffn.2 outputs forward and q/k/v, cross q, ffn.0 input gradients backward, [16, 32]
    #   each (the cross k/v input, the frozen text embedding's output, needs none): 6 x 512 elements;
    # - column-parallel adapters (self q,k,v and cross q over 16 tokens, cross k,v over 12: 88 rows):
    #   linear_in's output gathered [88, 4], linear_out's and linear_in's input gradients all-reduced [88, 4 + 32];
    # - row-parallel adapters (o, cross o: 32 rows): linear_in's output all-reduced [32, 4] and linear_out's
    #   gathered [32, 32] forward, linear_out's input gradient all-reduced [32, 4] backward;
    # - q, k, cross q [16, 32] and cross k [12, 32] gathered for the norms, forward and backward.
    # The first block's q/k/v input needs no gradient: one [16, 32] all-reduce less.
    peft = DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=("q", "k", "v", "o"))
    training = Training(seq_length=16, micro_batch_size=1)
    comm = dit_layout_report(SPEC, Parallelism(tp=2), training, peft=peft)["communication_per_step"]
    per_block_reduce = 6 * 512 + 88 * 36 + 2 * 32 * 4
    per_block_gather = 88 * 4 + 32 * 32 + 2 * (3 * 16 + 12) * 32
    assert comm == {"tp/all_reduce": (2 * per_block_reduce - 512) * 2, "tp/all_gather": 2 * per_block_gather * 2,
                    "total_bytes": 24_960 + 20_864}
    assert comm["tp/all_reduce"] == 24_960


def test_pipeline_stages_sum_to_the_model():
    whole = dit_parameter_counts(SPEC).num_params
    stages = [dit_rank_params(SPEC, Parallelism(pp=2), pp_rank=r) for r in range(2)]
    everywhere = sum(p.numel for p in stages[0] if p.name.startswith(("text_embedding", "time_")))
    # The text and time embeddings on both stages; everything else on one.
    assert sum(p.numel for s in stages for p in s) == whole + everywhere
    report = dit_layout_report(SPEC, Parallelism(pp=2), TRAINING)
    assert [s["forward_passes_in_flight"] for s in report["per_stage"]] == [2, 1]
    # pp/send_recv per micro-batch: [16, 32] bf16 (1,024 B) in and its gradient out on stage 1, out and in on
    # stage 0: 4 micro-batches x 2,048 B.
    assert report["communication_per_step"]["pp/send_recv"] == 4 * 2 * 16 * 32 * 2


def test_context_parallel_activations_are_a_shorter_clip():
    # CP 2: each rank runs 8 of the 16 video tokens and 6 of the 12 text tokens (Bridge splits the
    # context embeddings over CP too) through the flash convention.
    report = dit_layout_report(SPEC, Parallelism(cp=2), TRAINING, attention="local")
    half = dit_activations(SPEC, DiTBatch(video=(8,), text=(6,)), act_bytes=2, attention="flash")
    assert report["per_gpu"]["activations_bytes"] == half.total
    # The ring: per block and micro-batch, (CP - 1) x 2 (sent, received) x 3 (K, V forward; K, V and
    # their gradients backward), K and V of self-attention [8, 32] and cross-attention [6, 32] bf16:
    # 2 x (8 + 6) x 32 x 2 B = 1,792 B; 2 blocks x 4 micro-batches.
    assert report["communication_per_step"]["cp/send_recv"] == 2 * 4 * 1 * 2 * 3 * 1_792
    assert any("context parallelism (CP 2)" in u for u in report["unmeasured"])


def test_cli_reports_the_ddp_layout(capsys):
    from megatron_flops.cli import main

    assert main(["memory", "--model", str(EXAMPLES / "wan21_14b_dit.json"), "--seq-length", "1024", "--dp", "8",
                 "--distributed-optimizer", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "distributed optimizer" in report["assumptions"]
    # bf16 weights, fp32 gradients: the reduce-scatter moves twice the all-gather's bytes.
    assert report["communication_per_step"]["dp/reduce_scatter"] == 2 * report["communication_per_step"]["dp/all_gather"]


SP = Parallelism(tp=2, sequence_parallel=True)


def test_sequence_parallel_activations_split_the_residual_stream():
    # TP 2 + sequence parallelism, bf16, flash, 16 video and 12 text tokens, h 32, 4 heads. Against the TP 2
    # walk: the adaLN and LayerNorm storages (residual stream, 8 of the 16 tokens per rank) halve; the
    # column-parallel layers' inputs (q/k/v's, the cross q's, ffn.0's [16, 32] bf16, 1,024 B) are saved
    # unsplit as [8, 32] (-512 B each); the cross-attention's k/v layer gathers the text [12, 32] from both
    # ranks: 24 rows of the k norm's fp32 copy and normalised product [24, 32] x 4 B x 2, its rstd 24 x 4 B,
    # the normalised k and v [24, 16] bf16 (12 rows more than TP 2's: +12 x (256 + 4 + 64) = +3,888 B).
    batch = DiTBatch.uniform(SPEC, video_tokens=16, num_clips=1)
    tp2, sp = (dit_activations(SPEC, batch, act_bytes=2, tp=2, sequence_parallel=s) for s in (False, True))
    assert sp.block == {"adaln": tp2.block["adaln"] // 2, "norm": tp2.block["norm"] // 2,
                        "self_attn": tp2.block["self_attn"] - 512, "cross_attn": tp2.block["cross_attn"] - 512 + 3_888,
                        "ffn": tp2.block["ffn"] - 512}
    # Outside the blocks the head runs on 8 tokens (its LayerNorm input, statistics, 1 + scale, normalised x
    # and Linear input halve: 4 x 8 x 32 x 2 B + 2 x 8 x 4 B + 8 x 8 B = 2,176 B less); the loss is whole.
    assert {k: tp2.outside[k] - sp.outside[k] for k in sp.outside} == {
        "patch_embed": 0, "time_embed": 0, "text_embed": 0, "image_embed": 0, "head": 2_176, "loss": 0}
    assert dit_layout_report(SPEC, SP, TRAINING)["per_gpu"]["activations_bytes"] == sp.total


def test_sequence_parallel_collectives_replace_the_all_reduces():
    # TP 2, 16 video and 12 text tokens, h 32, bf16, 2 blocks, 4 micro-batches; elements per block and
    # micro-batch. Without SP: all-reduce of o, cross o, ffn.2 outputs [16, 32] (1,536, forward) and of q/k/v,
    # cross q, ffn.0 [16, 32] and cross k/v [12, 32] input gradients (1,920, backward).
    # With SP: reduce-scatter of the same row-parallel outputs (1,536, forward) and of the column-parallel
    # input gradients, the text gathered from both ranks [24, 32] (2,304 = 1,920 + 12 x 32, backward);
    # all-gather of the column-parallel inputs (q/k/v, cross q, ffn.0 [16, 32], cross k/v [24, 32]: 2,304) and
    # of q, k, cross q [16, 32] and cross k [24, 32] for the norms across heads (2,304) forward; backward the
    # inputs again, the row-parallel outputs' gradients (1,536) and the norms' (2,304).
    # Outside: the patch embedding's gradient [16, 32] gathered (first stage), the head's output [16, 16]
    # gathered and its gradient reduce-scattered (last stage).
    tp2 = dit_layout_report(SPEC, Parallelism(tp=2), TRAINING)["communication_per_step"]
    sp = dit_layout_report(SPEC, SP, TRAINING)["communication_per_step"]
    per_mb = 2 * 2  # 2 blocks, 2 B
    assert tp2["tp/all_reduce"] - 46_784 == 4 * per_mb * (1_536 + 1_920)
    assert sp["tp/reduce_scatter"] == 4 * (per_mb * (1_536 + 2_304) + 256 * 2)
    assert sp["tp/reduce_scatter"] == tp2["tp/all_reduce"] - 46_784 + 4 * (per_mb * 12 * 32 + 256 * 2)
    assert sp["tp/all_gather"] == 4 * (per_mb * (2 * 2_304 + 2_304 + 1_536 + 2_304) + (512 + 256) * 2)
    # Once per step: 11,696 whole weights' gradients and, marked sequence_parallel, the row-parallel biases
    # (3 x 32 per block), fp32.
    assert sp["tp/all_reduce"] == (11_696 + 2 * 3 * 32) * 4
    # Full recompute runs each block's forward collectives again.
    rerun = dit_layout_report(SPEC, SP, TRAINING, checkpointed_blocks=2)["communication_per_step"]
    assert rerun["tp/reduce_scatter"] - sp["tp/reduce_scatter"] == 4 * per_mb * 1_536
    assert rerun["tp/all_gather"] - sp["tp/all_gather"] == 4 * per_mb * 2 * 2_304


def test_sequence_parallel_pipeline_and_context_parallel():
    # PP 2: the hidden states sent between stages are this rank's [8, 32] bf16: half of TP 2's.
    pp = {s: dit_layout_report(SPEC, Parallelism(tp=2, pp=2, sequence_parallel=s), TRAINING) for s in (False, True)}
    assert pp[True]["communication_per_step"]["pp/send_recv"] * 2 == pp[False]["communication_per_step"]["pp/send_recv"]
    # CP 2: 8 video, 6 text tokens per rank. K and V round the ring: self-attention's [8, 16] each as under
    # TP 2, the cross-attention's [2 x 6, 16] (the gathered text): 2 x (8 x 16 + 12 x 16) x 2 B = 1,280 B per
    # block and micro-batch, x (CP - 1) x 2 (sent, received) x 3 (forward; backward K, V and gradients).
    cp = dit_layout_report(SPEC, Parallelism(tp=2, cp=2, sequence_parallel=True), TRAINING)
    assert cp["communication_per_step"]["cp/send_recv"] == 4 * 2 * 1 * 2 * 3 * 1_280


def test_refusals():
    from megatron_flops.memory.dit_layouts import dit_layout_reason

    peft = DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=("q",))
    assert dit_layout_reason(SPEC, SP, TRAINING, peft) is None  # (tests/test_memory_dit_lora_sp.py)
    # Bridge's own limitation: its provider cannot build interleaved WAN stages.
    vpp = dit_layout_reason(SPEC, Parallelism(pp=2, vpp=2), TRAINING, None)
    assert vpp is not None and "Megatron-Bridge 0.6.2 cannot interleave WAN itself" in vpp
    odd = Training(seq_length=18, micro_batch_size=1)
    assert "not divisible by CP x TP = 4" in dit_layout_reason(SPEC, Parallelism(tp=2, cp=2, sequence_parallel=True),
                                                                 odd, None)


def test_cli_reports_the_wan_14b_recipe_layout(capsys):
    # Megatron-Bridge 0.6.2's WAN 14B recipe: TP 2 + SP, CP 4, full uniform recompute, distributed optimizer.
    from megatron_flops.cli import main

    assert main(["memory", "--model", str(EXAMPLES / "wan21_14b_dit.json"), "--seq-length", "32768", "--tp", "2",
                 "--sequence-parallel", "--cp", "4", "--recompute", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1", "--distributed-optimizer", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["not_modelled"] == [] and isinstance(report["per_gpu"]["activations_bytes"], int)
    assert any(u.startswith("sequence parallelism (TP 2)") for u in report["unmeasured"])
    comm = report["communication_per_step"]
    assert {"tp/all_gather", "tp/reduce_scatter", "tp/all_reduce", "cp/send_recv"} <= set(comm)
