"""The memory and communication formulas by hand (stdlib only): buffer padding, optimizer shards,
schedules' in-flight counts, one-term deltas, FSDP2 shards, bad input, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flops.cli import main
from megatron_flops.flops.dit import DiTParam, DiTPeftSpec, DiTSpec
from megatron_flops.memory.activations import ChunkActivations, chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.comm import step_communication
from megatron_flops.memory.decoder import DecoderOptions, Param, chunk_parameters, parameter_counts
from megatron_flops.memory.fsdp import fsdp_rank_memory, real_rows, shard_rows
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory, rank_memory
from megatron_flops.memory.states import buffer_buckets, chunk_buffers, chunk_state_bytes, shard_numel
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.model.spec import ModelSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY_DIT = str(EXAMPLES / "wan_tiny_dit.json")
LLAMA = str(EXAMPLES / "llama3_8b.json")
TINY = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                   vocab_size=256))
PLAIN = DecoderOptions(add_bias_linear=False, position_embedding_type="rope", hidden_dropout=0.0,
                       attention_dropout=0.0, attention_backend="unfused")


# ---- buffers and optimizer shards ------------------------------------------------------------


def test_distributed_optimizer_buffer_padding_by_hand():
    params = [Param("a", 100), Param("b", 30), Param("c", 64)]
    # Reversed order: c at [0, 64), b at [64, 94); a starts at the next multiple of 64: [128, 228);
    # the bucket is padded to lcm(DP=2, 128) = 128: 256 elements.
    (bucket,) = buffer_buckets(params, dp=2, distributed_optimizer=True, bucket_size=None)
    assert (bucket.start, bucket.end) == (0, 256)
    assert [(p.name, s, e) for p, s, e in bucket.params] == [("c", 0, 64), ("b", 64, 94), ("a", 128, 228)]
    # DDP: no padding at all.
    (ddp,) = buffer_buckets(params, dp=2, distributed_optimizer=False, bucket_size=None)
    assert ddp.numel == 194
    # Shards of 128: rank 0 holds c and b (94 real elements), rank 1 holds a (100).
    assert [shard_numel(bucket, 2, r) for r in (0, 1)] == [94, 100]


def test_buckets_and_the_shared_embedding():
    params = [Param("embedding", 300, shared_embedding=True), Param("x", 10), Param("y", 10)]
    # bucket_size 15: y + x close a bucket at 20 (padded to 128); the tied embedding gets its own.
    buckets = buffer_buckets(params, dp=4, distributed_optimizer=True, bucket_size=15)
    assert [(b.start, b.end) for b in buckets] == [(0, 128), (128, 512)]
    # Without the distributed optimizer the embedding is no special case.
    assert [b.numel for b in buffer_buckets(params, dp=4, distributed_optimizer=False, bucket_size=15)] == [20, 300]


def test_state_bytes_adam_sgd_fp32():
    params = [Param("w", 1000), Param("frozen", 500, trainable=False)]
    training = Training(seq_length=8, micro_batch_size=1, params_dtype="bf16")
    buffers = chunk_buffers(params, dp=1, expert_dp=1, distributed_optimizer=False, bucket_size=None)
    states = chunk_state_bytes(params, buffers, training, sizes={"dp": 1, "expt_dp": 1}, ranks={"dp": 0, "expt_dp": 0},
                               distributed_optimizer=False).components
    # bf16 weights (1500 x 2), fp32 gradients and main copies and Adam moments of the 1000 trained.
    assert states == {"weights": 3000, "gradients": 4000, "optimizer/main_params": 4000,
                      "optimizer/exp_avg": 4000, "optimizer/exp_avg_sq": 4000}
    sgd = chunk_state_bytes(params, buffers, dataclasses.replace(training, optimizer="sgd", params_dtype="fp32"),
                            sizes={"dp": 1, "expt_dp": 1}, ranks={"dp": 0, "expt_dp": 0},
                            distributed_optimizer=False).components
    # fp32: no main copy; SGD keeps one momentum buffer.
    assert sgd == {"weights": 6000, "gradients": 4000, "optimizer/momentum_buffer": 4000}


# ---- parameters ------------------------------------------------------------------------------


def test_parameter_counts_by_hand():
    # Embedding 256 x 64 (tied); per layer: 2 LayerNorms (2 x 128), qkv 192 x 64, proj 64 x 64,
    # fc1 128 x 64, fc2 64 x 128; final LayerNorm 128.
    layer = 2 * 128 + 192 * 64 + 64 * 64 + 2 * 128 * 64
    assert parameter_counts(TINY, PLAIN, seq_length=8) == {"total": 256 * 64 + 2 * layer + 128,
                                                           "trainable": 256 * 64 + 2 * layer + 128}
    lora = PeftSpec(frozen=True, lora_rank=2, lora_targets=("linear_qkv",))
    # One adapter per layer: A [2, 64] + B [192, 2].
    counts = parameter_counts(TINY, PLAIN, seq_length=8, peft=lora)
    assert counts["trainable"] == 2 * (2 * 64 + 192 * 2)


def test_pipeline_split_and_tied_embedding():
    par = Parallelism(pp=2, dp=1)
    first = chunk_parameters(TINY, PLAIN, par, pp_rank=0, chunk=0, seq_length=8)
    last = chunk_parameters(TINY, PLAIN, par, pp_rank=1, chunk=0, seq_length=8)
    assert first[0] == Param("embedding.word_embeddings.weight", 256 * 64, shared_embedding=True)
    assert last[-1] == Param("output_layer.weight", 256 * 64, shared_embedding=True)
    assert [p.name for p in first[1:3]] == ["decoder.layers.0.input_layernorm.weight",
                                            "decoder.layers.0.input_layernorm.bias"]


# ---- schedules -------------------------------------------------------------------------------


def _peak_count(par: Parallelism, m: int, rank: int) -> int:
    unit = [ChunkActivations(components={"x": 1}) for _ in range(par.num_chunks)]
    return schedule_peak(unit, in_flight(par, m, rank))[0]


def test_in_flight_1f1b_and_interleaved():
    pp4 = Parallelism(pp=4)
    # 1F1B: min(M, PP - rank) micro-batches in flight.
    assert [_peak_count(pp4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [_peak_count(pp4, 2, r) for r in range(4)] == [2, 2, 2, 1]
    assert _peak_count(Parallelism(), 8, 0) == 1
    # Interleaved (PP 2 x VPP 2, M = 4): warm-up (PP - rank - 1) x 2 + (VPP - 1) x PP chunks,
    # then one more forward before the first backward: 5 on rank 0, 3 on rank 1.
    vpp = Parallelism(pp=2, vpp=2)
    assert [_peak_count(vpp, 4, r) for r in range(2)] == [5, 3]
    # Everything in warm-up when M x VPP is small: all 4 chunk passes of M = 2.
    assert _peak_count(vpp, 2, 0) == 4


def test_backward_recompute_peak():
    # One micro-batch holds 10; re-running a region holds 7 + 9: the peak is 16.
    act = ChunkActivations(components={"x": 10}, backward_peak=16)
    assert schedule_peak([act], in_flight(Parallelism(), 2, 0)) == (16, 1)


# ---- communication ---------------------------------------------------------------------------


def test_tensor_parallel_all_reduce_by_hand():
    par = Parallelism(tp=2, dp=1)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=3, params_dtype="bf16")
    comm = step_communication(TINY, PLAIN, par, training, pp_rank=0, buffers={})
    # Per micro-batch: [s, b, h] bf16 = 16 x 2 x 64 x 2 = 4096 B, 4 per layer x 2 layers +
    # embedding + output layer; cross-entropy 3 x 32 tokens x 4 B.
    assert comm == {"tp/all_reduce": 3 * (10 * 4096 + 3 * 32 * 4)}


def test_one_term_deltas():
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=4, params_dtype="bf16")
    ddp = rank_memory(TINY, PLAIN, Parallelism(dp=4), training, pp_rank=0)
    dist = rank_memory(TINY, PLAIN, Parallelism(dp=4, distributed_optimizer=True), training, pp_rank=0)
    # 82,560 parameters (see test_parameter_counts_by_hand), every one a multiple of 64 elements
    # and the sum a multiple of lcm(4, 128): the distributed optimizer pads nothing here and
    # shards the fp32 state in 4 (20,640 elements per rank).
    assert ddp.states["gradients"] == dist.states["gradients"] == 82560 * 4
    assert (ddp.states["optimizer/exp_avg"], dist.states["optimizer/exp_avg"]) == (82560 * 4, 20640 * 4)
    assert ddp.communication == {"dp/all_reduce": ddp.states["gradients"]}
    assert dist.communication == {"dp/reduce_scatter": dist.states["gradients"], "dp/all_gather": dist.states["weights"]}
    assert dist.activations == ddp.activations
    # Doubling the micro-batches doubles the pipeline traffic, not the 1F1B peak on the last stage.
    pp = Parallelism(pp=2)
    one = rank_memory(TINY, PLAIN, pp, training, pp_rank=1)
    two = rank_memory(TINY, PLAIN, pp, dataclasses.replace(training, num_microbatches=8), pp_rank=1)
    assert two.communication["pp/send_recv"] == 2 * one.communication["pp/send_recv"]
    assert two.activations == one.activations


def test_sequence_parallel_collectives_by_hand():
    par = Parallelism(tp=2, dp=1, sequence_parallel=True)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=3, params_dtype="bf16")
    comm = step_communication(TINY, PLAIN, par, training, pp_rank=0, buffers={})
    # Per micro-batch, [s, b, h] bf16 = 4096 B. All-gathers: per layer linear_qkv and linear_fc1
    # inputs twice (forward, weight gradient) and linear_proj/linear_fc2 output gradients (6 x 2
    # layers), the output layer's input twice, the embedding gradient: 15. Reduce-scatters: per
    # layer linear_proj/linear_fc2 outputs and linear_qkv/linear_fc1 input gradients (4 x 2), the
    # output layer's input gradient, the RoPE model's embedding output: 10. Cross-entropy's
    # three fp32 reductions stay all-reduces.
    assert comm == {"tp/all_gather": 3 * 15 * 4096, "tp/reduce_scatter": 3 * 10 * 4096,
                    "tp/all_reduce": 3 * 3 * 32 * 4}


def test_sequence_parallel_splits_what_lies_between_layers():
    training = Training(seq_length=16, micro_batch_size=2, params_dtype="fp32")
    plain = rank_memory(TINY, PLAIN, Parallelism(tp=2), training, pp_rank=0)
    sp = rank_memory(TINY, PLAIN, Parallelism(tp=2, sequence_parallel=True), training, pp_rank=0)
    (before,), (after,) = plain.activations_per_microbatch, sp.activations_per_microbatch
    tokens, h = 32, 64
    # 5 RMS-free LayerNorms (2 per layer + final): input [T, h] and mean/rstd fp32, halved.
    assert before["norm"] - after["norm"] == 4 * tokens // 2 * (h * 4 + 8)
    assert before["output"] - after["output"] == tokens // 2 * (h * 4 + 8) + tokens // 2 * h * 4
    # linear_qkv and linear_fc1 inputs, halved, per layer.
    assert before["attention"] - after["attention"] == 2 * tokens // 2 * h * 4
    assert before["mlp"] - after["mlp"] == 2 * tokens // 2 * h * 4
    assert sp.states == plain.states
    # The TP group all-reduces the replicated weights' fp32 gradients once: 5 norms x (weight, bias).
    buffers = {"dp": chunk_buffers(chunk_parameters(TINY, PLAIN, Parallelism(tp=2), pp_rank=0, chunk=0, seq_length=16),
                                   dp=1, expert_dp=1, distributed_optimizer=False, bucket_size=None)["dp"]}
    comm = step_communication(TINY, PLAIN, Parallelism(tp=2, sequence_parallel=True), training, pp_rank=0,
                              buffers=buffers)
    assert comm["tp/all_reduce"] == 5 * 2 * 64 * 4 + 3 * tokens * 4
    with pytest.raises(ValueError, match="--seq-length 6 is not divisible by --tp 4"):
        decoder_memory(TINY, PLAIN, Parallelism(tp=4, sequence_parallel=True), Training(seq_length=6, micro_batch_size=1))
    # With one TP rank there is nothing to split.
    assert rank_memory(TINY, PLAIN, Parallelism(sequence_parallel=True), training, pp_rank=0) == \
        rank_memory(TINY, PLAIN, Parallelism(), training, pp_rank=0)


def test_context_parallel_formula_is_consistent():
    training = Training(seq_length=32, micro_batch_size=2, num_microbatches=2)
    flash = dataclasses.replace(PLAIN, attention_backend="flash")
    # CP 1 is the report without context parallelism.
    assert decoder_memory(TINY, PLAIN, Parallelism(cp=1, dp=2), training) == \
        decoder_memory(TINY, PLAIN, Parallelism(dp=2), training)
    # CP 2: each rank runs s/2 tokens through a fused attention, and its gradients are reduced
    # over DP x CP = 4 ranks, as DP 4 without context parallelism would.
    cp = rank_memory(TINY, PLAIN, Parallelism(cp=2, dp=2), training, pp_rank=0)
    half = rank_memory(TINY, flash, Parallelism(dp=4), dataclasses.replace(training, seq_length=16), pp_rank=0)
    assert (cp.states, cp.activations) == (half.states, half.activations)
    # The K/V ring: 2 layers x 2 micro-batches x (CP-1) steps x (K, V forward; K, V and their
    # gradients backward), each [16 x 2 tokens, 4 groups x 16] bf16 = 2048 B, sent and received.
    kv = 2 * 32 * 4 * 16 * 2
    assert cp.communication["cp/send_recv"] == 2 * 2 * 1 * 2 * 3 * kv
    report = decoder_memory(TINY, PLAIN, Parallelism(cp=2, dp=2), training)
    assert any("context parallelism (CP 2)" in u for u in report.unmeasured)
    # A re-run forward passes K and V round the ring again: full recompute of the 2 layers, or the
    # selective core_attn checkpoint of both, adds 2 layers x 2 micro-batches x 1 step x 2 x kv.
    for recompute in (RecomputeSpec(granularity="full", method="uniform", num_layers=1),
                      RecomputeSpec(granularity="selective", modules=("core_attn",))):
        rerun = rank_memory(TINY, PLAIN, Parallelism(cp=2, dp=2), training, pp_rank=0, recompute=recompute)
        assert rerun.communication["cp/send_recv"] - cp.communication["cp/send_recv"] == 2 * 2 * 1 * 2 * kv
    mlp_only = RecomputeSpec(granularity="selective", modules=("mlp",))
    assert rank_memory(TINY, PLAIN, Parallelism(cp=2, dp=2), training, pp_rank=0, recompute=mlp_only
                       ).communication["cp/send_recv"] == cp.communication["cp/send_recv"]


def test_expert_all_to_all_range_by_hand():
    from megatron_flops.memory.moe import all_to_all_range, moe_communication

    moe = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                      vocab_size=256, num_moe_experts=4, moe_router_topk=2))
    options = dataclasses.replace(PLAIN, moe_token_dispatcher_type="alltoall")
    training = Training(seq_length=16, micro_batch_size=2, params_dtype="bf16")
    lo, hi = all_to_all_range(moe, options, Parallelism(ep=2, dp=2), training, moe_layers=2)
    # Own routed tokens 32 x 2 = 64: sent forward and their gradients back, [64, 64] bf16, plus
    # the probabilities [64] bf16 once; received tokens from 0 up to EP x 32 x min(2, 2) = 128.
    own, most = 64, 128
    assert lo == 2 * (2 * own * 64 * 2 + own * 2)
    assert hi == lo + 2 * (2 * most * 64 * 2 + most * 2)
    balanced = moe_communication(moe, options, Parallelism(ep=2, dp=2), training, moe_layers=2, rerun=0)
    assert lo < balanced["ep/all_to_all"] == lo + 2 * (2 * own * 64 * 2 + own * 2) < hi
    report = decoder_memory(moe, options, Parallelism(ep=2, dp=2), training)
    assert report.stages[0].communication_ranges == {"ep/all_to_all": (lo, hi)}
    assert any("balanced routing" in a for a in report.assumptions)
    # The allgather dispatcher has no all-to-all; full recompute (uniform) runs each MoE layer's
    # forward again: its own tokens and probabilities out, received tokens back, once more.
    allgather = dataclasses.replace(options, moe_token_dispatcher_type="allgather")
    assert all_to_all_range(moe, allgather, Parallelism(ep=2, dp=2), training, moe_layers=2) is None
    lo2, hi2 = all_to_all_range(moe, options, Parallelism(ep=2, dp=2), training, moe_layers=2, rerun=2)
    assert lo2 == lo + 2 * (own * 64 * 2 + own * 2)
    assert hi2 == hi + 2 * (own * 64 * 2 + own * 2) + 2 * most * 64 * 2


def test_moe_tensor_and_expert_parallel_traffic_by_hand():
    # TP 2 x EP 2 with sequence parallelism (megatron-core needs it), expert TP = TP 2.
    moe = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                      vocab_size=256, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32))
    options = dataclasses.replace(PLAIN, moe_token_dispatcher_type="alltoall")
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=1, params_dtype="bf16")
    par = Parallelism(tp=2, ep=2, dp=2, sequence_parallel=True)
    comm = step_communication(moe, options, par, training, pp_rank=0, buffers={})
    hidden = 32 * 64 * 2  # one [s, b, h] bf16 activation
    # Attention per layer: 3 all-gathers and 2 reduce-scatters of [s, b, h] (x 2 layers), the
    # output layer's input twice and the embedding gradient (3), its output and the output
    # layer's input gradient (2). Each MoE layer's dispatcher: the routed tokens 32 x 2 with
    # their probabilities all-gathered (forward) and reduce-scattered (backward), the experts'
    # output reduce-scattered (forward) and all-gathered (backward): 64 x (2 x 64 + 1) bf16.
    routed = 64 * (2 * 64 + 1) * 2
    assert comm["tp/all_gather"] == (3 * 2 + 3) * hidden + 2 * routed
    assert comm["tp/reduce_scatter"] == (2 * 2 + 2) * hidden + 2 * routed
    # Each TP rank routes its 16 x 2 / 2 = 16 tokens: the all-to-all of 32 routed tokens (bf16)
    # and probabilities, to the experts and back, forward and backward; token counts int64 [4]
    # gathered over TP x EP = 4 ranks.
    assert comm["ep/all_to_all"] == 2 * (4 * 32 * 64 * 2 + 2 * 32 * 2)
    assert comm["tp_ep/all_gather"] == 2 * 4 * 4 * 8
    report = decoder_memory(moe, options, par, training)
    assert report.not_modelled == () and not any("MoE" in u for u in report.unmeasured)
    # What one rank gathers over TP follows the routing: from no token to every token of the
    # TP x EP ranks picking one of its 2 experts, 2 x 32 x min(2, 2) = 128 (balanced: 64), each
    # (2 x 64 + 1) x 2 B both ways, in each of the 2 layers.
    per_token = (2 * 64 + 1) * 2
    for key in ("tp/all_gather", "tp/reduce_scatter"):
        assert report.stages[0].communication_ranges[key] == (comm[key] - 2 * 64 * per_token,
                                                              comm[key] + 2 * (128 - 64) * per_token)
    # Activations of a MoE layer (measured on TP2 x EP2 + SP in tests/test_memory_dist.py), per TP rank routing its
    # T_l = 16 tokens: the router's input [16, 64] bf16, top-2 indices int64 and fp32 scores
    # [16 x 2]; the routing map (bool) and probabilities (bf16) [4, 16], sorted indices int64
    # [32]; the experts take 32 x 2 = 64 tokens (balanced, after the TP all-gather): [64, 64]
    # bf16, probabilities [64], and per token 3 x ffn/TP = 3 x 16 GELU-MLP values.
    act = chunk_activations(moe, options, par, training, pp_rank=0, chunk=0).components
    assert act["moe/router"] == 2 * (16 * 64 * 2 + 32 * 8 + 32 * 4)
    assert act["moe/dispatcher"] == 2 * (4 * 16 * (1 + 2) + 32 * 8)
    assert act["moe/experts"] == 2 * (64 * 64 * 2 + 64 * 2 + 64 * 16 * 2 * 3)
    with pytest.raises(ValueError, match="--sequence-parallel"):
        decoder_memory(moe, options, Parallelism(tp=2, ep=2, dp=2), training)


def test_moe_allgather_dispatcher_traffic_as_measured():
    # The allgather dispatcher under TP 2 + SP, EP 1 (tests/test_memory_dist.py measures this
    # layout on gloo): 2 layers, MoE every other one, h 48, 4 experts top-2, fp32, s 16 x b 2,
    # 2 micro-batches. Over the expert TP x EP group (2 ranks) it all-gathers G = T x EP = 32 rows
    # of tokens [32, 48], probabilities [32, 4] and the bool routing map [32, 4] forward and the
    # output's gradient [32, 48] backward; reduce-scatters the output [32, 48] forward and the
    # tokens' and probabilities' gradients backward.
    spec = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72,
                                       vocab_size=96, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=56,
                                       moe_layer_freq=[0, 1]))
    options = dataclasses.replace(PLAIN, moe_token_dispatcher_type="allgather", padded_vocab_size=96)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2, params_dtype="fp32")
    par = Parallelism(tp=2, dp=2, sequence_parallel=True)
    comm = step_communication(spec, options, par, training, pp_rank=0, buffers={})
    assert comm["tp_ep/all_gather"] == 2 * 32 * (48 * 4 + 4 * 4 + 4 + 48 * 4) == 25_856  # measured
    assert comm["tp_ep/reduce_scatter"] == 2 * 32 * (48 * 4 + 48 * 4 + 4 * 4) == 25_600  # measured
    # The MoE layer has no dense MLP: [s, b, h] all-gathers 15 - 3 and reduce-scatters 10 - 2.
    hidden = 32 * 48 * 4
    assert (comm["tp/all_gather"], comm["tp/reduce_scatter"]) == (2 * 12 * hidden, 2 * 8 * hidden) == (147_456, 98_304)
    report = decoder_memory(spec, options, par, training)
    assert (report.not_modelled, report.unmeasured) == ((), ())
    assert report.group_sizes["tp_ep"] == 2


def test_moe_latent_projections_are_a_labelled_formula():
    # moe_latent_size 16: fc1_latent_proj [16, 64] and fc2_latent_proj [64, 16] (Transformer
    # Engine, whole on every TP rank) after the router; the experts work in the latent width.
    spec = ModelSpec.from_mapping(dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                       vocab_size=256, num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=32,
                                       moe_latent_size=16))
    options = dataclasses.replace(PLAIN, moe_token_dispatcher_type="alltoall", add_bias_linear=False)
    from megatron_flops.memory.decoder import chunk_parameters

    params = {p.name: p.numel for p in chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0,
                                                          seq_length=16)}
    mlp = "decoder.layers.0.mlp."
    assert params[mlp + "fc1_latent_proj.weight"] == params[mlp + "fc2_latent_proj.weight"] == 16 * 64
    assert params[mlp + "experts.local_experts.0.linear_fc1.weight"] == 32 * 16
    training = Training(seq_length=16, micro_batch_size=2, params_dtype="bf16")
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0).components
    # 32 tokens top-1: the experts keep [32, 16] latent tokens, probabilities [32] and 3 x 32 GELU
    # values per token; fc2_latent_proj keeps its input [32, 16] (bf16).
    assert act["moe/experts"] == 32 * 16 * 2 + 32 * 2 + 32 * 32 * 2 * 3
    assert act["moe/latent"] == 32 * 16 * 2
    report = decoder_memory(spec, options, Parallelism(), training)
    assert any("latent projections" in u for u in report.unmeasured)


def test_moe_stages_text_names_forward_passes_in_flight(capsys):
    # TP 2 + SP x EP 4 x PP 2 with the alltoall dispatcher: each stage says how many forward
    # passes it holds (never "None"), and the TP traffic of routed tokens its range.
    base = ["memory", "--model", "examples/mixtral_8x7b_hf_config.json", "--seq-length", "4096",
            "--num-microbatches", "8", "--distributed-optimizer", "--tp", "2", "--ep", "4", "--dp", "4"]
    assert main(base + ["--sequence-parallel", "--pp", "2"]) == 0
    text = capsys.readouterr().out
    assert "None forward passes" not in text
    assert "stage 0 72.080 GB (2 forward passes in flight), stage 1 63.511 GB (1 forward pass in flight)" in text
    assert "tp/all_gather per GPU with unbalanced routing:" in text
    assert main(base) == 2  # no sequence parallelism: megatron-core refuses
    assert "add --sequence-parallel" in capsys.readouterr().err


def test_lora_activations_by_hand():
    # Frozen base, LoRA rank 4 on linear_fc2 only, one stage: nothing requires grad before layer
    # 0's fc2 adapter, which saves fc2's input [T, ffn] and the [T, 4] intermediate.
    training = Training(seq_length=16, micro_batch_size=2, params_dtype="fp32")
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc2",))
    full = rank_memory(TINY, PLAIN, Parallelism(), training, pp_rank=0).activations_per_microbatch[0]
    lora = rank_memory(TINY, PLAIN, Parallelism(), training, pp_rank=0, peft=peft).activations_per_microbatch[0]
    T, h, ffn = 32, 64, 128
    assert lora["lora"] == 2 * T * 4 * 4
    assert "embedding" not in lora  # the frozen lookup keeps no ids
    # Layer 0's two norms; the output layer's input.
    assert full["norm"] - lora["norm"] == 2 * T * (h * 4 + 8)
    assert full["output"] - lora["output"] == T * h * 4
    # Full, per layer: qkv input 8192, cos/sin 4 x 16 x 16 x 4 = 4096, q and k after RoPE and the
    # qkv output 40960, softmax [2, 4, 16, 16] fp32 8192, proj input 8192 (69632), and the bool
    # mask [2, 1, 16, 16] once (512). LoRA: all of layer 0 (the mask moves to layer 1) and layer
    # 1's frozen qkv and proj inputs.
    assert full["attention"] == 2 * 69632 + 512
    assert full["attention"] - lora["attention"] == 69632 + 2 * 8192
    assert full["mlp"] - lora["mlp"] == T * ffn * 4 + 2 * T * h * 4


def test_cli_moe_stage_line_and_assumptions(capsys, tmp_path):
    model = tmp_path / "moe.json"
    model.write_text(json.dumps(dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                     vocab_size=256, num_moe_experts=4, moe_router_topk=2,
                                     moe_token_dispatcher_type="alltoall")))
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--pp", "2", "--ep", "2", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out
    assert "ep/all_to_all per GPU with unbalanced routing:" in out and "balanced routing" in out
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--pp", "2", "--ep", "2", "--dp", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("balanced routing" in a for a in out["assumptions"])
    assert set(out["communication_ranges_per_step"]) == {"ep/all_to_all"}


# ---- FSDP2 -----------------------------------------------------------------------------------


def test_fsdp_shards_by_hand():
    p = DiTParam("modulation", (1, 6, 8), True)
    # One row over 4 ranks: every rank allocates 1 row (48 elements), rank 0 holds it.
    assert (shard_rows(p, 4), [real_rows(p, 4, r) for r in range(4)]) == (1, [1, 0, 0, 0])
    q = DiTParam("w", (10, 3), True)
    assert (shard_rows(q, 4), [real_rows(q, 4, r) for r in range(4)]) == (3, [3, 3, 3, 1])


def test_fsdp_lora_vs_full_tiny():
    spec = DiTSpec(num_layers=1, hidden_size=8, num_heads=2, ffn_hidden_size=16, in_channels=2, out_channels=2,
                   freq_dim=4, text_dim=4, text_len=3, qk_norm=False, cross_attn_norm=False)
    training = Training(seq_length=1, micro_batch_size=1, num_microbatches=1, params_dtype="fp32")
    lora = fsdp_rank_memory(spec, training, dp=2, peft=DiTPeftSpec(frozen=True, lora_rank=2, lora_targets=("self_attn.q",)))
    # One adapter: A [2, 8] (1 row each) + B [8, 2] (4 rows each): 2 x 8 + 8 x 2 = 32 elements, 16 per rank.
    assert lora.states["gradients"] == 16 * 4
    assert lora.communication["fsdp/reduce_scatter"] == 32 * 4


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_hybrid_attention_and_mlp_layers_cost_what_gpt_layers_cost(sequence_parallel):
    # "*-*-": attention-only and MLP-only layers, each behind its own norm: a pair is one GPT layer's
    # parameters, saved tensors and TP collectives (half a layer's each), under TP 2 (+ SP) with DDP.
    sizes = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256)
    hybrid = ModelSpec.from_mapping(dict(sizes, hybrid_override_pattern="*-*-"))
    gpt = ModelSpec.from_mapping(dict(sizes, num_layers=2))
    options = dataclasses.replace(PLAIN, attention_backend="unfused")
    par = Parallelism(tp=2, dp=2, sequence_parallel=sequence_parallel)
    training = Training(seq_length=8, micro_batch_size=1, num_microbatches=2)
    reports = [decoder_memory(spec, options, par, training) for spec in (hybrid, gpt)]
    assert reports[0].parameters == reports[1].parameters
    assert reports[0].per_gpu.states == reports[1].per_gpu.states
    assert reports[0].per_gpu.activations == reports[1].per_gpu.activations
    assert reports[0].per_gpu.communication == reports[1].per_gpu.communication


@pytest.mark.parametrize("layout, message", [
    (dict(tp=3), "num_attention_heads=4 is not divisible by --tp 3"),
    (dict(pp=3), r"num_layers=2 is not divisible by PP x VPP = 3"),
    (dict(pp=2, vpp=2), r"num_layers=2 is not divisible by PP x VPP = 4"),
    (dict(ep=2, dp=2), "--ep 2 needs a MoE model"),
    (dict(fsdp=True, dp=2), r"--use-torch-fsdp2 \(--fsdp\) is not supported with tied embeddings"),
    (dict(cp=3, dp=1), "splits each sequence into 2 x CP chunks: --seq-length 8 is not divisible by 6"),
])
def test_bad_layouts(layout, message):
    with pytest.raises(ValueError, match=message):
        decoder_memory(TINY, PLAIN, Parallelism(**layout), Training(seq_length=8, micro_batch_size=1))


def test_work_is_bounded():
    # At most 2^16 layers and 2^16 forward passes (micro-batches x VPP) per report; the data-parallel
    # size is not bounded (memory/dp_ranks.py finds the most loaded rank without listing each).
    huge = dataclasses.replace(TINY, layer_runs=((TINY.layer_runs[0][0], 2**70),))
    with pytest.raises(ValueError, match=r"num_layers must be at most 65,536, got 1,180,591,620,717,411,303,424"):
        decoder_memory(huge, PLAIN, Parallelism(), Training(seq_length=8, micro_batch_size=1))
    # DP 2^40: one bucket of the 2-layer model's parameters at multiples of 64, padded to lcm(2^40, 128) = 2^40
    # elements, one per rank: rank 0's is the first parameter's first element (4 B per Adam moment), no rank's more.
    wide = decoder_memory(TINY, PLAIN, Parallelism(dp=2**40, distributed_optimizer=True),
                          Training(seq_length=8, micro_batch_size=1)).per_gpu
    assert (wide.dp_rank, wide.states["optimizer/exp_avg"]) == (0, 4)
    with pytest.raises(ValueError, match=r"--num-microbatches x VPP must be at most 65,536, got 65,538"):
        decoder_memory(TINY, PLAIN, Parallelism(), Training(seq_length=8, micro_batch_size=1, num_microbatches=65538))


@pytest.mark.parametrize("kwargs, message", [
    (dict(ep=3, dp=4), r"--ep 3 does not divide DP x CP = 4"),
    (dict(vpp=2), "--vpp needs --pp > 1"),
    (dict(distributed_optimizer=True, fsdp=True), "choose one"),
    (dict(tp=0), "--tp must be a positive integer"),
])
def test_bad_parallelism(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Parallelism(**kwargs)


# ---- CLI -------------------------------------------------------------------------------------


def test_cli_json_keys(capsys, tmp_path):
    model = tmp_path / "m.json"
    model.write_text(json.dumps(dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                     vocab_size=256, add_bias_linear=False, position_embedding_type="rope")))
    assert main(["memory", "--model", str(model), "--seq-length", "32", "--micro-batch-size", "2",
                 "--num-microbatches", "4", "--pp", "2", "--dp", "2", "--distributed-optimizer", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["per_gpu"]) >= {"weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
                                   "total_bytes"}
    assert len(out["per_stage"]) == 2
    comm = out["communication_per_step"]
    assert comm["total_bytes"] == sum(v for k, v in comm.items() if k != "total_bytes")
    assert set(comm) >= {"dp/reduce_scatter", "dp/all_gather", "pp/send_recv", "embd/all_reduce"}


def test_cli_dit_compare_full(capsys):
    assert main(["memory", "--model", TINY_DIT, "--seq-length", "16", "--dp", "4", "--fsdp",
                 "--compare-full"]) == 0
    out = capsys.readouterr().out
    assert "LoRA" in out and "full" in out and "fsdp/reduce_scatter" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", TINY_DIT, "--seq-length", "16", "--pp", "2", "--dp", "2", "--fsdp"],
     "a DiT under --fsdp (torch FSDP2) with --pp 2 is not modelled"),
    (["--model", LLAMA, "--seq-length", "16", "--tp", "3"], "not divisible by --tp 3"),
    (["--model", LLAMA, "--seq-length", "16", "--dp", "2", "--distributed-optimizer",
      "--optimizer", "sgd"], "distributed optimizer supports Adam only"),
])
def test_cli_bad_input_exits_2(argv, message, capsys):
    assert main(["memory", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_runs_as_a_program():
    out = subprocess.run([sys.executable, "-m", "megatron_flops", "memory", "--model", LLAMA,
                          "--seq-length", "8192", "--tp", "2", "--dp", "4", "--distributed-optimizer"],
                         capture_output=True, text=True, check=True).stdout
    assert "per GPU (GB), most loaded" in out and "tp/all_reduce" in out


def test_docs_memory_examples_are_the_commands_output(capsys, monkeypatch):
    # Every `$ megatron-flops memory ...` block in docs/memory.md shows lines the command prints,
    # in order ("..." stands for lines left out).
    import shlex

    monkeypatch.chdir(EXAMPLES.parent)
    text = (EXAMPLES.parent / "docs" / "memory.md").read_text()
    blocks = [b.split("\n```")[0] for b in text.split("```\n$ megatron-flops memory ")[1:]]
    assert len(blocks) == 5
    for block in blocks:
        command, *shown = block.splitlines()
        assert main(["memory", *shlex.split(command)]) == 0
        printed = iter(capsys.readouterr().out.splitlines())
        for line in (s for s in shown if s != "..."):
            assert line in printed, line
