"""Figures that the prose of docs/*.md states (outside a command's output block, which
tests/test_docs.py and tests/test_memory.py run): recomputed through the CLI and compared with
the text as written."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_flops.cli import main

ROOT = Path(__file__).resolve().parent.parent
DEEPSEEK_V3 = ROOT / "examples" / "deepseek_v3_hf_config.json"


def _prose(document: str) -> str:
    """The document with every run of white space (line breaks included) folded to one space."""
    return " ".join((ROOT / "docs" / document).read_text().split())


def _weights_bytes(capsys, transformer_impl: str) -> int:
    """Weight bytes per GPU of DeepSeek-V3 at TP 2 (+ SP, as megatron-core requires for MoE), EP 8, DP 8."""
    argv = ["memory", "--model", str(DEEPSEEK_V3), "--seq-length", "4096", "--tp", "2", "--sequence-parallel",
            "--ep", "8", "--dp", "8", "--transformer-impl", transformer_impl, "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["per_gpu"]["weights_bytes"]


def test_mla_down_projections_whole_under_transformer_engine(capsys):
    # docs/memory.md (MLA under TP): Transformer Engine's spec keeps the q and kv down projections
    # whole on every TP rank, the local spec splits them. Per layer they are [q_lora_rank, h] and
    # [kv_lora_rank + qk_rope_head_dim, h] = 7168 x (1536 + 512 + 64) parameters, of which TP 2 saves
    # half: 7168 x 2112 / 2 = 7,569,408 per layer, x 61 layers = 461,733,888 per GPU.
    config = json.loads(DEEPSEEK_V3.read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    q_lora, kv_down = config["q_lora_rank"], config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert (hidden, q_lora, kv_down, layers) == (7168, 1536, 576, 61)

    # bf16 weights: 2 bytes per parameter.
    extra = (_weights_bytes(capsys, "transformer_engine") - _weights_bytes(capsys, "local")) // 2
    assert extra == hidden * (q_lora + kv_down) // 2 * layers == 461_733_888

    stated = (f"{hidden} x ({q_lora} + {kv_down}) / 2 = {extra / layers / 1e6:.2f}M more parameters per layer and"
              f" GPU, {extra / 1e6:.0f}M over its {layers} layers")
    assert stated == "7168 x (1536 + 576) / 2 = 7.57M more parameters per layer and GPU, 462M over its 61 layers"
    assert stated in _prose("memory.md")
