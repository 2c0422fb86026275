"""LoRA FLOPs of legacy ``GroupedMLP`` routed experts: Megatron-Bridge matches no module there
(``weight1``/``weight2``, no ``linear_fc1``/``linear_fc2``), so ``estimate`` prices no expert
adapter; hand-derived integers, a one-term delta against ``TEGroupedMLP``, the CLI reading the
model file's fields, and memory and estimate agreeing on which experts are adapted."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from megatron_flops.cli._memory_model import routed_expert_adapters
from megatron_flops.cli._model_args import LoadedModel
from megatron_flops.flops.formulas import TRAIN_PASSES, SeqStats, gemm, parse_rows
from megatron_flops.flops.passes import PeftSpec, training_passes
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism
from megatron_flops.model.spec import ModelSpec

# L = 2 (layer 0 dense, layer 1 MoE), h = 8, ffn 16, 4 experts of ffn 6, top-2; rows [4, 6]: T = 10
# tokens, R = T x topk = 20 routed rows.
MOE = dict(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, vocab_size=16,
           padded_vocab_size=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6, moe_layer_freq=[0, 1])
SPEC = ModelSpec.from_mapping(MOE)
STATS = SeqStats.from_rows(parse_rows([4, 6]))
FC = ("linear_fc1", "linear_fc2")
LEGACY = dict(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)


def test_legacy_experts_hand_derived():
    # Rank 2 on linear_fc1/linear_fc2, base trainable (x3 everywhere). The dense layer's adapters stay:
    # fc1 A [10, 8] @ [8, 2] = 320, B [10, 2] @ [2, 16] = 640; fc2 A [10, 16] @ [16, 2] = 640, B [10, 2] @ [2, 8] = 320.
    # The routed experts' adapters go: fc1 A [20, 8] @ [8, 2] = 640, B [20, 2] @ [2, 6] = 480;
    # fc2 A [20, 6] @ [6, 2] = 480, B [20, 2] @ [2, 8] = 640.
    peft = PeftSpec(lora_rank=2, lora_targets=FC)
    te = training_passes(SPEC, STATS, peft=peft)
    legacy = training_passes(SPEC, STATS, peft=dataclasses.replace(peft, expert_adapters=False))
    assert te.forward["lora/experts.linear_fc1"] == gemm(20, 8, 2) + gemm(20, 2, 6) == 1120
    assert te.forward["lora/experts.linear_fc2"] == gemm(20, 6, 2) + gemm(20, 2, 8) == 1120
    assert legacy.forward == {"attn/qkv": 7680, "attn/core": 1664, "attn/out": 2560, "mlp": 5120,
                              "lora/linear_fc1": 960, "lora/linear_fc2": 960, "moe/router": 640,
                              "moe/routed": 3840, "logits": 2560}
    assert legacy.model().components == {k: TRAIN_PASSES * v for k, v in legacy.forward.items()}


def test_legacy_differs_from_te_grouped_by_the_expert_adapters_only():
    # Frozen base, adapters on every projection: the only terms that move are the expert adapters'.
    peft = PeftSpec(frozen=True, lora_rank=2)
    te = training_passes(SPEC, STATS, peft=peft).model().components
    legacy = training_passes(SPEC, STATS, peft=dataclasses.replace(peft, expert_adapters=False)).model().components
    experts = {k: v for k, v in te.items() if k.startswith("lora/experts.")}
    assert set(experts) == {"lora/experts.linear_fc1", "lora/experts.linear_fc2"}
    assert {k: v for k, v in te.items() if k not in experts} == legacy
    # Each adapter trains (forward + wgrad) and B's dgrad runs; A's too (the MoE layer's input
    # needs a gradient: layer 0's adapters train): 3 x 1120 each.
    assert sum(experts.values()) == TRAIN_PASSES * (1120 + 1120)


def test_target_on_legacy_experts_only_matches_no_projection():
    spec = ModelSpec.from_mapping(dict(MOE, moe_layer_freq=[1, 1]))
    peft = PeftSpec(frozen=True, lora_rank=2, lora_targets=("linear_qkv", "linear_fc1"))
    training_passes(spec, STATS, peft=peft)  # TEGroupedMLP / SequentialMLP: the experts' linear_fc1
    with pytest.raises(ValueError, match="lora target 'linear_fc1' matches no projection"):
        training_passes(spec, STATS, peft=dataclasses.replace(peft, expert_adapters=False))


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_flops", "estimate", *argv], capture_output=True, text=True)


@pytest.mark.parametrize("fields, adapters", [
    ({}, True),  # SequentialMLP
    (dict(moe_grouped_gemm=True), True),  # TEGroupedMLP
    (LEGACY, False),
    (dict(moe_grouped_gemm=True, transformer_impl="local"), False),  # the local spec's GroupedMLP
])
def test_cli_reads_the_experts_module(tmp_path, fields, adapters):
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps(dict(MOE, **fields, lora={"dim": 2, "target_modules": list(FC)})))
    out = _cli("--model", str(model_file), "--seqlens", "[4, 6]", "--json")
    assert out.returncode == 0, out.stderr
    peft = PeftSpec(frozen=True, lora_rank=2, lora_targets=FC, expert_adapters=adapters)
    passes = training_passes(SPEC, STATS, peft=peft)
    report = json.loads(out.stdout)
    assert report["total_flops"] == passes.model().total
    assert report["executed_flops"] == passes.executed().total
    assert ("lora/experts.linear_fc1" in report["components"]) is adapters
    # Hand-derived (test_legacy_experts_hand_derived): the routed experts' adapters add fc1's 1120
    # and fc2's 1120 forward FLOPs, x 3 per step (layer 0's adapters train, so A's dgrad runs too).
    legacy = training_passes(SPEC, STATS, peft=dataclasses.replace(peft, expert_adapters=False))
    assert sum(passes.forward.values()) - sum(legacy.forward.values()) == (1120 + 1120 if adapters else 0)
    assert report["total_flops"] - legacy.model().total == (TRAIN_PASSES * (1120 + 1120) if adapters else 0)


@pytest.mark.parametrize("fields", [{}, dict(moe_grouped_gemm=True), LEGACY,
                                    dict(moe_grouped_gemm=True, transformer_impl="local")])
def test_memory_and_estimate_agree_on_expert_adapters(fields):
    raw = dict(MOE, **fields)
    options = DecoderOptions.from_mapping(raw)
    params = chunk_parameters(SPEC, options, Parallelism(), pp_rank=0, chunk=0, seq_length=10,
                              peft=PeftSpec(frozen=True, lora_rank=2, lora_targets=FC))
    memory = any(".experts." in p.name and ".adapter." in p.name for p in params)
    estimate = routed_expert_adapters(LoadedModel(spec=SPEC, raw=raw, source="model.json", seq_length=10))
    assert memory is estimate


def test_megatron_args_legacy_experts():
    # One MoE layer, rank 2 on linear_qkv and linear_fc1, base trainable: TEGroupedMLP's expert fc1
    # adapter is 3 x (640 + 480) = 3360; legacy GroupedMLP has none, and no other linear_fc1.
    args = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --ffn-hidden-size 16 --vocab-size 16 "
            "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 6 --moe-grouped-gemm")
    lora = ("--seqlens", "[4, 6]", "--lora-rank", "2", "--lora-targets", "linear_qkv,linear_fc1")
    out = _cli("--megatron-args", args, *lora, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["components"]["lora/experts.linear_fc1"] == TRAIN_PASSES * 1120 == 3360
    out = _cli("--megatron-args", args + " --moe-use-legacy-grouped-gemm", *lora)
    assert out.returncode == 2
    assert "lora target 'linear_fc1' matches no projection of this model (its routed experts, legacy GroupedMLP" in out.stderr
