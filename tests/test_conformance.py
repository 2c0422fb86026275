"""Conformance: FLOPs measured by FlopCounterMode on real megatron-core GPTModels (forward +
backward, CPU) equal ``estimate --attention full`` by integer equality.

Rows of different lengths are measured one sequence at a time: running each sub-sequence of a
packed row as its own sequence is the oracle for packed attention (the local attention cannot
run THD on CPU). One model is built per configuration; every distinct length is measured once.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch.nn.functional as F

import mcore_cpu
from megatron_flops.flops.formulas import estimate, parse_rows
from megatron_flops.model.spec import ModelSpec

pytestmark = [pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON),
              pytest.mark.usefixtures("mcore")]

VOCAB = 128
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
# Rows: an unpacked sequence, a packed row of three sub-sequences, another unpacked length.
ROWS = [24, [7, 12, 5], 12]

MATRIX = {
    "dense MHA": dict(BASE),
    "GQA": dict(BASE, num_query_groups=2),
    "kv_channels": dict(BASE, kv_channels=24),
    "SwiGLU": dict(BASE, gated_linear_unit=True, activation_func=F.silu),
    "MoE top-2": dict(BASE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48),
    "MoE shared + mixed layers": dict(
        BASE, num_layers=3, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=80, moe_layer_freq=[0, 1, 1],
        gated_linear_unit=True, activation_func=F.silu,
    ),
    "MoE shared-expert gate": dict(
        BASE, num_moe_experts=4, moe_router_topk=1, moe_router_pre_softmax=True, moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
    ),
    "MLA": dict(
        BASE, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
    ),
    "MLA + q_lora_rank": dict(
        BASE, multi_latent_attention=True, q_lora_rank=40, kv_lora_rank=32,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=24,
    ),
    "MTP": dict(BASE, mtp_num_layers=1),
}
VARIANTS = [("tied", True, "rope"), ("untied", False, "rope"), ("learned pos", True, "learned_absolute")]


def _measure_rows(model, rows) -> int:
    """Sum of measured forward+backward FLOPs, one sequence at a time."""
    counts = Counter()
    for row in rows:
        for s in (row if isinstance(row, list) else [row]):
            counts[s] += 1
    return sum(n * mcore_cpu.measure_train_flops(model, 1, s, vocab_size=VOCAB) for s, n in counts.items())


def _spec_for(model, share: bool) -> ModelSpec:
    return ModelSpec.from_transformer_config(
        model.config, vocab_size=VOCAB, share_embeddings_and_output_weights=share
    )


@functools.cache
def measured_and_estimated(name: str) -> tuple[int, int]:
    """FLOPs of ``MATRIX[name]`` over ROWS: measured, and ``estimate --attention full``."""
    model = mcore_cpu.build_gpt(dict(MATRIX[name]), vocab_size=VOCAB, max_seq_len=32)
    return _measure_rows(model, ROWS), estimate(_spec_for(model, True), parse_rows(ROWS), attention="full").total


@pytest.mark.parametrize("name", list(MATRIX))
def test_measured_equals_estimate(name):
    measured, expected = measured_and_estimated(name)
    assert measured == expected


def test_conventions_table_is_the_scripts_output():
    # The table in docs/conventions.md must be exactly what scripts/conformance_table.py prints (no drift).
    root = Path(__file__).resolve().parents[1]
    script = importlib.util.spec_from_file_location("conformance_table", root / "scripts" / "conformance_table.py")
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    lines = module.table_lines({name: measured_and_estimated(name) for name in MATRIX})
    readme = (root / "docs" / "conventions.md").read_text().splitlines()
    start = readme.index(lines[0])
    assert readme[start:start + len(lines) + 1] == [*lines, ""]
    assert f"`{json.dumps(ROWS)}`" in "\n".join(readme)


@pytest.mark.parametrize("variant, share, pos", VARIANTS)
def test_output_layer_and_position_variants(variant, share, pos):
    # Tied/untied output and the position embedding change no GEMM: same count either way.
    model = mcore_cpu.build_gpt(
        dict(BASE, gated_linear_unit=True, activation_func=F.silu, num_query_groups=2),
        vocab_size=VOCAB, max_seq_len=32, share_embeddings=share, position_embedding_type=pos,
    )
    expected = estimate(_spec_for(model, share), parse_rows([16, 9]), attention="full").total
    assert _measure_rows(model, [16, 9]) == expected


def test_batched_rows_equal_one_at_a_time():
    # The oracle itself: a [b, s] batch measures b x one sequence (no cross-row GEMM).
    model = mcore_cpu.build_gpt(dict(BASE), vocab_size=VOCAB, max_seq_len=32)
    assert mcore_cpu.measure_train_flops(model, 3, 16, vocab_size=VOCAB) == 3 * mcore_cpu.measure_train_flops(
        model, 1, 16, vocab_size=VOCAB
    )


def test_note_base_model_closed_form():
    # The shared note's measurement: 2 layers, h 64, 4 heads, ffn 256, V 128, b 2, s 32:
    # 6*b*s*(L*(4h^2 + 2h*ffn) + 2L*s*h + h*V) = 44,040,192.
    b, s, L, h, ffn, V = 2, 32, 2, 64, 256, 128
    closed = 6 * b * s * (L * (4 * h * h + 2 * h * ffn) + 2 * L * s * h + h * V)
    assert closed == 44_040_192
    model = mcore_cpu.build_gpt(dict(BASE, ffn_hidden_size=ffn), vocab_size=V, max_seq_len=s)
    assert mcore_cpu.measure_train_flops(model, b, s, vocab_size=V) == closed
    spec = _spec_for(model, True)
    assert estimate(spec, parse_rows([s] * b), attention="full").total == closed


def test_cli_json_contract(tmp_path):
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps(dict(BASE, vocab_size=VOCAB, gated_linear_unit=True, activation_func="silu")))
    out = subprocess.run(
        [sys.executable, "-m", "megatron_flops", "estimate", "--model", str(model_file),
         "--seqlens", json.dumps(ROWS), "--attention", "full", "--json"],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(out.stdout)
    model = mcore_cpu.build_gpt(dict(MATRIX["SwiGLU"]), vocab_size=VOCAB, max_seq_len=32)
    assert report["total_flops"] == _measure_rows(model, ROWS)
    assert sum(report["components"].values()) == report["total_flops"]
