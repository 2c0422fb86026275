"""Hugging Face layers that run attention and the MLP in parallel on the layer's input
(:mod:`megatron_flops.memory.hf_parallel`), against transformers' own layers on CPU.

One-term deltas: the saved-for-backward bytes (saved-tensor hooks over distinct storages, one
training step of the whole causal LM: eager attention, fp32, dropout 0) of a parallel layer's model
minus those of its sequential twin (the same config with the family's switch flipped) equal the
report's figures for the two files minus each other; the attention, embedding and loss cancel.
Twins: gpt_neox and stablelm ``use_parallel_residual``, falcon ``parallel_attn``, falcon's new
decoder ``num_ln_in_parallel_attn`` 2 against 1. cohere has no switch: its twin is its own layer
run sequentially (a second norm on the residual after attention, local port), with its norms as
torch's LayerNorm without bias (what the report counts cohere's composite CohereLayerNorm as).
Full recompute: the peak of transformers' per-layer checkpointing, the same way.

Whole figures (no twin needed): megatron-core's local modules wired as the parallel layer (a local
port, as tests/test_memory_hf_layers.py ports Bridge's gemma spec), with selective ``core_attn`` and
``mlp`` and full recompute, and on 2 gloo processes under TP 2 with and without sequence
parallelism (states, collectives, saved bytes, the peak)."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from megatron_flops.memory.activations import chunk_activations
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.model.spec import ModelSpec

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import test_hf_config  # noqa: E402  (the families' tiny configs)
from hf_tiny import eager_model  # noqa: E402

SEQ, MBS, VOCAB = 16, 2, 100
T, H, FP32 = SEQ * MBS, 64, 4  # tokens of a micro-batch, hidden size (every config below), fp32 bytes
FAMILIES = test_hf_config.FAMILIES
# name -> (model_type, parallel config keywords, its twin's, parallel - twin per layer: bytes, parameters).
# NB: per layer, one norm against megatron-core's two: no pre-MLP norm (its [T, h] input and fp32 mean and
# rstd [T] each) and no fc1 input of its own (the norm's output linear_qkv keeps); two norms on the
# layer's input: the second norm's [T, h] input is the first's. Parameters: LayerNorm weight and bias [h].
TWINS = {
    "gpt_neox (two norms)": ("gpt_neox", dict(FAMILIES["gpt_neox"], use_parallel_residual=True),
                             dict(FAMILIES["gpt_neox"], use_parallel_residual=False), -T * H * FP32, 0),
    "stablelm (one norm)": ("stablelm", dict(FAMILIES["stablelm"], use_parallel_residual=True),
                            dict(FAMILIES["stablelm"], use_parallel_residual=False),
                            -(2 * T * H * FP32 + 2 * T * FP32), -2 * H),
    "falcon (one norm)": ("falcon", dict(FAMILIES["falcon"], parallel_attn=True),
                          dict(FAMILIES["falcon"], parallel_attn=False), -(2 * T * H * FP32 + 2 * T * FP32), -2 * H),
    # Two norms on the layer's input against one: the second norm's statistics and output (fc1's input).
    "falcon new decoder (two norms against one)": (
        "falcon", dict(test_hf_config.VARIANTS["falcon new decoder"][1], num_ln_in_parallel_attn=2),
        dict(test_hf_config.VARIANTS["falcon new decoder"][1], num_ln_in_parallel_attn=1),
        T * H * FP32 + 2 * T * FP32, 2 * H),
}


def _saved_bytes(model) -> int:
    """Distinct storages saved for backward by one training step on [MBS, SEQ] token ids."""
    import mcore_memory

    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (MBS, SEQ))
    meter = mcore_memory.SavedTensorMeter(model.parameters())
    model.train()
    with meter.tracking(), meter.one_forward():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return meter.forward[0]


def _report(raw: dict, **overrides) -> tuple[int, int]:
    """(saved bytes of one micro-batch, parameters) of the config file ``raw`` as the report
    counts them: the local attention (transformers' eager), fp32, the vocabulary unpadded;
    ``overrides``: other ``DecoderOptions`` values."""
    spec = ModelSpec.from_hf_config(raw)
    options = dataclasses.replace(DecoderOptions.from_mapping(raw, hf=True), attention_backend="unfused",
                                  padded_vocab_size=VOCAB, **overrides)
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=1, params_dtype="fp32")
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0)
    params = chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=SEQ)
    return act.forward + act.shared, sum(p.numel for p in params)


@pytest.mark.parametrize("name", list(TWINS))
def test_parallel_layer_saves_what_transformers_saves_against_its_sequential_twin(name):
    model_type, parallel_kw, twin_kw, per_layer, per_layer_params = TWINS[name]
    configs = [transformers.AutoConfig.for_model(model_type, **kw) for kw in (parallel_kw, twin_kw)]
    models = [eager_model(c) for c in configs]
    reports = [_report(json.loads(c.to_json_string())) for c in configs]
    layers = configs[0].num_hidden_layers
    # The report's parameters are transformers' (tied or untied embeddings alike).
    assert [r[1] for r in reports] == [sum(p.numel() for p in m.parameters()) for m in models]
    assert reports[0][1] - reports[1][1] == layers * per_layer_params
    measured = _saved_bytes(models[0]) - _saved_bytes(models[1])
    assert measured == reports[0][0] - reports[1][0] == layers * per_layer


def _serial_cohere_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                           position_embeddings=None, **kwargs):
    """CohereDecoderLayer.forward run sequentially: the MLP reads a second norm of the residual."""
    residual = hidden_states
    attention, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                  position_ids=position_ids, cache=cache, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
    residual = residual + attention
    return residual + self.mlp(self.post_attention_layernorm(residual))


def _cohere(serial: bool):
    config = transformers.AutoConfig.for_model("cohere", **dict(FAMILIES["cohere"], use_qk_norm=False))
    model = eager_model(config)
    for layer in model.model.layers:
        layer.input_layernorm = torch.nn.LayerNorm(H, bias=False)
        if serial:
            layer.post_attention_layernorm = torch.nn.LayerNorm(H, bias=False)
            layer.forward = types.MethodType(_serial_cohere_forward, layer)
    return config, model


def test_cohere_saves_one_norm_less_than_its_sequential_port():
    (config, parallel), (_, serial) = _cohere(False), _cohere(True)
    measured = _saved_bytes(serial) - _saved_bytes(parallel)
    # Per layer (2): the second norm's [T, h] input and fp32 mean and rstd, and its output (the MLP's input).
    assert measured == config.num_hidden_layers * (2 * T * H * FP32 + 2 * T * FP32)
    raw = json.loads(config.to_json_string())
    assert DecoderOptions.from_mapping(raw, hf=True).parallel_layer_norms == 1
    # The report for the file, and for the same file counted as megatron-core's sequential layer.
    counted = [_report(raw, parallel_layer_norms=n)[0] for n in (0, 1)]
    assert counted[0] - counted[1] == measured


def _peak_bytes(model) -> int:
    """The most saved-for-backward bytes held at once over one training step with transformers'
    gradient checkpointing of every layer (reentrant: each layer's forward runs under no_grad,
    keeps its inputs, and runs again in backward, metered too)."""
    import mcore_memory

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (MBS, SEQ))
    meter = mcore_memory.SavedTensorMeter(model.parameters())
    model.train()
    with meter.tracking():
        model(input_ids=ids, labels=ids).loss.backward()
    return meter.peak


@pytest.mark.parametrize("name", ["gpt_neox (two norms)", "stablelm (one norm)"])
def test_full_recompute_rerun_peak_moves_as_transformers_checkpointed_layer(name):
    # Full recompute (megatron-core's uniform, one layer per checkpoint; transformers' per-layer
    # checkpoint): the forward keeps the layers' inputs alike; the peak, while the last layer runs again
    # in backward, moves by one layer's difference.
    from megatron_flops.flops.passes import RecomputeSpec
    from megatron_flops.memory.activations import in_flight, schedule_peak

    model_type, parallel_kw, twin_kw, per_layer, _ = TWINS[name]
    configs = [transformers.AutoConfig.for_model(model_type, **kw) for kw in (parallel_kw, twin_kw)]
    recompute = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
    training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=1, params_dtype="fp32")
    counted = []
    for config in configs:
        raw = json.loads(config.to_json_string())
        options = dataclasses.replace(DecoderOptions.from_mapping(raw, hf=True), attention_backend="unfused",
                                      padded_vocab_size=VOCAB)
        act = chunk_activations(ModelSpec.from_hf_config(raw), options, Parallelism(), training, pp_rank=0,
                                chunk=0, recompute=recompute)
        counted.append((act.forward, schedule_peak([act], in_flight(Parallelism(), 1, 0))[0]))
    assert counted[0][0] == counted[1][0]
    measured = _peak_bytes(eager_model(configs[0])) - _peak_bytes(eager_model(configs[1]))
    assert measured == counted[0][1] - counted[1][1] == per_layer


@pytest.mark.parametrize("model_type, kw, norms", [
    ("cohere", {}, 1), ("stablelm", {}, 0), ("stablelm", dict(use_parallel_residual=True), 1), ("gpt_neox", {}, 2),
    ("gpt_neox", dict(use_parallel_residual=False), 0), ("falcon", {}, 1), ("falcon", dict(parallel_attn=False), 0),
    # falcon's new decoder adds the MLP's output to the attention's whatever parallel_attn says.
    ("falcon", dict(new_decoder_architecture=True), 2), ("falcon", dict(new_decoder_architecture=True,
                                                                          num_ln_in_parallel_attn=1), 1),
    ("llama", {}, 0),
])
def test_parallel_layer_norms_read_as_transformers_builds_the_layer(model_type, kw, norms):
    # (transformers' defaults: stablelm's use_parallel_residual False, gpt_neox's True, falcon's parallel_attn True.)
    raw = json.loads(transformers.AutoConfig.for_model(model_type, **kw).to_json_string())
    assert DecoderOptions.from_mapping(raw, hf=True).parallel_layer_norms == norms


def test_parallel_layer_is_named_unmeasured_where_no_framework_runs_it(tmp_path):
    import contextlib
    import io

    from megatron_flops.cli import main

    path = tmp_path / "config.json"
    path.write_text(transformers.AutoConfig.for_model("gpt_neox", **FAMILIES["gpt_neox"]).to_json_string())

    def unmeasured(*flags: str) -> list[str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["memory", "--model", str(path), "--seq-length", str(SEQ), "--json", *flags]) == 0
        report = json.loads(out.getvalue())
        assert report["not_modelled"] == [] and any("in parallel" in a for a in report["assumptions"])
        return [u for u in report["unmeasured"] if "parallel attention and MLP" in u]

    full = ("--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    assert unmeasured() == unmeasured(*full) == []
    assert "TP > 1, sequence parallelism" in unmeasured("--tp", "2", "--sequence-parallel")[0]
    assert unmeasured("--recompute", "selective", "--recompute-modules", "core_attn") == []
    assert "selective layernorm recompute, LoRA" in unmeasured("--recompute", "selective", "--recompute-modules",
                                                               "layernorm", "--lora-rank", "4")[0]
    with pytest.raises(ValueError, match="parallel_layer_norms"):
        DecoderOptions(parallel_layer_norms=3)


def _parallel_layer_spec(spec, norms: int):
    """megatron-core's local layer spec with its layer run in parallel (a local port: no framework
    has this layer): ``norms`` 2, the pre-MLP norm reads the layer's input; 1, no pre-MLP norm and
    the MLP reads the input norm's output (kept by a forward hook). Each sublayer adds its own
    residual (bias-dropout-add), the sum subtracts the input once more: adds save nothing."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class ParallelLayer(TransformerLayer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.input_layernorm.register_forward_hook(lambda _m, _i, out: setattr(self, "_normed", out))

        def forward(self, hidden_states, *args, **kwargs):
            kwargs.pop("dynamic_inference_decode_only", None)
            attention, context = self._forward_attention(hidden_states, *args, **kwargs)  # x + attn(norm(x))
            mlp_input = hidden_states if norms == 2 else self._normed
            del self._normed
            mlp = self._forward_mlp(mlp_input)  # its input + mlp(norm(x))
            return attention + mlp - mlp_input, context

    spec.module = ParallelLayer
    if norms == 1:
        spec.submodules.pre_mlp_layernorm = IdentityOp
    return spec


PORT_BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, hidden_dropout=0.0,
                 attention_dropout=0.0, add_bias_linear=False, num_query_groups=2)
PORT_CASES = {
    "plain": {},
    "SwiGLU, selective core_attn + mlp": dict(gated_linear_unit=True, activation_func="silu",
                                              bias_activation_fusion=True, recompute_granularity="selective",
                                              recompute_modules=["core_attn", "mlp"]),
    "full recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@pytest.mark.parametrize("norms", [1, 2], ids=["one norm", "two norms"])
@pytest.mark.parametrize("case", list(PORT_CASES))
def test_parallel_layer_on_megatron_core_modules_saves_and_holds_as_counted(mcore, monkeypatch, case, norms):
    # The whole figure, not a delta: megatron-core's local modules wired as the parallel layer, one
    # schedule of 2 micro-batches (tests/test_memory_hf_layers.py's meter), against the report; with
    # selective core_attn and mlp recompute and full recompute, which transformers has no twin for.
    from megatron_flops.flops.passes import RecomputeSpec
    from megatron_flops.memory.activations import in_flight, schedule_peak
    from test_memory_activations import NUM_MB, SEQ as MSEQ, VOCAB as MVOCAB
    from test_memory_hf_layers import _measure

    fields = dict(PORT_BASE, **PORT_CASES[case])
    config = dict(fields, activation_func=torch.nn.functional.silu) if "activation_func" in fields else fields
    build_spec = mcore.build_layer_spec
    monkeypatch.setattr(mcore, "build_layer_spec", lambda c, **kw: _parallel_layer_spec(build_spec(c, **kw), norms))
    torch.manual_seed(0)
    model = mcore.build_gpt(config, vocab_size=MVOCAB, max_seq_len=MSEQ)
    model_file = dict(fields, vocab_size=MVOCAB)
    spec = ModelSpec.from_mapping(model_file)
    options = DecoderOptions.from_mapping(dict(model_file, padded_vocab_size=MVOCAB, attention_backend="local",
                                               position_embedding_type="rope", parallel_layer_norms=norms))
    assert [(p.name, p.numel) for p in chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0,
                                                        seq_length=MSEQ)] == \
        [(n, p.numel()) for n, p in model.named_parameters()]
    training = Training(seq_length=MSEQ, micro_batch_size=MBS, num_microbatches=NUM_MB, params_dtype="fp32")
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0,
                            recompute=RecomputeSpec.from_mapping(model_file))
    forward, peak = _measure(model)  # (fp32 LayerNorms: torch's CPU kernel saves what CUDA's does)
    assert forward == [act.forward + act.shared] * NUM_MB
    assert peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]


# The same port under tensor and sequence parallelism, 2 gloo processes (tests/test_memory_dist.py's
# worker and checks): weights, gradients, optimizer state, every collective's payload, the saved
# bytes and the peak. (No framework runs the parallel layer so: the report names these figures
# unmeasured; this checks they are the port's.)
DIST_BASE = dict(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=72, hidden_dropout=0.0,
                 attention_dropout=0.0)
DIST_RUNS = {
    f"TP2{' + SP' if sp else ''}, {norms} norm{'s' if norms > 1 else ''}, fp32": dict(
        layout=dict(tp=2, sp=sp), model=dict(DIST_BASE), m=2, build=dict(params_dtype="fp32"), norms=norms)
    for sp, norms in ((True, 1), (True, 2), (False, 1))
}


def parallel_layer_worker(rank: int, world_size: int, runs: dict) -> dict:
    import mcore_cpu
    import test_memory_dist

    build_spec, out = mcore_cpu.build_layer_spec, {}
    for name, run in runs.items():
        norms = run["norms"]
        mcore_cpu.build_layer_spec = lambda c, **kw: _parallel_layer_spec(build_spec(c, **kw), norms)
        out.update(test_memory_dist.memory_worker(rank, world_size, {name: run}))
    mcore_cpu.build_layer_spec = build_spec
    return out


@pytest.mark.dist
def test_parallel_layer_port_under_tensor_and_sequence_parallelism(mcore, monkeypatch):
    import mcore_dist
    import test_memory_dist as dist

    measured = mcore_dist.run_by_name(parallel_layer_worker, 2, DIST_RUNS, timeout=600)
    monkeypatch.setattr(dist, "WORLD", 2)  # (its checks' layout: DP = WORLD / (TP x PP), 1 here)
    setup = dist.setup

    def parallel_setup(run: dict):
        spec, options, *rest = setup(run)
        return (spec, dataclasses.replace(options, parallel_layer_norms=run["norms"]), *rest)

    monkeypatch.setattr(dist, "setup", parallel_setup)
    for name, run in DIST_RUNS.items():
        results = measured[name]
        for check in (dist.check_parameters, dist.check_states, dist.check_communication, dist.check_activations):
            check(run, results)
