"""Frozen weights, LoRA adapters and activation recompute: hand-derived passes, one-term deltas,
conventions, bad input, and FlopCounterMode on real megatron-core GPTModels (forward + backward,
CPU) equal to the estimate by integer equality.

Oracles: a frozen base (``requires_grad=False`` on every parameter) with LoRA adapters wrapped
around megatron's linear layers, built two ways: from megatron ``ColumnParallelLinear`` layers as
Megatron-Bridge's ``ParallelLinearAdapter`` builds them (measures the executed count), and from
plain ``F.linear`` (autograd skips unneeded input gradients: measures the model count).
Recompute runs megatron-core's own ``CheckpointFunction``/``CheckpointWithoutOutput``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import mcore_cpu
from megatron_flops.flops.formulas import TRAIN_PASSES, SeqStats, gemm, parse_rows, training_flops
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec, training_passes
from megatron_flops.model.spec import ModelSpec

VOCAB = 128
ROWS = [16, 9]
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
MOE = dict(BASE, num_layers=3, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           moe_shared_expert_intermediate_size=80, moe_layer_freq=[0, 1, 1],
           gated_linear_unit=True, activation_func=F.silu)
MLA = dict(BASE, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=16)
MLA_Q = dict(MLA, q_lora_rank=40, v_head_dim=24)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _selective(*modules: str) -> dict:
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


# ---- pure: hand-derived ----------------------------------------------------------------------

# L = 2, h = 8, 2 heads of 4, ffn 16, V = 16; rows [4, 6]: T = 10 tokens, sum s^2 = 16 + 36 = 52.
TINY = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
                                   vocab_size=16, padded_vocab_size=16))
TINY_STATS = SeqStats.from_rows(parse_rows([4, 6]))


def test_no_peft_no_recompute_is_training_flops():
    specs = [TINY] + [
        ModelSpec.from_mapping(dict(c, vocab_size=VOCAB, activation_func="silu" if c.get("gated_linear_unit") else "gelu"))
        for c in (BASE, MOE, MLA, MLA_Q, dict(BASE, mtp_num_layers=2))
    ]
    stats = SeqStats.from_rows(parse_rows([16, [5, 4], {"seqlens": [3], "pad_to": 8}]))
    for spec in specs:
        for padded in (False, True):
            passes = training_passes(spec, stats, include_padding=padded)
            stock = training_flops(spec, stats, include_padding=padded)
            assert passes.model().components == stock.components
            assert passes.model("train_passes").components == stock.components
            assert passes.executed().components == stock.components
            assert not any(passes.unneeded.values()) and not any(passes.recompute.values())


def test_frozen_lora_hand_derived():
    # Rank 2 on linear_qkv ([10, 8] @ [8, 24]) and linear_fc2 ([10, 16] @ [16, 8]), base frozen.
    # Per layer forward: qkv 2*10*8*24 = 3840; adapter qkv A 2*10*8*2 = 320, B 2*10*2*24 = 960;
    # core (full) 2*2*(4+4)*52 = 1664; out 2*10*8*8 = 1280; mlp 2*10*8*16 + 2*10*16*8 = 5120;
    # adapter fc2 A 2*10*16*2 = 640, B 2*10*2*8 = 320; logits (once) 2*10*8*16 = 2560.
    passes = training_passes(TINY, TINY_STATS, peft=PeftSpec(frozen=True, lora_rank=2,
                                                             lora_targets=("linear_qkv", "linear_fc2")),
                             attention="full")
    assert passes.forward == {"attn/qkv": 7680, "lora/linear_qkv": 2560, "attn/core": 3328, "attn/out": 2560,
                              "mlp": 10240, "lora/linear_fc2": 1920, "logits": 2560}
    # Layer 0's input needs no gradient: no dgrad for linear_qkv and adapter A; from the adapter on,
    # everything needs one (core: both operands, 2 x 1664). Layer 1: every dgrad.
    assert passes.input_grad == {"attn/qkv": 3840, "lora/linear_qkv": 960 + 1280, "attn/core": 4 * 1664,
                                 "attn/out": 2560, "mlp": 10240, "lora/linear_fc2": 1920, "logits": 2560}
    # Only the adapters train.
    assert passes.weight_grad == {"attn/qkv": 0, "lora/linear_qkv": 2560, "attn/core": 0, "attn/out": 0,
                                  "mlp": 0, "lora/linear_fc2": 1920, "logits": 0}
    # Megatron's adapter linear_in still runs layer 0's A dgrad (320).
    assert passes.unneeded == dict.fromkeys(passes.forward, 0) | {"lora/linear_qkv": 320}
    assert passes.model().total == 30848 + 30016 + 4480
    assert passes.executed().total == passes.model().total + 320
    assert passes.model("train_passes").total == TRAIN_PASSES * 30848


def test_first_layer_skip_is_the_only_difference_from_a_trainable_base():
    # Same adapters, base trainable: 3x everywhere. The frozen base drops every weight gradient of
    # the base (forward sizes) and layer 0's linear_qkv dgrad (3840) and adapter A dgrad (320).
    peft = PeftSpec(lora_rank=2, lora_targets=("linear_qkv", "linear_fc2"))
    trained = training_passes(TINY, TINY_STATS, peft=peft, attention="full")
    frozen = training_passes(TINY, TINY_STATS, peft=dataclasses.replace(peft, frozen=True), attention="full")
    assert trained.model().components == {k: TRAIN_PASSES * v for k, v in trained.forward.items()}
    base_keys = ("attn/qkv", "attn/core", "attn/out", "mlp", "logits")
    base_wgrad = sum(trained.forward[k] for k in base_keys) - trained.forward["attn/core"]
    assert trained.model().total - frozen.model().total == base_wgrad + 3840 + 320


def test_recompute_hand_derived():
    # Full uniform: both layers' forward again (everything but the logits): 2 x (3840 + 1664 +
    # 1280 + 5120) = 23,808. Block, 1 layer: half. Selective core_attn: 3328; mlp: 10240.
    def recomputed(**fields) -> int:
        return sum(training_passes(TINY, TINY_STATS, recompute=RecomputeSpec(**fields),
                                   attention="full").recompute.values())

    assert recomputed(granularity="full", method="uniform", num_layers=1) == 23808
    assert recomputed(granularity="full", method="uniform", num_layers=2) == 23808
    assert recomputed(granularity="full", method="block", num_layers=1) == 11904
    assert recomputed(granularity="selective") == 3328
    assert recomputed(granularity="selective", modules=("mlp", "layernorm")) == 10240
    # Two pipeline stages: block recompute re-runs the first layer of each (here, both layers).
    assert recomputed(granularity="full", method="block", num_layers=1, pipeline_model_parallel_size=2) == 23808


# ---- pure: one-term deltas -------------------------------------------------------------------


def test_rank_plus_one_moves_adapters_only():
    # r -> r + 1 adds one column to A and one row to B: fwd per layer 2*10*8 + 2*10*24 = 640 (qkv),
    # 2*10*16 + 2*10*8 = 480 (fc2); passes: qkv layer 0 A 2x, B 3x; everything else 3x.
    peft = PeftSpec(frozen=True, lora_rank=2, lora_targets=("linear_qkv", "linear_fc2"))
    base = training_passes(TINY, TINY_STATS, peft=peft).model().components
    more = training_passes(TINY, TINY_STATS, peft=dataclasses.replace(peft, lora_rank=3)).model().components
    delta = {k: more[k] - base[k] for k in base if more[k] != base[k]}
    assert delta == {"lora/linear_qkv": (2 * 160 + 3 * 480) + 3 * 640, "lora/linear_fc2": 2 * 3 * 480}


def test_one_recompute_module_moves_one_executed_term():
    # Adding "mlp" to the selective modules re-runs the MLP forward (10240) and its adapter (1920).
    peft = PeftSpec(frozen=True, lora_rank=2, lora_targets=("linear_qkv", "linear_fc2"))
    base = training_passes(TINY, TINY_STATS, peft=peft, recompute=RecomputeSpec(granularity="selective"),
                           attention="full")
    more = training_passes(TINY, TINY_STATS, peft=peft,
                           recompute=RecomputeSpec(granularity="selective", modules=("core_attn", "mlp")),
                           attention="full")
    assert more.model().components == base.model().components
    b, m = base.executed().components, more.executed().components
    assert {k: m[k] - b[k] for k in b if m[k] != b[k]} == {"mlp": 10240, "lora/linear_fc2": 1920}


def test_block_recompute_over_uneven_stages():
    # 3 TINY layers (11,904 forward each) on PP 2. The first stage holds 1 layer, the last 2 (as
    # megatron-core splits num_layers_in_first_pipeline_stage=1): block 1 re-runs layers 0 and 1,
    # 23,808; block 2 all three, 35,712. The embedding counted in the split: (3 + 1) / 2 = 2 per
    # rank, 1 + 2 layers again. A layout 'Et|t|tL' on PP 3: one layer per stage, block 1 re-runs all.
    (kind, count), = TINY.layer_runs
    spec = dataclasses.replace(TINY, layer_runs=((kind, count + 1),))

    def recomputed(block: int, pp: int, **split) -> int:
        fields = dict(FULL, recompute_method="block", recompute_num_layers=block, pipeline_model_parallel_size=pp,
                      **split)
        recompute = RecomputeSpec.from_mapping(fields)
        return sum(training_passes(spec, TINY_STATS, recompute=recompute, attention="full").recompute.values())

    assert recomputed(1, 2, num_layers_in_first_pipeline_stage=1) == 2 * 11904
    assert recomputed(2, 2, num_layers_in_first_pipeline_stage=1) == 3 * 11904
    assert recomputed(1, 2, num_layers_in_last_pipeline_stage=1) == 2 * 11904
    assert recomputed(1, 2, account_for_embedding_in_pipeline_split=True) == 2 * 11904
    assert recomputed(1, 3, pipeline_model_parallel_layout="Et|t|tL") == 3 * 11904
    # Empty edge stages ('|Ett|tL', 'Ett|tL|' on PP 3: stages of 0, 2, 1 and 2, 1, 0 layers, the
    # embedding and loss built on the edge stages anyway): block 1 re-runs the first layer of the two
    # non-empty stages, 2 x 11,904.
    assert recomputed(1, 3, pipeline_model_parallel_layout="|Ett|tL") == 2 * 11904
    assert recomputed(1, 3, pipeline_model_parallel_layout="Ett|tL|") == 2 * 11904


def test_one_more_block_layer_moves_one_layer():
    # Block recompute of 1 -> 2 layers on a 3-layer TINY: one layer's forward, 11,904.
    (kind, count), = TINY.layer_runs
    spec = dataclasses.replace(TINY, layer_runs=((kind, count + 1),))

    def executed(n: int) -> int:
        return training_passes(spec, TINY_STATS, recompute=RecomputeSpec(granularity="full", method="block",
                                                                         num_layers=n), attention="full").executed().total

    assert executed(2) - executed(1) == 3840 + 1664 + 1280 + 5120


def test_frozen_router_wgrad_is_unneeded():
    # A frozen router whose input needs a gradient still runs its wgrad [T, h]^T @ [T, E]: 2*T*h*E.
    spec = ModelSpec.from_mapping(dict(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16,
                                       padded_vocab_size=16, num_moe_experts=4, moe_ffn_hidden_size=6))
    passes = training_passes(spec, TINY_STATS, peft=PeftSpec(frozen=True, lora_rank=2, lora_targets=("linear_qkv",)))
    assert passes.unneeded["moe/router"] == gemm(10, 8, 4)
    assert passes.input_grad["moe/router"] == gemm(10, 8, 4) and passes.weight_grad["moe/router"] == 0


# ---- pure: bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lora_rank=0), "lora rank must be a positive integer"),
        (dict(lora_rank=4, lora_targets=("linear_qvk",)), r"unknown lora target 'linear_qvk' \(did you mean 'linear_qkv'\?\)"),
        (dict(lora_rank=4, lora_targets=()), "lora targets must be a non-empty tuple"),
        (dict(frozen=True), "nothing to train"),
    ],
)
def test_peft_spec_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeftSpec(**kwargs)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(recompute_granularity="partial"), "recompute_granularity must be one of"),
        (dict(recompute_granularity="full", recompute_num_layers=1), "needs recompute_method"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "needs recompute_num_layers >= 1"),
        (dict(recompute_granularity="selective", recompute_num_layers=1), "recompute_num_layers must be None"),
        (dict(recompute_granularity="selective", recompute_modules=["attn"]), "unknown recompute module 'attn'"),
        (dict(recompute_granularity="selective", recompute_modules="mlp"), "recompute_modules must be a list"),
        (dict(FULL, recompute_method="block", pipeline_model_parallel_layout=3), "layout must be a string"),
        (dict(FULL, pipeline_model_parallel_size=0), "pipeline_model_parallel_size must be a positive integer"),
    ],
)
def test_recompute_spec_bad_input(fields, message):
    with pytest.raises(ValueError, match=message):
        RecomputeSpec.from_mapping(fields, source="m.json")


def test_training_passes_bad_input():
    lora = PeftSpec(frozen=True, lora_rank=2, lora_targets=("linear_q_proj",))
    with pytest.raises(ValueError, match="lora target 'linear_q_proj' matches no projection"):
        training_passes(TINY, TINY_STATS, peft=lora)
    hybrid = ModelSpec.from_mapping(dict(hidden_size=64, num_attention_heads=4, vocab_size=16,
                                         hybrid_override_pattern="M*-"))
    with pytest.raises(ValueError, match="GPT decoders only"):
        training_passes(hybrid, TINY_STATS, recompute=RecomputeSpec(granularity="selective"))
    with pytest.raises(ValueError, match="does not split evenly into 4 pipeline model chunks"):
        training_passes(TINY, TINY_STATS, recompute=RecomputeSpec(granularity="full", method="block", num_layers=1,
                                                                  pipeline_model_parallel_size=2,
                                                                  virtual_pipeline_model_parallel_size=2))
    mtp = dataclasses.replace(TINY, mtp_num_layers=1)
    with pytest.raises(ValueError, match="MTP recompute needs recompute_num_layers=1"):
        training_passes(mtp, TINY_STATS, recompute=RecomputeSpec(granularity="full", method="uniform", num_layers=2))
    with pytest.raises(ValueError, match="unknown model FLOPs convention"):
        training_passes(TINY, TINY_STATS).model("6N")


# ---- megatron-core under FlopCounterMode -----------------------------------------------------


class LoRA(torch.nn.Module):
    """``base(x) + x @ A @ B`` around a megatron linear layer (returns ``(output, bias)`` like it).

    ``megatron=True``: A and B are megatron ``ColumnParallelLinear`` layers, as Megatron-Bridge's
    adapters are (their autograd Function always computes the input gradient); ``False``: plain
    ``F.linear`` (autograd computes only the gradients some parameter needs).
    """

    def __init__(self, base: torch.nn.Module, rank: int, megatron: bool) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear

        self.base, self.megatron = base, megatron
        d_out, d_in = base.weight.shape
        if megatron:
            init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
            self.linear_in = ColumnParallelLinear(d_in, rank, config=base.config, init_method=init, bias=False,
                                                  gather_output=True)
            self.linear_out = ColumnParallelLinear(rank, d_out, config=base.config, init_method=init, bias=False,
                                                   gather_output=True)
        else:
            self.a = torch.nn.Parameter(torch.randn(rank, d_in) * 0.02)
            self.b = torch.nn.Parameter(torch.randn(d_out, rank) * 0.02)

    def forward(self, x, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        if self.megatron:
            return out + self.linear_out(self.linear_in(x)[0])[0], bias
        return out + F.linear(F.linear(x, self.a), self.b), bias


def _freeze_and_adapt(model, targets, rank: int, megatron: bool) -> int:
    """Freeze every parameter, then wrap every module named in ``targets``; returns the count."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and not isinstance(parent, LoRA):
                setattr(parent, name, LoRA(child, rank, megatron))
                wrapped += 1
    return wrapped


def _decoder_input_requires_grad(model) -> None:
    """What Megatron-Bridge does for PEFT + full recompute: the decoder input requires grad."""
    decoder = model.decoder
    forward = decoder.forward

    def patched(hidden_states, *args, **kwargs):
        if not hidden_states.requires_grad:
            hidden_states = hidden_states.detach().requires_grad_(True)
        return forward(hidden_states, *args, **kwargs)

    decoder.forward = patched


def _build(config: dict, *, targets=(), rank: int = 4, megatron: bool = True, bridge_patch: bool = False):
    torch.manual_seed(0)
    model = mcore_cpu.build_gpt(dict(config), vocab_size=VOCAB, max_seq_len=32)
    if targets:
        assert _freeze_and_adapt(model, targets, rank, megatron) > 0
    if bridge_patch:
        _decoder_input_requires_grad(model)
    return model


def _measure(model, rows=ROWS) -> int:
    """Forward + backward FLOPs summed over the rows' sequences, one sequence at a time."""
    counts = Counter(rows)
    return sum(n * mcore_cpu.measure_train_flops(model, 1, s, vocab_size=VOCAB) for s, n in counts.items())


def _passes(model, targets=(), rank: int = 4):
    """The estimate for ``model``: spec and recompute read from its ``TransformerConfig``."""
    spec = ModelSpec.from_transformer_config(model.config, vocab_size=VOCAB)
    peft = PeftSpec(frozen=True, lora_rank=rank, lora_targets=tuple(targets)) if targets else None
    return training_passes(spec, SeqStats.from_rows(parse_rows(ROWS)), peft=peft,
                           recompute=RecomputeSpec.from_mapping(vars(model.config)), attention="full")


LORA_CASES = {
    "dense, every target": (BASE, ALL),
    "dense, linear_proj only": (BASE, ("linear_proj",)),
    "dense, linear_fc1 only": (BASE, ("linear_fc1",)),
    "MoE + shared, linear_qkv": (MOE, ("linear_qkv",)),
    "MoE + shared, expert fc1/fc2": (MOE, ("linear_fc1", "linear_fc2")),
    "MLA, linear_q_proj only (partial core backward)": (MLA, ("linear_q_proj",)),
    "MLA, linear_kv_up_proj only": (MLA, ("linear_kv_up_proj",)),
    "MLA + q_lora, up/down projections": (MLA_Q, ("linear_q_up_proj", "linear_kv_down_proj")),
    "MTP, linear_proj": (dict(BASE, mtp_num_layers=1), ("linear_proj",)),
}


@pytest.mark.parametrize("name", list(LORA_CASES))
def test_frozen_lora_measured_equals_executed(mcore, name):
    config, targets = LORA_CASES[name]
    model = _build(config, targets=targets, megatron=True)
    assert _measure(model) == _passes(model, targets).executed().total


@pytest.mark.parametrize("name", [n for n in LORA_CASES if not n.startswith("MoE")])
def test_frozen_plain_lora_measured_equals_model(mcore, name):
    # Plain adapters run no unneeded GEMM (and no MoE router: its wgrad is always executed).
    config, targets = LORA_CASES[name]
    model = _build(config, targets=targets, megatron=False)
    passes = _passes(model, targets)
    assert _measure(model) == passes.model().total < passes.executed().total


RECOMPUTE_CASES = {
    "full uniform 1": (BASE, FULL),
    "full uniform 2": (BASE, dict(FULL, recompute_num_layers=2)),
    "full block 1": (BASE, dict(FULL, recompute_method="block")),
    "selective default (core_attn)": (BASE, dict(recompute_granularity="selective")),
    "selective mlp + layernorm": (BASE, _selective("mlp", "layernorm")),
    "MoE selective moe": (MOE, _selective("moe")),
    "MoE selective shared_experts": (MOE, _selective("shared_experts")),
    "MoE selective moe + shared_experts (shared twice)": (MOE, _selective("moe", "shared_experts")),
    "MoE selective mlp + core_attn": (MOE, _selective("mlp", "core_attn")),
    "MoE full block 2": (MOE, dict(FULL, recompute_method="block", recompute_num_layers=2)),
    "MLA selective mla_up_proj": (MLA, _selective("mla_up_proj")),
    "MLA + q_lora selective mla_up_proj + core_attn": (MLA_Q, _selective("mla_up_proj", "core_attn")),
    "MTP full uniform": (dict(BASE, mtp_num_layers=1), FULL),
    "MTP full block (MTP not recomputed)": (dict(BASE, mtp_num_layers=1), dict(FULL, recompute_method="block")),
}


@pytest.mark.parametrize("name", list(RECOMPUTE_CASES))
def test_recompute_measured_equals_executed(mcore, name):
    base, recompute = RECOMPUTE_CASES[name]
    config = dict(base, **recompute)
    model = _build(config)
    passes = _passes(model)
    # The recomputed forward really runs under FlopCounterMode: executed = 3x + recompute.
    assert sum(passes.recompute.values()) > 0
    assert _measure(model) == passes.executed().total == passes.model().total + sum(passes.recompute.values())


PEFT_RECOMPUTE_CASES = {
    "full uniform, Bridge's input-grad patch": (dict(BASE, **FULL), ("linear_qkv", "linear_fc2"), True),
    "full block, Bridge's input-grad patch": (dict(BASE, **dict(FULL, recompute_method="block")), ("linear_proj",), True),
    "selective core_attn, linear_proj": (dict(BASE, recompute_granularity="selective"), ("linear_proj",), False),
    "selective mlp, linear_qkv + linear_fc1": (dict(BASE, **_selective("mlp")), ("linear_qkv", "linear_fc1"), False),
    "MoE selective moe + core_attn": (dict(MOE, **_selective("moe", "core_attn")), ("linear_qkv", "linear_fc1"), False),
}


@pytest.mark.parametrize("name", list(PEFT_RECOMPUTE_CASES))
def test_frozen_lora_with_recompute_measured_equals_executed(mcore, name):
    config, targets, patch = PEFT_RECOMPUTE_CASES[name]
    model = _build(config, targets=targets, bridge_patch=patch)
    assert _measure(model) == _passes(model, targets).executed().total


def test_full_recompute_frozen_without_bridge_patch_trains_nothing(mcore):
    # Plain megatron-core: the checkpoint's input needs no gradient, so its backward never runs
    # and nothing requires grad; we model Megatron-Bridge's fix instead.
    model = _build(dict(BASE, **FULL), targets=ALL)
    with pytest.raises(RuntimeError, match="does not require grad"):
        _measure(model)


def test_selective_mlp_with_adapters_only_inside_is_refused(mcore):
    # The MLP checkpoint of layer 0 has an input without gradient: megatron-core would give its
    # adapters no gradient (and here no loss gradient at all); the estimate refuses the setup.
    config = dict(BASE, **_selective("mlp"))
    model = _build(config, targets=("linear_fc1",))
    with pytest.raises(RuntimeError, match="does not require grad"):
        _measure(model)
    with pytest.raises(ValueError, match="selective recompute of 'mlp' with a frozen base"):
        _passes(model, ("linear_fc1",))


# ---- CLI -------------------------------------------------------------------------------------


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_flops", "estimate", *argv], capture_output=True, text=True)


def test_cli_lora_and_recompute(tmp_path):
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps(dict(BASE, vocab_size=VOCAB, recompute_granularity="selective",
                                          recompute_modules=["core_attn", "mlp"])))
    out = _cli("--model", str(model_file), "--seqlens", json.dumps(ROWS), "--attention", "full", "--json",
               "--frozen", "--lora-rank", "4", "--lora-targets", "linear_qkv,linear_fc2")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    spec = ModelSpec.from_mapping(dict(BASE, vocab_size=VOCAB))
    passes = training_passes(spec, SeqStats.from_rows(parse_rows(ROWS)),
                             peft=PeftSpec(frozen=True, lora_rank=4, lora_targets=("linear_qkv", "linear_fc2")),
                             recompute=RecomputeSpec(granularity="selective", modules=("core_attn", "mlp")),
                             attention="full")
    assert report["total_flops"] == passes.model().total == sum(report["components"].values())
    assert report["executed_flops"] == passes.executed().total
    assert report["recompute_flops"] == sum(passes.recompute.values()) > 0
    assert report["unneeded_flops"] == sum(passes.unneeded.values()) > 0
    # The model file's "lora" section (Megatron-Bridge names) gives the same numbers.
    model_file.write_text(json.dumps(dict(BASE, vocab_size=VOCAB, lora={"dim": 4, "target_modules": ["linear_qkv", "linear_fc2"]})))
    out = _cli("--model", str(model_file), "--seqlens", json.dumps(ROWS), "--attention", "full", "--json",
               "--recompute", "selective", "--recompute-modules", "core_attn,mlp")
    assert json.loads(out.stdout)["executed_flops"] == passes.executed().total


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-rank", "4", "--lora-targets", "linear_qkv,fc9"], "unknown lora target 'fc9'"),
        (["--lora-targets", "linear_qkv"], "--lora-targets needs --lora-rank"),
        (["--frozen"], "nothing to train"),
        (["--recompute-method", "uniform"], "need --recompute full|selective"),
        (["--recompute", "full", "--recompute-method", "uniform"], "needs recompute_num_layers"),
        (["--kv-seqlens", "[3, 4]"], "--kv-seqlens prices cross-attention"),
    ],
)
def test_cli_bad_flags(tmp_path, argv, message):
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps(dict(BASE, vocab_size=VOCAB)))
    out = _cli("--model", str(model_file), "--seqlens", "[16, 9]", *argv)
    assert out.returncode == 2
    assert message in out.stderr
