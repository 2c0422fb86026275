"""Linear attention (Gated DeltaNet): the projections and the short convolution are priced exactly,
the recurrence under a named convention (``gdn/core``, :func:`formulas.gdn_core_flops`). Measured
with FlopCounterMode on transformers' Qwen3-Next (its torch fallbacks), the measurement equals the
estimate plus two remainders, each an exact closed form: what torch's padded convolution and
FlopCounterMode's grouped-conv formula add, and the chunked delta rule that the fallback runs in
place of the convention. Megatron-LM's and Megatron-Bridge's GDN formulas are computed for a
reference config and their relation to ours stated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_tiny import estimate_report, measured_flops, tiny_model
from megatron_flops.cli import main
from megatron_flops.flops.formulas import (TRAIN_PASSES, SeqStats, estimate, gdn_core_flops, parse_rows,
                                           training_flops)
from megatron_flops.model.spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
MLM_TRAINING = REPO.parent / "shared" / "upstream" / "megatron-lm" / "core_v0.19.0" / "megatron" / "training" / "training.py"

# Qwen3-Next, tiny: d_k != d_v so that the convention's d_k * d_v shows; GQA-style value heads (2 per key head).
QWEN3_NEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=100, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, num_experts_per_tok=2, mlp_only_layers=[1],
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
CHUNK = 64  # transformers' torch_chunk_gated_delta_rule chunk_size


def torch_conv_flops(s: int, channels: int, k: int) -> int:
    """FlopCounterMode's count of transformers' torch ``causal_conv1d_fn`` over one sequence, forward
    and backward: F.conv1d with padding k - 1 computes s + k - 1 outputs (k MACs per channel each);
    the input gradient is the same size; the weight gradient's formula ignores ``groups``, so a
    depthwise convolution's is counted ``channels`` times: 2*C*k*(s + k - 1) * (1 + 1 + C)."""
    return 2 * channels * k * (s + k - 1) * (2 + channels)


def torch_chunked_delta_rule_flops(s: int, nv: int, dk: int, dv: int) -> int:
    """FlopCounterMode's count of transformers' ``torch_chunk_gated_delta_rule`` over one sequence,
    forward and backward, read off its matmuls (n = ceil(s / 64) chunks of C = 64, per value head):

    per chunk, 3x (forward, two operand gradients): k_beta @ k^T and q @ k^T (C^2 d_k each), and
    intra @ v_new (C^2 d_v); the two solve_triangular's backward each run one matmul for the
    matrix gradient (C^2 d_k + C^2 d_v; the solves themselves count 0): n C^2 (7 d_k + 4 d_v).
    The state matmuls k_cumdecay @ S and q @ S (C d_k d_v) run 3x except in the first chunk (S = 0
    needs no gradient: 2x), and k^T @ v_new 3x except in the last (the final state is dropped: 1x):
    C d_k d_v (9n - 4)."""
    n = -(-s // CHUNK)
    return 2 * nv * (n * CHUNK * CHUNK * (7 * dk + 4 * dv) + (9 * n - 4) * CHUNK * dk * dv)


def _qwen3_next(**kw):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    return tiny_model("qwen3_next", **{**QWEN3_NEXT, **kw})


def test_qwen3_next_measured_is_the_estimate_plus_the_named_remainders():
    config, model = _qwen3_next()
    seqlens = [12, 7, 70]  # 70: two chunks of the torch delta rule
    measured = measured_flops(model, seqlens, use_cache=False)
    report = estimate_report(config, [[s] for s in seqlens])
    parts = report["components"]
    num_gdn = 3
    nv, dk, dv, k = 4, 8, 12, 4
    channels = 2 * 2 * dk + nv * dv  # q, k (2 key heads each) and v
    tokens = sum(seqlens)
    # The priced convolution and core: 3 passes of 2*T*C*k and of 2*4*T*nv*dk*dv, per GDN layer.
    assert parts["gdn/conv"] == num_gdn * TRAIN_PASSES * 2 * tokens * channels * k
    assert parts["gdn/core"] == num_gdn * TRAIN_PASSES * gdn_core_flops(tokens, nv, dk, dv)
    # Everything else FlopCounterMode sees is a GEMM the estimate prices exactly.
    rest = report["total_flops"] - parts["gdn/conv"] - parts["gdn/core"]
    conv = sum(torch_conv_flops(s, channels, k) for s in seqlens)
    core = sum(torch_chunked_delta_rule_flops(s, nv, dk, dv) for s in seqlens)
    assert measured == rest + num_gdn * (conv + core)
    assert report["padded_vocab_size"] == 100


def test_qwen3_next_layers_follow_transformers():
    config, model = _qwen3_next(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3],
                                layer_types=["linear_attention", "full_attention"] * 3)
    spec = ModelSpec.from_hf_config(config.to_dict())
    hf = [("gdn" if layer.block_type == "linear_attention" else "attention",
           "moe" if hasattr(layer.mlp, "experts") else "mlp") for layer in model.model.layers]
    assert list(spec.layers) == hf
    assert spec.attention_output_gate and spec.gdn is not None
    assert (spec.gdn.num_key_heads, spec.gdn.num_value_heads, spec.gdn.key_head_dim, spec.gdn.value_head_dim,
            spec.gdn.conv_kernel_dim) == (2, 4, 8, 12, 4)


# ---- Megatron-LM and Megatron-Bridge reference formulas -----------------------------------------

# Qwen3-Next-80B-A3B's GDN sizes (its config.json), megatron-core field names.
REF = dict(hidden_size=2048, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
           linear_num_value_heads=32, linear_conv_kernel_dim=4)


def megatron_gdn_layer_flops(tokens: int, hidden_size: int, linear_key_head_dim: int, linear_value_head_dim: int,
                             linear_num_key_heads: int, linear_num_value_heads: int, linear_conv_kernel_dim: int) -> int:
    """Megatron-LM core_v0.19.0 ``gdn_layer_flops`` (training.py) and Megatron-Bridge main's
    ``gdn_layer_flops`` / ``gdn_self_attn_per_layer`` (flop_utils.py), one forward: the same
    expression in both, 2 * T * (h * (2qk + 2v + 2nv) + K * (2qk + v) + 4 * nv * dv^2 + h * v)."""
    qk = linear_key_head_dim * linear_num_key_heads
    v = linear_value_head_dim * linear_num_value_heads
    return 2 * tokens * (hidden_size * (2 * qk + 2 * v + 2 * linear_num_value_heads)
                         + linear_conv_kernel_dim * (2 * qk + v)
                         + linear_num_value_heads * linear_value_head_dim ** 2 * 4
                         + hidden_size * v)


def _gdn_layer(fields: dict, tokens: int) -> dict[str, int]:
    spec = ModelSpec.from_mapping(dict(fields, num_layers=1, num_attention_heads=16, vocab_size=128,
                                       experimental_attention_variant="gated_delta_net", linear_attention_freq=[1]))
    parts = training_flops(spec, SeqStats.full_length(1, tokens)).components
    return {k: v for k, v in parts.items() if k.startswith("gdn/")}


def test_gdn_layer_equals_megatron_and_bridge_when_key_and_value_heads_match():
    tokens = 4096
    ours = _gdn_layer(REF, tokens)
    # Qwen3-Next: d_k = d_v = 128, so the convention equals their "4 * nv * dv^2" term exactly.
    assert sum(ours.values()) == TRAIN_PASSES * megatron_gdn_layer_flops(tokens, **REF)
    # Term by term: in_proj 2*T*2048*(2*2048 + 2*4096 + 64); conv 2*T*4*(2*2048 + 4096); core
    # 2*T*4*32*128*128; out_proj 2*T*4096*2048 (forward), x3.
    assert ours == {k: TRAIN_PASSES * v for k, v in {
        "gdn/in_proj": 2 * tokens * 2048 * 12352, "gdn/conv": 2 * tokens * 4 * 8192,
        "gdn/core": 2 * tokens * 4 * 32 * 128 * 128, "gdn/out_proj": 2 * tokens * 4096 * 2048}.items()}


def test_gdn_core_differs_from_megatron_only_by_dk_times_dv():
    tokens = 1000
    fields = dict(REF, linear_key_head_dim=64)  # d_k != d_v
    ours = _gdn_layer(fields, tokens)
    theirs = TRAIN_PASSES * megatron_gdn_layer_flops(tokens, **fields)
    # They write dv^2 where the state is dk x dv: ours - theirs = 3 * 2 * 4 * T * nv * dv * (dk - dv).
    assert sum(ours.values()) - theirs == TRAIN_PASSES * 2 * 4 * tokens * 32 * 128 * (64 - 128)


def test_megatron_lm_reference_formula_is_the_one_computed_here():
    if not MLM_TRAINING.exists():
        pytest.skip("Megatron-LM core_v0.19.0 snapshot not present")
    text = MLM_TRAINING.read_text()
    for line in ("hidden_size * (2 * qk_dim + 2 * v_dim + 2 * num_v_heads)", "conv_kernel_dim * (2 * qk_dim + v_dim)",
                 "num_v_heads * (v_head_dim ** 2) * 4", "hidden_size * v_dim"):
        assert line in text


# ---- megatron-core fields and hybrid patterns ----------------------------------------------------

BASE = dict(hidden_size=64, num_attention_heads=4, vocab_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8)


def test_linear_attention_freq_places_gdn_layers_and_mtp_copies_the_last_layer():
    spec = ModelSpec.from_mapping(dict(BASE, num_layers=8, experimental_attention_variant="gated_delta_net",
                                       linear_attention_freq=4, mtp_num_layers=1))
    assert [m for m, _ in spec.layers] == ["gdn", "gdn", "gdn", "attention"] * 2
    # megatron-core builds MTP layers from the last decoder layer's spec: here softmax attention.
    assert spec.mtp_layer_runs == ((("attention", "mlp"), 1),)
    listed = ModelSpec.from_mapping(dict(BASE, num_layers=3, experimental_attention_variant="gdn",
                                         linear_attention_freq=[0, 1, 1], mtp_num_layers=2))
    assert [m for m, _ in listed.layers] == ["attention", "gdn", "gdn"]
    assert listed.mtp_layer_runs == ((("gdn", "mlp"), 1),)
    parts = estimate(listed, parse_rows([16])).components
    assert parts["mtp/gdn/core"] == 2 * parts["gdn/core"] // 2  # two MTP depths, two decoder GDN layers


def test_hybrid_pattern_symbols_pipes_and_mtp_depths():
    spec = ModelSpec.from_mapping(dict(BASE, num_moe_experts=4, moe_router_topk=2, hybrid_layer_pattern="MG*-|E*G-/G-/G-"))
    assert spec.layers == (("mamba", "none"), ("gdn", "none"), ("attention", "none"), ("none", "mlp"),
                           ("none", "moe"), ("attention", "none"), ("gdn", "none"), ("none", "mlp"))
    assert spec.mtp_num_layers == 2 and spec.mtp_layer_runs == ((("gdn", "none"), 1), (("none", "mlp"), 1))
    parts = estimate(spec, parse_rows([16])).components
    # Each MTP depth runs the pattern after '/': one GDN layer and one MLP per depth.
    assert parts["mtp/gdn/core"] == parts["gdn/core"] and parts["mtp/mlp"] == parts["mlp"]
    # window_size slides the '*' layers at the layer numbers window_attn_skip_freq picks (every 3rd stays full).
    windowed = ModelSpec.from_mapping(dict(BASE, hybrid_layer_pattern="***G**", window_size=[3, 0],
                                           window_attn_skip_freq=3))
    assert [m for m, _ in windowed.layers] == ["window", "window", "attention", "gdn", "window", "attention"]


def test_mla_symbol_needs_multi_latent_attention():
    mla = dict(BASE, multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    spec = ModelSpec.from_mapping(dict(mla, hybrid_layer_pattern="+-M+-"))
    assert spec.mla is not None and [m for m, _ in spec.layers] == ["attention", "none", "mamba", "attention", "none"]
    with pytest.raises(ValueError, match="'\\*' builds standard attention"):
        ModelSpec.from_mapping(dict(mla, hybrid_layer_pattern="*-"))


@pytest.mark.parametrize("fields, message", [
    (dict(BASE, num_layers=2, experimental_attention_variant="lightning"), "'lightning' is not supported; supported: gated_delta_net, gdn, dsa"),
    (dict(BASE, num_layers=2, experimental_attention_variant="gated_delta_net"), "linear_attention_freq' is not set"),
    (dict(BASE, num_layers=2, linear_attention_freq=2), "needs experimental_attention_variant"),
    (dict(BASE, hybrid_layer_pattern="M*D-"), "'\\*' builds standard attention, '\\+' and 'D'"),
    (dict(BASE, hybrid_layer_pattern="M*Q-"), "may only use the symbols MG\\*\\+D-E\\|/; 'Q' is unknown"),
    (dict(BASE, hybrid_layer_pattern="M*/G/M"), "every MTP part after '/' must be the same"),
    (dict(BASE, hybrid_layer_pattern="M*/G", mtp_num_layers=3), "mtp_num_layers=3 but .* has 1 MTP depths"),
    (dict(BASE, hybrid_layer_pattern="G-", linear_num_key_heads=3), "linear_num_key_heads=3 does not divide"),
])
def test_unsupported_variants_and_symbols_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_mapping(fields)


def test_cli_exits_2_naming_the_variant(tmp_path, capsys):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(dict(BASE, num_layers=2, experimental_attention_variant="kda")))
    assert main(["estimate", "--model", str(path), "--seqlens", "[[8]]"]) == 2
    assert "'kda' is not supported; supported: gated_delta_net, gdn, dsa" in capsys.readouterr().err


def test_megatron_lm_command_line_with_gated_delta_net():
    from megatron_flops.model.megatron_args import load_megatron_args

    args, source = load_megatron_args(
        "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --vocab-size 128 --swiglu "
        "--experimental-attention-variant gated_delta_net --linear-attention-freq ([1]*3+[0]*1)*2 "
        "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 8 --linear-value-head-dim 8")
    spec = ModelSpec.from_megatron_args(args, source=source)
    assert [m for m, _ in spec.layers] == ["gdn", "gdn", "gdn", "attention"] * 2
    assert spec.gdn is not None and (spec.gdn.num_value_heads, spec.gdn.conv_kernel_dim) == (4, 4)


# ---- Kimi Delta Attention (Kimi Linear) ----------------------------------------------------------

KIMI = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, moe_intermediate_size=32,
            num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=2, linear_head_dim=8,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"])


def torch_chunked_kda_flops(s: int, heads: int, d: int) -> int:
    """FlopCounterMode's count of transformers' ``chunk_kimi_delta_attention`` over one sequence,
    forward and backward, per head (n chunks of C = 64): attn @ v_beta, attn @ (k_beta * decay) and
    attn_intra @ v_new (C^2 d each) 3x per chunk (the intra-chunk scores are elementwise products
    and sums: no matmul); the state matmuls as in the GDN fallback, C d^2 (9n - 4)."""
    n = -(-s // CHUNK)
    return 2 * heads * (9 * n * CHUNK * CHUNK * d + (9 * n - 4) * CHUNK * d * d)


def test_kimi_linear_measured_is_the_estimate_plus_the_named_remainders():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    config, model = tiny_model("kimi_linear", **KIMI)
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert spec.layers == (("kda", "mlp"), ("attention", "moe"), ("kda", "moe"))
    seqlens = [12, 70]
    measured = measured_flops(model, seqlens, use_cache=False)
    report = estimate_report(config, [[s] for s in seqlens])
    parts = report["components"]
    heads, d, k, channels, tokens = 2, 8, 4, 3 * 16, sum(seqlens)
    assert parts["kda/core"] == 2 * TRAIN_PASSES * gdn_core_flops(tokens, heads, d, d)
    rest = report["total_flops"] - parts["kda/conv"] - parts["kda/core"]
    conv = sum(torch_conv_flops(s, channels, k) for s in seqlens)
    core = sum(torch_chunked_kda_flops(s, heads, d) for s in seqlens)
    assert measured == rest + 2 * (conv + core)


def test_kda_relation_to_megatron_bridge():
    # Kimi-Linear-48B's KDA sizes: h 2304, 32 heads of 128, kernel 4.
    h, heads, d, k, tokens = 2304, 32, 128, 4, 4096
    layer_types = ["linear_attention"]
    spec = ModelSpec.from_hf_config(dict(KIMI, model_type="kimi_linear", hidden_size=h, num_hidden_layers=1,
                                         linear_num_heads=heads, linear_head_dim=d, linear_conv_kernel_dim=k,
                                         layer_types=layer_types, mlp_layer_types=["dense"]))
    parts = training_flops(spec, SeqStats.full_length(1, tokens)).components
    ours = sum(v for key, v in parts.items() if key.startswith("kda/"))
    dim = heads * d
    # Megatron-Bridge main's kda_self_attn_per_layer (flop_utils.py, Kimi's kimi_kda_layers), per token x3 x2.
    bridge = 3 * 2 * tokens * (h * dim * 5 + h * heads + h * d + d * dim + k * 3 * dim + heads * d * d * 4)
    # Bridge prices the output gate as a full h -> H*d projection; Kimi Linear's is low rank, h -> d -> H*d.
    assert bridge - ours == 3 * 2 * tokens * (h * dim - (h * d + d * dim))
