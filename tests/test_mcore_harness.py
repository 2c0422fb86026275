"""Smoke tests for the megatron-core CPU harness (tests/mcore_cpu.py, tests/mcore_dist.py).

Skipped with a clear reason when megatron.core cannot be imported. The expected numbers
and the GEMM decompositions behind them are documented in tests/MCORE_CPU_FINDINGS.md.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

try:  # tests/ imported as a package
    from . import mcore_cpu, mcore_dist
except ImportError:  # tests/ on sys.path (pytest's default prepend import mode)
    import mcore_cpu  # type: ignore[no-redef]
    import mcore_dist  # type: ignore[no-redef]

pytestmark = pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)

# The base model from /work/shared/notes/megatron-core-on-cpu.md.
B, S, H, L, N, FFN, V = 2, 32, 64, 2, 4, 256, 128
BASE = dict(num_layers=L, hidden_size=H, num_attention_heads=N, ffn_hidden_size=FFN)
BASE_TRAIN_FLOPS = 44_040_192


def test_base_model_train_flops(mcore):
    # Idempotent set-up: repeated calls within one process are fine.
    mcore.apply_cpu_patches()
    mcore.init_single_process()
    model = mcore.build_gpt(BASE, V, S)
    measured = mcore.measure_train_flops(model, B, S, vocab_size=V)
    formula = 6 * B * S * (L * (4 * H * H + 2 * H * FFN) + 2 * L * S * H + H * V)
    assert formula == BASE_TRAIN_FLOPS
    assert measured == BASE_TRAIN_FLOPS
    # Repeatable, and the forward breakdown is exactly one third of it.
    assert mcore.measure_train_flops(model, B, S, vocab_size=V) == BASE_TRAIN_FLOPS
    fwd = mcore.measure_forward_flops(model, B, S, vocab_size=V)
    assert 3 * sum(fwd["Global"].values()) == BASE_TRAIN_FLOPS
    assert fwd["GPTModel.output_layer"] == {"mm": 2 * B * S * H * V}


# --------------------------------------------------------------------------------------
# Feature table (numbers recorded in MCORE_CPU_FINDINGS.md). T = b*s tokens.
# Forward GEMM FLOPs of one transformer layer = 2*T*(sum of linear in*out) + attention,
# attention (local DotProductAttention, full s x s) = 2*b*n*s*s*(d_qk + d_v).
# Training = 3 x forward (+ recomputed forward).
# --------------------------------------------------------------------------------------
T = B * S


def _lin(i, o, tokens=T):
    return 2 * tokens * i * o


def _attn(d_qk, d_v, n=N):
    return 2 * B * n * S * S * (d_qk + d_v)


def _dense_layer(qkv_out=3 * H, proj_in=H, d_qk=H // N, d_v=H // N, fc1_out=FFN, fc2_in=FFN):
    return _lin(H, qkv_out) + _attn(d_qk, d_v) + _lin(proj_in, H) + _lin(H, fc1_out) + _lin(fc2_in, H)


_OUT = _lin(H, V)
_BASE_LAYER = _dense_layer()
# MoE layer: router h->E, shared expert h->160->h, top-2 of 4 experts h->96->h on T*k tokens.
_MOE_LAYER = (
    _lin(H, 3 * H) + _attn(16, 16) + _lin(H, H)
    + _lin(H, 4) + _lin(H, 160) + _lin(160, H) + _lin(H, 96, T * 2) + _lin(96, H, T * 2)
)
_MLA = dict(multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16,
            qk_pos_emb_head_dim=8, v_head_dim=20)
_MLA_ATTN_COMMON = _lin(H, 32 + 8) + _lin(32, N * (16 + 20)) + _attn(24, 20) + _lin(N * 20, H)
_MLP = _lin(H, FFN) + _lin(FFN, H)

FEATURES = {
    # name: (config_kwargs, build kwargs, expected train FLOPs by formula, recorded number)
    "base": (BASE, {}, 3 * (L * _BASE_LAYER + _OUT), 44_040_192),
    "untied": (BASE, dict(share_embeddings=False), 3 * (L * _BASE_LAYER + _OUT), 44_040_192),
    "gqa_g2": (dict(BASE, num_query_groups=2), {},
               3 * (L * _dense_layer(qkv_out=H + 2 * 2 * 16) + _OUT), 40_894_464),
    "kv_channels_24": (dict(BASE, kv_channels=24), {},
                       3 * (L * _dense_layer(qkv_out=3 * 96, proj_in=96, d_qk=24, d_v=24) + _OUT),
                       51_904_512),
    "swiglu": (dict(BASE, gated_linear_unit=True, activation_func=torch.nn.functional.silu), {},
               3 * (L * _dense_layer(fc1_out=2 * FFN) + _OUT), 56_623_104),
    "moe_shared_freq10": (dict(BASE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                               moe_shared_expert_intermediate_size=160, moe_layer_freq=[1, 0]), {},
                          3 * (_MOE_LAYER + _BASE_LAYER + _OUT), 48_857_088),
    "mla_q_lora": (dict(BASE, q_lora_rank=48, **_MLA), {},
                   3 * (L * (_lin(H, 48) + _lin(48, N * 24) + _MLA_ATTN_COMMON + _MLP) + _OUT),
                   47_972_352),
    "mla_no_q_lora": (dict(BASE, q_lora_rank=None, **_MLA), {},
                      3 * (L * (_lin(H, N * 24) + _MLA_ATTN_COMMON + _MLP) + _OUT), 46_792_704),
    "mtp_1": (dict(BASE, mtp_num_layers=1), {},
              3 * (L * _BASE_LAYER + _OUT + _lin(2 * H, H) + _BASE_LAYER + _OUT), 70_778_880),
    "full_recompute_uniform_1": (
        dict(BASE, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        {}, 3 * (L * _BASE_LAYER + _OUT) + L * _BASE_LAYER, 57_671_680),
    "selective_recompute_core_attn": (
        dict(BASE, recompute_granularity="selective"), {},
        3 * (L * _BASE_LAYER + _OUT) + L * _attn(16, 16), 45_088_768),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_train_flops(mcore, name):
    config_kwargs, build_kwargs, formula, recorded = FEATURES[name]
    assert formula == recorded
    model = mcore.build_gpt(config_kwargs, V, S, **build_kwargs)
    assert mcore.measure_train_flops(model, B, S, vocab_size=V) == recorded


# --------------------------------------------------------------------------------------
# Multi-process: megatron-core's own pipeline schedules on 4 local gloo processes.
# --------------------------------------------------------------------------------------
DIST_MODEL = dict(config_kwargs=dict(BASE, num_layers=4), vocab_size=V, seq_length=S)
DIST_RUNS = [
    # DP=2 x PP=2 x VPP=2: interleaved 1F1B, megatron DDP, tied embeddings across stages.
    dict(tp=1, pp=2, vpp=2, ddp=True, num_microbatches=4, micro_batch_size=B),
    # TP=2 x PP=2 x VPP=2, DP=1 (the only PP2 x VPP2 x DP1 layout on 4 ranks), no DDP.
    dict(tp=2, pp=2, vpp=2, ddp=False, num_microbatches=4, micro_batch_size=B),
    # DP=2 x PP=2: non-interleaved 1F1B, megatron DDP.
    dict(tp=1, pp=2, vpp=None, ddp=True, num_microbatches=2, micro_batch_size=B),
]


def test_pipeline_schedules_four_processes(mcore):
    world = 4
    results = mcore_dist.run_distributed(
        mcore_dist.schedule_flops_worker, world, DIST_RUNS, DIST_MODEL, timeout=900
    )
    # Reference: the same model, single process, one micro-batch.
    ref_model = mcore.build_gpt(DIST_MODEL["config_kwargs"], V, S)
    per_microbatch = mcore.measure_train_flops(ref_model, B, S, vocab_size=V)
    assert per_microbatch == 3 * (4 * _BASE_LAYER + _OUT)

    for i, run in enumerate(DIST_RUNS):
        per_rank = [results[r][i] for r in range(world)]
        dp = world // (run["tp"] * run["pp"])
        assert all(x["sizes"]["dp"] == dp for x in per_rank)
        # Pipeline stages partition the layers and TP splits every GEMM exactly:
        # the ranks together execute DP x M x (single-process FLOPs), nothing more.
        total = sum(x["flops"] for x in per_rank)
        assert total == dp * run["num_microbatches"] * per_microbatch, (run, per_rank)
        last = [x for x in per_rank if x["sizes"]["pp_rank"] == run["pp"] - 1]
        assert all(len(x["losses"]) == run["num_microbatches"] for x in last)
        assert all(0.0 < loss < 10.0 for x in last for loss in x["losses"])
