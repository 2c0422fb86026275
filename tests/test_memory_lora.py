"""LoRA adapters under tensor parallelism and selective ``mlp`` recompute, by hand: parameters per
TP rank as Megatron-Bridge splits them, the adapters' and the re-run's ``tp/*`` payloads, and
what is refused. The same layout is measured to the byte in tests/test_memory_dist.py (DP2 x TP2,
LoRA on all four targets, frozen base)."""

from __future__ import annotations

import re

import pytest

from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.activations import check_activations_supported, chunk_activations
from megatron_flops.memory.decoder import DecoderOptions, check_supported, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.lora import adapter_numels
from megatron_flops.memory.report import rank_memory
from megatron_flops.model.spec import ModelSpec

ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# As tests/test_memory_dist.py's BASE: 2 layers, h 48, 4 heads of 12, ffn 72, vocab 96.
SPEC = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72,
                                   vocab_size=96))
OPTIONS = DecoderOptions(add_bias_linear=False, position_embedding_type="rope", attention_backend="unfused",
                         hidden_dropout=0.0, attention_dropout=0.0, padded_vocab_size=96, transformer_impl="local")
TRAINING = Training(seq_length=16, micro_batch_size=2, num_microbatches=2, params_dtype="bf16")
TP2 = Parallelism(tp=2, dp=2)
LORA = PeftSpec(frozen=True, lora_rank=4, lora_targets=ALL)


def test_adapter_numels_split_as_bridge():
    # Column-parallel target (linear_qkv, weight [(4 + 2 x 4) x 12 / 2, 48] = [72, 48] per rank):
    # linear_in [r/TP, 48] = [2, 48], linear_out [72, r] = [72, 4].
    assert adapter_numels("linear_qkv", 48, 72, 4, 2) == (96, 288)
    # Row-parallel target (linear_proj, weight [48, 48/2] per rank): linear_in [r, 24],
    # linear_out [48/TP, r] = [24, 4].
    assert adapter_numels("linear_proj", 24, 48, 4, 2) == (96, 96)
    assert adapter_numels("linear_fc2", 36, 48, 4, 1) == (144, 192)  # TP 1: A [r, in], B [out, r]


def test_parameters_per_tp_rank():
    params = {p.name: p.numel for p in chunk_parameters(SPEC, OPTIONS, TP2, pp_rank=0, chunk=0, seq_length=16,
                                                       peft=LORA)}
    prefix = "decoder.layers.0."
    assert params[prefix + "self_attention.linear_qkv.adapter.linear_in.weight"] == 2 * 48
    assert params[prefix + "self_attention.linear_qkv.adapter.linear_out.weight"] == 72 * 4
    assert params[prefix + "mlp.linear_fc1.adapter.linear_out.weight"] == 36 * 4  # fc1 [72/2, 48]
    assert params[prefix + "mlp.linear_fc2.adapter.linear_in.weight"] == 4 * 36
    assert params[prefix + "mlp.linear_fc2.adapter.linear_out.weight"] == 24 * 4


def test_tp_payload_by_hand():
    # T = 32 tokens, bf16 (2 bytes), r = 4, h = 48: [T, r] = 256 bytes, [T, h] = 3,072 bytes.
    comm = rank_memory(SPEC, OPTIONS, TP2, TRAINING, pp_rank=0, peft=LORA).communication
    # all_gather, per layer and micro-batch: linear_qkv's and linear_fc1's [T, r] (2 x 256),
    # linear_proj's and linear_fc2's output [T, h] (2 x 3,072) = 6,656; x 2 layers x 2 = 26,624.
    assert comm["tp/all_gather"] == 26_624
    # all_reduce, per micro-batch: the base's 4 per layer + embedding + output layer (10 x 3,072)
    # and cross-entropy's 3 fp32 [T] (384) = 31,104; less layer 0's frozen linear_qkv, whose input
    # requires no grad (3,072); the adapters' per layer: column targets [T, r] + [T, h] each
    # (2 x 3,328), row targets [T, r] twice each (2 x 512) = 7,680, x 2 layers.
    # 2 x (31,104 - 3,072 + 15,360) = 86,784.
    assert comm["tp/all_reduce"] == 86_784
    # Selective mlp recompute re-runs each MLP: fc2's all-reduce [T, h] and the fc1/fc2 adapters'
    # forward collectives (all_gather 256 + 3,072, all_reduce 256), x 2 layers x 2 micro-batches.
    recompute = RecomputeSpec(granularity="selective", modules=("core_attn", "mlp"))
    rerun = rank_memory(SPEC, OPTIONS, TP2, TRAINING, pp_rank=0, peft=LORA, recompute=recompute).communication
    assert rerun["tp/all_gather"] - comm["tp/all_gather"] == 4 * 3_328
    assert rerun["tp/all_reduce"] - comm["tp/all_reduce"] == 4 * (3_072 + 256)


def test_frozen_base_with_every_adapter_in_a_checkpointed_mlp_is_refused():
    # Only fc2 adapted, under selective mlp: each MLP's checkpoint input requires no grad (nothing upstream
    # trains), so megatron-core's reentrant checkpoint gives no adapter a gradient: refused, as `estimate`
    # refuses it (one rule, flops/passes.py check_checkpointed_regions).
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc2",))
    recompute = RecomputeSpec(granularity="selective", modules=("mlp",))
    with pytest.raises(ValueError, match="selective recompute of 'mlp' with a frozen base: megatron-core's reentrant "
                                         "checkpoint gives the trainable weights of linear_fc2 \\(layer 0\\) no gradient"):
        rank_memory(SPEC, OPTIONS, TP2, TRAINING, pp_rank=0, peft=peft, recompute=recompute)


@pytest.mark.parametrize("par, peft, match", [
    # (MLA's projection on a dense model: nothing adapted, no adapter to start the gradient.)
    (TP2, PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_q_proj",)), "first layer has no adapter"),
    (TP2, PeftSpec(frozen=True, lora_rank=3, lora_targets=ALL), "not divisible by --tp 2"),
])
def test_lora_under_tp_refusals(par, peft, match):
    with pytest.raises(ValueError, match=match):
        check_supported(SPEC, par, peft, OPTIONS)
    # A frozen MoE first layer without shared experts and no attention target: its first adapters
    # are the routed experts' (the gradient starts inside the layer: tests/test_memory_moe_lora_start_dist.py).
    moe = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72,
                                      vocab_size=96, num_moe_experts=4, moe_router_topk=2))
    sp = Parallelism(tp=2, dp=2, sequence_parallel=True)
    check_supported(moe, sp, LORA, OPTIONS)
    check_supported(moe, sp, PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1",)), OPTIONS)


def test_selective_mlp_with_biases_refused():
    recompute = RecomputeSpec(granularity="selective", modules=("mlp",))
    biased = DecoderOptions(add_bias_linear=True)
    assert "biases" in (check_activations_supported(SPEC, biased, Parallelism(), recompute) or "")
    assert check_activations_supported(SPEC, OPTIONS, Parallelism(), recompute) is None


def test_sequence_parallel_payload_by_hand():
    # DP2 x TP2 + SP, frozen base, LoRA on linear_proj and linear_fc1 (measured in
    # tests/test_memory_dist.py). [T, h] = 3,072 bytes, [T, r] = 256; per micro-batch:
    par = Parallelism(tp=2, dp=2, sequence_parallel=True)
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_proj", "linear_fc1"))
    comm = rank_memory(SPEC, OPTIONS, par, TRAINING, pp_rank=0, peft=peft).communication
    # all_gather: the trained base's 6 per layer + output layer 2 + embedding 1 = 15 [T, h], less
    # what the frozen base skips: 2 weight-gradient gathers per layer, the output layer's, the
    # embedding's gradient, layer 0's linear_proj output gradient (before the first adapter) = 7;
    # adapters per layer: linear_proj's output 3,072 and gradient 3,072, linear_fc1's input 3,072
    # and [T, r] 256 = 9,472.
    assert comm["tp/all_gather"] == 2 * ((15 - 7) * 3_072 + 2 * 9_472)
    # reduce_scatter: 4 per layer + output layer + embedding = 10, less layer 0's linear_qkv input
    # gradient; linear_fc1's adapter reduce-scatters its input gradient, one per layer.
    assert comm["tp/reduce_scatter"] == 2 * (10 - 1 + 2) * 3_072
    # all_reduce: cross-entropy's 3 fp32 [T] (384); per layer linear_proj's [T, r] forward and
    # both linear_out input gradients [T, r].
    assert comm["tp/all_reduce"] == 2 * (384 + 2 * 3 * 256)


_MOE_SPEC = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, vocab_size=64,
                 num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
_MLA_SPEC = dict(_MOE_SPEC, multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=4,
                 v_head_dim=12, moe_layer_freq=[0, 1])


@pytest.mark.parametrize("fields, par, peft, reason", [
    # (MLA's own projections: measured, tests/test_memory_lora_mla_dist.py.)
    (_MLA_SPEC, Parallelism(), PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_q_proj", "linear_kv_up_proj")),
     None),
    # (flex: a formula listed in unmeasured, tests/test_memory_moe_lora_start.py.)
    (dict(_MOE_SPEC, moe_token_dispatcher_type="flex"), Parallelism(),
     PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1",)), None),
    (_MOE_SPEC, Parallelism(), PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1",)), None),
    (dict(_MOE_SPEC, moe_token_dispatcher_type="alltoall"), Parallelism(),
     PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1",)), None),
    (dict(_MOE_SPEC, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True),
     Parallelism(), PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1",)), None),
    # (Without shared experts the gradient starts in a later dense layer; with them their adapter is the first:
    # formulas, tests/test_memory_grouped_start.py.)
    (dict(_MOE_SPEC, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True,
          moe_shared_expert_intermediate_size=32), Parallelism(),
     PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1",)), None),
    (_MOE_SPEC, Parallelism(), PeftSpec(frozen=True, lora_rank=4), None),
    (_MLA_SPEC, Parallelism(), PeftSpec(frozen=True, lora_rank=4), None),
    (_MLA_SPEC, Parallelism(), PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1",)), None),
], ids=["MLA projections", "MoE first layer, experts only, flex", "MoE first layer, experts only, allgather",
        "MoE first layer, experts only",
        "MoE first layer, experts only, legacy grouped experts",
        "MoE first layer, experts only, legacy grouped experts, shared experts", "MoE default targets",
        "MLA + MoE default targets (linear_qkv adapts nothing)", "MLA, dense first layer, fc1"])
def test_lora_moe_mla_activations_refused_with_a_reason(fields, par, peft, reason):
    # Activations of LoRA/frozen MoE and MLA decoders are measured at TP 1 (tests/test_memory_activations.py);
    # what was not measured is refused, never silently priced.
    spec = ModelSpec.from_mapping(fields)
    options = DecoderOptions.from_mapping(dict(fields, padded_vocab_size=64))
    got = check_activations_supported(spec, options, par, None, peft)
    if reason is None:
        assert got is None
    else:
        assert got is not None and re.search(reason, got)


def test_moe_expert_adapters_under_tp_by_hand():
    # TP2 + SP, EP1, MoE every layer (top-2 of 4, experts' ffn 32, no shared experts), LoRA r=4 on
    # linear_proj, linear_fc1, linear_fc2, frozen base, bf16; T = 32 tokens.
    spec = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72,
                                       vocab_size=96, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32))
    par = Parallelism(tp=2, dp=2, sequence_parallel=True)
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_proj", "linear_fc1", "linear_fc2"))
    params = {p.name: p.numel for p in chunk_parameters(spec, OPTIONS, par, pp_rank=0, chunk=0, seq_length=16,
                                                       peft=peft)}
    expert = "decoder.layers.0.mlp.experts.local_experts.3."
    # Split over expert TP (= TP) as the layer: fc1's linear_in [r/2, h], fc2's linear_out [h/2, r].
    assert params[expert + "linear_fc1.adapter.linear_in.weight"] == 2 * 48
    assert params[expert + "linear_fc1.adapter.linear_out.weight"] == 16 * 4  # [ffn/TP, r]
    assert params[expert + "linear_fc2.adapter.linear_in.weight"] == 4 * 16  # [r, ffn/TP]
    assert params[expert + "linear_fc2.adapter.linear_out.weight"] == 24 * 4
    from megatron_flops.memory.lora_layers import lora_tp_communication

    comm = lora_tp_communication(spec, par, TRAINING, pp_rank=0, peft=peft)
    # Per layer and micro-batch (bf16: [T, r] = 256 bytes, [T, h] = 3,072): linear_proj's adapter
    # all-gathers its output and, in backward, its output gradient (2 x 3,072); the routed
    # experts' adapters, over 64 routed tokens (32 x top-2), fc1's [n, r] (512) and fc2's
    # output [n, h] (6,144), forward only. No dense MLP: no fc1/fc2 adapter of the TP group.
    # Less what the frozen base skips: per layer linear_qkv's weight-gradient all-gather (no
    # linear_fc1 in the TP group), the output layer's and the embedding's, and layer 0's
    # linear_proj output gradient (before the first adapter) = 2 + 1 + 1 + 1 = 5 x 3,072.
    assert comm["tp/all_gather"] == 2 * (2 * (2 * 3_072 + 512 + 6_144) - 5 * 3_072)
    # linear_proj's [T, r] forward and its linear_out's input gradient [T, r] per layer.
    assert comm["tp/all_reduce"] == 2 * 2 * 2 * 256
    # Layer 0's linear_qkv input gradient (before the first adapter) is not reduce-scattered.
    assert comm["tp/reduce_scatter"] == -2 * 3_072


def test_moe_expert_adapters_with_their_own_tp_by_hand():
    # As above with an expert TP other than TP (a formula, labelled unmeasured: Megatron-Bridge 0.6.2 splits
    # an expert linear's adapter over expert_tensor_parallel_size). TP2 + SP, ETP1 x EP2: the experts'
    # adapters whole ([r, h], [ffn, r]; [r, ffn], [h, r]), nothing gathered for them; the TP group's
    # payloads are the dense adapters' alone (linear_proj: 2 x 3,072 a layer, less the 5 x 3,072 skipped).
    from megatron_flops.memory.lora_layers import expert_lora_unmeasured, lora_tp_communication

    spec = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72,
                                       vocab_size=96, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32))
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_proj", "linear_fc1", "linear_fc2"))
    etp1 = Parallelism(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True)
    check_supported(spec, etp1, peft, OPTIONS)
    params = {p.name: p.numel for p in chunk_parameters(spec, OPTIONS, etp1, pp_rank=0, chunk=0, seq_length=16,
                                                       peft=peft)}
    expert = "decoder.layers.0.mlp.experts.local_experts.1."
    assert [params[expert + f"linear_fc{i}.adapter.linear_{io}.weight"] for i in (1, 2) for io in ("in", "out")] \
        == [4 * 48, 32 * 4, 4 * 32, 48 * 4]
    comm = lora_tp_communication(spec, etp1, TRAINING, pp_rank=0, peft=peft)
    assert comm["tp/all_gather"] == 2 * (2 * 2 * 3_072 - 5 * 3_072) and "etp/all_gather" not in comm
    # TP1, ETP2 x EP2: no TP group; the expert TP group gathers, per layer and micro-batch, over the
    # 128 tokens its experts get (32 per rank x ETP 2 x top-2), fc1's [n, r] (1,024) and fc2's output
    # [n, h] (12,288).
    etp2 = Parallelism(tp=1, dp=4, ep=2, etp=2)
    assert lora_tp_communication(spec, etp2, TRAINING, pp_rank=0, peft=peft) == {
        "etp/all_gather": 2 * 2 * (1_024 + 12_288)}
    assert "expert TP 2 other than TP 1" in expert_lora_unmeasured(spec, etp2, peft)[0]
    assert expert_lora_unmeasured(spec, Parallelism(tp=2, dp=2, sequence_parallel=True), peft) == []
    with pytest.raises(ValueError, match="not divisible by the experts' TP 2"):
        check_supported(spec, etp2, PeftSpec(frozen=True, lora_rank=3, lora_targets=("linear_fc1",)), OPTIONS)


def test_first_adapter_in_experts_only_without_attention_targets():
    # A frozen MLA + MoE first layer: an adapter on MLA's own projections starts the gradient in attention.
    from megatron_flops.memory.moe_lora_start import starts_in_experts

    spec = ModelSpec.from_mapping(dict(_MLA_SPEC, moe_layer_freq=1))
    assert starts_in_experts(spec, PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1", "linear_fc2")))
    assert not starts_in_experts(spec, PeftSpec(frozen=True, lora_rank=4,
                                                 lora_targets=("linear_q_proj", "linear_fc1")))
    # (MLA has no linear_qkv: that target adapts nothing there, the experts' adapters start the gradient.)
    assert starts_in_experts(spec, PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_qkv", "linear_fc1")))


@pytest.mark.parametrize("gating, per_token", [
    # (T k = 32 x 2 = 64 routed tokens, ffn 96, fp32; each of the 2 MoE layers keeps the probabilities [64].)
    # GELU: a started frozen expert keeps fc1's output and the activation's [64, 96]; layer 0 not the latter,
    # which only the (gradient-free) probabilities multiply.
    (dict(), 2),
    # Fused SwiGLU: the kernel keeps its input [64, 2 x 96] (and the probabilities) either way: no delta.
    (dict(gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True), 2),
    # Unfused SwiGLU: fc1's output (2), silu(x1), x2 and their product; layer 0 not the product.
    (dict(gated_linear_unit=True, activation_func="silu"), 5),
], ids=["GELU", "fused SwiGLU (Mixtral)", "unfused SwiGLU"])
def test_experts_of_a_frozen_first_layer_whose_adapters_start_the_gradient(gating, per_token):
    # tests/test_memory_activations.py's "frozen MoE first layer" cases (measured at TP 1): 2 MoE layers, top-2 of 4.
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
                  num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, moe_token_dispatcher_type="alltoall",
                  **gating)
    spec, options = ModelSpec.from_mapping(fields), DecoderOptions.from_mapping(dict(fields, padded_vocab_size=256))
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2, params_dtype="fp32")
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1", "linear_fc2"))
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0, peft=peft)
    started = 64 * 96 * 4 * per_token + 64 * 4
    dropped = 0 if gating.get("bias_activation_fusion") else 64 * 96 * 4
    assert act.components["moe/experts"] == 2 * started - dropped
