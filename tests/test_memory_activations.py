"""Saved-for-backward bytes of real megatron-core GPT micro-batches (local layer spec, one gloo
process, no-pipelining schedule over two micro-batches) against
:func:`megatron_flops.memory.activations.chunk_activations`, one layer variant at a time.

Measured with ``saved_tensors_hooks`` (distinct storages, parameters and one-element tensors
left out): the bytes each forward (with the loss function) saves, and the peak held at once. Where
torch's CPU kernels save more than the CUDA convention the formula follows, the test adds the
difference by name (:func:`cpu_kernel_delta`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mcore_cpu
from megatron_flops.memory.activations import chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.model.spec import ModelSpec

VOCAB, SEQ, MBS, NUM_MB = 256, 16, 2, 2
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            hidden_dropout=0.0, attention_dropout=0.0)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, moe_token_dispatcher_type="alltoall")
FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform")

# name -> (TransformerConfig fields, position embedding, params dtype)
CASES = {
    "MHA, RoPE, GELU, fp32": ({}, "rope", "fp32"),
    "GQA, RoPE": (dict(num_query_groups=2), "rope", "fp32"),
    "MHA, learned positions (q/k/v views of the qkv output)": ({}, "learned_absolute", "fp32"),
    "GQA, learned positions (q copied, k/v repeated)": (dict(num_query_groups=2), "learned_absolute", "fp32"),
    "SwiGLU unfused": (dict(gated_linear_unit=True, activation_func="silu"), "rope", "fp32"),
    "SwiGLU fused (bias_activation_fusion)": (dict(gated_linear_unit=True, activation_func="silu",
                                                   bias_activation_fusion=True), "rope", "fp32"),
    "biases, fused bias-GELU": (dict(add_bias_linear=True, bias_activation_fusion=True), "rope", "fp32"),
    "dropout 0.1 (hidden and attention)": (dict(hidden_dropout=0.1, attention_dropout=0.1), "rope", "fp32"),
    "RMSNorm": (dict(normalization="RMSNorm"), "rope", "fp32"),
    "bf16 (fp32 softmax + bf16 probabilities)": ({}, "rope", "bf16"),
    "bf16, softmax in bf16": (dict(attention_softmax_in_fp32=False), "rope", "bf16"),
    "bf16, dropout": (dict(hidden_dropout=0.1, attention_dropout=0.1), "rope", "bf16"),
    "full recompute, uniform 1": (dict(FULL_UNIFORM, recompute_num_layers=1), "rope", "fp32"),
    "full recompute, uniform 2": (dict(FULL_UNIFORM, recompute_num_layers=2), "rope", "fp32"),
    "full recompute, block 1, GQA, SwiGLU": (dict(recompute_granularity="full", recompute_method="block",
                                                  recompute_num_layers=1, num_query_groups=2,
                                                  gated_linear_unit=True, activation_func="silu"), "rope", "fp32"),
    "selective core_attn, MHA": (dict(recompute_granularity="selective"), "rope", "fp32"),
    "selective core_attn, GQA": (dict(recompute_granularity="selective", num_query_groups=2), "rope", "fp32"),
    "selective core_attn, GQA, learned positions": (dict(recompute_granularity="selective", num_query_groups=2),
                                                    "learned_absolute", "fp32"),
    # MoE (megatron-core's router, alltoall/allgather dispatcher and SequentialMLP experts).
    "MoE top-2 of 4, GELU experts, alltoall": (dict(MOE), "rope", "fp32"),
    "MoE SwiGLU unfused, shared experts, allgather": (dict(MOE, gated_linear_unit=True, activation_func="silu",
                                                           moe_shared_expert_intermediate_size=80,
                                                           moe_token_dispatcher_type="allgather"), "rope", "fp32"),
    "MoE SwiGLU fused, sigmoid top-3 of 8 + expert bias, every other layer": (
        dict(MOE, gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True, num_moe_experts=8,
             moe_router_topk=3, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
             moe_layer_freq=[0, 1]), "rope", "fp32"),
    "MoE pre-softmax top-1, learned positions": (dict(MOE, moe_router_pre_softmax=True, moe_router_topk=1),
                                                 "learned_absolute", "fp32"),
    "MoE bf16, shared experts": (dict(MOE, moe_shared_expert_intermediate_size=80), "rope", "bf16"),
    "MoE selective core_attn": (dict(MOE, recompute_granularity="selective"), "rope", "fp32"),
}


@pytest.fixture(scope="module")
def mcore():
    if not mcore_cpu.HAVE_MCORE:
        pytest.skip(mcore_cpu.SKIP_REASON)
    import mcore_memory

    mcore_cpu.init_single_process()
    mcore_memory.patch_alltoall_dispatcher()


def cpu_kernel_delta(fields: dict, act: int, num_norms: int, tokens: int, hidden: int, scores: int) -> int:
    """Bytes torch's CPU kernels save beyond the CUDA convention, by name:
    LayerNorm keeps mean/rstd in the input dtype (CUDA: fp32); RMSNorm is composite and also
    keeps ``x * rstd`` [T, h]; dropout keeps an activation-dtype mask (CUDA: bool)."""
    delta = 0
    if fields.get("normalization", "LayerNorm") == "LayerNorm":
        delta += num_norms * tokens * 2 * (act - 4)
    else:
        assert act == 4, "torch's CPU RMSNorm in 16 bits saves fp32 copies too: not covered"
        delta += num_norms * tokens * hidden * act
    if fields.get("hidden_dropout"):
        # Embedding + two sites per layer.
        delta += (1 + 2 * BASE["num_layers"]) * tokens * hidden * (act - 1)
    if fields.get("attention_dropout"):
        delta += BASE["num_layers"] * scores * (act - 1)
    return delta


def _measure(fields: dict, position: str, dtype: str):
    import mcore_dist
    import mcore_memory
    from megatron.core.transformer.module import Float16Module

    config = dict(BASE, **fields)
    if config.get("activation_func") == "silu":
        config["activation_func"] = torch.nn.functional.silu
    if dtype == "bf16":
        config.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = mcore_cpu.build_gpt(config, vocab_size=VOCAB, max_seq_len=SEQ, position_embedding_type=position)
    if dtype == "bf16":
        model = Float16Module(model.config, model)
    meter = mcore_memory.SavedTensorMeter(model.parameters())
    with meter.tracking():
        mcore_dist.run_schedule([model], num_microbatches=NUM_MB, micro_batch_size=MBS, seq_length=SEQ,
                                vocab_size=VOCAB, forward_step_func=mcore_memory.metered_forward_step(meter, [model]),
                                data_iterators=[mcore_memory.batches(NUM_MB, MBS, SEQ, VOCAB)], count_flops=False)
    return meter.forward, meter.peak


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_match_megatron_core(mcore, name):
    fields, position, dtype = CASES[name]
    measured_forward, measured_peak = _measure(fields, position, dtype)
    model = dict(BASE, **fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model)
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type=position,
                                               add_bias_linear=fields.get("add_bias_linear", False)))
    par = Parallelism()
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype=dtype)
    act = chunk_activations(spec, options, par, training, pp_rank=0, chunk=0,
                            recompute=RecomputeSpec.from_mapping(model))
    delta = cpu_kernel_delta(fields, training.param_bytes, 2 * BASE["num_layers"] + 1, SEQ * MBS,
                             BASE["hidden_size"], MBS * BASE["num_attention_heads"] * SEQ * SEQ)
    if "recompute_granularity" in fields:
        assert delta == 0  # (fp32, no dropout: the recompute peaks need no CPU correction)
    act = dataclasses.replace(act, components={**act.components, "cpu": delta})
    assert measured_forward == [act.forward + act.shared] * NUM_MB
    assert measured_peak == schedule_peak([act], in_flight(par, NUM_MB, 0))[0]


MLA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, multi_latent_attention=True,
           kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, normalization="RMSNorm",
           add_bias_linear=False, mtp_num_layers=1, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=32)


@pytest.mark.parametrize("fields", [dict(MLA, q_lora_rank=24, qk_layernorm=True), dict(MLA, q_lora_rank=None)],
                         ids=["q_lora, qk_layernorm", "direct q"])
def test_mla_mtp_parameters_in_megatron_order(mcore, fields):
    from megatron_flops.memory.decoder import chunk_parameters

    torch.manual_seed(0)
    model = mcore_cpu.build_gpt(fields, vocab_size=VOCAB, max_seq_len=SEQ, share_embeddings=False)
    spec = ModelSpec.from_mapping(dict(fields, vocab_size=VOCAB, share_embeddings_and_output_weights=False))
    options = DecoderOptions.from_mapping(dict(fields, padded_vocab_size=VOCAB, position_embedding_type="rope"))
    params = chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=SEQ)
    assert [(p.name, p.numel) for p in params] == [(n, p.numel()) for n, p in model.named_parameters()]
