"""Memory of the layers beside a GPT's: Mamba-2, Gated DeltaNet, Kimi Delta Attention, DeepSeek
sparse attention's indexer, gated and sliding-window attention, hybrid layer patterns.

Measured here: every mixer's parameter names and shapes against the real module built on CPU
(megatron-core 0.16.1's ``GatedDeltaNet``, ``MambaMixer`` and ``DSAIndexer``, transformers'
``KimiLinearDeltaAttention``), a gated-attention GPT's parameters in ``named_parameters()``
order, and the saved-for-backward bytes of gated and sliding-window attention through real
megatron-core steps. Not measurable here (CUDA/Triton kernels): Mamba's and GDN's activations,
formulas checked as integers below and labelled ``unmeasured`` in the report."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch

import mcore_cpu
from megatron_flops.cli import main
from megatron_flops.memory.activations import chunk_activations, in_flight, schedule_peak
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.ssm import dsa_indexer_tensors, dsa_saved, gdn_saved, kda_saved, mamba_saved, mixer_tensors
from megatron_flops.model.spec import ModelSpec

SMALL = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, normalization="RMSNorm",
             add_bias_linear=False, vocab_size=256,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2)
HYBRID = dict(SMALL, num_layers=4, hybrid_override_pattern="MG*-")  # one Mamba, one GDN, one attention, one MLP layer
DSA = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
           multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16, experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=16,
           dsa_indexer_topk=8)


def _shapes(module: torch.nn.Module) -> list[tuple[str, int]]:
    return [(name, p.numel()) for name, p in module.named_parameters()]


def _ours(tensors, prefix: str) -> list[tuple[str, int]]:
    return [(name.removeprefix(prefix), numel) for name, numel, _ in tensors]


def test_mixer_parameters_match_megatron_core_modules(mcore, monkeypatch):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import gated_delta_net, mamba_mixer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = ModelSpec.from_mapping(HYBRID)
    fields = {k: v for k, v in SMALL.items() if k != "vocab_size"}
    config = mcore_cpu.make_config(dict(fields, activation_func=torch.nn.functional.silu))
    groups = ProcessGroupCollection.use_mpu_process_groups()
    monkeypatch.setattr(gated_delta_net, "HAVE_FLA", True)  # (fla's kernels run in forward only)
    mcore_cpu.stub_mamba_ssm(lambda obj, name, value: monkeypatch.setattr(obj, name, value, raising=False))
    with mcore_cpu.cuda_to_cpu_mode():
        gdn = gated_delta_net.GatedDeltaNet(config, gated_delta_net.GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear),
            layer_number=1, pg_collection=groups)
        mamba = mamba_mixer.MambaMixer(config, mamba_mixer.MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear), d_model=64, layer_number=1, pg_collection=groups)
    assert _ours(mixer_tensors(spec, "gdn", "", 1, False), "self_attention.") == _shapes(gdn)
    # in_proj [2*32 + 2*32 + 2*4, 64]; conv1d [2*32 + 32, 1, 4]; per-head out_norm [8].
    assert _shapes(gdn)[2:] == [("in_proj.weight", 136 * 64), ("conv1d.weight", 96 * 4), ("out_norm.weight", 8),
                                ("out_proj.weight", 64 * 32)]
    assert _ours(mixer_tensors(spec, "mamba", "", 1, False), "mixer.") == _shapes(mamba)
    # 8 heads of 16 (inner 128): in_proj [2*128 + 2*2*16 + 8, 64], conv over x, B, C [128 + 64, 1, 4].
    assert _shapes(mamba)[3] == ("in_proj.weight", 328 * 64) and _shapes(mamba)[4] == ("conv1d.weight", 192 * 4)


def test_dsa_indexer_parameters_match_megatron_core(mcore):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class Duplicated(torch.nn.Linear):  # TELinear(parallel_mode="duplicated"): a whole weight on every rank
        def __init__(self, d_in, d_out, *, bias=False, **_):
            super().__init__(d_in, d_out, bias=bias)

    fields = {k: v for k, v in DSA.items() if k not in ("vocab_size", "experimental_attention_variant")}
    config = MLATransformerConfig(**fields, normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                                  rope_type="rope")
    with mcore_cpu.cuda_to_cpu_mode():
        indexer = dsa.DSAIndexer(config, dsa.DSAIndexerSubmodules(
            linear_wq_b=Duplicated, linear_wk=Duplicated, k_norm=WrappedTorchNorm, linear_weights_proj=Duplicated),
            pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    prefix = "self_attention.core_attention.indexer."
    assert _ours(dsa_indexer_tensors(ModelSpec.from_mapping(DSA), ""), prefix) == _shapes(indexer)


def test_kda_parameters_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear

    from test_linear_attention import KIMI

    config = transformers.AutoConfig.for_model("kimi_linear", **KIMI)
    layer = modeling_kimi_linear.KimiLinearDeltaAttention(config, layer_idx=0)
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert spec.layers[0][0] == "kda"
    assert _ours(mixer_tensors(spec, "kda", "", 1, False), "self_attention.") == _shapes(layer)


# (seq, micro-batch, dtype, heads, head dim, conv width): one chunk of 64 (padded), two (70: the
# state carried across chunks), three in bf16, and no padding (64).
KDA_CASES = [(16, 2, "fp32", 2, 8, 4), (70, 1, "fp32", 2, 8, 4), (130, 1, "bf16", 3, 4, 3), (64, 2, "fp32", 2, 8, 4)]


@pytest.mark.parametrize("seq, mbs, dtype, heads, d, conv", KDA_CASES)
def test_kda_saved_bytes_match_transformers(seq, mbs, dtype, heads, d, conv):
    """transformers' KimiLinearDeltaAttention (its torch path: no fla here), one forward under
    saved-tensor hooks: the storages still held when the forward returns, against the report's
    KDA component (its input + :func:`kda_saved`)."""
    import gc

    import mcore_memory

    transformers = pytest.importorskip("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear

    from test_linear_attention import KIMI

    class DetachingMeter(mcore_memory.SavedTensorMeter):
        # A saved output packed as itself references its own grad_fn: a cycle through the graph that
        # keeps alive what the forward drops (the last chunk's state update). Detached, it does not.
        def _pack(self, t):
            return super()._pack(t.detach())

    kw = dict(KIMI, linear_num_heads=heads, linear_head_dim=d, linear_conv_kernel_dim=conv)
    config = transformers.AutoConfig.for_model("kimi_linear", **kw)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    layer = modeling_kimi_linear.KimiLinearDeltaAttention(config, layer_idx=0).to(torch_dtype)
    meter = DetachingMeter(layer.parameters())
    x = torch.randn(mbs, seq, 64, dtype=torch_dtype, requires_grad=True)
    with meter.tracking():
        out = layer(x)
    gc.collect()
    held = meter.current
    out.float().sum().backward()
    spec = ModelSpec.from_hf_config(dict(kw, model_type="kimi_linear"))
    training = Training(seq_length=seq, micro_batch_size=mbs, num_microbatches=1, params_dtype=dtype)
    options = DecoderOptions(normalization="RMSNorm", add_bias_linear=False, padded_vocab_size=100)
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0)
    assert held == act.components["kda"] // 2  # (two KDA layers in KIMI's three)
    if (seq, mbs, dtype) == (16, 2, "fp32"):
        # T = 32, 2 heads x 8 (dim 16), one chunk of 64: the decay mask and its product 2 x 4 x 64 x 64
        # x 8 x 4 = 1,048,576; the row loop's clones 4 x 4 x (2,016 + 85,344) = 1,397,760; the solved
        # matrix, intra scores 2 x 4 x 4,096 x 4 = 131,072 and intra product 524,288; seven padded
        # [4, 64, 8] 57,344 and beta 1,024; masks 3 x 4,096; the state 1,024, exp(g) and new values
        # 2 x 8,192; the conv 13,440, gates 8,976, L2 norms 4,608 and output norm + o_proj 10,496:
        # 3,227,280 in all, beside the [T, 64] input 8,192.
        assert kda_saved(spec, s=16, b=2, act=4) == 3_227_280 and held == 3_227_280 + 8_192


def test_gated_attention_parameters_in_megatron_order(mcore):
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                  attention_output_gate=True, add_bias_linear=False)
    model = mcore_cpu.build_gpt(fields, vocab_size=256, max_seq_len=16, share_embeddings=False)
    spec = ModelSpec.from_mapping(dict(fields, vocab_size=256, share_embeddings_and_output_weights=False))
    options = DecoderOptions.from_mapping(dict(fields, padded_vocab_size=256, position_embedding_type="rope"))
    ours = chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=16)
    assert [(p.name, p.numel) for p in ours] == _shapes(model)
    # linear_qkv: [(4 + 2*2 + 4 gate) * 16, 64].
    assert ("decoder.layers.0.self_attention.linear_qkv.weight", 12 * 16 * 64) in _shapes(model)


# Saved bytes of attention variants that run on CPU (the local unfused attention).
ATTENTION_CASES = {
    "gated, MHA, RoPE": (dict(attention_output_gate=True), "rope", "fp32"),
    "gated, GQA, learned positions": (dict(attention_output_gate=True, num_query_groups=2), "learned_absolute", "fp32"),
    "gated, bf16": (dict(attention_output_gate=True), "rope", "bf16"),
    "sliding window 4 (the [s, s] softmax is saved whatever the window)": (dict(window_size=(4, 0)), "rope", "fp32"),
    "gated, full recompute, uniform 1": (dict(attention_output_gate=True, recompute_granularity="full",
                                              recompute_method="uniform", recompute_num_layers=1), "rope", "fp32"),
    "gated, selective core_attn, MHA": (dict(attention_output_gate=True, recompute_granularity="selective"),
                                        "rope", "fp32"),
    "gated, selective core_attn, GQA": (dict(attention_output_gate=True, recompute_granularity="selective",
                                             num_query_groups=2), "rope", "fp32"),
}


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_gated_and_windowed_attention_saved_bytes(mcore, name):
    import test_memory_activations as base

    fields, position, dtype = ATTENTION_CASES[name]
    measured_forward, measured_peak = base._measure(fields, position, dtype)
    model = dict(base.BASE, **fields, vocab_size=base.VOCAB)
    spec = ModelSpec.from_mapping(model)
    options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=base.VOCAB, attention_backend="local",
                                               position_embedding_type=position, add_bias_linear=False))
    training = Training(seq_length=base.SEQ, micro_batch_size=base.MBS, num_microbatches=base.NUM_MB,
                        params_dtype=dtype)
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0,
                            recompute=RecomputeSpec.from_mapping(model))
    delta = base.cpu_kernel_delta(fields, training.param_bytes, 2 * base.BASE["num_layers"] + 1, base.SEQ * base.MBS,
                                  base.BASE["hidden_size"], 0)
    act = dataclasses.replace(act, components={**act.components, "cpu": delta})
    assert measured_forward == [act.forward + act.shared] * base.NUM_MB
    assert measured_peak == schedule_peak([act], in_flight(Parallelism(), base.NUM_MB, 0))[0]


def test_gate_adds_two_head_widths_per_layer():
    # MHA with RoPE, fp32, T = 32 tokens, 4 heads x 16: the qkv output grows by the gate [T, 64] and
    # the gated output [T, 64] is kept beside the core output: 2 x 32 x 64 x 4 = 16,384 per layer.
    plain = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=1, params_dtype="fp32")
    options = DecoderOptions(attention_backend="unfused", position_embedding_type="rope", padded_vocab_size=256)
    sizes = [chunk_activations(ModelSpec.from_mapping(dict(plain, attention_output_gate=g)), options, Parallelism(),
                               training, pp_rank=0, chunk=0).forward for g in (False, True)]
    assert sizes[1] - sizes[0] == 2 * 16_384


def test_mamba_and_gdn_formulas():
    spec = ModelSpec.from_mapping(HYBRID)
    # Mamba, T = 32, bf16: inner 128, 8 heads, 2 groups, in_proj width 2*128 + 2*2*16 + 8 = 328.
    # zxBCdt 32*328*2 = 20,992; out_x 32*128*2 = 8,192; A, exp(A_log) and the dt_bias copy 3 x 8*4 = 96;
    # norm input 8,192 and rstd 32*2*4 = 256; out_proj input 8,192: 45,920.
    assert mamba_saved(spec, tokens=32, tp=1, act=2) == 45_920
    # GDN, T = 32, bf16: 2 key heads x 16 (qk 32), 4 value heads x 8 (v 32).
    # conv input 32*96*2 = 6,144; l2norm of q and k 2*(32*32*2 + 32*2*4) = 4,608; q, k repeated to 4
    # heads 2*32*4*16*2 = 8,192; softplus in/out 2*32*4*4 + exp and -exp 2*4*2 + beta 32*4*2 = 1,296;
    # v 2,048, cumulated g 512, WY matrix 32*4*64*2 = 16,384; gated norm: input, output and gate
    # 3*2,048 + rstd 512 = 6,656; out_proj input 2,048: 47,888.
    assert gdn_saved(spec, tokens=32, tp=1, act=2, param=2) == 47_888
    # TP 2 halves the heads: the per-rank figures shrink (groups, heads and widths per rank).
    assert mamba_saved(spec, tokens=32, tp=2, act=2) < 45_920


def test_hybrid_report_lists_every_layer_and_labels_formulas():
    spec = ModelSpec.from_mapping(HYBRID)
    options = DecoderOptions(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
                             padded_vocab_size=256, attention_backend="unfused")
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2, params_dtype="bf16")
    report = decoder_memory(spec, options, Parallelism(), training)
    names = [p.name for p in chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=16)]
    assert "decoder.layers.0.mixer.in_proj.weight" in names and "decoder.layers.1.self_attention.conv1d.weight" in names
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in names and "decoder.layers.3.mlp.linear_fc1.weight" in names
    assert not any(n.startswith("decoder.layers.3.input_layernorm") or n.startswith("decoder.layers.2.pre_mlp")
                   for n in names)
    assert report.per_gpu.activations is not None and not report.not_modelled
    assert {"mamba", "gdn", "attention", "mlp"} <= set(report.per_gpu.activations_per_microbatch[0])
    assert any("Mamba layers" in u for u in report.unmeasured) and any("Gated DeltaNet" in u for u in report.unmeasured)


def test_cli_hybrid_model_shows_unmeasured_formulas(capsys, tmp_path):
    nemotron_h_like = dict(hybrid_override_pattern="M-M*-M-M-", hidden_size=256, num_attention_heads=8,
                           num_query_groups=2, ffn_hidden_size=512, mamba_state_dim=64, mamba_head_dim=32,
                           mamba_num_groups=4, vocab_size=1000, normalization="RMSNorm", add_bias_linear=False,
                           activation_func="squared_relu", position_embedding_type="none")
    model = tmp_path / "nemotron_h_like.json"
    model.write_text(json.dumps(nemotron_h_like))
    assert main(["memory", "--model", str(model), "--seq-length", "1024", "--tp", "2", "--dp", "2",
                 "--distributed-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "activations" in out and "n/m" not in out
    assert "unmeasured formula (this setup): activations of Mamba layers" in out
    assert "unmeasured formula (this setup): tp/* traffic of Mamba and GDN layers" in out
    assert main(["memory", "--model", str(model), "--seq-length", "1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["total"] == report["parameters"]["trainable"] > 0
    assert any("Mamba" in u for u in report["unmeasured"])


def test_refusals_name_what_is_not_modelled(capsys, tmp_path):
    model = tmp_path / "hybrid.json"
    model.write_text(json.dumps(HYBRID))
    # (CP 2 is modelled: tests/test_memory_linear_cp.py; 2 key heads do not split over 4 CP ranks.)
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--cp", "4"]) == 2
    assert "linear_num_key_heads / TP = 2 is not divisible by --cp 4" in capsys.readouterr().err
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--recompute", "full",
                 "--recompute-method", "uniform", "--recompute-num-layers", "1"]) == 0
    assert "not modelled (this setup): activations of Mamba, Gated DeltaNet, Kimi Delta Attention and hybrid layers " \
           "are modelled without full recompute" in capsys.readouterr().out
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--pp", "2", "--vpp", "2"]) == 2
    assert "takes virtual pipeline stages of a hybrid pattern from its '|' separators" in capsys.readouterr().err
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--pp", "2"]) == 0
    assert "split evenly over the 2 pipeline stages" in capsys.readouterr().out


def test_selective_recompute_touches_only_the_attention_layers():
    # core_attn recompute checkpoints softmax attention's core; Mamba and GDN layers save the same.
    spec = ModelSpec.from_mapping(HYBRID)
    options = DecoderOptions(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
                             padded_vocab_size=256, attention_backend="unfused", hidden_dropout=0.0)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=1, params_dtype="bf16")
    plain, selective = (chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0,
                                          recompute=r) for r in (None, RecomputeSpec(granularity="selective")))
    assert {k: v for k, v in plain.components.items() if k != "attention"} == \
        {k: v for k, v in selective.components.items() if k != "attention"}
    assert selective.components["attention"] < plain.components["attention"] and selective.backward_peak


class _Hadamard(torch.autograd.Function):
    """fast_hadamard_transform's stand-in (a Sylvester Hadamard matrix by matmul): like the CUDA
    kernel's autograd function it saves nothing for backward, so the saved bytes are unchanged."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return _Hadamard.rotate(x, scale)

    @staticmethod
    def backward(ctx, grad):
        return _Hadamard.rotate(grad, ctx.scale), None

    @staticmethod
    def rotate(x, scale):
        h = torch.ones(1, 1)
        while h.size(0) < x.size(-1):
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return (x.float() @ h * scale).to(x.dtype)


def dsa_core_attention_spec():
    """The DSA spec's ``DSAttention`` built from the local spec's layers (the indexer's duplicated
    linears as torch linears), with fast_hadamard_transform's CUDA kernel replaced (test-only: in
    this process, for its life)."""
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class Duplicated(torch.nn.Linear):  # TELinear(parallel_mode="duplicated"): (output, bias)
        def __init__(self, d_in, d_out, *, bias=False, **_):
            super().__init__(d_in, d_out, bias=bias)

        def forward(self, x):
            return super().forward(x), None

    dsa.hadamard_transform = _Hadamard.apply
    return ModuleSpec(module=dsa.DSAttention, submodules=dsa.DSAttentionSubmodules(
        indexer=ModuleSpec(module=dsa.DSAIndexer, submodules=dsa.DSAIndexerSubmodules(
            linear_wq_b=Duplicated, linear_wk=Duplicated, k_norm=WrappedTorchNorm, linear_weights_proj=Duplicated))))


def _dsa_attention(model: dict, sequence_parallel: bool = False):
    """megatron-core 0.16.1's MLA self-attention with DSAttention as its core (the DSA spec's,
    built from the local spec's layers: the indexer's duplicated linears as torch linears), bf16,
    on this process's TP group, for the fields ``model`` (as :data:`DSA`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = {k: v for k, v in model.items() if k not in ("vocab_size", "experimental_attention_variant")}
    config = MLATransformerConfig(**fields, experimental_attention_variant="dsa", dsa_indexer_loss_coeff=0.01,
                                  normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                                  rope_type="rope", bf16=True, params_dtype=torch.bfloat16,
                                  tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                  sequence_parallel=sequence_parallel)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm").submodules.self_attention
    spec.submodules.core_attention = dsa_core_attention_spec()
    with mcore_cpu.cuda_to_cpu_mode():
        return build_module(spec, config=config, layer_number=1).bfloat16()


def _dsa_saved_forward(seq: int, mbs: int, sequence_parallel: bool = False, model: dict = DSA, tp: int = 1) -> int:
    """Bytes of the distinct storages one forward of :func:`_dsa_attention` saves (its input is
    this rank's [seq / tp, mbs, 64] slice under sequence parallelism)."""
    import mcore_memory

    attention = _dsa_attention(model, sequence_parallel)
    meter = mcore_memory.SavedTensorMeter(attention.parameters())
    torch.manual_seed(0)
    x = torch.randn(seq // (tp if sequence_parallel else 1), mbs, 64, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).expand(mbs, 1, seq, seq)
    with meter.tracking(), meter.one_forward(), mcore_cpu.cuda_to_cpu_mode():
        out, _ = attention(x, attention_mask=mask)
    out.float().sum().backward()
    return meter.forward[0]


def dsa_tp_worker(rank: int, world_size: int, runs: dict) -> dict:
    """A 2-rank gloo worker: :func:`_dsa_saved_forward` under TP 2 for each run (seq, mbs, SP, model)."""
    import mcore_dist
    import mcore_memory

    mcore_dist.init_worker(tp=world_size)
    mcore_memory.patch_sequence_parallel_norm()
    return {name: _dsa_saved_forward(*run, tp=world_size) for name, run in runs.items()}


@pytest.mark.parametrize("seq, mbs", [(16, 2), (12, 1)])
def test_dsa_attention_saved_bytes(mcore, monkeypatch, seq, mbs):
    from megatron.core.transformer.experimental_attention_variant import dsa

    monkeypatch.setattr(dsa, "hadamard_transform", dsa.hadamard_transform)  # (restored after the test)
    measured = _dsa_saved_forward(seq, mbs)
    spec = ModelSpec.from_mapping(DSA)
    options = DecoderOptions.from_mapping(dict(DSA, padded_vocab_size=256, attention_backend="local",
                                               position_embedding_type="rope", add_bias_linear=False))
    training = Training(seq_length=seq, micro_batch_size=mbs, num_microbatches=1)
    ours = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0).components["attention"]
    t = seq * mbs
    # NB: torch's CPU LayerNorm keeps k_norm's mean and rstd in bf16 (CUDA: fp32): 2 x T x 2 bytes less.
    # NB: the forward's count sees top-k's int64 indices [b, s, 8], which go before it ends (only the
    # indices are used: top-k's backward node is dropped; tests/test_memory_dsa_more.py checks the peak).
    assert measured == ours - 2 * t * 2 + mbs * seq * 8 * 8
    if (seq, mbs) == (16, 2):
        # T = 32, bf16. MLA: the input [T, 64], the q latent [T, 24], the kv latent [T, 32 + 8],
        # cos/sin 4 x [16, 8], linear_proj's input [T, 4 x 16]: 4,096 + 1,536 + 2,560 + 1,024 + 4,096
        # = 13,312. Indexer: cos/sin 4 x 256, k_norm's input [T, 16] 1,024 and stats 2 x 32 x 4, fp32
        # q [T, 2, 16] 4,096 and k [T, 16] 2,048, ReLU's [2, 2, 16, 16] fp32 4,096, weights [T, 2]
        # 128: 12,672. KL loss: 3 x [2, 16, 16] fp32 = 6,144. Sparse attention: fp32 q and k
        # 2 x [8, 16, 24] x 4 = 24,576, softmax [2, 4, 16, 16] fp32 8,192 and bf16 4,096, v [8, 16, 16]
        # bf16 4,096 (a view of MLA's v): 40,960. Total 73,088 (measured: 73,088 - 128 + top-k's 2,048).
        assert ours == dsa_saved(spec, s=16, b=2, heads=4, act=2) + 13_312 == 73_088


DSA_TP_RUNS = {"TP2": (16, 2, False, DSA), "TP2 SP": (16, 2, True, DSA),
               "TP2 SP, no q latent": (16, 2, True, dict(DSA, q_lora_rank=None))}


@pytest.mark.dist
def test_dsa_attention_saved_bytes_under_tensor_parallelism(mcore):
    import mcore_dist

    measured = mcore_dist.run_distributed(dsa_tp_worker, 2, DSA_TP_RUNS, timeout=600)
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=1)
    for name, (_, _, sp, model) in DSA_TP_RUNS.items():
        options = DecoderOptions.from_mapping(dict(model, padded_vocab_size=256, attention_backend="local",
                                                   position_embedding_type="rope", add_bias_linear=False))
        ours = chunk_activations(ModelSpec.from_mapping(model), options, Parallelism(tp=2, sequence_parallel=sp),
                                 training, pp_rank=0, chunk=0).components["attention"]
        # NB: CPU k_norm statistics in bf16 and top-k's transient [2, 16, 8] int64, as at TP 1 (the
        # indexer sees all T = 32 tokens).
        assert [r[name] for r in measured] == [ours - 2 * 32 * 2 + 2_048] * 2, name
    # TP 2 halves the sparse attention's heads (4 -> 2): its fp32 q, k, softmax, bf16 softmax and v
    # (40,960 at TP 1, see above) to 20,480; the indexer (12,672) and the KL loss (6,144) stay whole.
    # Sequence parallelism adds the indexer's gathered copies of the norm output [32, 64] and the q
    # latent [32, 24] in bf16: 32 x 88 x 2 = 5,632 (without a q latent, the norm output twice).
    spec = ModelSpec.from_mapping(DSA)
    tp2 = dsa_saved(spec, s=16, b=2, heads=2, act=2)
    assert tp2 == 73_088 - 13_312 - 20_480
    assert dsa_saved(spec, s=16, b=2, heads=2, act=2, sequence_parallel=True) - tp2 == 5_632


def test_hybrid_mla_layers_have_no_latent_norms():
    # megatron-core's hybrid specs build an MLA layer's q_layernorm and kv_layernorm as IdentityOp:
    # qk_layernorm changes nothing there (a GPT's MLA layer would gain 24 + 32 norm weights).
    mla = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
               v_head_dim=16)
    spec = ModelSpec.from_mapping(dict(SMALL, num_layers=3, hybrid_override_pattern="M+-", **mla))
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2, params_dtype="bf16")
    reports = [decoder_memory(spec, DecoderOptions(normalization="RMSNorm", add_bias_linear=False, qk_layernorm=qk,
                                                   position_embedding_type="rope", padded_vocab_size=256,
                                                   attention_backend="unfused"), Parallelism(), training)
               for qk in (False, True)]
    assert reports[0].parameters == reports[1].parameters and reports[0].per_gpu == reports[1].per_gpu
    assert any("IdentityOp" in a for a in reports[1].assumptions)
