"""LoRA adapters on MLA's projections as Transformer Engine's spec builds MLA (the CLI's default) under
TP: formulas (no Transformer Engine on CPU), each checked as one term against the local spec's measured
figures (tests/test_memory_lora_mla_dist.py) with the same adapters.

Megatron-Bridge's ``ParallelLinearAdapter`` on a duplicated ``TELinear`` (``base_linear_is_parallel=False``,
0.3.1 and 0.6.2 alike): ``linear_in = ColumnParallelLinear(h, r, gather_output=True)`` [r/TP, h],
``linear_out = ColumnParallelLinear(r, out, gather_output=True)`` [out/TP, r] (the local spec's adapter
has the same shapes, its linear_out without the gather), and no sequence-parallel gather of its own.
Under sequence parallelism megatron-core feeds the duplicated down projections this rank's [s/TP]
tokens, so linear_in's all-gather concatenates different ranks' tokens: refused, as Bridge's.

The up projections are column parallel in both specs and their adapters read the latent the base
all-gathered over the sequence, so adapters on them alone are priced under sequence parallelism too:
``TEColumnParallelLinear`` (no ``qk_layernorm``) as the local spec's adapter (measured:
tests/test_memory_lora_mla_dist.py); with ``qk_layernorm`` the latent norm is fused in
(``TELayerNormColumnParallelLinear``), Bridge sets ``return_layernorm_output_gathered`` and
``disable_sequence_parallel_comm`` (0.3.1 and 0.6.2's ``get_adapter_attributes_from_linear``, Transformer
Engine >= 1.5), and Transformer Engine adds the adapter's input gradient to its own before its
reduce-scatter: no adapter all-gather of the [T, latent] input, no reduce-scatter of its gradient."""

from __future__ import annotations

import pytest

from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.decoder import DecoderOptions, check_supported, chunk_parameters
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


PAR = Parallelism(tp=2)


def _report(options: DecoderOptions, targets: tuple[str, ...] | None, *, frozen: bool = False,
            par: Parallelism = PAR):
    peft = None if targets is None else PeftSpec(frozen=frozen, lora_rank=4, lora_targets=targets)
    return decoder_memory(ModelSpec.from_mapping(MLA), options, par, TRAINING, peft=peft)


def _adapters(options: DecoderOptions) -> dict[str, int]:
    peft = PeftSpec(lora_rank=4, lora_targets=FOUR)
    params = chunk_parameters(ModelSpec.from_mapping(MLA), options, PAR, pp_rank=0, chunk=0, seq_length=16, peft=peft)
    return {p.name: p.numel for p in params if ".adapter." in p.name}


def test_adapter_parameters_equal_the_local_specs():
    te = _adapters(TE)
    # q_down: linear_in [r/TP, h] = 2 * 48 = 96, linear_out [q_lora/TP, r] = 12 * 4 = 48;
    # kv_down: 96 and [(kv_lora + rope)/TP, r] = 20 * 4 = 80 (local: the same shapes, its output split).
    assert te["decoder.layers.0.self_attention.linear_q_down_proj.adapter.linear_in.weight"] == 96
    assert te["decoder.layers.0.self_attention.linear_q_down_proj.adapter.linear_out.weight"] == 48
    assert te["decoder.layers.0.self_attention.linear_kv_down_proj.adapter.linear_out.weight"] == 80
    assert te == _adapters(LOCAL)


def _delta(options: DecoderOptions, targets: tuple[str, ...], par: Parallelism = PAR) -> tuple[dict[str, int], int]:
    """What the adapters on ``targets`` add to a trained base: collectives per step, saved bytes."""
    with_lora, base = _report(options, targets, par=par).per_gpu, _report(options, None, par=par).per_gpu
    keys = with_lora.communication.keys() | base.communication.keys()
    comm = {k: with_lora.communication.get(k, 0) - base.communication.get(k, 0) for k in keys}
    assert with_lora.activations is not None and base.activations is not None
    return {k: v for k, v in comm.items() if v}, with_lora.activations - base.activations


def test_one_term_delta_the_down_adapters_output_gather():
    local, te = _delta(LOCAL, FOUR), _delta(TE, FOUR)
    # Per layer, forward: each down adapter's linear_out all-gathers its output [T, out] (the local
    # spec's leaves it split): 32 * (24 + 40) * 4 B = 8192 B; 2 layers: 16384 B. Nothing else differs.
    assert te[0]["tp/all_gather"] - local[0]["tp/all_gather"] == 16384
    assert {k: v for k, v in te[0].items() if k != "tp/all_gather"} == {
        k: v for k, v in local[0].items() if k != "tp/all_gather"}
    assert te[1] == local[1]  # saved tensors: linear_in's input (the base's), linear_out's [T, r]


def test_down_adapters_collectives_per_step():
    # LoRA on q_down: per layer and micro-batch, forward all-gathers [T, r] = 32 * 4 * 4 = 512 B and
    # [T, q_lora] = 32 * 24 * 4 = 3072 B; backward all-reduces [T, r] = 512 B and its input gradient
    # [T, h] = 32 * 48 * 4 = 6144 B. 2 layers.
    comm, saved = _delta(TE, ("linear_q_down_proj",))
    assert comm == {"tp/all_gather": 2 * (512 + 3072), "tp/all_reduce": 2 * (512 + 6144)}
    assert saved == 2 * 512  # [T, r] per layer (its input is the base's)


def test_frozen_first_layer_skips_only_the_latents():
    # A frozen base adapted on kv_down only (+ linear_proj): TE's duplicated down projections reduce
    # no input gradient, so layer 0 skips only q_up's latent all-reduce [T, q_lora] = 3072 B more than
    # with both down projections adapted; the local spec's skips also its 2 [T, h] (same in both).
    kv = _report(TE, ("linear_kv_down_proj", "linear_proj"), frozen=True).per_gpu.communication
    both = _report(TE, ("linear_q_down_proj", "linear_kv_down_proj", "linear_proj"), frozen=True).per_gpu.communication
    # both - kv: q_down's adapter: 2 layers x (512 + 3072) gathered, 2 x (512 + 6144) all-reduced; layer 0's q
    # latent now requires grad: + 3072 all-reduced.
    assert both["tp/all_gather"] - kv["tp/all_gather"] == 2 * (512 + 3072)
    assert both["tp/all_reduce"] - kv["tp/all_reduce"] == 2 * (512 + 6144) + 3072


def test_the_figures_are_labelled_unmeasured():
    te = _report(TE, FOUR + ("linear_proj",), frozen=True)
    assert any(u.startswith("LoRA adapters on MLA's") and "--transformer-impl local is measured" in u
               for u in te.unmeasured)
    local = _report(LOCAL, FOUR + ("linear_proj",), frozen=True)
    assert not any(u.startswith("LoRA adapters on MLA's") for u in local.unmeasured)


def test_sequence_parallel_down_adapters_are_refused():
    spec = ModelSpec.from_mapping(MLA)
    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=FOUR)
    par = Parallelism(tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="Megatron-Bridge .* cannot train LoRA adapters on MLA's .* under sequence "
                                         "parallelism"):
        check_supported(spec, par, peft, TE)
    check_supported(spec, par, peft, LOCAL)


UP = ("linear_q_up_proj", "linear_kv_up_proj")
SP = Parallelism(tp=2, sequence_parallel=True)


def test_sequence_parallel_up_adapters_without_latent_norms_equal_the_local_specs():
    # TEColumnParallelLinear: Bridge's adapter as around the local ColumnParallelLinear. Per layer,
    # forward: each adapter all-gathers its latent [T, q_lora] = 32 * 24 * 4 = 3072 B, [T, kv_lora]
    # = 4096 B, and [T, r] = 512 B; backward: all-reduces [T, r] = 512 B each and reduce-scatters
    # its input gradient (3072 + 4096 B). Saved: the gathered latents and [T, r] twice. 2 layers.
    te, local = _delta(TE, UP, SP), _delta(LOCAL, UP, SP)
    assert te == local
    assert te[0] == {"tp/all_gather": 2 * (3072 + 4096 + 2 * 512), "tp/all_reduce": 2 * 2 * 512,
                     "tp/reduce_scatter": 2 * (3072 + 4096)}
    assert te[1] == 2 * (3072 + 4096 + 2 * 512)


def test_sequence_parallel_up_adapters_around_the_fused_latent_norms():
    # qk_layernorm: the adapters read the norm output Transformer Engine gathered: the local spec's
    # figures less, per layer, the latents' all-gather (3072 + 4096 B) and their gradients'
    # reduce-scatter (the same); saved tensors as the local spec's (the gathered latents, [T, r]).
    fused = DecoderOptions(transformer_impl="transformer_engine", qk_layernorm=True)
    te, local = _delta(fused, UP, SP), _delta(DecoderOptions(transformer_impl="local", qk_layernorm=True), UP, SP)
    assert te[0] == {"tp/all_gather": 2 * 2 * 512, "tp/all_reduce": 2 * 2 * 512}
    assert local[0]["tp/all_gather"] - te[0]["tp/all_gather"] == 2 * (3072 + 4096)
    assert local[0]["tp/reduce_scatter"] == 2 * (3072 + 4096)
    assert te[1] == local[1] == 2 * (3072 + 4096 + 2 * 512)
    report = decoder_memory(ModelSpec.from_mapping(MLA), fused, SP, TRAINING,
                            peft=PeftSpec(frozen=True, lora_rank=4, lora_targets=UP + ("linear_proj",)))
    assert any(u.startswith("LoRA adapters on MLA's") and "return_layernorm_output_gathered" in u
               for u in report.unmeasured)


def test_frozen_first_layer_runs_no_fused_adapter_reduce_scatter():
    from megatron_flops.memory.lora_layers import lora_tp_communication

    peft = PeftSpec(frozen=True, lora_rank=4, lora_targets=UP + ("linear_proj",))

    def comm(fused_up: bool) -> dict[str, int]:
        return lora_tp_communication(ModelSpec.from_mapping(MLA), SP, TRAINING, pp_rank=0, peft=peft,
                                     duplicated=True, fused=UP if fused_up else ())

    plain, fused = comm(False), comm(True)
    # Fused: no latent all-gathers in either layer (2 * (3072 + 4096) B); their gradients'
    # reduce-scatters only in layer 1 (layer 0's latents require no grad: the unfused adapters skip
    # theirs there too). Nothing else differs.
    assert plain["tp/all_gather"] - fused["tp/all_gather"] == 2 * (3072 + 4096)
    assert plain["tp/reduce_scatter"] - fused["tp/reduce_scatter"] == 3072 + 4096
    assert plain["tp/all_reduce"] == fused["tp/all_reduce"]


def test_selective_mla_up_proj_rerun_regathers_no_fused_adapter_input():
    from megatron_flops.flops.passes import RecomputeSpec
    from megatron_flops.memory.recompute import selective_rerun_communication

    recompute = RecomputeSpec(granularity="selective", modules=("mla_up_proj",))
    peft = PeftSpec(lora_rank=4, lora_targets=UP)

    def rerun(fused_up: bool) -> dict[str, int]:
        return selective_rerun_communication(ModelSpec.from_mapping(MLA), SP, TRAINING, pp_rank=0, recompute=recompute,
                                             peft=peft, fused=UP if fused_up else ())

    # The re-run up projections all-gather their latents again (Transformer Engine's gather serves the
    # fused adapters); the unfused adapters gather theirs again too: 2 layers x (3072 + 4096) B more.
    # Both re-gather linear_in's [T, r] (512 B per adapter and layer).
    assert rerun(True) == {"tp/all_gather": 2 * (3072 + 4096 + 2 * 512)}
    assert rerun(False)["tp/all_gather"] - rerun(True)["tp/all_gather"] == 2 * (3072 + 4096)
