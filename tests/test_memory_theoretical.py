"""Megatron-LM's ``--report-theoretical-memory`` (core_v0.16.1,
``megatron/training/theoretical_memory_usage.py``) re-derived for the layouts of docs/memory.md,
so that the docs' comparison table is computed, not copied. Its estimate, in brief:

- weights and optimizer: the parameters of the most loaded shard (the transformer block / PP,
  plus the MTP block and the embedding (twice when untied and PP = 1), all / TP; every expert
  counted on every GPU: the formula does not divide by EP) x 18 bytes (DDP) or
  ``6 + 12 / DP`` (distributed optimizer);
- activations without sequence parallelism: ``s b h (10 + 24 / TP)`` bytes per layer (a dense
  layer: MoE, MLA and the FFN width are not read), x the layers, plus ``s b h PP`` and
  ``8 s b PP`` bytes, times ``min(1, M / PP)`` under 1F1B; with PP = 1 the logits and the final
  norm's output in 16 bits; x 1.05.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from megatron_flops.cli import main

ROOT = Path(__file__).resolve().parents[1]
MB = 1024 * 1024


def megatron_lm_theoretical(c: dict, *, tp: int, pp: int, dp: int, distributed_optimizer: bool, seq: int,
                            mbs: int, num_microbatches: int) -> tuple[float, float]:
    """(weights and optimizer, activations) in bytes, as Megatron-LM core_v0.16.1 reports them
    (no sequence parallelism, no VPP)."""
    h, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_layers"]
    norm = 1 if c.get("normalization") == "RMSNorm" else 2
    glu = 3 / 2 if c.get("swiglu") else 1
    if c.get("multi_latent_attention"):
        rope, qk, v = c["qk_pos_emb_head_dim"], c["qk_head_dim"], c["v_head_dim"]
        q = (h * heads * (qk + rope) if c.get("q_lora_rank") is None
             else c["q_lora_rank"] * (h + heads * (qk + rope) + norm))
        attn = q + c["kv_lora_rank"] * (h + heads * (qk + v) + norm) + h * rope + heads * v * h
    else:
        ratio = c["kv_channels"] * heads / h
        attn = 2 * h * h * (1 + c["num_query_groups"] / heads) * ratio
    pattern = c.get("moe_pattern", [0] * layers)
    moe_layers = sum(pattern)
    dense = 2 * h * (c["ffn_hidden_size"] * glu + norm) + attn
    moe = 2 * h * (c.get("moe_ffn_hidden_size", 0) * c.get("num_experts", 1) * glu
                   + c.get("shared_ffn", 0) * glu + norm) + attn
    mtp = c.get("mtp_num_layers", 0)
    block = dense * (layers - moe_layers) + moe * moe_layers + norm * h
    mtp_block = (moe if pattern[-1] else dense) * mtp
    embedding = h * c["padded_vocab_size"]
    shard = (block / pp + mtp_block + embedding) / tp
    if pp == 1:
        shard += embedding / tp  # untied
    weights = shard * (6 + 12 / dp if distributed_optimizer else 18)
    act = seq * mbs * h * (10 + 24 / tp) * layers + 8 * seq * mbs * pp + seq * mbs * h * pp
    if pp > 1:
        act *= min(1, num_microbatches / pp)
    else:
        act += (seq * mbs * c["padded_vocab_size"] / tp + seq * mbs * h) * 2
    return weights, act * 1.05


MIXTRAL = dict(hidden_size=4096, num_attention_heads=32, num_query_groups=8, kv_channels=128, num_layers=32,
               ffn_hidden_size=14336, swiglu=True, normalization="RMSNorm", num_experts=8, moe_ffn_hidden_size=14336,
               moe_pattern=[1] * 32, padded_vocab_size=32000)
DEEPSEEK_V3 = dict(hidden_size=7168, num_attention_heads=128, num_layers=61, ffn_hidden_size=18432, swiglu=True,
                   normalization="RMSNorm", multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
                   qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256,
                   moe_ffn_hidden_size=2048, shared_ffn=2048, moe_pattern=[0] * 3 + [1] * 58,
                   padded_vocab_size=129280)

# docs/memory.md's comparison: (model file, reference config, layout) per row.
LAYOUTS = {
    "Mixtral 8x7B, 8 GPUs": ("examples/mixtral_8x7b_hf_config.json", MIXTRAL, dict(ep=8, dp=8, m=8)),
    "Mixtral 8x7B, 64 GPUs": ("examples/mixtral_8x7b_hf_config.json", MIXTRAL, dict(pp=4, ep=8, dp=16, m=16)),
    "DeepSeek-V3, 8 GPUs": ("examples/deepseek_v3_hf_config.json", DEEPSEEK_V3, dict(ep=8, dp=8, m=8)),
    "DeepSeek-V3, 64 GPUs": ("examples/deepseek_v3_hf_config.json", DEEPSEEK_V3, dict(ep=64, dp=64, m=8)),
}
SEQ = 4096


def ours(model: str, layout: dict, capsys) -> dict:
    argv = ["memory", "--model", str(ROOT / model), "--seq-length", str(SEQ), "--distributed-optimizer",
            "--num-microbatches", str(layout["m"]), "--json"]
    for flag in ("pp", "ep", "dp"):
        if flag in layout:
            argv += [f"--{flag}", str(layout[flag])]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["per_gpu"]


def table_rows(capsys) -> dict[str, list[str]]:
    rows = {}
    for name, (model, ref, layout) in LAYOUTS.items():
        gpu = ours(model, layout, capsys)
        states = gpu["total_bytes"] - (gpu["activations_bytes"] or 0)
        theirs_w, theirs_a = megatron_lm_theoretical(ref, tp=1, pp=layout.get("pp", 1), dp=layout["dp"],
                                                     distributed_optimizer=True, seq=SEQ, mbs=1,
                                                     num_microbatches=layout["m"])
        act = "n/m" if gpu["activations_bytes"] is None else f"{gpu['activations_bytes'] / 1e9:,.1f}"
        rows[name] = [f"{states / 1e9:,.1f}", f"{theirs_w / 1e9:,.1f}", act, f"{theirs_a / 1e9:,.1f}"]
    return rows


def test_docs_comparison_table_is_computed(capsys):
    # Every row of the table in docs/memory.md ("| name | ours | theirs | ours | theirs | ...")
    # holds these numbers (GB = 10^9 bytes).
    text = (ROOT / "docs" / "memory.md").read_text()
    for name, cells in table_rows(capsys).items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        assert [c.strip() for c in row.strip("|").split("|")][1:5] == cells, (name, cells)


def test_reference_formula_by_hand():
    # Mixtral's dense part on one GPU, DDP (18 B per parameter): attention 2 h^2 (1 + 8/32) =
    # 41,943,040 per layer; the formula counts all 8 experts per layer on every GPU.
    w, _ = megatron_lm_theoretical(MIXTRAL, tp=1, pp=1, dp=1, distributed_optimizer=False, seq=1, mbs=1,
                                   num_microbatches=1)
    layer = 2 * 4096 * (14336 * 8 * 1.5 + 1) + 2 * 4096 * 4096 * 1.25
    assert w == pytest.approx((32 * layer + 4096 + 2 * 4096 * 32000) * 18)
    # Our parameter count of the same model is the formula's plus the routers it leaves out
    # (32 layers x [8 experts, 4096]).
    assert math.isclose(w / 18 + 32 * 8 * 4096, 46_702_792_704, rel_tol=1e-12)
