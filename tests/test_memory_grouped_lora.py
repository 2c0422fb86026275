"""Megatron-Bridge 0.6.2's per-expert and shared-outer LoRA adapters on grouped-GEMM experts
(megatron_flops/memory/grouped_lora.py): formulas read from Bridge's source, not run here (its
peft package imports transformer_engine, and TEGroupedMLP is CUDA-only), so the report lists
them in ``unmeasured``; these tests pin the integers with their derivations."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from megatron_flops.cli import main
from megatron_flops.flops.passes import PeftSpec

# 2 MoE layers, h 64, 4 experts (2 per rank at EP 2), expert ffn 32 gated (fc1 [64, 64]), top-2, 16 tokens.
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=128,
             num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
             add_bias_linear=False, gated_linear_unit=True, moe_token_dispatcher_type="alltoall")


def _run(tmp_path, command: str, layout: str, *flags: str) -> dict:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(MODEL))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([command, "--model", str(path), "--seq-length", "16", "--lora-rank", "8",
                     "--lora-grouped-experts", layout, *flags, "--json"]) == 0
    return json.loads(out.getvalue())


def test_parameters_of_each_layout(tmp_path):
    got = {layout: _run(tmp_path, "memory", layout)["parameters"]["total"]
           for layout in ("shared", "per-expert", "shared-outer")}
    # Adapters per MoE layer (r 8, h 64, ffn 32, gate 2, 4 experts on one rank):
    # shared: fc1 A [8, 64] + B [64, 8] = 1024, fc2 A [8, 32] + B [64, 8] = 768: 1792.
    # per-expert: 4 x 1792 = 7168 (+5376 per layer). shared-outer: fc1 A [8, 64] + 4 x B [64, 8] = 2560,
    # fc2 4 x A [8, 32] + B [64, 8] = 1536: 4096 (+2304). Two layers.
    assert got["per-expert"] - got["shared"] == 2 * 5376
    assert got["shared-outer"] - got["shared"] == 2 * 2304


def test_activations_and_all_reduce(tmp_path):
    runs = {layout: _run(tmp_path, "memory", layout, "--dp", "2", "--ep", "2", "--num-microbatches", "2")
            for layout in ("shared", "per-expert", "shared-outer")}
    lora = {k: r["per_stage"][0]["activations_per_microbatch"][0]["lora"] for k, r in runs.items()}
    # 32 routed (token, expert) pairs per layer (16 tokens x top-2), 2 local experts, bf16.
    # per-expert takes grouped_mm (bf16, dims 8, 64, 64, 8 / 8, 32, 64, 8 all multiples of 8): a copy of
    # each adapter's input (fc1 32 x 64 x 2 = 4096, fc2 32 x 32 x 2 = 2048) and int32 offsets [2] (8) each; and
    # per adapter the weights it indexes (weight[[0, 1]]: copies grouped_mm keeps, their inputs requiring grad)
    # with the int64 indices [2] of each index op (2 x 16): fc1 A [2, 8, 64] + B [2, 64, 8] = 2048 elements,
    # fc2 A [2, 8, 32] + B [2, 64, 8] = 1536, x 2 bytes.
    assert lora["per-expert"] - lora["shared"] == 2 * (4096 + 8 + 2048 + 8 + 2 * 2 * 16 + (2048 + 1536) * 2)
    # shared-outer: torch._grouped_mm's int32 offsets [2] per adapter (the rest as the shared adapter's).
    assert lora["shared-outer"] - lora["shared"] == 2 * 2 * 8
    comm = {k: r["communication_per_step"] for k, r in runs.items()}
    # shared-outer's shared sides (fc1 A [8, 64], fc2 B [64, 8], bf16) all-reduced over TP x DP x CP = 2 each
    # backward: 2 micro-batches x 2 layers x 1024 x 2 bytes.
    assert comm["shared-outer"]["tp_dp_cp/all_reduce"] == 2 * 2 * 1024 * 2
    assert "tp_dp_cp/all_reduce" not in comm["shared"] and "tp_dp_cp/all_reduce" not in comm["per-expert"]
    assert any("one adapter per local expert" in u for u in runs["per-expert"]["unmeasured"])


def test_per_expert_in_fp32_loops_as_the_shared_adapter(tmp_path):
    # fp32 is no grouped_mm input: Bridge's per-expert loop keeps views of the input and [n_e, r] per expert.
    shared, per = (_run(tmp_path, "memory", k, "--params-dtype", "fp32") for k in ("shared", "per-expert"))
    assert shared["per_stage"][0]["activations_per_microbatch"] == per["per_stage"][0]["activations_per_microbatch"]


def test_shared_outer_under_expert_tp_is_refused():
    from megatron_flops.memory.grouped_lora import check_grouped_lora
    from megatron_flops.memory.layout import Parallelism

    peft = PeftSpec(lora_rank=8, grouped_expert_adapters="shared-outer")
    with pytest.raises(ValueError, match="cannot train there"):
        check_grouped_lora(Parallelism(tp=2, sequence_parallel=True), peft, grouped=True)
    check_grouped_lora(Parallelism(tp=2, sequence_parallel=True), peft, grouped=False)  # (SequentialMLP: unused)


def test_flops_are_the_same(tmp_path):
    # Every routed token runs one rank-r pair per adapted linear whatever the layout.
    flops = {_run(tmp_path, "estimate", k)["total_flops"] for k in ("shared", "per-expert", "shared-outer")}
    assert len(flops) == 1


def test_bridge_fields_in_the_model_file():
    read = PeftSpec.from_lora_mapping
    assert read({"dim": 4}).grouped_expert_adapters == "shared"
    assert read({"dim": 4, "share_expert_adapters": False}).grouped_expert_adapters == "per-expert"
    # experts_shared_outer_loras wins over share_expert_adapters, as in Bridge's LoRA.transform.
    assert read({"dim": 4, "share_expert_adapters": False,
                 "experts_shared_outer_loras": True}).grouped_expert_adapters == "shared-outer"
    with pytest.raises(ValueError, match="must be true or false"):
        read({"dim": 4, "share_expert_adapters": "no"})
