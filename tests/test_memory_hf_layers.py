"""Megatron-Bridge's gemma2/gemma3 layer spec (post-norms on ``linear_proj`` and ``linear_fc2``,
attention-score and output-logit soft-capping), as :mod:`megatron_flops.memory.hf_layers` counts
it for gemma2, gemma3 and glm4, against a real megatron-core GPT on CPU.

Bridge's spec is Transformer Engine's (``TERowParallelLinearLayerNorm``, ``TENorm``): it does not
run on CPU. Measured instead: megatron-core's local spec with the same modules put in the same
places (a local port, :func:`_bridge_gemma_spec`): a norm on each row-parallel layer's output,
``cap * tanh(scores / cap)`` before the softmax, ``cap * tanh(logits / cap)`` after the output
layer. Saved-for-backward bytes (saved-tensor hooks over distinct storages) and the parameters in
``named_parameters()`` order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mcore_cpu
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.activations import chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.model.spec import ModelSpec
from test_memory_activations import BASE, MBS, NUM_MB, SEQ, VOCAB, cpu_kernel_delta

CAPS = dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def _capped(tensor: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(tensor / cap)  # (Bridge's logit_softcapping: tanh saves its output)


class _CappedSoftmax(torch.nn.Module):
    """Bridge's Gemma2DotProductAttention: the raw scores soft-capped before the softmax."""

    def __init__(self, softmax: torch.nn.Module, cap: float) -> None:
        super().__init__()
        self.softmax, self.cap = softmax, cap

    def forward(self, scores: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.softmax(_capped(scores, self.cap), *args, **kwargs)


def _bridge_gemma_spec(spec, config, *, olmo2: bool):
    """The local spec with Bridge's ``TERowParallelLinearLayerNorm`` (local port) as linear_proj and
    linear_fc2, and the capped softmax in the core attention; ``olmo2``: no pre-norms, no capping."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PostNormRowParallelLinear(RowParallelLinear):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = LNImpl(config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

        def forward(self, x):
            output, bias = super().forward(x)
            assert bias is None
            return self.post_layernorm(output), bias

    class CappedAttention(DotProductAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scale_mask_softmax = _CappedSoftmax(self.scale_mask_softmax, CAPS["attn_logit_softcapping"])

    from megatron.core.transformer.identity_op import IdentityOp

    layer = spec.submodules
    layer.self_attention.submodules.linear_proj = PostNormRowParallelLinear
    if olmo2:
        layer.input_layernorm = layer.pre_mlp_layernorm = IdentityOp
    else:
        layer.self_attention.submodules.core_attention = CappedAttention
    layer.mlp.submodules.linear_fc2 = PostNormRowParallelLinear
    return spec


def _build(fields: dict, monkeypatch, *, olmo2: bool):
    build_spec = mcore_cpu.build_layer_spec
    monkeypatch.setattr(mcore_cpu, "build_layer_spec",
                        lambda config, **kw: _bridge_gemma_spec(build_spec(config, **kw), config, olmo2=olmo2))
    torch.manual_seed(0)
    model = mcore_cpu.build_gpt(fields, vocab_size=VOCAB, max_seq_len=SEQ)
    if olmo2:
        return model
    output_forward = model.output_layer.forward

    def capped_output(*args, **kwargs):  # Bridge's Gemma2OutputLayer
        logits, bias = output_forward(*args, **kwargs)
        return _capped(logits, CAPS["final_logit_softcapping"]), bias

    model.output_layer.forward = capped_output
    return model


def _measure(model):
    import mcore_dist
    import mcore_memory

    meter = mcore_memory.SavedTensorMeter(model.parameters())
    with meter.tracking():
        mcore_dist.run_schedule([model], num_microbatches=NUM_MB, micro_batch_size=MBS, seq_length=SEQ,
                                vocab_size=VOCAB, forward_step_func=mcore_memory.metered_forward_step(meter, [model]),
                                data_iterators=[mcore_memory.batches(NUM_MB, MBS, SEQ, VOCAB)], count_flops=False)
    return meter.forward, meter.peak


GEMMA = dict(num_query_groups=2, gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True,
             add_bias_linear=False)
CASES = {
    "LayerNorm, MHA, GELU": dict(add_bias_linear=False),
    "RMSNorm, GQA, fused SwiGLU (gemma-like)": dict(GEMMA, normalization="RMSNorm"),
    "LayerNorm, GQA, selective core_attn + mlp": dict(GEMMA, recompute_granularity="selective",
                                                      recompute_modules=["core_attn", "mlp"]),
    # olmo2/olmo3: the post-norms instead of the pre-norms (and no capping).
    "olmo2: RMSNorm, qk_layernorm, SwiGLU": dict(GEMMA, normalization="RMSNorm", qk_layernorm=True, olmo2=True),
    "olmo2: LayerNorm, selective mlp": dict(GEMMA, recompute_granularity="selective", recompute_modules=["mlp"],
                                            olmo2=True),
    "olmo2: LayerNorm, full recompute": dict(GEMMA, recompute_granularity="full", recompute_method="uniform",
                                             recompute_num_layers=1, olmo2=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bridge_gemma_spec_saves_and_holds_as_counted(mcore, monkeypatch, name):
    fields = dict(BASE, **CASES[name])
    olmo2 = fields.pop("olmo2", False)
    config = dict(fields, activation_func=torch.nn.functional.silu) if "activation_func" in fields else fields
    model = _build(config, monkeypatch, olmo2=olmo2)
    caps = {} if olmo2 else CAPS
    model_file = dict(fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model_file)
    options = DecoderOptions.from_mapping(dict(model_file, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope", post_layernorms=True,
                                               pre_layernorms=not olmo2, **caps))
    assert [(p.name, p.numel) for p in chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0,
                                                        seq_length=SEQ)] == \
        [(n, p.numel()) for n, p in model.named_parameters()]
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype="fp32")
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0,
                            recompute=RecomputeSpec.from_mapping(model_file))
    plain = chunk_activations(spec, dataclasses.replace(options, post_layernorms=False, attn_logit_softcapping=None,
                                                        final_logit_softcapping=None, pre_layernorms=True),
                              Parallelism(), training, pp_rank=0, chunk=0, recompute=RecomputeSpec.from_mapping(model_file))
    # What the spec adds, fp32, T = 32 tokens, h = 64, 4 heads, 2 layers: per layer two norms' inputs
    # [T, h] and rstd (LayerNorm: mean too) [T], and tanh's [b, heads, s, s] scores (inside the
    # core_attn checkpoint: re-saved in backward only); tanh's [T, V] logits once.
    T, h, layers, stats = SEQ * MBS, 64, BASE["num_layers"], 4 if fields.get("normalization") == "RMSNorm" else 8
    scores = 0 if "core_attn" in fields.get("recompute_modules", ()) else MBS * 4 * SEQ * SEQ * 4
    # (the fc2 post-norm inside the mlp checkpoint: re-saved in backward only)
    fc2_norm = 0 if "mlp" in fields.get("recompute_modules", ()) else T * (h * 4 + stats)
    if olmo2:  # (a norm moved: each linear after it saves the residual in place of the norm's output)
        assert act.forward - plain.forward == (-T * (h * 4 + stats) * layers if fc2_norm == 0 else 0)
    else:
        assert act.forward - plain.forward == layers * (T * (h * 4 + stats) + fc2_norm + scores) + T * VOCAB * 4
    # (torch's CPU RMSNorm also saves x * rstd: 4 norms per layer and the final one.)
    act = dataclasses.replace(act, components={**act.components,
                                               "cpu": cpu_kernel_delta(fields, 4, (2 if olmo2 else 4) * layers + 1,
                                                                       T, h, 0)})
    forward, peak = _measure(model)
    assert forward == [act.forward + act.shared] * NUM_MB
    assert peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]


@pytest.mark.parametrize("affine", ["weight", "none"], ids=["LayerNorms without bias (cohere)",
                                                           "LayerNorms without weight or bias (olmo)"])
def test_layernorms_without_affine_parameters_save_as_megatron_cores(mcore, affine):
    # megatron-core's local LayerNorms (torch's) with their bias, or weight and bias, removed: the
    # parameters as hf_layers counts them, and the same saved bytes (input, mean and rstd: fp32 here,
    # where torch's CPU kernel keeps them as CUDA's).
    fields = dict(BASE, add_bias_linear=False, qk_layernorm=True, num_query_groups=2)
    torch.manual_seed(0)
    model = mcore_cpu.build_gpt(fields, vocab_size=VOCAB, max_seq_len=SEQ)
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            names = ("bias",) if affine == "weight" else ("weight", "bias")
            for name in names:
                delattr(module, name)
                module.register_parameter(name, None)
    model_file = dict(fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model_file)
    options = DecoderOptions.from_mapping(dict(model_file, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope", norm_weight=affine == "weight",
                                               norm_bias=False))
    assert [(p.name, p.numel) for p in chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0,
                                                        seq_length=SEQ)] == \
        [(n, p.numel()) for n, p in model.named_parameters()]
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype="fp32")
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0)
    assert act == chunk_activations(spec, DecoderOptions.from_mapping(dict(model_file, padded_vocab_size=VOCAB,
                                                                           attention_backend="local",
                                                                           position_embedding_type="rope")),
                                    Parallelism(), training, pp_rank=0, chunk=0)
    forward, peak = _measure(model)
    assert forward == [act.forward + act.shared] * NUM_MB
    assert peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]


@pytest.mark.parametrize("recompute", [{}, dict(recompute_granularity="selective", recompute_modules=["mlp"])],
                         ids=["plain", "selective mlp"])
def test_xielu_saves_as_counted(mcore, recompute):
    # apertus: transformers' XIELUActivation (its python path, as on CPU) in each megatron-core MLP.
    # Per layer, beyond one elementwise activation: alpha_p * x, expm1(min(x, eps)), expm1(...) - x
    # (fp32) and where's bool condition, [T, ffn] each: 2 x 32 x 128 x 13 = 106496 bytes.
    from transformers.activations import XIELUActivation

    fields = dict(BASE, add_bias_linear=False, **recompute)
    torch.manual_seed(0)
    model = mcore_cpu.build_gpt(fields, vocab_size=VOCAB, max_seq_len=SEQ)
    for layer in model.decoder.layers:
        layer.mlp.activation_func = XIELUActivation(dtype=torch.float32)
    model_file = dict(fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model_file)
    options = DecoderOptions.from_mapping(dict(model_file, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope", xielu=True))
    assert [(p.name, p.numel) for p in chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0,
                                                        seq_length=SEQ)] == \
        [(n, p.numel()) for n, p in model.named_parameters()]
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype="fp32")
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0,
                            recompute=RecomputeSpec.from_mapping(model_file))
    plain = chunk_activations(spec, dataclasses.replace(options, xielu=False), Parallelism(), training, pp_rank=0,
                              chunk=0, recompute=RecomputeSpec.from_mapping(model_file))
    assert act.forward - plain.forward == (0 if recompute else 2 * 32 * 128 * 13)
    forward, peak = _measure(model)
    assert forward == [act.forward + act.shared] * NUM_MB
    assert peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]
