"""A frozen MoE first layer adapted on its experts only (:mod:`megatron_flops.memory.moe_lora_start`):
the formulas for what CPU cannot run (TEGroupedMLP experts, the flex dispatcher), exact integers, and
their labels. (Measured layouts: tests/test_memory_moe_lora_start_dist.py.)"""

from __future__ import annotations

import pytest

from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.moe_lora_start import (first_adapter_ep_skip, first_adapter_moe_reason,
                                                  first_adapter_moe_saved, first_adapter_unmeasured)
from megatron_flops.model.spec import ModelSpec

# Mixtral-like: every layer MoE, top-4 of 4 experts, h = 48, fused SwiGLU; s = 16, b = 2 (T_l = 32), fp32, m = 2.
FIELDS = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, num_moe_experts=4,
              moe_router_topk=4, moe_ffn_hidden_size=56, moe_layer_freq=1, gated_linear_unit=True,
              activation_func="silu", vocab_size=64)
SPEC = ModelSpec.from_mapping(FIELDS)
PEFT = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1", "linear_fc2"))
TRAINING = Training(seq_length=16, micro_batch_size=2, num_microbatches=2, params_dtype="fp32")
EP2 = Parallelism(tp=1, ep=2, dp=2)


def options(**kw) -> DecoderOptions:
    return DecoderOptions.from_mapping(dict(FIELDS, padded_vocab_size=64, add_bias_linear=False,
                                            bias_activation_fusion=True, **kw))


def test_alltoall_ep_skip():
    # This rank's T_l x k = 32 x 4 = 128 routed tokens' gradients [128, h + 1] are not sent back through the
    # dispatch all-to-all: 128 x 49 x 4 B = 25,088 B per micro-batch, x 2 (as measured at EP2).
    assert first_adapter_ep_skip(SPEC, options(moe_token_dispatcher_type="alltoall"), EP2, TRAINING, pp_rank=0,
                                 peft=PEFT, recompute=None) == {"ep/all_to_all": -50_176}
    # Full recompute: Megatron-Bridge makes the decoder's input require grad, the backward runs.
    full = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
    assert first_adapter_ep_skip(SPEC, options(moe_token_dispatcher_type="alltoall"), EP2, TRAINING, pp_rank=0,
                                 peft=PEFT, recompute=full) == {}


@pytest.mark.parametrize(("backend", "skipped"), [
    # DeepEP: sent = T_l x ETP x min(k, EP) = 32 x 1 x 2 = 64 (token, rank) pairs, each the gradient [h] and the
    # ETP x k = 4 fp32 weights' gradient: 64 x (48 x 4 + 4 x 4) = 13,312 B per micro-batch, x 2.
    ("deepep", 26_624),
    # HybridEP: [h] and the rank's E/EP = 2 fp32 probabilities: 64 x (192 + 8) = 12,800 B, x 2.
    ("hybridep", 25_600),
])
def test_flex_ep_skip(backend, skipped):
    opts = options(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)
    assert first_adapter_ep_skip(SPEC, opts, EP2, TRAINING, pp_rank=0, peft=PEFT, recompute=None) == \
        {"ep/all_to_all": -skipped}


def test_flex_dispatcher_keeps_only_the_combines_sorted_indices():
    # n = T x k = 32 x 4 = 128 pairs reach this rank (balanced): DeepEP's unpermute keeps int64 [128] = 1,024 B;
    # HybridEP permutes in its kernels. The experts keep the same as with alltoall but fp32 probabilities.
    saved = {backend: first_adapter_moe_saved(SPEC, options(moe_token_dispatcher_type="flex",
                                                            moe_flex_dispatcher_backend=backend), PEFT,
                                              tokens=32, local_tokens=32, act=2, tp=1, ep=2)
             for backend in ("deepep", "hybridep")}
    assert saved["deepep"]["moe/dispatcher"] == 1_024 and saved["hybridep"]["moe/dispatcher"] == 0
    alltoall = first_adapter_moe_saved(SPEC, options(moe_token_dispatcher_type="alltoall"), PEFT, tokens=32,
                                       local_tokens=32, act=2, tp=1, ep=2)
    # bf16 (act = 2): 128 probabilities x (4 - 2) B more in fp32.
    assert saved["deepep"]["moe/experts"] - alltoall["moe/experts"] == 256
    assert saved["deepep"]["lora"] == alltoall["lora"]


def test_grouped_experts_save_as_sequential_and_are_labelled():
    grouped = options(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, transformer_impl="transformer_engine")
    sequential = options(moe_token_dispatcher_type="alltoall")
    kw = dict(tokens=32, local_tokens=32, act=4, tp=1, ep=2)
    assert first_adapter_moe_saved(SPEC, grouped, PEFT, **kw) == first_adapter_moe_saved(SPEC, sequential, PEFT, **kw)
    assert first_adapter_moe_reason(SPEC, grouped, EP2, None, PEFT) is None
    assert any("TEGroupedMLP" in note for note in first_adapter_unmeasured(SPEC, grouped, PEFT))
    assert first_adapter_unmeasured(SPEC, sequential, PEFT) == []
    # Megatron-Bridge 0.6.2's per-expert adapters: modelled (tests/test_memory_grouped_start.py); legacy
    # GroupedMLP without shared experts: no adapter of the layer trains, nothing saved, the gradient starts in a
    # later dense layer: modelled too (tests/test_memory_grouped_start.py), labelled.
    per_expert = PeftSpec(frozen=True, lora_rank=4, lora_targets=PEFT.lora_targets, grouped_expert_adapters="per-expert")
    assert first_adapter_moe_reason(SPEC, grouped, EP2, None, per_expert) is None
    legacy = options(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, transformer_impl="local")
    assert first_adapter_moe_reason(SPEC, legacy, EP2, None, PEFT) is None
    assert first_adapter_moe_saved(SPEC, legacy, PEFT, **kw) == {}
    assert any(note.startswith("the leading MoE layers of legacy GroupedMLP experts")
               for note in first_adapter_unmeasured(SPEC, legacy, PEFT))


def test_latent_projections_keep_nothing_and_the_experts_work_at_the_latent_width():
    # moe_latent_size 24 (measured: tests/test_memory_activations.py at TP 1, tests/test_memory_moe_lora_start_dist.py
    # under TP2 + SP and EP2, with a stand-in for TELinear). fc1_latent_proj runs before any adapter; the frozen
    # fc2_latent_proj (Transformer Engine keeps a linear's input only when its weight trains) keeps nothing.
    # n = T x k = 32 x 4 = 128 routed tokens, fp32: the combine's sorted indices int64 [128] = 1,024 B; the fused
    # SwiGLU experts keep the probabilities [128] and fc1's output [128, 2 x 56]: 512 + 57,344 = 57,856 B;
    # the adapters: fc1's [128, r] + its input, the permuted latent tokens [128, 24]: 2,048 + 12,288 = 14,336 B,
    # fc2's [128, r] + its input [128, 56]: 2,048 + 28,672 = 30,720 B.
    spec = ModelSpec.from_mapping(dict(FIELDS, moe_latent_size=24))
    opts = options(moe_token_dispatcher_type="alltoall", moe_latent_size=24)
    assert first_adapter_moe_reason(spec, opts, EP2, None, PEFT) is None
    assert first_adapter_moe_saved(spec, opts, PEFT, tokens=32, local_tokens=32, act=4, tp=1) == \
        {"moe/dispatcher": 1_024, "moe/experts": 57_856, "lora": 45_056}
    # EP2: the dispatch all-to-all's gradients not sent are latent-wide: 128 x (24 + 1) x 4 B = 12,800 B per
    # micro-batch, x 2.
    assert first_adapter_ep_skip(spec, opts, EP2, TRAINING, pp_rank=0, peft=PEFT, recompute=None) == \
        {"ep/all_to_all": -25_600}


@pytest.mark.parametrize("freq", [1, [1, 0]])
def test_selective_mlp_and_shared_experts_without_shared_experts_are_modelled(freq):
    # Selective mlp checkpoints the dense layers only (megatron-core's TransformerLayer: not is_moe_layer), whose
    # input requires grad after layer 0; shared_experts checkpoints nothing without shared experts.
    spec = ModelSpec.from_mapping(dict(FIELDS, moe_layer_freq=freq))
    selective = RecomputeSpec(granularity="selective", modules=("core_attn", "mlp", "shared_experts"))
    assert first_adapter_moe_reason(spec, options(moe_token_dispatcher_type="alltoall"), EP2, selective, PEFT) is None


@pytest.mark.parametrize("targets", [("linear_fc1", "linear_fc2"), ("linear_fc2",)])
def test_selective_shared_experts_is_refused_as_estimate_refuses_it(targets):
    # Shared experts run first in layer 0, inside a checkpoint whose input requires no grad: their adapters would
    # get no gradient. `estimate` (flops/passes.py) and `memory` refuse it with one message.
    from megatron_flops.flops.formulas import SeqStats
    from megatron_flops.flops.passes import training_passes
    from megatron_flops.memory.activations import check_activations_supported

    spec = ModelSpec.from_mapping(dict(FIELDS, moe_shared_expert_intermediate_size=32))
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=targets)
    selective = RecomputeSpec(granularity="selective", modules=("shared_experts",))
    with pytest.raises(ValueError) as flops:
        training_passes(spec, SeqStats.full_length(2, 16), peft=peft, recompute=selective)
    with pytest.raises(ValueError) as memory:
        check_activations_supported(spec, options(moe_token_dispatcher_type="alltoall"), EP2, selective, peft)
    assert str(memory.value) == str(flops.value)
    assert "selective recompute of 'shared_experts' with a frozen base" in str(memory.value)


# An MLA + MoE first layer (the survey's "mla moe first" file): s = 16, b = 1 (T = 16), bf16, h = 64, 4 heads,
# q_lora 24, kv_lora 16, qk 16, rope 8, v 16, shared experts 32; LoRA on the experts only.
MLA_FIRST = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
                 num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32,
                 multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                 v_head_dim=16, normalization="RMSNorm")
SPEC_MLA_FIRST = ModelSpec.from_mapping(MLA_FIRST)


def _mla_first_forward(*modules: str) -> int:
    from megatron_flops.memory.activations import chunk_activations

    opts = DecoderOptions.from_mapping(dict(MLA_FIRST, padded_vocab_size=128, attention_backend="local",
                                            transformer_impl="local", add_bias_linear=False))
    recompute = RecomputeSpec(granularity="selective", modules=modules) if modules else None
    act = chunk_activations(SPEC_MLA_FIRST, opts, Parallelism(), Training(seq_length=16, micro_batch_size=1), pp_rank=0,
                            chunk=0, recompute=recompute, peft=PEFT)
    return act.forward + act.shared


def test_mla_up_proj_in_a_frozen_moe_first_layer_saves_nothing():
    # Layer 0's up-projection checkpoint (megatron-core's CheckpointWithoutOutput) runs before any adapter: its
    # inputs require no grad, so autograd saves nothing for it, and its hook tensor (the core attention's output)
    # requiring none, no re-run is registered (measured: tests/test_memory_recompute_modules.py at TP 1,
    # tests/test_memory_moe_lora_start_dist.py under TP2 + SP). Layer 0 saves the same with or without it; each of
    # the 3 later layers (frozen base, hidden states requiring grad) saves, without recompute, RoPE's cos and sin
    # for q and k 4 x [16, 8] x 2 B = 1,024 B, q and k [16, 4, 24] x 2 B = 3,072 B each, v [16, 4, 16] x 2 B =
    # 2,048 B: 9,216 B; under mla_up_proj the checkpoint's inputs, the q latent [16, 24] and kv_down's output
    # [16, 16 + 8], 48 x 16 x 2 B = 1,536 B, and the fp32 RoPE frequencies [16, 8] x 4 B = 512 B: 2,048 B.
    none, up = _mla_first_forward(), _mla_first_forward("mla_up_proj")
    assert none - up == 3 * (9_216 - 2_048)
    # core_attn as well: each later layer's fp32 softmax [1, 4, 16, 16] x 4 B = 4,096 B, attention dropout's bool
    # mask (megatron-core's default p = 0.1) 1,024 B and output x 2 B = 2,048 B, 7,168 B, are re-saved in backward
    # only (the checkpoint keeps q, k, v and the mask, kept already).
    assert up - _mla_first_forward("core_attn", "mla_up_proj") == 3 * 7_168
    par = Parallelism()
    for modules in (("mla_up_proj",), ("core_attn", "mla_up_proj")):
        assert first_adapter_moe_reason(SPEC_MLA_FIRST, options(), par, RecomputeSpec(granularity="selective",
                                                                                      modules=modules), PEFT) is None

