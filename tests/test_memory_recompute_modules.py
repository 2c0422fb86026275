"""Selective recompute of megatron-core 0.16.1's other modules (``layernorm``, ``mla_up_proj``,
``moe``, ``shared_experts``), measured: the saved-for-backward bytes of real megatron-core GPT
micro-batches (tests/test_memory_activations.py's single-process fixture) against
:func:`megatron_flops.memory.activations.chunk_activations`.

``layernorm`` and ``mla_up_proj`` run under ``CheckpointWithoutOutput``, which frees the storage
of an output other ops saved (``resize_(0)``) and restores it in backward: the saved-tensor hooks
see the storage when it is saved, at its full size, so these are measured with
:class:`mcore_memory.LiveStorageMeter`, which sizes each saved storage when it reads it (at the
end of each forward, and at every pack and unpack for the peak). fp32 LayerNorm without dropout:
torch's CPU kernels save as the CUDA convention (no CPU correction)."""

from __future__ import annotations

import dataclasses
import re

import pytest

import mcore_memory
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.activations import (check_activations_supported, chunk_activations, in_flight,
                                               schedule_peak)
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.model.spec import ModelSpec
from test_memory_activations import ALL, BASE, LORA_RANK, MBS, MLA_LN, MOE, NUM_MB, SEQ, VOCAB, _measure


def _selective(*modules: str) -> dict:
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


SHARED = dict(MOE, moe_shared_expert_intermediate_size=80)
MLA_MOE = dict(MLA_LN, q_lora_rank=24, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
               moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=32, moe_token_dispatcher_type="alltoall")
CASES = {
    "layernorm": _selective("layernorm"),
    "layernorm, GQA, SwiGLU": dict(_selective("layernorm"), num_query_groups=2, gated_linear_unit=True,
                                   activation_func="silu"),
    "layernorm + core_attn + mlp, GQA": dict(_selective("layernorm", "core_attn", "mlp"), num_query_groups=2),
    "layernorm, 1 MTP layer": dict(_selective("layernorm"), mtp_num_layers=1),
    "MoE: moe": dict(SHARED, **_selective("moe")),
    "MoE: shared_experts": dict(SHARED, **_selective("shared_experts")),
    "MoE: moe + shared_experts (gated), allgather": dict(SHARED, **_selective("moe", "shared_experts"),
                                                         moe_shared_expert_gate=True,
                                                         moe_token_dispatcher_type="allgather"),
    "MoE: layernorm + shared_experts, every other layer": dict(SHARED, **_selective("layernorm", "shared_experts"),
                                                               moe_layer_freq=[0, 1]),
    "MoE: layernorm + moe + core_attn": dict(SHARED, **_selective("layernorm", "moe", "core_attn")),
    "MLA: mla_up_proj, q_lora": dict(MLA_LN, q_lora_rank=24, **_selective("mla_up_proj")),
    "MLA: mla_up_proj, direct q, qk_layernorm": dict(MLA_LN, q_lora_rank=None, qk_layernorm=True,
                                                     **_selective("mla_up_proj")),
    "MLA: mla_up_proj + core_attn, q_lora, qk_layernorm": dict(MLA_LN, q_lora_rank=24, qk_layernorm=True,
                                                               **_selective("mla_up_proj", "core_attn")),
    # Where the most held is in backward (the restored q, k, v; the wide shared experts re-run).
    "MLA: mla_up_proj, 16 heads": dict(MLA_LN, q_lora_rank=24, num_attention_heads=16, **_selective("mla_up_proj")),
    "MoE: shared_experts, wide shared experts": dict(SHARED, moe_shared_expert_intermediate_size=1024,
                                                     **_selective("shared_experts")),
    "MLA + MoE, 1 MTP layer: every module": dict(
        MLA_MOE, mtp_num_layers=1, **_selective("layernorm", "mla_up_proj", "core_attn", "moe", "shared_experts")),
}


def _model(fields: dict, dtype: str = "fp32"):
    model = dict(BASE, **fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model)
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope", add_bias_linear=False,
                                               transformer_impl="local"))
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype=dtype)
    return spec, options, training, RecomputeSpec.from_mapping(model)


@pytest.mark.parametrize("name", list(CASES))
def test_selective_recompute_saved_bytes_match_megatron_core(mcore, name):  # noqa: F811
    fields = CASES[name]
    measured_forward, measured_peak = _measure(fields, "rope", "fp32", meter_cls=mcore_memory.LiveStorageMeter)
    spec, options, training, recompute = _model(fields)
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0, recompute=recompute)
    assert measured_forward == [act.forward + act.shared] * NUM_MB
    assert measured_peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]
    assert (measured_peak > measured_forward[0]) == (name in BACKWARD_PEAKS)


# With LoRA adapters (rank 4, as Megatron-Bridge's): fields, targets, frozen base. A frozen base's
# MLA up projections keep no input, but the up-projection checkpoint keeps its inputs (q latent
# [T, 24], kv_down's output [T, 32 + 8]: (24 + 40) * 32 * 4 = 8192 bytes in layer 1; layer 0 runs
# before the first adapter, its checkpoint saves nothing); the shared experts' adapters' [T, r]
# intermediates are re-saved inside the shared_experts checkpoint. (Frozen base + layernorm:
# megatron-core fails, test_what_is_not_modelled_says_why.)
MLA_FOUR = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
PEFT_CASES = {
    "layernorm, base trains, linear_qkv": (_selective("layernorm"), ("linear_qkv",), False),
    "moe, frozen, all four targets": (dict(SHARED, **_selective("moe")), ALL, True),
    "moe, base trains, linear_fc1 + linear_fc2": (dict(SHARED, **_selective("moe")), ("linear_fc1", "linear_fc2"),
                                                   False),
    "shared_experts, frozen, all four targets": (dict(SHARED, **_selective("shared_experts")), ALL, True),
    "layernorm + moe + shared_experts, base trains, linear_fc2": (
        dict(SHARED, **_selective("layernorm", "moe", "shared_experts")), ("linear_fc2",), False),
    "mla_up_proj, q_lora, frozen, all four targets": (dict(MLA_LN, q_lora_rank=24, **_selective("mla_up_proj")), ALL,
                                                      True),
    "mla_up_proj, direct q, frozen, all four targets": (dict(MLA_LN, q_lora_rank=None, **_selective("mla_up_proj")),
                                                        ALL, True),
    "mla_up_proj, q_lora, qk_layernorm, frozen, all four targets": (
        dict(MLA_LN, q_lora_rank=24, qk_layernorm=True, **_selective("mla_up_proj")), ALL, True),
    # Adapters on MLA's up projections run inside the checkpoint: re-saved when it re-runs.
    "mla_up_proj, q_lora, qk_layernorm, frozen, MLA's four projections": (
        dict(MLA_LN, q_lora_rank=24, qk_layernorm=True, **_selective("mla_up_proj")), MLA_FOUR, True),
    "mla_up_proj, q_lora, base trains, MLA's four projections + linear_proj": (
        dict(MLA_LN, q_lora_rank=24, **_selective("mla_up_proj")), MLA_FOUR + ("linear_proj",), False),
    "mla_up_proj, q_lora, qk_layernorm, base trains, linear_proj": (
        dict(MLA_LN, q_lora_rank=24, qk_layernorm=True, **_selective("mla_up_proj")), ("linear_proj",), False),
    # A frozen MLA + MoE first layer adapted on its experts only (memory/moe_lora_start.py): nothing requires grad
    # before the shared experts' fc1 adapter, so layer 0's up-projection checkpoint saves nothing and never re-runs
    # (test_mla_up_proj_in_a_frozen_moe_first_layer_saves_nothing: the integers).
    **{f"{label}, MLA + MoE first layer, shared experts, frozen, linear_fc1 + linear_fc2": (
        dict(MLA_MOE, moe_layer_freq=1, **_selective(*modules)), ("linear_fc1", "linear_fc2"), True)
       for label, modules in (("mla_up_proj", ("mla_up_proj",)), ("core_attn + mla_up_proj", ("core_attn", "mla_up_proj")))},
}


@pytest.mark.parametrize("name", list(PEFT_CASES))
def test_selective_recompute_with_lora_saved_bytes_match_megatron_core(mcore, name):
    fields, targets, frozen = PEFT_CASES[name]
    measured_forward, measured_peak = _measure(fields, "rope", "fp32", lora=(targets, LORA_RANK, frozen),
                                               meter_cls=mcore_memory.LiveStorageMeter)
    spec, options, training, recompute = _model(fields)
    peft = PeftSpec(frozen=frozen, lora_rank=LORA_RANK, lora_targets=targets)
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0, recompute=recompute,
                            peft=peft)
    assert measured_forward == [act.forward + act.shared] * NUM_MB
    assert measured_peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]


# Cases whose peak is in a backward pass (a recompute region's), not at the end of a forward.
BACKWARD_PEAKS = ("MoE: moe", "MoE: moe + shared_experts (gated), allgather", "MoE: layernorm + moe + core_attn",
                  "MLA: mla_up_proj, 16 heads", "MoE: shared_experts, wide shared experts")


def test_transformer_engine_spec_recomputes_only_its_separate_norms():
    # Transformer Engine's spec fuses the input norm into linear_qkv and a dense layer's pre-MLP
    # norm into linear_fc1 (IdentityOp: nothing to recompute); MLA's input norm and a MoE layer's
    # pre-MLP norm are modules of their own. T = 32 tokens, h = 64, fp32: each recomputed norm
    # frees its [T, h] output and its fp32 mean and rstd, 32 * 64 * 4 + 32 * 2 * 4 = 8448 bytes.
    def forward(fields: dict, impl: str) -> int:
        spec, options, training, recompute = _model(fields)
        options = dataclasses.replace(options, transformer_impl=impl)
        act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0, recompute=recompute)
        return act.forward

    per_norm = SEQ * MBS * 64 * 4 + SEQ * MBS * 2 * 4
    for fields, separate in ((BASE, 0), (dict(SHARED, moe_layer_freq=[0, 1]), 1), (dict(MLA_LN, q_lora_rank=24), 2)):
        plain = forward(fields, "transformer_engine")
        with_norms = dict(fields, **_selective("layernorm"))
        assert plain - forward(with_norms, "transformer_engine") == separate * per_norm
        assert plain - forward(with_norms, "local") == 2 * BASE["num_layers"] * per_norm  # (every norm)


# ---- FLOPs: `estimate` prices what each module's recompute re-runs ------------------------------

# 4 layers (layer 0 dense, 1-3 MoE: top-2 of 4 experts, ffn 48, shared experts 32), MLA (q_lora 24,
# kv_lora 16, 4 heads of qk 16 + rope 8 and v 16), h = 64, one sequence of T = 16 tokens.
FLOPS_MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
                   num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                   moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1, 1], multi_latent_attention=True,
                   q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
T = 16
# The MLA up projections per layer: q_up [T, 24] @ [24, 4 * 24], kv_up [T, 16] @ [16, 4 * (16 + 16)].
UP_PROJ = 4 * (2 * T * 24 * 96 + 2 * T * 16 * 128)


def _estimate(path, *flags: str) -> dict:
    import contextlib
    import io
    import json

    from megatron_flops.cli import build_parser

    args = build_parser().parse_args(["estimate", "--model", str(path), "--seq-length", str(T),
                                      "--convention", "train_passes", "--json", *flags])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("modules, delta", [
    # One forward of the module's GEMMs (train_passes: a component is 3 x its forward FLOPs).
    ("layernorm", {}), ("core_attn", {"attn/core": "/3"}), ("mlp", {"mlp": "/3"}),
    ("mla_up_proj", {"attn/qkv": UP_PROJ}),
    ("moe", {"moe/router": "/3", "moe/routed": "/3", "moe/shared": "/3"}),
    ("shared_experts", {"moe/shared": "/3"}),
    ("moe,shared_experts", {"moe/router": "/3", "moe/routed": "/3", "moe/shared": "2/3"}),  # (the inner re-run too)
])
def test_estimate_adds_one_forward_of_each_recomputed_module(tmp_path, modules, delta):
    import json

    path = tmp_path / "model.json"
    path.write_text(json.dumps(FLOPS_MODEL))
    plain = _estimate(path)
    report = _estimate(path, "--recompute", "selective", "--recompute-modules", modules)
    model = plain["components"]
    expected = {key: {"/3": model[key] // 3, "2/3": 2 * model[key] // 3}.get(value, value)  # type: ignore[arg-type]
                for key, value in delta.items()}
    got = {key: value - plain["executed_components"][key] for key, value in report["executed_components"].items()
           if value != plain["executed_components"][key]}
    assert got == expected
    assert report["recompute_flops"] == sum(expected.values())
    assert report["components"] == model  # (model FLOPs do not count recompute)


@pytest.mark.parametrize("command", ["estimate", "memory"])
def test_mla_up_proj_without_mla_is_refused_as_megatron_core_refuses_it(tmp_path, command):
    import json

    from megatron_flops.cli import build_parser

    path = tmp_path / "model.json"
    path.write_text(json.dumps(dict(FLOPS_MODEL, multi_latent_attention=False)))
    args = build_parser().parse_args([command, "--model", str(path), "--seq-length", str(T), "--recompute",
                                      "selective", "--recompute-modules", "core_attn,mla_up_proj"])
    # (one rule, flops/passes.py check_recompute_modules: TransformerConfig's own ValueError)
    with pytest.raises(ValueError, match="'mla_up_proj in recompute_modules is only supported with "
                                         "multi_latent_attention'"):
        args.func(args)


@pytest.mark.parametrize("fields, par, peft, reason", [
    (dict(SHARED, **_selective("layernorm", "moe")), Parallelism(), PeftSpec(frozen=True, lora_rank=4),
     "layernorm with a frozen base: megatron-core 0.16.1's and 0.19.0's CheckpointWithoutOutput fail"),
])
def test_what_is_not_modelled_says_why(fields, par, peft, reason):
    spec, options, _, recompute = _model(fields)
    assert recompute is not None
    got = check_activations_supported(spec, options, par, recompute, peft)
    assert got is not None and got.startswith("activations under selective recompute of")
    assert re.search(reason, got)


def test_moe_and_shared_experts_rerun_their_collectives_under_tp():
    # TP2 + SP, 3 MoE layers with shared experts, M = 2 micro-batches of [s, b, h] = [16, 2, 64] in
    # bf16 (hidden = 16 * 2 * 64 * 2 = 4096 bytes): each re-run of the shared experts all-gathers
    # fc1's input and reduce-scatters fc2's output, one hidden each. moe: 3 re-runs per
    # micro-batch; shared_experts: 3; both: 6 (the inner checkpoint re-runs after the outer one).
    from megatron_flops.memory.recompute import selective_rerun_communication

    spec = ModelSpec.from_mapping(dict(FLOPS_MODEL, multi_latent_attention=False))
    par = Parallelism(tp=2, sequence_parallel=True)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2)
    for modules, runs in ((("moe",), 3), (("shared_experts",), 3), (("moe", "shared_experts"), 6), (("core_attn",), 0)):
        got = selective_rerun_communication(spec, par, training, pp_rank=0,
                                            recompute=RecomputeSpec(granularity="selective", modules=modules), peft=None)
        assert got == ({"tp/all_gather": 2 * runs * 4096, "tp/reduce_scatter": 2 * runs * 4096} if runs else {})


def test_mla_up_proj_reruns_its_all_gathers_under_sequence_parallelism():
    # 2 MLA layers, M = 2 micro-batches of [s, b] = [16, 2] = 32 tokens, fp32. Under TP2 + SP each
    # re-run up projection all-gathers its latent input again: q latent 32 * 24 * 4 = 3072 and kv
    # latent 32 * 32 * 4 = 4096 bytes (direct q: the hidden states, 32 * 64 * 4 = 8192); per step
    # 2 * 2 * (3072 + 4096) = 28672 (direct q: 2 * 2 * (8192 + 4096) = 49152). TP2 without SP: the
    # inputs enter by an identity forward, nothing re-runs.
    from megatron_flops.memory.recompute import selective_rerun_communication

    for q_lora, sp, expected in ((24, True, {"tp/all_gather": 28672}), (None, True, {"tp/all_gather": 49152}),
                                 (24, False, {})):
        spec, _, training, recompute = _model(dict(MLA_LN, q_lora_rank=q_lora, **_selective("mla_up_proj")))
        got = selective_rerun_communication(spec, Parallelism(tp=2, sequence_parallel=sp), training, pp_rank=0,
                                            recompute=recompute, peft=None)
        assert got == expected


def test_transformer_engine_mla_up_proj_recomputes_the_fused_latent_norms():
    # Transformer Engine's MLA spec fuses the q and kv latent norms into the up projections:
    # selective mla_up_proj re-runs them, so forward keeps neither their fp32 mean and rstd nor
    # their outputs. Per layer (T = 32, fp32): q norm 32 * 2 * 4 + 32 * 24 * 4 = 3328, kv norm
    # 32 * 2 * 4 + 32 * 32 * 4 = 4352; 2 layers: 15360 bytes fewer than the local spec keeps.
    fields = dict(MLA_LN, q_lora_rank=24, qk_layernorm=True, **_selective("mla_up_proj"))
    spec, options, training, recompute = _model(fields)
    kept = {impl: chunk_activations(spec, dataclasses.replace(options, transformer_impl=impl), Parallelism(),
                                    training, pp_rank=0, chunk=0, recompute=recompute)
            for impl in ("local", "transformer_engine")}
    assert kept["local"].forward - kept["transformer_engine"].forward == 2 * (3328 + 4352)


def test_selective_moe_reruns_routed_expert_adapters_only_where_they_gather():
    # 2 MoE layers (4 experts, top-2, no shared experts), [s, b] = [16, 2] = 32 tokens, bf16, LoRA
    # rank 4 on linear_fc1/linear_fc2, TP2 + SP. Each re-run layer (selective moe) runs the dispatcher
    # size of a dense MLP again, 32 x 64 x 2 = 4,096 bytes gathered and reduce-scattered, and its
    # routed experts' adapters all-gather over expert TP [n, r] and [n, h] for n = 32 / TP x ETP x 2:
    # at ETP = TP 2, n = 64, 64 x 2 x (4 + 64) = 8,704 bytes. At ETP 1 (EP 2) they gather nothing,
    # and legacy GroupedMLP experts (no linear_fc1/linear_fc2 modules) have no adapter.
    from megatron_flops.memory.recompute import selective_rerun_communication

    spec = ModelSpec.from_mapping(dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_layers=2,
                                       vocab_size=128, add_bias_linear=False, num_moe_experts=4, moe_router_topk=2,
                                       moe_ffn_hidden_size=64))
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=1, params_dtype="bf16")
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_proj", "linear_fc1", "linear_fc2"))
    recompute = RecomputeSpec(granularity="selective", modules=("moe",))

    def reruns(par: Parallelism, **kw: bool) -> dict[str, int]:
        return selective_rerun_communication(spec, par, training, pp_rank=0, recompute=recompute, peft=peft, **kw)

    assert 64 * 2 * (4 + 64) == 8_704
    etp2 = Parallelism(tp=2, sequence_parallel=True)
    assert reruns(etp2) == {"tp/all_gather": 2 * (4_096 + 8_704), "tp/reduce_scatter": 2 * 4_096}
    assert reruns(etp2, expert_adapters=False) == {"tp/all_gather": 2 * 4_096, "tp/reduce_scatter": 2 * 4_096}
    etp1 = Parallelism(tp=2, sequence_parallel=True, ep=2, etp=1, dp=2)
    assert reruns(etp1) == {"tp/all_gather": 2 * 4_096, "tp/reduce_scatter": 2 * 4_096}


def test_layernorm_recompute_fails_for_a_frozen_moe_first_layer_adapted_on_its_experts(mcore):
    # The framework's own failure (recompute.selective_reason, the reason `memory` gives, ahead of the experts-first
    # one): layer 0's norms run under CheckpointWithoutOutput with inputs that require no grad, so it saves none,
    # and a norm's re-run in backward finds no input.
    fields = dict(MLA_MOE, moe_layer_freq=1, **_selective("layernorm", "mla_up_proj"))
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'input'"):  # (the norm's re-run)
        _measure(fields, "rope", "fp32", lora=(("linear_fc1", "linear_fc2"), LORA_RANK, True),
                 meter_cls=mcore_memory.LiveStorageMeter)
    spec, options, _, recompute = _model(fields)
    peft = PeftSpec(frozen=True, lora_rank=LORA_RANK, lora_targets=("linear_fc1", "linear_fc2"))
    reason = check_activations_supported(spec, options, Parallelism(), recompute, peft)
    assert reason is not None and "CheckpointWithoutOutput fail" in reason
