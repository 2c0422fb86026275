"""A frozen MoE first layer whose first adapter is a routed expert's, on grouped-GEMM experts
(megatron_flops/memory/grouped_start.py): Megatron-Bridge 0.6.2's per-expert and shared-outer
adapters, selective moe_act recompute, legacy GroupedMLP. Formulas read from megatron-core 0.16.1's
and Bridge 0.6.2's source (Transformer Engine and grouped_gemm are CUDA-only), listed in
``unmeasured``; these tests pin the integers with their derivations, as one-term deltas against the
TEGroupedMLP shared-adapter case (tests/test_memory_moe_lora_start.py), and the refusals estimate and
memory share."""

from __future__ import annotations

import contextlib
import io
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from frameworks import procs
from megatron_flops.cli import main
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.grouped_lora import grouped_adapter_saved
from megatron_flops.memory.grouped_start import (first_adapter_moe_act_freed, grouped_first_adapter_reason,
                                                 legacy_combine_skip)
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.moe_lora_start import first_adapter_unmeasured
from megatron_flops.model.spec import ModelSpec

# One MoE layer (the first adapter a routed expert's): s = 16, b = 1 (T = 16), h = 64, E = 4 experts (2 per
# rank at EP 2), top-2, expert ffn 48 gated (fc1 [n, 96]), shared experts 32 wide, bf16 (a = 2), DP2 x EP2.
# Balanced: n = T x k = 32 routed (token, expert) pairs reach a rank's experts.
MODEL = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
             num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32,
             moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, add_bias_linear=False,
             gated_linear_unit=True, activation_func="silu", normalization="RMSNorm", bias_activation_fusion=False)
LEGACY = dict(moe_use_legacy_grouped_gemm=True)
FROZEN = ("--frozen", "--lora-targets", "linear_fc1,linear_fc2", "--dp", "2", "--ep", "2")
MOE_ACT = ("--recompute", "selective", "--recompute-modules", "moe_act")
PER_TOKEN = 32 * 48 * 2  # one [n, ffn] activation: 3072


def _run(tmp_path: Path, *argv: str, command: str = "memory", code: int = 0, **fields: Any) -> tuple[dict, str]:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**MODEL, **fields}))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main([command, "--model", str(path), "--seq-length", "16", *argv, "--json"]) == code
    return (json.loads(out.getvalue()) if code == 0 else {}), " ".join(err.getvalue().split())


def _memory(tmp_path: Path, *argv: str, rank: str = "4", **fields: Any) -> dict:
    report, _ = _run(tmp_path, *FROZEN, "--lora-rank", rank, *argv, **fields)
    assert report["not_modelled"] == []
    return report


def _saved(report: dict) -> dict[str, int]:
    return report["per_stage"][0]["activations_per_microbatch"][0]


@pytest.mark.parametrize(("layout", "extra"), [
    # The per-expert adapters take grouped_mm (bf16, r 8, h 64, 2 ffn 96, ffn 48: multiples of 8), whose copy of
    # fc1's input [n, h] (its grouped GEMM keeps it: only the weight requires grad) replaces the permuted tokens
    # the shared adapter keeps, and fc2's likewise: no more bytes (as for a started frozen layer). Each indexes
    # its weights (weight[[0, 1]]: a copy, and the index op's int64 indices [2]: 16 B, 4 x 16 = 64): grouped_mm
    # keeps fc1's B [2, 96, 8] (1536 elements: its input, the [n, r] intermediate, requires grad), not fc1's A
    # (the permuted tokens require no grad), and fc2's A [2, 8, 48] and B [2, 64, 8] (768 + 1024): 3328 x 2 B.
    ("per-expert", 16 + 64 + 3328 * 2),
    # shared-outer's per-expert sides are parameters used whole (no copy): torch._grouped_mm's offsets only.
    ("shared-outer", 16),
])
def test_per_expert_and_shared_outer_add_their_grouped_tensors(tmp_path, layout, extra):
    shared = _saved(_memory(tmp_path, rank="8"))
    report = _memory(tmp_path, "--lora-grouped-experts", layout, rank="8")
    # Both layouts' grouped GEMMs keep their int32 offsets [E/EP = 2] per adapted linear: 2 x 2 x 4 B = 16.
    assert _saved(report) == {**shared, "lora": shared["lora"] + extra}
    label = f"the first MoE layer's TEGroupedMLP {layout} adapters"
    assert any(line.startswith(label) for line in report["unmeasured"])


@pytest.fixture(scope="module")
def bridge_adapter_saved() -> dict[str, int]:
    """tests/grouped_adapter_step.py's measurement in Megatron-Bridge 0.6.2's venv."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    saved: dict[str, int] = procs.run_json("megatron-bridge-0.6.2",
                                           "import grouped_adapter_step; grouped_adapter_step.main()", port,
                                           timeout_s=600)
    return saved


@pytest.mark.parametrize(("name", "width", "started"), [
    ("linear_fc1 frozen input", 64, False), ("linear_fc1 input grad", 64, True),
    ("linear_fc2 frozen input", 48, False), ("linear_fc2 input grad", 48, True)])
def test_per_expert_grouped_mm_adapter_saves_as_measured(bridge_adapter_saved, name, width, started):
    # Bridge 0.6.2's GroupedExpertLinearAdapter alone on CPU (grouped_mm's path; tests/grouped_adapter_step.py):
    # 2 local experts, n = 32 tokens, r 8, h 64, ffn 48, bf16. What the shared adapter keeps (its input [n, in],
    # here grouped_mm's copy, and the [n, r] intermediate) plus grouped_adapter_saved's extra: offsets (8 B), the
    # two index ops' int64 indices (32 B), linear_out's weight copy (fc1 [2, 96, 8], fc2 [2, 64, 8]) and, where the
    # input requires grad, linear_in's ([2, 8, 64], [2, 8, 48]). E.g. fc1, frozen input: 4096 + 512 + 8 + 32 + 3072.
    target = name.split()[0]
    peft = PeftSpec(frozen=True, lora_rank=8, lora_targets=(target,), grouped_expert_adapters="per-expert")
    weights = {"linear_fc1": (2 * 8 * 64, 2 * 96 * 8), "linear_fc2": (2 * 8 * 48, 2 * 64 * 8)}
    extra = grouped_adapter_saved(peft, grouped_mm=True, got=32, num_local=2, width=64, ffn=48, act=2, frozen=True,
                                  moe_act=False, weights=weights, started=started)
    assert bridge_adapter_saved[name] == 32 * width * 2 + 32 * 8 * 2 + extra


def test_per_expert_grouped_mm_adapter_frozen_fc1_total(bridge_adapter_saved):
    # fc1 with a frozen input: its input copy [32, 64] (4096 B), the [n, r] intermediate [32, 8] (512), the int32
    # offsets (8), the two index ops' int64 indices (32) and linear_out's weight copy [2, 96, 8] (3072).
    assert bridge_adapter_saved["linear_fc1 frozen input"] == 4096 + 512 + 8 + 32 + 3072 == 7720


@pytest.mark.parametrize(("fusion", "experts", "freed"), [
    # Unfused SwiGLU: without moe_act the layer keeps the probabilities [n] (64 B), fc1's output [n, 2 ffn], silu(x1)
    # and x2 + offset (4 x 3072); moe_act keeps fc1's output and the probabilities (the checkpoint's inputs), and in
    # backward holds again silu(x1), x2 + offset and the restored output (fc2's adapter's input): 3 x 3072 (no
    # activation output kept for the probabilities, which need no gradient).
    (False, 64 + 4 * PER_TOKEN, 3 * PER_TOKEN),
    # Fused: the kernel keeps its input (fc1's output) and the probabilities either way; moe_act frees fc2's input.
    (True, 64 + 2 * PER_TOKEN, PER_TOKEN),
])
def test_moe_act_keeps_fc1_output_and_frees_fc2_adapters_input(tmp_path, fusion, experts, freed):
    plain = _saved(_memory(tmp_path, bias_activation_fusion=fusion))
    report = _memory(tmp_path, *MOE_ACT, bias_activation_fusion=fusion)
    act = _saved(report)
    assert plain["moe/experts"] == experts
    assert act["moe/experts"] == 64 + 2 * PER_TOKEN == 6208
    # fc2's adapter's input [n, ffn] is the freed activation output: not kept after forward.
    assert act["lora"] == plain["lora"] - PER_TOKEN
    assert any("moe_act recompute in the first MoE layer" in line for line in report["unmeasured"])
    spec, options = ModelSpec.from_mapping(MODEL), DecoderOptions.from_mapping(
        dict(MODEL, bias_activation_fusion=fusion, padded_vocab_size=128))
    # The started layer's freed count (4 or 1 x 3072, moe.moe_act_freed) less the unfused activation output.
    started = (4 if not fusion else 1) * PER_TOKEN
    assert first_adapter_moe_act_freed(spec, options, freed=started, tokens=16, act=2, tp=1, received=None) == freed


def test_moe_act_with_fc2_the_only_expert_target_is_not_modelled():
    spec, options = ModelSpec.from_mapping(MODEL), DecoderOptions.from_mapping(dict(MODEL, padded_vocab_size=128))
    fc2 = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc2",))
    # fc1's output requires no grad: CheckpointWithoutOutput records no node, saves no input, and its recompute
    # calls the activation without arguments (seen on CPU with megatron-core 0.16.1).
    assert "fails in backward" in (grouped_first_adapter_reason(spec, options, fc2, moe_act=True) or "")
    assert grouped_first_adapter_reason(spec, options, fc2, moe_act=False) is None


def test_legacy_grouped_experts_keep_nothing_on_the_routed_path(tmp_path):
    te = _memory(tmp_path)
    legacy = _memory(tmp_path, **LEGACY)
    # GroupedMLP has no linear_fc1/linear_fc2: the shared experts' linear_fc1 adapter is the layer's first; the
    # router, dispatcher, gmm, the compiled activation and the combine see nothing that requires grad. TEGroupedMLP
    # keeps the combine's sorted indices (int64 [T_l x k = 32]: 256 B), the probabilities and fc1's output, silu(x1)
    # and x2 + offset (64 + 4 x 3072 = 12352) and its adapters' inputs and [n, r] intermediates (fc1: 32 x 64 x 2
    # + 32 x 4 x 2 = 4352, fc2: 3072 + 256 = 3328): none of it here.
    assert _saved(te)["moe/dispatcher"] == 256 and _saved(te)["moe/experts"] == 12352
    assert _saved(legacy) == {k: v - {"lora": 4352 + 3328}.get(k, 0) for k, v in _saved(te).items()
                              if k not in ("moe/dispatcher", "moe/experts")}
    # EP 2: beyond the dispatch all-to-all's backward (both), the combine's: this rank's routed tokens' output
    # gradient [T_l x k, h] = 32 x 64 x 2 B = 4096 B.
    assert legacy["communication_per_step"]["ep/all_to_all"] == te["communication_per_step"]["ep/all_to_all"] - 4096
    assert any(line.startswith("the first MoE layer's legacy GroupedMLP experts") for line in legacy["unmeasured"])


def test_legacy_combine_skip_per_dispatcher():
    spec = ModelSpec.from_mapping(MODEL)
    training = Training(seq_length=16, micro_batch_size=1, num_microbatches=2)  # bf16: a = 2, m = 2

    def skip(dispatcher: str, **par: Any) -> dict[str, int]:
        options = DecoderOptions.from_mapping(dict(MODEL, **LEGACY, moe_token_dispatcher_type=dispatcher,
                                                   padded_vocab_size=128))
        return legacy_combine_skip(spec, options, Parallelism(**par), training)

    # alltoall, TP2 + SP x EP2 (T_l = 8): the output gradient's all-to-all [T_l x k, h] = 8 x 2 x 64 x 2 B = 2048 B
    # and its expert-TP all-gather [T_l x ETP x k, h] = 4096 B, per micro-batch.
    assert skip("alltoall", tp=2, sequence_parallel=True, ep=2, dp=2) == {"ep/all_to_all": -2 * 2048,
                                                                          "tp/all_gather": -2 * 4096}
    # allgather, EP2: the output gradient's all-gather over the G = T_l x ETP x EP = 32 rows [G, h]: 4096 B.
    assert skip("allgather", ep=2, dp=2) == {"tp_ep/all_gather": -2 * 4096}
    # flex (DeepEP), EP2: the combine's backward, [h] per (token, rank) sent: 16 x min(2, 2) x 128 B = 4096 B.
    assert skip("flex", ep=2, dp=2) == {"ep/all_to_all": -2 * 4096}
    # TEGroupedMLP's combine runs backward (its experts' output requires grad).
    te = DecoderOptions.from_mapping(dict(MODEL, padded_vocab_size=128))
    assert legacy_combine_skip(spec, te, Parallelism(ep=2, dp=2), training) == {}


def test_legacy_without_shared_experts_is_refused_as_estimate_refuses(tmp_path):
    fields = dict(LEGACY, moe_shared_expert_intermediate_size=None)
    argv = ("--frozen", "--lora-rank", "4", "--lora-targets", "linear_fc1,linear_fc2")
    _, estimate = _run(tmp_path, *argv, command="estimate", code=2, **fields)
    _, memory = _run(tmp_path, *argv, code=2, **fields)
    # One rule (flops/passes.py check_lora_targets): no projection takes the adapter, so none trains.
    assert "matches no projection of this model (its routed experts, legacy GroupedMLP, take no adapter)" in memory
    assert estimate == memory


NO_SHARED = dict(LEGACY, moe_shared_expert_intermediate_size=None)
ADAPTED = ("--frozen", "--lora-rank", "4", "--lora-targets", "linear_fc1,linear_fc2")


@pytest.mark.parametrize("freq", [[1, 0], [1, 1, 0]])
def test_legacy_moe_first_then_dense_saves_as_a_dense_first_layer(tmp_path, freq):
    # Legacy GroupedMLP without shared experts: no adapter of the leading MoE layers trains, nothing in them requires
    # grad, so they save nothing, and the gradient starts at the dense layer's linear_fc1 adapter: the model saves
    # exactly what a frozen one-layer dense model (the measured dense-first case) saves, key by key.
    legacy, _ = _run(tmp_path, *ADAPTED, num_layers=len(freq), moe_layer_freq=freq, **NO_SHARED)
    dense, _ = _run(tmp_path, *ADAPTED, num_layers=1, num_moe_experts=None, moe_router_topk=None,
                    moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None, moe_grouped_gemm=False)
    assert legacy["not_modelled"] == []
    # fc1's input [16, 64] x 2 B, fc1's output 2 x [16, 128] and silu's, fc2's input [16, 128] ... (the dense case)
    assert _saved(legacy) == _saved(dense) == {"mlp": 22528, "lora": 256, "dropout": 1024, "output": 10512}
    assert any(line.startswith("the leading MoE layers of legacy GroupedMLP experts without shared experts")
               for line in legacy["unmeasured"])


def test_legacy_leading_moe_layers_run_no_backward(tmp_path):
    def comm(freq: list[int], *argv: str) -> dict[str, int]:
        report, _ = _run(tmp_path, *ADAPTED, *argv, num_layers=len(freq), moe_layer_freq=freq, **NO_SHARED)
        return report["communication_per_step"]

    # DP2 x EP2 (T_l = 16, k = 2, h = 64, a = 2 B, m = 1): per leading MoE layer its forward all-to-alls only: the
    # dispatch's tokens and probabilities [T_l x k, h + 1] = 32 x 65 x 2 = 4160 B and the combine's [32, 64]: 4096 B
    # (no backward of either).
    for freq in ([1, 0], [1, 1, 0]):
        assert comm(freq, "--dp", "2", "--ep", "2")["ep/all_to_all"] == (len(freq) - 1) * (4160 + 4096)
    # TP2 + SP x DP2 x EP2 (T_l = 8, ETP = TP = 2): a second leading MoE layer adds its forward collectives only: the
    # attention's SP all-gather [16, 64] and reduce-scatter (2048 B each); the dispatch all-to-all [8 x 2, 65] (2080
    # B), the combine's [16, 64] (2048 B); the expert-TP all-gather of the received tokens [32, 65] (4160 B) and the
    # reduce-scatter of the experts' output [32, 64] (4096 B); the routing's token counts (128 B): none of their
    # backward (their input gradients, the attention's TP collectives included).
    sp = ("--tp", "2", "--sequence-parallel", "--dp", "2", "--ep", "2")
    one, two = comm([1, 0], *sp), comm([1, 1, 0], *sp)
    assert {k: two[k] - one[k] for k in one if k not in ("total_bytes", "dp/all_reduce")} == {
        "tp/all_gather": 2048 + 4160, "tp/reduce_scatter": 2048 + 4096, "tp/all_reduce": 0, "tp_ep/all_gather": 128,
        "ep/all_to_all": 2080 + 2048}


def test_te_grouped_first_adapter_label_names_its_layout():
    spec = ModelSpec.from_mapping(MODEL)
    options = DecoderOptions.from_mapping(dict(MODEL, padded_vocab_size=128))
    for layout in ("shared", "per-expert", "shared-outer"):
        peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_fc1", "linear_fc2"),
                        grouped_expert_adapters=layout)
        labels = " ".join(first_adapter_unmeasured(spec, options, peft))
        assert f"from linear_fc1's {layout} adapter" in labels


def test_moe_act_without_grouped_gemm_is_refused_by_estimate_as_by_memory(tmp_path):
    fields = dict(moe_grouped_gemm=False)
    _, estimate = _run(tmp_path, *MOE_ACT, command="estimate", code=2, **fields)
    _, memory = _run(tmp_path, *MOE_ACT, code=2, **fields)
    assert "megatron-core refuses selective recompute of moe_act without grouped-GEMM experts" in estimate
    assert estimate == memory
    _run(tmp_path, *MOE_ACT, command="estimate")  # (with grouped-GEMM experts: accepted)
