"""The causal convention against published closed forms, and every intended difference.

- Narayanan et al. 2021 (Megatron-LM, appendix): 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) for
  MHA with ffn = 4h. The paper prices the whole s^2 product: our ``full`` convention.
- Megatron-LM's ``num_floating_point_operations`` extends it for GQA, ``kv_channels`` and
  SwiGLU and halves core attention for the causal mask: our ``causal`` convention (the
  default); restated here from its algebra, then compared term by term. Our only intended
  differences: the MoE router GEMM (Megatron-LM omits it) and the MLA/MTP norm terms that
  Megatron-LM prices although no GEMM runs.
"""

from __future__ import annotations

import pytest

from megatron_flops.flops.formulas import SeqStats, estimate, parse_rows, training_flops
from megatron_flops.model.spec import ModelSpec


def megatron_lm_closed_form(c: dict, batch: int, seq: int) -> int:
    """Megatron-LM's training FLOPs for full-length rows, from its algebra (ints throughout)."""
    h, L, V = c["hidden_size"], c["num_layers"], c["padded_vocab_size"]
    heads = c["num_attention_heads"]
    groups = c.get("num_query_groups") or heads
    kv = c.get("kv_channels") or h // heads
    ffn_factor = 3 if c.get("swiglu") else 2
    tokens = batch * seq
    mtp = c.get("mtp_num_layers", 0)
    layers = L + mtp
    moe = c.get("num_experts")
    n_moe = 0
    if moe:
        pattern = c["moe_layer_freq"]
        n_moe = sum(pattern) + pattern[-1] * mtp
    n_dense = layers - n_moe
    if c.get("multi_latent_attention"):
        nq, qk, rope, v = heads, c["qk_head_dim"], c["qk_pos_emb_head_dim"], c["v_head_dim"]
        q_lora, kv_lora = c.get("q_lora_rank"), c["kv_lora_rank"]
        q_term = h * nq * (qk + rope) if q_lora is None else q_lora * (h + nq * (qk + rope) + 1)
        attn = 6 * (q_term + kv_lora * (h + nq * (qk + v) + 1) + h * rope + nq * v * h)
        core_fwd_x2 = 3 * 2 * (nq * (qk + rope) + nq * v)  # before the causal /2
    else:
        q_proj, kv_proj = kv * heads, kv * groups
        attn = 6 * (h * (q_proj + 2 * kv_proj) + q_proj * h)
        core_fwd_x2 = 3 * 2 * q_proj * 2
    mlp = 6 * h * c["ffn_hidden_size"] * ffn_factor * n_dense
    if moe:
        mlp += 6 * h * (c["moe_ffn_hidden_size"] * c["moe_router_topk"] * ffn_factor) * n_moe
        mlp += 6 * h * c.get("moe_shared_expert_intermediate_size", 0) * ffn_factor * n_moe
    mtp_terms = 6 * mtp * (3 * h + 2 * h * h)
    logits = 6 * h * V * (mtp + 1)
    per_token = mlp + attn * layers + mtp_terms + logits
    core = batch * seq * seq * core_fwd_x2 * layers // 2
    return tokens * per_token + core


def _spec(c: dict) -> ModelSpec:
    fields = {k: v for k, v in c.items() if k not in ("swiglu", "num_experts", "padded_vocab_size")}
    fields["vocab_size"] = c["padded_vocab_size"]
    if c.get("swiglu"):
        fields.update(gated_linear_unit=True, activation_func="silu")
    if c.get("num_experts"):
        fields["num_moe_experts"] = c["num_experts"]
    return ModelSpec.from_mapping(fields)


def test_paper_appendix_formula():
    # GPT-3-like MHA, ffn = 4h: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)), kept in integers:
    # 72 B s L h^2 + 12 B s^2 L h + 6 B s h V.
    B, s, L, h, V = 8, 2048, 24, 2048, 51200
    spec = ModelSpec.from_mapping(dict(num_layers=L, hidden_size=h, num_attention_heads=16, vocab_size=V))
    closed = 72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V
    assert estimate(spec, parse_rows([s] * B), attention="full").total == closed
    # The causal convention takes half of the s^2 term: 6 B s^2 L h less.
    assert estimate(spec, parse_rows([s] * B)).total == closed - 6 * B * s * s * L * h


DENSE = {
    "llama-like GQA SwiGLU": dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                                  ffn_hidden_size=688, swiglu=True, padded_vocab_size=1024),
    "kv_channels": dict(num_layers=3, hidden_size=192, num_attention_heads=6, kv_channels=48,
                        ffn_hidden_size=512, padded_vocab_size=512),
    "MHA gelu": dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                     padded_vocab_size=256),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_equals_megatron_lm(name):
    c = DENSE[name]
    assert estimate(_spec(c), parse_rows([512] * 3)).total == megatron_lm_closed_form(c, 3, 512)


def test_moe_differs_by_the_router_gemm_only():
    c = dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, swiglu=True,
             num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96, moe_shared_expert_intermediate_size=64,
             moe_layer_freq=[0, 1, 1, 1], padded_vocab_size=256)
    ours = estimate(_spec(c), parse_rows([256] * 2))
    # Router: [T, h] @ [h, E] per MoE layer, x3: 6 * T * h * E * 3 layers.
    router = 6 * 512 * 128 * 8 * 3
    assert ours.components["moe/router"] == router
    assert ours.total - router == megatron_lm_closed_form(c, 2, 256)


@pytest.mark.parametrize("q_lora", [None, 48])
def test_mla_differs_by_the_norm_terms_only(q_lora):
    c = dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
             multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=32, qk_head_dim=16,
             qk_pos_emb_head_dim=8, v_head_dim=16, padded_vocab_size=256)
    ours = estimate(_spec(c), parse_rows([128] * 2)).total
    # Megatron-LM adds 6 * T * L * (kv_lora_rank [+ q_lora_rank]) for the q/kv norms.
    norms = 6 * 256 * 2 * (32 + (q_lora or 0))
    assert megatron_lm_closed_form(c, 2, 128) - ours == norms


def test_mtp_differs_by_the_norm_terms_only():
    c = dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
             mtp_num_layers=2, padded_vocab_size=256)
    ours = estimate(_spec(c), parse_rows([64] * 4)).total
    # Megatron-LM prices 3h per token per MTP layer for enorm/hnorm/final norm: 6 * T * 2 * 3h.
    assert megatron_lm_closed_form(c, 4, 64) - ours == 6 * 256 * 2 * 3 * 128


# ---- one-term deltas: change one statistic, only one component moves, by an exact amount -------

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128)


def test_sum_of_squares_moves_only_core_attention():
    spec = ModelSpec.from_mapping(BASE)
    a = SeqStats(num_sequences=2, num_tokens=100, num_padded_tokens=100, sum_seqlen_squared=5000)
    b = SeqStats(num_sequences=2, num_tokens=100, num_padded_tokens=100, sum_seqlen_squared=5001)
    da, db = training_flops(spec, a).components, training_flops(spec, b).components
    moved = {k: db[k] - da[k] for k in da if db[k] != da[k]}
    # One more pair: 3 passes x 2 layers x FLOPS_PER_MAC 2 x 4 heads x (16 + 16) / 2 (causal) = 768.
    assert moved == {"attn/core": 768}


def test_one_more_token_moves_only_token_linear_terms():
    spec = ModelSpec.from_mapping(BASE)
    a = SeqStats(num_tokens=100, num_padded_tokens=101, sum_seqlen_squared=5000)
    b = SeqStats(num_tokens=101, num_padded_tokens=101, sum_seqlen_squared=5000)
    da, db = training_flops(spec, a).components, training_flops(spec, b).components
    moved = {k: db[k] - da[k] for k in da if db[k] != da[k]}
    # Per token x3: qkv 2*64*192*2 layers, out 2*64*64*2, mlp 2*(64*256 + 256*64)*2, logits 2*64*128.
    assert moved == {
        "attn/qkv": 3 * 2 * 64 * 192 * 2,
        "attn/out": 3 * 2 * 64 * 64 * 2,
        "mlp": 3 * 2 * 2 * 64 * 256 * 2,
        "logits": 3 * 2 * 64 * 128,
    }


def test_padding_moves_only_executed_flops():
    spec = ModelSpec.from_mapping(BASE)
    # An unpacked sequence (an int) padded to 16 is attended over all 16 tokens.
    rows = parse_rows([{"seqlens": 10, "pad_to": 16}])
    model, executed = estimate(spec, rows), estimate(spec, rows, include_padding=True)
    assert model.total == estimate(spec, parse_rows([10])).total
    assert executed.total == estimate(spec, parse_rows([16])).total


def test_sliding_window_counts_band_pairs():
    # Window 3 on a 10-token sequence: |q - k| <= 3 gives 10*7 - 3*4 = 58 pairs (full: 100).
    spec = ModelSpec.from_mapping(dict(BASE, window_size=[3, 0], window_attn_skip_freq=2))
    full = ModelSpec.from_mapping(BASE)
    # Layer 1 windowed, layer 2 full (skip freq 2): core = 3 * 2 * 4 * 32 * (58 + 100) for "full".
    assert estimate(spec, parse_rows([10]), attention="full").components["attn/core"] == 3 * 2 * 4 * 32 * 158
    assert estimate(full, parse_rows([10]), attention="full").components["attn/core"] == 3 * 2 * 4 * 32 * 200
    # Causal halves the band: 79 pairs.
    assert estimate(spec, parse_rows([10])).components["attn/core"] == 3 * 2 * 4 * 32 * 79


def test_hybrid_mamba_follows_megatron_lm():
    # Pattern "M*-M": 2 Mamba layers, 1 attention-only layer, 1 MLP-only layer (Megatron-LM's
    # hybrid_flops). h=64, 4 heads of 16, ffn 128 (gelu), V=128, state 16, head dim 16, 2 groups.
    h, T, s, V, ffn, N, G = 64, 2 * 32, 32, 128, 128, 16, 2
    spec = ModelSpec.from_mapping(dict(
        hidden_size=h, num_attention_heads=4, ffn_hidden_size=ffn, vocab_size=V, num_layers=4,
        hybrid_override_pattern="M*-M", mamba_state_dim=N, mamba_head_dim=16, mamba_num_groups=G,
    ))
    d_in, heads = 2 * h, 2 * h // 16
    mamba = 2 * T * h * (2 * d_in + 2 * G * N + heads) + 7 * T * d_in * N + 2 * T * d_in * h
    attn = 4 * T * h * h + 4 * T * h * h + 2 * (2 * s * s) * h  # q+o, k+v (MHA), causal core
    mlp = 4 * T * h * ffn
    logits = 2 * T * h * V
    assert estimate(spec, parse_rows([s, s])).total == 3 * (2 * mamba + attn + mlp + logits)
