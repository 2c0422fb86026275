"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) from megatron-core fields: absorbed MLA over
the top-k keys of each query, a lightning indexer over every causal pair, and the indexer's KL loss
when it trains. Each term is derived here by hand, and Megatron-Bridge's DSA formula (main after
v0.6.0) is computed for a reference config with the relation to ours stated exactly."""

from __future__ import annotations

from fractions import Fraction

import pytest

from megatron_flops.flops.formulas import band_pairs, estimate, parse_rows
from megatron_flops.model.spec import ModelSpec

# A tiny DeepSeek-V3.2-like model: MLA with q_lora, the indexer, every layer DSA.
H, NQ, Q_LORA, KV_LORA, QK, ROPE, V = 64, 4, 24, 16, 8, 4, 8
IDX_HEADS, IDX_DIM, TOPK = 2, 8, 5
DSA = dict(hidden_size=H, num_attention_heads=NQ, num_layers=1, vocab_size=128, multi_latent_attention=True,
           q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=V,
           experimental_attention_variant="dsa", dsa_indexer_n_heads=IDX_HEADS, dsa_indexer_head_dim=IDX_DIM,
           dsa_indexer_topk=TOPK)


def _parts(fields: dict, seqlens: list[int], attention: str = "causal") -> dict[str, int]:
    spec = ModelSpec.from_mapping(fields)
    return dict(estimate(spec, parse_rows(seqlens), attention=attention).components)


def test_dsa_terms_by_hand():
    s = 12
    parts = _parts(dict(DSA, dsa_indexer_loss_coeff=0.01), [s])
    # Projections: q_down h->24, q_up 24->4*(8+4), kv_down h->16+4, kv_up 16->4*(8+8) (absorbed: same MACs), x3.
    assert parts["attn/qkv"] == 3 * 2 * s * (H * Q_LORA + Q_LORA * NQ * (QK + ROPE) + H * (KV_LORA + ROPE)
                                             + KV_LORA * NQ * (QK + V))
    assert parts["attn/out"] == 3 * 2 * s * NQ * V * H
    # Sparse core: top-5 keys per query, min(i, 5) for i = 1..12: 5*12 - 5*4/2 = 50 causal pairs; under the
    # causal convention half the two-sided band |q - k| <= 4: band = 12*9 - 4*5 = 88 -> 44 pairs (50 - s/2).
    assert band_pairs(s, TOPK - 1) == 88
    assert parts["dsa/core"] == 3 * 2 * NQ * (KV_LORA + ROPE + KV_LORA) * 44
    # Indexer projections: wq_b 24->2*8, wk h->8, weights h->2; forward + wgrad (inputs detached).
    assert parts["dsa/indexer"] == 2 * 2 * s * (Q_LORA * IDX_HEADS * IDX_DIM + H * IDX_DIM + H * IDX_HEADS)
    # Index scores: 2*(8+1) MACs per pair over s^2/2 pairs forward, and its backward (2 GEMMs) for the dense loss.
    assert parts["dsa/indexer_scores"] == (1 + 2) * 2 * IDX_HEADS * (IDX_DIM + 1) * s * s // 2
    # The loss's target: main-model scores over (kv_lora + rope), forward only, every causal pair.
    assert parts["dsa/indexer_loss"] == 2 * NQ * (KV_LORA + ROPE) * s * s // 2
    # Without the loss: indexer forward only, no score backward, no target.
    frozen = _parts(DSA, [s])
    assert frozen["dsa/indexer"] * 2 == parts["dsa/indexer"] and "dsa/indexer_loss" not in frozen
    assert frozen["dsa/indexer_scores"] == 2 * IDX_HEADS * (IDX_DIM + 1) * s * s // 2
    # Sparse loss: the backward and the target over the selected pairs only (44 under the convention).
    sparse = _parts(dict(DSA, dsa_indexer_loss_coeff=0.01, dsa_indexer_use_sparse_loss=True), [s])
    assert sparse["dsa/indexer_loss"] == 2 * NQ * (KV_LORA + ROPE) * 44
    assert sparse["dsa/indexer_scores"] == 2 * IDX_HEADS * (IDX_DIM + 1) * (s * s // 2 + 2 * 44)


def bridge_dsa_self_attn_term(*, s: int, n: int, trains: bool, sparse_loss: bool) -> Fraction:
    """Megatron-Bridge main's ``self_attn_term`` for ``experimental_attention_variant == "dsa"``
    (flop_utils.py), one layer, ``n`` rows of ``s`` tokens, ``s > topk``, in exact arithmetic."""
    tokens = n * s
    ctx_dense = Fraction(s + 1, 2)
    ctx_sparse = TOPK - Fraction(TOPK * (TOPK - 1), 2 * s)
    q_term = Q_LORA * (H + NQ * (QK + ROPE) + 1)
    kv_term = KV_LORA * (H + NQ * (QK + V) + 1) + H * ROPE
    projections = 6 * (q_term + kv_term + NQ * V * H)
    core = 6 * ctx_sparse * NQ * (2 * KV_LORA + ROPE)
    idx_proj = (4 if trains else 2) * (Q_LORA * IDX_HEADS * IDX_DIM + H * IDX_DIM + H * IDX_HEADS)
    unit = IDX_HEADS * (IDX_DIM + 1)
    loss_ctx = ctx_sparse if sparse_loss else ctx_dense
    scores = 2 * ctx_dense * unit + (4 * loss_ctx * unit if trains else 0)
    teacher = 2 * loss_ctx * NQ * (KV_LORA + ROPE) if trains else 0
    return tokens * (projections + core + idx_proj + scores + teacher)


@pytest.mark.parametrize("trains, sparse_loss", [(False, False), (True, False), (True, True)])
def test_dsa_relation_to_megatron_bridge(trains, sparse_loss):
    s, n = 40, 3
    fields = dict(DSA, dsa_indexer_loss_coeff=0.01 if trains else 0, dsa_indexer_use_sparse_loss=sparse_loss)
    parts = _parts(fields, [s] * n)
    ours = sum(v for k, v in parts.items() if k.startswith(("attn/", "dsa/")))
    # Bridge - ours, all token-linear: Bridge prices the q/kv norms (+1 per lora rank), and counts causal
    # pairs with the diagonal (s(s+1)/2, sum min(i, k)) where our causal convention halves the two-sided
    # count (s/2 fewer pairs per sequence) in the core (3 passes), the indexer scores (1 + 2 passes when
    # trained) and the loss target (1 pass).
    unit = IDX_HEADS * (IDX_DIM + 1)
    per_token = (6 * (Q_LORA + KV_LORA) + 3 * NQ * (2 * KV_LORA + ROPE) + unit * (1 + 2 * trains)
                 + trains * NQ * (KV_LORA + ROPE))
    assert bridge_dsa_self_attn_term(s=s, n=n, trains=trains, sparse_loss=sparse_loss) - ours == n * s * per_token


def test_dsa_hybrid_symbol_and_mtp():
    hybrid = ModelSpec.from_mapping(dict({k: v for k, v in DSA.items() if k not in ("num_layers",
                                                                                       "experimental_attention_variant")},
                                         hybrid_layer_pattern="D-MD-/D-"))
    assert [m for m, _ in hybrid.layers] == ["dsa", "none", "mamba", "dsa", "none"]
    parts = estimate(hybrid, parse_rows([16])).components
    assert parts["mtp/dsa/core"] * 2 == parts["dsa/core"]
    gpt = ModelSpec.from_mapping(dict(DSA, mtp_num_layers=1))
    # MTP copies the last decoder layer: a DSA layer.
    assert gpt.mtp_layer_runs == ((("dsa", "mlp"), 1),)


@pytest.mark.parametrize("fields, message", [
    (dict(DSA, multi_latent_attention=False), "DSA layers need multi-latent attention"),
    ({k: v for k, v in DSA.items() if k != "dsa_indexer_topk"}, "DSA layers need 'dsa_indexer_topk'"),
    (dict(DSA, window_size=[4, 0]), "DSA layers and window_size together"),
    (dict(DSA, dsa_indexer_loss_coeff="big"), "dsa_indexer_loss_coeff must be a number"),
])
def test_dsa_refusals(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_mapping(fields)


@pytest.mark.parametrize("device", [False, True])
def test_tracker_prices_dsa_as_the_estimate(device, monkeypatch):
    # The top-k band travels as the window statistic, on the host and on the device path alike.
    torch = pytest.importorskip("torch")
    from megatron_flops.tracking import batch_checks
    from megatron_flops.tracking.tracker import FlopsTracker

    if device:
        monkeypatch.setattr(batch_checks, "HOST_DEVICE_TYPES", frozenset())
    spec = ModelSpec.from_mapping(dict(DSA, dsa_indexer_loss_coeff=0.01, dsa_indexer_use_sparse_loss=True))
    tracker = FlopsTracker(spec, seq_length=32)
    tracker.record(tokens=torch.zeros(1, 32, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 12, 30]))
    result = tracker.end_step()
    assert result.flops == estimate(spec, parse_rows([[3, 9, 18]])).total


# ---- Hugging Face deepseek_v32 ---------------------------------------------------------------------

V32 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
           vocab_size=100, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, n_group=1, topk_group=1, index_n_heads=2, index_head_dim=16, index_topk=5)


def test_deepseek_v32_measured_is_the_estimate_with_the_dense_core():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from hf_tiny import estimate_report, measured_flops, tiny_model

    config, model = tiny_model("deepseek_v32", **V32)
    seqlens = [12, 7, 3]
    measured = measured_flops(model, seqlens, use_cache=False)
    report = estimate_report(config, [[s] for s in seqlens])
    parts = report["components"]
    # The indexer runs under no_grad in transformers: forward only, scores over every (masked) pair; its
    # projections and scores equal the estimate. transformers' eager attention masks a dense MLA core
    # (not absorbed: q.k over nope + rope, context over v, every pair, 3 passes) where we price the
    # top-k pairs over the latent dims (dsa/core).
    dense_core = sum(3 * 2 * 4 * (16 + 8 + 16) * s * s for s in seqlens)
    assert measured == report["total_flops"] - parts["dsa/core"] + 3 * dense_core
    # 3 DSA layers; under "full", dsa/core = 3 passes x 2 x 4 heads x (16 + 8 + 16) latent dims x the band.
    assert parts["dsa/core"] == 3 * 3 * 2 * 4 * (16 + 8 + 16) * sum(band_pairs(s, 4) for s in seqlens)


def test_glm_moe_dsa_shares_top_k_and_is_measured():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from hf_tiny import estimate_report, measured_flops, tiny_model

    config, model = tiny_model("glm_moe_dsa", **dict(V32, num_hidden_layers=4), index_topk_freq=2,
                               index_skip_topk_offset=2)
    assert config.indexer_types == ["full", "full", "shared", "full"]
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert [m for m, _ in spec.layers] == ["dsa", "dsa", "dsa_shared", "dsa"]
    seqlens = [12, 7]
    measured = measured_flops(model, seqlens, use_cache=False)
    report = estimate_report(config, [[s] for s in seqlens])
    dense_core = sum(3 * 2 * 4 * (16 + 8 + 16) * s * s for s in seqlens)
    assert measured == report["total_flops"] - report["components"]["dsa/core"] + 4 * dense_core
    # The shared layer prices no indexer: 3 of the 4 layers run one, forward only, every pair under "full":
    # 2 x 2 heads x (16 + 1) MACs per pair.
    assert report["components"]["dsa/indexer_scores"] == 3 * sum(2 * 2 * 17 * s * s for s in seqlens)


def test_megatron_core_index_sharing():
    spec = ModelSpec.from_mapping(dict(DSA, num_layers=7, dsa_indexer_topk_freq=3, dsa_indexer_skip_topk_offset=2,
                                       mtp_num_layers=1))
    # Layer n runs its indexer when max(n - 2, 0) % 3 == 0: layers 1, 2, 5 (n = 5: 3 % 3).
    assert [m for m, _ in spec.layers] == ["dsa", "dsa", "dsa_shared", "dsa_shared", "dsa", "dsa_shared", "dsa_shared"]
    assert spec.mtp_layer_runs == ((("dsa", "mlp"), 1),)  # MTP layers number their own: the first runs one
    parts = estimate(spec, parse_rows([10])).components
    single = estimate(ModelSpec.from_mapping(dict(DSA, num_layers=1)), parse_rows([10])).components
    assert parts["dsa/indexer"] == 3 * single["dsa/indexer"] and parts["mtp/dsa/indexer"] == single["dsa/indexer"]
    assert parts["dsa/core"] == 7 * single["dsa/core"]
