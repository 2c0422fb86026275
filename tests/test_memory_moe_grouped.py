"""Grouped-GEMM experts, selective moe_act recompute and the flex dispatcher
(megatron_flops/memory/moe_grouped.py): formulas read from megatron-core 0.16.1's source (CUDA-only
kernels, nothing to measure on CPU), checked as one-term deltas against the measured SequentialMLP
and alltoall figures through ``megatron-flops memory``, each listed in ``unmeasured``."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_flops.cli import main

# Layer 0 dense, layer 1 MoE: s = 16, b = 1 (T = 16 tokens), h = 64, E = 4 experts, topk k = 2,
# expert ffn 48, SwiGLU without the fused bias-activation, bf16 (a = 2 bytes).
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
             num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[0, 1],
             moe_token_dispatcher_type="alltoall", gated_linear_unit=True, activation_func="silu",
             add_bias_linear=False, normalization="RMSNorm")
DP2_EP2 = ("--dp", "2", "--ep", "2")
# n = T x k = 32 routed tokens reach a rank's experts (balanced), each [h] = 128 bytes.
PERMUTED = 32 * 64 * 2  # the permuted tokens [n, h]: 4096
PROBS = 32 * 2  # their probabilities [n] in bf16: 64
PER_TOKEN = 32 * 48 * 2  # one [n, ffn] activation: 3072


def _report(tmp_path: Path, *argv: str, code: int = 0, **fields: Any) -> dict[str, Any]:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**MODEL, **fields}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["memory", "--model", str(path), "--seq-length", "16", *argv, "--json"]) == code
    return json.loads(out.getvalue()) if code == 0 else {}


def _activations(report: dict[str, Any]) -> dict[str, int]:
    return report["per_stage"][0]["activations_per_microbatch"][0]


def _refusal(tmp_path: Path, *argv: str, **fields: Any) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**MODEL, **fields}))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main(["memory", "--model", str(path), "--seq-length", "16", *argv]) == 2
    return " ".join(err.getvalue().split())


def test_sequential_experts_are_measured_not_listed(tmp_path):
    report = _report(tmp_path, *DP2_EP2)
    # SequentialMLP, unfused SwiGLU: fc1's output (2), silu(x1), x2 + offset, their product, the
    # weighted product (fc2's input): 6 [n, ffn] per token.
    assert _activations(report)["moe/experts"] == PERMUTED + PROBS + 6 * PER_TOKEN == 22592
    assert not any("moe_grouped_gemm" in line or "flex" in line for line in report["unmeasured"])
    assert any("SequentialMLP" in line for line in report["assumptions"])


def test_te_grouped_experts_save_as_sequential_and_are_listed(tmp_path):
    plain = _report(tmp_path, *DP2_EP2)
    grouped = _report(tmp_path, *DP2_EP2, moe_grouped_gemm=True)
    # TEGroupedMLP: GroupedLinear keeps its inputs (fc1: the permuted tokens, fc2: its input), the
    # activation as SequentialMLP's: the same 22592 bytes, now a formula.
    assert _activations(grouped) == _activations(plain)
    assert [line for line in grouped["unmeasured"] if "TEGroupedMLP" in line]
    assert not any("SequentialMLP (moe_grouped_gemm off" in line for line in grouped["assumptions"])
    # Linear biases (bias_dropout_fusion off, as TEGroupedMLP requires): fc2's bias times the
    # probabilities keeps a view of them, nothing new.
    biased = _report(tmp_path, *DP2_EP2, moe_grouped_gemm=True, add_bias_linear=True, bias_dropout_fusion=False)
    assert _activations(biased)["moe/experts"] == _activations(plain)["moe/experts"]


def test_legacy_grouped_experts_keep_fc1_output_and_fc2_input(tmp_path):
    plain = _report(tmp_path, *DP2_EP2)
    legacy = _report(tmp_path, *DP2_EP2, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
    # GroupedMLP: the compiled activation keeps only fc1's output (2) and the probabilities, gmm
    # fc2's input (1): 3 [n, ffn] per token instead of 6, 3 x 3072 = 9216 fewer bytes.
    assert _activations(legacy)["moe/experts"] == PERMUTED + PROBS + 3 * PER_TOKEN == 13376
    assert plain["per_gpu"]["activations_bytes"] - legacy["per_gpu"]["activations_bytes"] == 9216
    assert [line for line in legacy["unmeasured"] if "GroupedMLP saves" in line]
    # The local spec builds GroupedMLP for moe_grouped_gemm too.
    local = _report(tmp_path, *DP2_EP2, "--transformer-impl", "local", moe_grouped_gemm=True)
    assert _activations(local)["moe/experts"] == 13376


@pytest.mark.parametrize("legacy", [False, True])
def test_moe_act_keeps_fc1_output_only(tmp_path, legacy):
    recompute = dict(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=legacy, recompute_granularity="selective",
                     recompute_modules=["moe_act"])
    grouped = _report(tmp_path, *DP2_EP2, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=legacy)
    report = _report(tmp_path, *DP2_EP2, **recompute)
    # CheckpointWithoutOutput keeps its inputs, fc1's output [n, 2 ffn] (2) and the probabilities;
    # the activation's tensors and fc2's input are freed: TEGroupedMLP 6 - 2 = 4, GroupedMLP
    # 3 - 2 = 1 [n, ffn] fewer. (Held again while the experts' backward runs, below the forward peak
    # here: the output layer's 12560 bytes are freed by then.)
    assert _activations(report)["moe/experts"] == PERMUTED + PROBS + 2 * PER_TOKEN == 10304
    freed = (1 if legacy else 4) * PER_TOKEN
    assert grouped["per_gpu"]["activations_bytes"] - report["per_gpu"]["activations_bytes"] == freed
    assert [line for line in report["unmeasured"] if line.startswith("selective moe_act recompute")]
    assert report["not_modelled"] == []


def test_moe_act_inside_moe_recompute_holds_the_freed_bytes_in_backward(tmp_path):
    moe = _report(tmp_path, *DP2_EP2, moe_grouped_gemm=True, recompute_granularity="selective",
                  recompute_modules=["moe"])
    both = _report(tmp_path, *DP2_EP2, moe_grouped_gemm=True, recompute_granularity="selective",
                   recompute_modules=["moe", "moe_act"])
    # The moe checkpoint keeps the layer's input either way; re-run in backward, the layer holds
    # what moe_act keeps plus what it frees: the same peak.
    assert _activations(both) == _activations(moe)
    assert both["per_gpu"]["activations_bytes"] == moe["per_gpu"]["activations_bytes"]


def test_flex_deepep_vs_alltoall(tmp_path):
    alltoall = _report(tmp_path, *DP2_EP2)
    flex = _report(tmp_path, *DP2_EP2, moe_token_dispatcher_type="flex")
    before, after = _activations(alltoall), _activations(flex)
    # T_l = 16 tokens, ETP 1, k = 2, EP 2 (E/EP = 2 local experts), n = N = 32 (the token's two
    # experts on two EP ranks): top-2 indices int64 [16, 2] = 256, the valid-index mask bool
    # [32, 2] = 64, the (token, expert) index pairs 2 x int64 [32] = 512, permute's transposed
    # map and fp32 probabilities [2, 32] x 5 = 320 and sorted indices int64 [32] = 256.
    assert after["moe/dispatcher"] == 256 + 64 + 512 + 320 + 256 == 1408
    assert before["moe/dispatcher"] == 448  # (alltoall: bool and bf16 [E, T_l] = 192, int64 [T_l k] = 256)
    assert after["moe/experts"] - before["moe/experts"] == 32 * (4 - 2)  # fp32 probabilities
    assert {k: v for k, v in after.items() if k not in ("moe/dispatcher", "moe/experts")} == \
        {k: v for k, v in before.items() if k not in ("moe/dispatcher", "moe/experts")}
    # ep/all_to_all: 32 (token, rank) sends of [h] = 256 bytes; forward dispatch with 2 int64
    # indices and 2 fp32 weights (24) and combine, backward combine with 2 fp32 weight gradients
    # (8) and dispatch: 32 x (256 + 24) + 32 x (256 + 8) = 17408 (alltoall: 2 x (2 x 8192 + 64)).
    assert flex["communication_per_step"]["ep/all_to_all"] == 17408
    assert alltoall["communication_per_step"]["ep/all_to_all"] == 16512
    assert "tp_ep/all_gather" not in flex["communication_per_step"]  # (no token-count all-gather)
    assert [line for line in flex["unmeasured"] if line.startswith("flex dispatcher (deepep")]
    assert flex["not_modelled"] == []


def test_flex_hybridep_keeps_nothing_beside_its_handle(tmp_path):
    report = _report(tmp_path, *DP2_EP2, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
    assert "moe/dispatcher" not in _activations(report)
    assert _activations(report)["moe/experts"] == PERMUTED + 32 * 4 + 6 * PER_TOKEN
    # 32 sends each way of [h] (256) and the rank's 2 fp32 probabilities (8), forward and backward.
    assert report["communication_per_step"]["ep/all_to_all"] == 2 * 32 * (256 + 8) == 16896
    assert [line for line in report["unmeasured"] if "HybridEP's wire format assumed" in line]


def test_flex_over_expert_tp_and_ep(tmp_path):
    report = _report(tmp_path, "--tp", "2", "--sequence-parallel", "--dp", "2", "--ep", "2",
                     moe_token_dispatcher_type="flex")
    # TP2 + SP, ETP = TP = 2, EP 2: T_l = 8, the group G = 4; each token to ETP x min(k, EP) = 4
    # ranks (32 sends), n = N = 16 x 2 = 32 per rank. Dispatcher: int64 [8, 4] = 256, bool [32, 4]
    # = 128, 512, [2, 32] x 5 = 320, 256. Experts (ffn/ETP = 24): 4096 + fp32 128 + 6 x 32 x 24 x 2.
    assert _activations(report)["moe/dispatcher"] == 256 + 128 + 512 + 320 + 256 == 1472
    assert _activations(report)["moe/experts"] == 4096 + 128 + 6 * 32 * 24 * 2 == 13440
    # 32 x (256 + 4 x 12) forward + 32 x (256 + 4 x 4) backward, over expert TP x EP.
    comm = report["communication_per_step"]
    assert comm["tp_ep/all_to_all"] == 32 * 304 + 32 * 272 == 18432
    assert "ep/all_to_all" not in comm and "tp_ep/all_gather" not in comm


@pytest.mark.parametrize("argv, fields, reason", [
    (("--dp", "2"), dict(moe_token_dispatcher_type="flex"), "Flex token dispatcher requires TPxEP > 1"),
    (DP2_EP2, dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="nccl"),
     "--moe-flex-dispatcher-backend=deepep or --moe-flex-dispatcher-backend=hybridep"),
    (DP2_EP2, dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
     "moe_act in recompute_modules is only supported with moe_grouped_gemm"),
    (DP2_EP2, dict(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True, add_bias_linear=True),
     "bias not supported in Grouped GEMM yet"),
    (DP2_EP2, dict(moe_grouped_gemm=True, add_bias_linear=True),
     "bias_dropout_fusion is not supported in TEGroupedMLP when add_bias_linear=True"),
    ((*DP2_EP2, "--params-dtype", "fp16"), dict(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True),
     "Currently GroupedMLP for MoE only supports bf16"),
])
def test_what_megatron_core_refuses_is_refused_with_its_reason(tmp_path, argv, fields, reason):
    assert reason in _refusal(tmp_path, *argv, **fields)


def test_grouped_experts_under_lora_are_not_modelled(tmp_path):
    report = _report(tmp_path, *DP2_EP2, "--lora-rank", "4", moe_grouped_gemm=True)
    assert report["per_gpu"]["activations_bytes"] is None
    assert any("grouped-GEMM experts (moe_grouped_gemm) under LoRA" in r for r in report["not_modelled"])


def test_megatron_args_carry_the_flags(tmp_path):
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --vocab-size 100 "
            "--seq-length 16 --max-position-embeddings 16 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
            "--swiglu --disable-bias-linear --bf16 --expert-model-parallel-size 2 --moe-token-dispatcher-type flex "
            "--moe-flex-dispatcher-backend hybridep --moe-grouped-gemm --recompute-granularity selective "
            "--recompute-modules moe_act")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["memory", "--megatron-args", line, "--dp", "2", "--json"]) == 0
    report = json.loads(out.getvalue())
    # 2 MoE layers (moe_layer_freq 1), fused SwiGLU (Megatron-LM's default), moe_act: fc1's output
    # only, fp32 probabilities (HybridEP): 2 x (4096 + 128 + 2 x 3072) = 20736; no dispatcher keeps.
    acts = _activations(report)
    assert acts["moe/experts"] == 2 * (4096 + 128 + 2 * 3072) == 20736 and "moe/dispatcher" not in acts
    assert sum(line.startswith(("routed experts' activations as megatron-core 0.16.1's TEGroupedMLP",
                                "selective moe_act recompute", "flex dispatcher (hybridep"))
               for line in report["unmeasured"]) == 3
