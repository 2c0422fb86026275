"""LoRA adapters on a dense decoder's fused norm + linear targets under Transformer Engine's spec
(the CLI's default) with TP + sequence parallelism: formulas (no Transformer Engine on CPU), each
checked as one term against the local spec's measured figures (tests/test_memory_dist.py; by hand:
tests/test_memory_lora.py) with the same adapters.

megatron-core 0.16.1's ``get_gpt_layer_with_transformer_engine_spec`` builds a dense attention's
``linear_qkv`` and a dense MLP's ``linear_fc1`` as ``TELayerNormColumnParallelLinear`` (the input and
pre-MLP norms fused in, ``IdentityOp`` in their place); a MoE layer keeps its pre-MLP norm
(``backend.layer_norm() if num_experts``) and its shared experts' ``linear_fc1`` is a plain
``TEColumnParallelLinear``. Around a fused norm + linear, Megatron-Bridge (0.3.1 and 0.6.2,
``get_adapter_attributes_from_linear``) sets ``return_layernorm_output_gathered`` and, Transformer
Engine >= 1.5 without TP communication overlap, ``disable_sequence_parallel_comm``: the adapter reads
the norm output the base all-gathered, and Transformer Engine reduce-scatters the adapter's input
gradient with its own. So per adapted fused target and layer: no ``tp/all_gather`` of [T, h] in
forward and no ``tp/reduce_scatter`` of its gradient in backward; nothing else differs."""

from __future__ import annotations

from dataclasses import replace

from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.recompute import selective_rerun_communication
from megatron_flops.memory.report import decoder_memory
from megatron_flops.model.spec import ModelSpec

# bf16, 2 layers, h 48, s 16, b 2: T = 32 tokens, [T, h] = 32 * 48 * 2 = 3,072 B, [T, r] = 256 B (r 4).
DENSE = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, vocab_size=96)
TH = 3_072
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
TE = DecoderOptions(add_bias_linear=False, position_embedding_type="rope", attention_backend="unfused",
                    hidden_dropout=0.0, attention_dropout=0.0)
LOCAL = replace(TE, transformer_impl="local")
TRAINING = Training(seq_length=16, micro_batch_size=2, params_dtype="bf16")
SP = Parallelism(tp=2, sequence_parallel=True)


def _report(options: DecoderOptions, targets: tuple[str, ...] | None, *, frozen: bool = False,
            fields: dict = DENSE, par: Parallelism = SP) -> tuple[dict[str, int], int]:
    """Collectives per step and saved bytes with adapters on ``targets`` (None: no LoRA)."""
    peft = None if targets is None else PeftSpec(frozen=frozen, lora_rank=4, lora_targets=targets)
    report = decoder_memory(ModelSpec.from_mapping(fields), options, par, TRAINING, peft=peft).per_gpu
    assert report.activations is not None
    return dict(report.communication), report.activations


def _minus(local: dict[str, int], te: dict[str, int]) -> dict[str, int]:
    return {k: v for k in local.keys() | te.keys() if (v := local.get(k, 0) - te.get(k, 0))}


def test_the_bases_are_the_same():
    # (so the differences below are the adapters'; the fused norms' saved tensors aside, which SP
    # keeps the same: the norm output is gathered either way.)
    assert _report(TE, None)[0] == _report(LOCAL, None)[0]


def test_trained_base_one_term_per_fused_adapter():
    (local, local_saved), (te, te_saved) = _report(LOCAL, ALL), _report(TE, ALL)
    # Per layer, linear_qkv's and linear_fc1's adapters: all-gather [T, h] (3,072 B) each in forward
    # and reduce-scatter its gradient in backward (local); under TE neither. 2 layers x 2 targets.
    assert _minus(local, te) == {"tp/all_gather": 2 * 2 * TH, "tp/reduce_scatter": 2 * 2 * TH}
    assert te_saved - _report(TE, None)[1] == local_saved - _report(LOCAL, None)[1]  # the gathered [T, h], [T, r]


def test_frozen_first_layer():
    local, te = _report(LOCAL, ALL, frozen=True)[0], _report(TE, ALL, frozen=True)[0]
    # Layer 0's linear_qkv adapter (the first) has an input needing no grad: the local one skips its
    # reduce-scatter there too, so 3 reduce-scatters differ; the 4 all-gathers all do.
    assert _minus(local, te) == {"tp/all_gather": 4 * TH, "tp/reduce_scatter": 3 * TH}


def test_frozen_first_adapter_on_fc1():
    local, te = _report(LOCAL, ("linear_fc1",), frozen=True)[0], _report(TE, ("linear_fc1",), frozen=True)[0]
    # The first adapter is layer 0's linear_fc1 (no reduce-scatter in either spec); layer 1's differs.
    assert _minus(local, te) == {"tp/all_gather": 2 * TH, "tp/reduce_scatter": TH}
    local, te = (_report(o, ("linear_proj", "linear_fc1"), frozen=True)[0] for o in (LOCAL, TE))
    # After linear_proj's adapter, layer 0's fc1 input requires grad: both layers differ.
    assert _minus(local, te) == {"tp/all_gather": 2 * TH, "tp/reduce_scatter": 2 * TH}


def test_row_parallel_targets_and_no_sp_equal_the_local_specs():
    assert _report(TE, ("linear_proj", "linear_fc2")) == _report(LOCAL, ("linear_proj", "linear_fc2"))
    tp2 = Parallelism(tp=2)  # without SP the adapter all-reduces its own input gradient, as the local one
    assert _report(TE, ALL, par=tp2) == _report(LOCAL, ALL, par=tp2)


def test_moe_layer_shared_experts_fc1_is_not_fused():
    moe = dict(DENSE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
               moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1])
    targets = ("linear_qkv", "linear_proj", "linear_fc1")
    local, te = _report(LOCAL, targets, fields=moe)[0], _report(TE, targets, fields=moe)[0]
    # linear_qkv in both layers, linear_fc1 in layer 0's dense MLP only (layer 1's shared experts'
    # linear_fc1 keeps its gather; its routed experts' adapters gather no input under SP either way).
    assert _minus(local, te) == {"tp/all_gather": 3 * TH, "tp/reduce_scatter": 3 * TH}


def test_selective_mlp_rerun_regathers_no_fused_adapter_input():
    spec = ModelSpec.from_mapping(DENSE)
    recompute = RecomputeSpec(granularity="selective", modules=("mlp",))
    peft = PeftSpec(lora_rank=4, lora_targets=ALL)

    def rerun(options: DecoderOptions) -> dict[str, int]:
        return selective_rerun_communication(spec, SP, TRAINING, pp_rank=0, recompute=recompute, peft=peft,
                                             fused=options.fused_norm_targets)

    # Each of the 2 re-run MLPs all-gathers its input again (the base's, 3,072 B), linear_fc1's adapter
    # its [T, r] (256 B) and linear_fc2's adapter its output [T, h] (its [T, r] is all-reduced);
    # linear_fc1's adapter its input [T, h] in the local spec only.
    assert _minus(rerun(LOCAL), rerun(TE)) == {"tp/all_gather": 2 * TH}
    assert rerun(TE)["tp/all_gather"] == 2 * (TH + 256 + TH)


def test_the_figures_are_labelled_unmeasured():
    spec = ModelSpec.from_mapping(DENSE)

    def labels(options: DecoderOptions, par: Parallelism, targets: tuple[str, ...]) -> list[str]:
        report = decoder_memory(spec, options, par, TRAINING, peft=PeftSpec(lora_rank=4, lora_targets=targets))
        return [u for u in report.unmeasured if "around Transformer Engine's fused norm + linear" in u]

    (label,) = labels(TE, SP, ALL)
    assert label.startswith("LoRA adapters on ['linear_qkv', 'linear_fc1']")
    assert "return_layernorm_output_gathered" in label and "--transformer-impl local is measured" in label
    assert labels(LOCAL, SP, ALL) == labels(TE, Parallelism(tp=2), ALL) == []
    assert labels(TE, SP, ("linear_proj", "linear_fc2")) == []
