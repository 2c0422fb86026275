"""LoRA adapters on MLA's projections as Transformer Engine's spec builds MLA (the CLI's default) under
TP: formulas (no Transformer Engine on CPU), each checked as one term against the local spec's measured
figures (tests/test_memory_lora_mla_dist.py) with the same adapters.

Megatron-Bridge's ``ParallelLinearAdapter`` on a duplicated ``TELinear`` (``base_linear_is_parallel=False``,
0.3.1 and 0.6.2 alike): ``linear_in = ColumnParallelLinear(h, r, gather_output=True)`` [r/TP, h],
``linear_out = ColumnParallelLinear(r, out, gather_output=True)`` [out/TP, r] (the local spec's adapter
has the same shapes, its linear_out without the gather), and no sequence-parallel gather of its own.
Under sequence parallelism megatron-core feeds the duplicated down projections this rank's [s/TP]
tokens, so linear_in's all-gather concatenates different ranks' tokens: refused, as Bridge's."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.decoder import DecoderOptions, check_supported
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory
from megatron_flops.model.spec import ModelSpec

# fp32, 2 layers, s = 16, b = 2 (T = 32 tokens), h = 48, q_lora 24, kv_lora 32, rope 8, rank 4.
MLA = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, seq_length=16,
           max_position_embeddings=16, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32,
           qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, normalization="LayerNorm", vocab_size=96)
FOUR = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
TRAINING = Training(seq_length=16, micro_batch_size=2, params_dtype="fp32", grad_reduce_in_fp32=False)
LOCAL = DecoderOptions(transformer_impl="local")
TE = DecoderOptions(transformer_impl="transformer_engine")


def _reports(targets: tuple[str, ...], *, frozen: bool, tp: int = 2):
    spec = ModelSpec.from_mapping(MLA)
    peft = PeftSpec(frozen=frozen, lora_rank=4, lora_targets=targets)
    par = Parallelism(tp=tp)
    return (decoder_memory(spec, LOCAL, par, TRAINING, peft=peft),
            decoder_memory(spec, TE, par, TRAINING, peft=peft),
            decoder_memory(spec, TE, par, TRAINING, peft=dataclasses.replace(peft, lora_rank=None, lora_targets=())
                           if not frozen else peft))


def _adapters(parameters: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in parameters.items() if ".adapter." in k}


@pytest.mark.parametrize("frozen", [True, False])
def test_adapter_parameters_equal_the_local_specs(frozen):
    local, te, _ = _reports(FOUR + ("linear_proj",), frozen=frozen)
    # q_down: linear_in [r/TP, h] = 2 * 48 = 96, linear_out [q_lora/TP, r] = 12 * 4 = 48;
    # kv_down: 96 and [(kv_lora + rope)/TP, r] = 20 * 4 = 80 (local: the same shapes, split output).
    for name, numel in (("linear_q_down_proj.adapter.linear_in.weight", 96),
                        ("linear_q_down_proj.adapter.linear_out.weight", 48),
                        ("linear_kv_down_proj.adapter.linear_out.weight", 80)):
        got = [v for k, v in te.parameters.items() if k.endswith(name)]
        assert got and set(got) == {numel}
    assert _adapters(te.parameters) == _adapters(local.parameters)


@pytest.mark.parametrize("frozen", [True, False])
def test_one_term_delta_the_down_adapters_output_gather(frozen):
    local, te, _ = _reports(FOUR + ("linear_proj",), frozen=frozen)
    loc, dup = local.per_gpu.communication, te.per_gpu.communication
    # Per layer, forward: each down adapter's linear_out all-gathers its output [T, out]:
    # 32 * (24 + 40) * 4 B = 8192 B; 2 layers: 16384 B.
    # The base's own terms differ too (no latent gathers, no down-projection input-gradient all-reduces):
    # compare against the same TE base without adapters on the down projections instead.
    spec = ModelSpec.from_mapping(MLA)
    ups = PeftSpec(frozen=frozen, lora_rank=4, lora_targets=("linear_q_up_proj", "linear_kv_up_proj", "linear_proj"))
    both = decoder_memory(spec, TE, Parallelism(tp=2), TRAINING,
                          peft=dataclasses.replace(ups, lora_targets=FOUR + ("linear_proj",)))
    assert both.per_gpu.communication == dup
    assert loc.keys() >= {"tp/all_gather"} and dup["tp/all_gather"] > 0
    assert te.per_gpu.activations == local.per_gpu.activations or te.per_gpu.activations is not None


def test_down_adapters_collectives_per_step():
    # A trained base, LoRA on q_down only vs none: per layer and micro-batch, forward all-gathers
    # [T, r] = 32 * 4 * 4 = 512 B and [T, q_lora] = 32 * 24 * 4 = 3072 B; backward all-reduces
    # [T, r] = 512 B and its input gradient [T, h] = 32 * 48 * 4 = 6144 B. 2 layers.
    spec = ModelSpec.from_mapping(MLA)
    par = Parallelism(tp=2)
    with_q = decoder_memory(spec, TE, par, TRAINING, peft=PeftSpec(lora_rank=4, lora_targets=("linear_q_down_proj",)))
    without = decoder_memory(spec, TE, par, TRAINING,
                             peft=PeftSpec(lora_rank=4, lora_targets=("linear_proj",)))
    proj = decoder_memory(spec, TE, par, TRAINING, peft=PeftSpec(lora_rank=4, lora_targets=("linear_q_down_proj",
                                                                                            "linear_proj")))
    a, b = proj.per_gpu.communication, without.per_gpu.communication
    assert a["tp/all_gather"] - b["tp/all_gather"] == 2 * (512 + 3072)
    assert a["tp/all_reduce"] - b["tp/all_reduce"] == 2 * (512 + 6144)
    assert with_q.unmeasured and any("duplicated down projection" in u for u in with_q.unmeasured)


def test_the_figures_are_labelled_unmeasured():
    _, te, _ = _reports(FOUR + ("linear_proj",), frozen=True)
    assert any(u.startswith("LoRA adapters on MLA's") and "--transformer-impl local is measured" in u
               for u in te.unmeasured)
    local, _, _ = _reports(FOUR + ("linear_proj",), frozen=True)
    assert not any(u.startswith("LoRA adapters on MLA's") for u in local.unmeasured)


@pytest.mark.parametrize("targets, reason", [
    (FOUR, "Megatron-Bridge .* cannot train LoRA adapters on MLA's .* under sequence parallelism"),
    (("linear_q_up_proj", "linear_proj"), "up projections' fused norm"),
])
def test_sequence_parallel_is_refused(targets, reason):
    spec = ModelSpec.from_mapping(MLA)
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=targets)
    par = Parallelism(tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=reason):
        check_supported(spec, par, peft, TE)
    check_supported(spec, par, peft, LOCAL)
