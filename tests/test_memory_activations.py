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
import mcore_memory
from megatron_flops.memory.activations import chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
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
    # Partial rotary (glm, stablelm, gpt_neox, nemotron files): cos and sin of the rotated part only.
    "GQA, RoPE on half of each head": (dict(num_query_groups=2, rotary_percent=0.5), "rope", "fp32"),
    "MHA, RoPE on a quarter of each head, bf16": (dict(rotary_percent=0.25), "rope", "bf16"),
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
    # The shared experts' sigmoid gate keeps its output and the shared output it scales.
    "MoE SwiGLU, gated shared experts, allgather": (dict(MOE, gated_linear_unit=True, activation_func="silu",
                                                         moe_shared_expert_intermediate_size=80,
                                                         moe_shared_expert_gate=True,
                                                         moe_token_dispatcher_type="allgather"), "rope", "fp32"),
    # Full recompute re-runs the MoE layers in backward (the peak holds one layer's routing).
    "MoE full recompute, uniform 1, gated shared experts": (dict(MOE, **FULL_UNIFORM, recompute_num_layers=1,
                                                                 moe_shared_expert_intermediate_size=80,
                                                                 moe_shared_expert_gate=True), "rope", "fp32"),
    "MoE every other layer, full recompute, block 1": (dict(MOE, recompute_granularity="full",
                                                            recompute_method="block", recompute_num_layers=1,
                                                            moe_layer_freq=[0, 1]), "learned_absolute", "fp32"),
    "selective mlp, SwiGLU unfused": (dict(recompute_granularity="selective", recompute_modules=["mlp"],
                                           gated_linear_unit=True, activation_func="silu"), "rope", "fp32"),
    "selective core_attn + mlp, GQA": (dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"],
                                            num_query_groups=2), "rope", "fp32"),
    # q/k norms per head (non-MLA): their inputs are views of the qkv output (GQA: q is a copy).
    "MHA, RoPE, qk_layernorm": (dict(qk_layernorm=True), "rope", "fp32"),
    "MHA, learned positions, qk_layernorm (q, k fresh storages)": (dict(qk_layernorm=True), "learned_absolute",
                                                                   "fp32"),
    "GQA, learned positions, qk_layernorm (q copied)": (dict(qk_layernorm=True, num_query_groups=2),
                                                        "learned_absolute", "fp32"),
    "GQA, RoPE, RMSNorm, qk_layernorm": (dict(qk_layernorm=True, num_query_groups=2, normalization="RMSNorm"),
                                         "rope", "fp32"),
    "bf16, GQA, qk_layernorm": (dict(qk_layernorm=True, num_query_groups=2), "rope", "bf16"),
    "selective core_attn, GQA, qk_layernorm": (dict(recompute_granularity="selective", num_query_groups=2,
                                                    qk_layernorm=True), "rope", "fp32"),
}


def cpu_kernel_delta(fields: dict, act: int, num_norms: int, tokens: int, hidden: int, scores: int) -> int:
    """Bytes torch's CPU kernels save beyond the CUDA convention, by name:
    LayerNorm keeps mean/rstd in the input dtype (CUDA: fp32); RMSNorm is composite and also
    keeps ``x * rstd`` [T, h] (the q/k norms: [T, heads or groups, head_dim]); dropout keeps an
    activation-dtype mask (CUDA: bool)."""
    delta = 0
    if fields.get("normalization", "LayerNorm") == "LayerNorm":
        delta += num_norms * tokens * 2 * (act - 4)
    else:
        assert act == 4, "torch's CPU RMSNorm in 16 bits saves fp32 copies too: not covered"
        delta += num_norms * tokens * hidden * act
    if fields.get("qk_layernorm"):
        # Per layer, the q and k norms over [T, heads + groups] rows of head_dim.
        heads = BASE["num_attention_heads"]
        rows = BASE["num_layers"] * tokens * (heads + fields.get("num_query_groups", heads))
        if fields.get("normalization", "LayerNorm") == "LayerNorm":
            delta += rows * 2 * (act - 4)
        else:
            delta += rows * hidden // heads * act
    if fields.get("hidden_dropout"):
        # Embedding + two sites per layer.
        delta += (1 + 2 * BASE["num_layers"]) * tokens * hidden * (act - 1)
    if fields.get("attention_dropout"):
        delta += BASE["num_layers"] * scores * (act - 1)
    return delta


def _measure(fields: dict, position: str, dtype: str, lora=None, meter_cls=None):
    import mcore_dist
    import mcore_memory
    from megatron.core.transformer.module import Float16Module

    config = dict(BASE, **fields)
    rotary_percent = config.pop("rotary_percent", 1.0)  # (a GPTModel argument)
    if config.get("activation_func") == "silu":
        config["activation_func"] = torch.nn.functional.silu
    if dtype == "bf16":
        config.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = mcore_cpu.build_gpt(config, vocab_size=VOCAB, max_seq_len=SEQ, position_embedding_type=position,
                                rotary_percent=rotary_percent)
    if lora is not None:
        targets, rank, frozen = lora
        base = list(model.parameters())
        mcore_memory.apply_lora(model, targets, rank)
        for p in base:
            p.requires_grad_(not frozen)
    if dtype == "bf16":
        model = Float16Module(model.config, model)
    meter = (meter_cls or mcore_memory.SavedTensorMeter)(model.parameters())
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


# MLA layers (fp32 LayerNorm: torch's CPU kernels save as the CUDA convention).
MLA_LN = dict(multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
              normalization="LayerNorm", add_bias_linear=False)
# LoRA (Megatron-Bridge's adapter layout, tests/mcore_memory.apply_lora) on a frozen base or beside a
# trained one: name -> (TransformerConfig fields, position embedding, dtype, targets, frozen,
# norms that save (of 2 x layers + 1), hidden-dropout sites that save, attention-dropout sites).
LORA_RANK = 4
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
MLA_FOUR = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
PEFT_CASES = {
    # Layer 0's input norm runs before the first adapter (linear_qkv): 4 norms save.
    "frozen, all four targets": ({}, "rope", "fp32", ALL, True, 4, 0, 0),
    # Nothing requires grad before layer 0's fc2 adapter: layer 1 saves the mask.
    "frozen, linear_fc2 only, learned positions": ({}, "learned_absolute", "fp32", ("linear_fc2",), True, 3, 0, 0),
    "frozen, linear_proj only, GQA, SwiGLU unfused": (dict(num_query_groups=2, gated_linear_unit=True,
                                                           activation_func="silu"), "rope", "fp32",
                                                      ("linear_proj",), True, 4, 0, 0),
    "base trains, linear_qkv + linear_fc1, biases, fused bias-GELU": (
        dict(add_bias_linear=True, bias_activation_fusion=True), "rope", "fp32", ("linear_qkv", "linear_fc1"),
        False, 5, 0, 0),
    "frozen, all four targets, bf16": ({}, "rope", "bf16", ALL, True, 4, 0, 0),
    # From layer 0's fc1 adapter: its post-MLP dropout, then layer 1's three sites.
    "frozen, linear_fc1 only, dropout": (dict(hidden_dropout=0.1, attention_dropout=0.1), "rope", "fp32",
                                         ("linear_fc1",), True, 3, 3, 1),
    # Recompute (fp32 LayerNorm: no CPU delta). Full recompute: Bridge makes the decoder's input
    # require grad (maybe_enable_recompute_inputs_grad), so every checkpoint runs backward.
    "frozen, all four targets, full recompute (uniform 1)": (dict(FULL_UNIFORM, recompute_num_layers=1), "rope",
                                                             "fp32", ALL, True, 0, 0, 0),
    "frozen, linear_fc2 only, full recompute (uniform 2)": (dict(FULL_UNIFORM, recompute_num_layers=2), "rope",
                                                            "fp32", ("linear_fc2",), True, 0, 0, 0),
    "frozen, all four targets, full recompute (block 1)": (dict(recompute_granularity="full", recompute_method="block",
                                                                recompute_num_layers=1), "rope", "fp32", ALL, True,
                                                           0, 0, 0),
    "frozen, all four targets, selective core_attn": (dict(recompute_granularity="selective"), "rope", "fp32", ALL,
                                                      True, 0, 0, 0),
    # Layer 0's checkpointed core attention: no input requires grad, nothing saved or re-run.
    "frozen, linear_proj only, GQA, selective core_attn": (dict(recompute_granularity="selective", num_query_groups=2),
                                                           "rope", "fp32", ("linear_proj",), True, 0, 0, 0),
    "frozen, all four targets, selective core_attn + mlp": (dict(recompute_granularity="selective",
                                                                 recompute_modules=["core_attn", "mlp"]), "rope",
                                                            "fp32", ALL, True, 0, 0, 0),
    # Multi-token prediction: a frozen embedding's output requires no grad (no ids, no enorm input),
    # eh_proj (not a target) keeps no input; the MTP layer saves as any layer.
    "frozen, all four targets, 1 MTP layer": (dict(mtp_num_layers=1), "rope", "fp32", ALL, True, 0, 0, 0),
    "base trains, linear_qkv, 2 MTP layers": (dict(mtp_num_layers=2), "rope", "fp32", ("linear_qkv",), False,
                                               0, 0, 0),
    "frozen, linear_fc2 only, 1 MTP layer, full recompute (uniform 1)": (
        dict(FULL_UNIFORM, recompute_num_layers=1, mtp_num_layers=1), "rope", "fp32", ("linear_fc2",), True, 0, 0, 0),
    "base trains, linear_qkv, selective core_attn": (dict(recompute_granularity="selective"), "rope", "fp32",
                                                     ("linear_qkv",), False, 0, 0, 0),
    # MoE: a frozen expert keeps neither the permuted tokens (fc1's input) nor fc2's input; the
    # router's gating function keeps its input regardless (fp32 LayerNorm: no CPU delta).
    "frozen MoE top-2 of 4, alltoall, linear_qkv + linear_proj": (dict(MOE), "rope", "fp32",
                                                                  ("linear_qkv", "linear_proj"), True, 0, 0, 0),
    "frozen MoE SwiGLU unfused, gated shared experts, allgather, linear_proj": (
        dict(MOE, gated_linear_unit=True, activation_func="silu", moe_shared_expert_intermediate_size=80,
             moe_shared_expert_gate=True, moe_token_dispatcher_type="allgather"), "rope", "fp32", ("linear_proj",),
        True, 0, 0, 0),
    # MLA: a frozen projection keeps no input; the latents only as their norms' inputs.
    "frozen MLA, q_lora, qk_layernorm, linear_proj + linear_fc1": (
        dict(MLA_LN, q_lora_rank=24, qk_layernorm=True), "rope", "fp32", ("linear_proj", "linear_fc1"), True,
        0, 0, 0),
    "frozen MLA, direct q, MoE every other layer, linear_proj": (
        dict(MLA_LN, q_lora_rank=None, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
             moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=32, moe_token_dispatcher_type="alltoall"),
        "rope", "fp32", ("linear_proj",), True, 0, 0, 0),
    # Bridge wraps every routed expert's and the shared experts' linear_fc1/linear_fc2: each
    # adapter keeps its [n, r] intermediate over the tokens routed to it and, the base frozen,
    # the wrapped layer's input (the permuted tokens, the weighted activation).
    "frozen MoE, shared experts, all four targets (every expert's fc1, fc2)": (
        dict(MOE, moe_shared_expert_intermediate_size=80), "rope", "fp32", ALL, True, 0, 0, 0),
    # A frozen MoE first layer, no attention target: the first expert adapter starts the gradient inside
    # the layer (memory/moe_lora_start.py): no attention, norm, router or permutation saves before it.
    "frozen MoE first layer, linear_fc1 + linear_fc2 only": (dict(MOE), "rope", "fp32", ("linear_fc1", "linear_fc2"),
                                                             True, 0, 0, 0),
    "frozen MoE first layer, linear_fc2 only": (dict(MOE), "rope", "fp32", ("linear_fc2",), True, 0, 0, 0),
    "frozen MoE first layer, SwiGLU fused (Mixtral), linear_fc1 + linear_fc2": (
        dict(MOE, gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True), "rope", "fp32",
        ("linear_fc1", "linear_fc2"), True, 0, 0, 0),
    "frozen MoE first layer, SwiGLU fused, linear_fc2 only": (
        dict(MOE, gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True), "rope", "fp32",
        ("linear_fc2",), True, 0, 0, 0),
    "frozen MoE first layer, SwiGLU unfused, linear_fc1 + linear_fc2": (
        dict(MOE, gated_linear_unit=True, activation_func="silu"), "rope", "fp32", ("linear_fc1", "linear_fc2"),
        True, 0, 0, 0),
    "frozen MoE first layer, SwiGLU unfused, linear_fc2 only": (
        dict(MOE, gated_linear_unit=True, activation_func="silu"), "rope", "fp32", ("linear_fc2",), True, 0, 0, 0),
    "frozen MoE first layer, gated shared experts, allgather, linear_fc1 + linear_fc2": (
        dict(MOE, moe_shared_expert_intermediate_size=80, moe_shared_expert_gate=True,
             moe_token_dispatcher_type="allgather"), "rope", "fp32", ("linear_fc1", "linear_fc2"), True, 0, 0, 0),
    "frozen MoE first layer, shared experts, linear_fc2 only": (
        dict(MOE, moe_shared_expert_intermediate_size=80), "rope", "fp32", ("linear_fc2",), True, 0, 0, 0),
    # Latent projections (tests/mcore_cpu.DuplicatedLinearStandIn for Transformer Engine's TELinear): the frozen
    # fc1_latent_proj runs before any adapter, the frozen fc2_latent_proj keeps no input; the experts and their
    # adapters work at the latent width (test_first_adapter_moe_latent_bytes: the integers).
    "frozen MoE first layer, latent 32, SwiGLU fused (Mixtral), linear_fc1 + linear_fc2": (
        dict(MOE, moe_latent_size=32, gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True),
        "rope", "fp32", ("linear_fc1", "linear_fc2"), True, 0, 0, 0),
    "frozen MoE first layer, latent 32, gated shared experts, allgather, linear_fc2 only": (
        dict(MOE, moe_latent_size=32, moe_shared_expert_intermediate_size=80, moe_shared_expert_gate=True,
             moe_token_dispatcher_type="allgather"), "rope", "fp32", ("linear_fc2",), True, 0, 0, 0),
    # Selective mlp checkpoints the dense layers only (TransformerLayer: not is_moe_layer): layer 1's MLP, whose
    # input requires grad by then; selective shared_experts without shared experts checkpoints nothing.
    "frozen MoE first layer then dense, selective mlp + shared_experts, linear_fc1 + linear_fc2": (
        dict(MOE, moe_layer_freq=[1, 0], gated_linear_unit=True, activation_func="silu",
             recompute_granularity="selective", recompute_modules=["mlp", "shared_experts"]), "rope", "fp32",
        ("linear_fc1", "linear_fc2"), True, 0, 0, 0),
    "base trains, MoE SwiGLU fused every other layer, linear_fc1 + linear_fc2": (
        dict(MOE, gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True, moe_layer_freq=[0, 1]),
        "rope", "fp32", ("linear_fc1", "linear_fc2"), False, 0, 0, 0),
    "frozen MLA + MoE, q_lora, all four targets (no linear_qkv in MLA)": (
        dict(MLA_LN, q_lora_rank=24, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
             moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=32, moe_token_dispatcher_type="alltoall"),
        "rope", "fp32", ALL, True, 0, 0, 0),
    # Adapters on MLA's own projections (tests/test_memory_lora_mla_dist.py under TP): the down
    # projections' adapters share the input norm's output; without latent norms kv_up's adapter
    # copies its latent (a view of kv_down's output) contiguous [T, kv_lora].
    "base trains MLA, q_lora, qk_layernorm, MLA's four projections": (
        dict(MLA_LN, q_lora_rank=24, qk_layernorm=True), "rope", "fp32", MLA_FOUR, False, 0, 0, 0),
    "frozen MLA, direct q, linear_q_proj + linear_kv_down_proj + linear_kv_up_proj": (
        dict(MLA_LN, q_lora_rank=None), "rope", "fp32", ("linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj"),
        True, 0, 0, 0),
    # Multi-token prediction with an MLA + MoE layer (the last layer's kind).
    "frozen MLA + MoE, 1 MTP layer, linear_proj + linear_fc2": (
        dict(MLA_LN, q_lora_rank=24, qk_layernorm=True, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
             moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=32, moe_token_dispatcher_type="alltoall",
             mtp_num_layers=1), "rope", "fp32", ("linear_proj", "linear_fc2"), True, 0, 0, 0),
}


@pytest.mark.parametrize("name", list(PEFT_CASES))
def test_lora_saved_bytes_match_megatron_core(mcore, name):
    from megatron_flops.flops.passes import PeftSpec

    fields, position, dtype, targets, frozen, norms, hidden_sites, attn_sites = PEFT_CASES[name]
    if fields.get("recompute_granularity") == "full" and mcore_memory.bridge_peft() is None:
        pytest.skip("full recompute of a frozen model needs Megatron-Bridge's fix (its cached venv is absent)")
    measured_forward, measured_peak = _measure(fields, position, dtype, lora=(targets, LORA_RANK, frozen))
    model = dict(BASE, **fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model)
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type=position,
                                               add_bias_linear=fields.get("add_bias_linear", False)))
    par = Parallelism()
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype=dtype)
    peft = PeftSpec(frozen=frozen, lora_rank=LORA_RANK, lora_targets=targets)
    act = chunk_activations(spec, options, par, training, pp_rank=0, chunk=0, peft=peft,
                            recompute=RecomputeSpec.from_mapping(model))
    a, tokens, h = training.param_bytes, SEQ * MBS, BASE["hidden_size"]
    # The CPU kernels' extra bytes (see cpu_kernel_delta), for the sites that save.
    delta = norms * tokens * 2 * (a - 4) + hidden_sites * tokens * h * (a - 1)
    delta += attn_sites * MBS * BASE["num_attention_heads"] * SEQ * SEQ * (a - 1)
    if "recompute_granularity" not in fields and "num_moe_experts" not in fields and "kv_lora_rank" not in fields:
        # Every adapter's [T, r] intermediate, in each layer (MTP's too).
        layers = BASE["num_layers"] + fields.get("mtp_num_layers", 0)
        assert act.components["lora"] == layers * len(targets) * tokens * LORA_RANK * a
    assert measured_forward == [act.forward + act.shared + delta] * NUM_MB
    assert measured_peak == schedule_peak([act], in_flight(par, NUM_MB, 0))[0] + delta


MLA_DENSE = {k: v for k, v in MLA.items() if not k.startswith(("mtp_", "moe_", "num_moe"))}
MLA_CASES = {
    "q_lora, no latent norms": dict(MLA_DENSE, q_lora_rank=24),
    "q_lora, qk_layernorm (the latent norms)": dict(MLA_DENSE, q_lora_rank=24, qk_layernorm=True),
    "direct q, qk_layernorm": dict(MLA_DENSE, q_lora_rank=None, qk_layernorm=True),
    "q_lora, MoE every other layer, shared experts, alltoall": dict(
        MLA, q_lora_rank=24, mtp_num_layers=None, moe_token_dispatcher_type="alltoall"),
    # Multi-token prediction (its layer: the last layer's kind, here MoE).
    "q_lora, qk_layernorm, MoE every other layer, 1 MTP layer": dict(
        MLA, q_lora_rank=24, qk_layernorm=True, moe_token_dispatcher_type="alltoall"),
    "dense GPT, 2 MTP layers": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                    normalization="RMSNorm", add_bias_linear=False, mtp_num_layers=2),
    # Recompute (LayerNorm, fp32: torch's CPU kernels save as the CUDA convention, so the
    # backward peaks need no correction).
    "q_lora, qk_layernorm, full recompute (uniform 1)": dict(
        MLA_DENSE, q_lora_rank=24, qk_layernorm=True, normalization="LayerNorm", **FULL_UNIFORM,
        recompute_num_layers=1),
    "direct q, selective core_attn": dict(MLA_DENSE, q_lora_rank=None, normalization="LayerNorm",
                                          recompute_granularity="selective"),
    # MTP under full recompute: megatron-core checkpoints each MTP layer after its embedding
    # (uniform, recompute_num_layers 1; block leaves it alone).
    "dense GPT, RoPE, 2 MTP layers, full recompute (uniform 1)": dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, add_bias_linear=False,
        normalization="LayerNorm", mtp_num_layers=2, **FULL_UNIFORM, recompute_num_layers=1),
    "q_lora, 1 MTP layer, full recompute (block 1)": dict(
        MLA_DENSE, q_lora_rank=24, normalization="LayerNorm", mtp_num_layers=1, recompute_granularity="full",
        recompute_method="block", recompute_num_layers=1),
    "q_lora, qk_layernorm, 1 MTP layer, selective core_attn": dict(
        MLA_DENSE, q_lora_rank=24, qk_layernorm=True, normalization="LayerNorm", mtp_num_layers=1,
        recompute_granularity="selective"),
}


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_mla_mtp_saved_bytes_match_megatron_core(mcore, name):
    fields = dict(MLA_CASES[name], hidden_dropout=0.0, attention_dropout=0.0)
    measured_forward, measured_peak = _measure(fields, "rope", "fp32")
    model = dict(fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model)
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope"))
    par = Parallelism()
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype="fp32")
    act = chunk_activations(spec, options, par, training, pp_rank=0, chunk=0,
                            recompute=RecomputeSpec.from_mapping(model))
    # torch's CPU RMSNorm is composite and also keeps x * rstd: [T, h] per main norm (2 per
    # layer + final), [T, q_lora] and [T, kv_lora] per layer for the latent norms.
    # An MTP layer adds 5 norms (enorm, hnorm, its layer's two, its final norm).
    tokens, mtp = SEQ * MBS, fields.get("mtp_num_layers") or 0
    layers = fields["num_layers"] + mtp
    delta = (2 * layers + 1 + 3 * mtp) * tokens * fields["hidden_size"] * 4
    if fields.get("qk_layernorm"):
        delta += layers * tokens * ((fields.get("q_lora_rank") or 0) + fields["kv_lora_rank"]) * 4
    if fields.get("normalization", "RMSNorm") == "LayerNorm" or "recompute_granularity" in fields:
        assert fields.get("normalization") == "LayerNorm"  # (fp32 LayerNorm: no CPU correction)
        delta = 0
    assert measured_forward == [act.forward + act.shared + delta] * NUM_MB
    assert measured_peak == schedule_peak([act], in_flight(par, NUM_MB, 0))[0] + delta


def test_non_gated_fused_experts_are_refused_like_megatron_core(mcore):
    # megatron-core's experts pass the routing probabilities to MLP.forward, which fuses only
    # SwiGLU and quick-GELU with them: a non-gated fused bias-GELU expert raises in forward.
    fields = dict(MOE, add_bias_linear=True, bias_activation_fusion=True)
    with pytest.raises(ValueError, match="Only support fusion of swiglu and quick_gelu"):
        _measure(fields, "rope", "fp32")
    model = dict(BASE, **fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model)
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB))
    from megatron_flops.memory.report import decoder_memory

    with pytest.raises(ValueError, match="non-gated activation"):
        decoder_memory(spec, options, Parallelism(), Training(seq_length=SEQ, micro_batch_size=MBS,
                                                              num_microbatches=NUM_MB))


def test_leading_moe_layer_without_expert_adapters_saves_nothing(mcore, monkeypatch):
    # Legacy GroupedMLP (CUDA-only) takes no expert adapter. Stand-in: SequentialMLP experts whose adapters are
    # removed again after Bridge's wrapping (a test-only switch), so the first (MoE) layer has no adapter at all and
    # the gradient starts at layer 1's (dense) linear_fc1 adapter. Nothing in layer 0 requires grad: it saves
    # nothing, and the model (read with legacy GroupedMLP options, whose experts take no adapter) saves exactly what
    # a frozen dense first layer saves (fp32 LayerNorm: no CPU correction).
    real = mcore_memory.apply_lora

    def without_expert_adapters(model, targets, rank):
        out = real(model, targets, rank)
        for prefix, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if ".experts." in f"{prefix}." and isinstance(child, mcore_memory.LoRALinear):
                    setattr(parent, name, child.to_wrap)
        return out

    monkeypatch.setattr(mcore_memory, "apply_lora", without_expert_adapters)
    fields = dict(MOE, moe_layer_freq=[1, 0], gated_linear_unit=True, activation_func="silu")
    targets = ("linear_fc1", "linear_fc2")
    measured_forward, measured_peak = _measure(fields, "rope", "fp32", lora=(targets, LORA_RANK, True))
    model = dict(BASE, **fields, vocab_size=VOCAB)
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope", add_bias_linear=False,
                                               moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True))
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype="fp32")
    act = chunk_activations(ModelSpec.from_mapping(model), options, Parallelism(), training, pp_rank=0, chunk=0,
                            peft=PeftSpec(frozen=True, lora_rank=LORA_RANK, lora_targets=targets))
    # Layer 1's MLP from fc1's adapter on only (T = 32, r = 4, fp32): the two adapters' [T, r] intermediates; no
    # attention, norm, router, dispatcher or expert tensor (layer 0's, or layer 1's attention before the adapter).
    assert act.components["lora"] == 2 * 32 * 4 * 4
    assert not {"attention", "norm", "moe/router", "moe/dispatcher", "moe/experts"} & set(act.components)
    assert measured_forward == [act.forward + act.shared] * NUM_MB
    assert measured_peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]
