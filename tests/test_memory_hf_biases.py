"""Hugging Face layers with biases on some linear layers only, as ``hf_proj_bias``/``hf_mlp_bias``
count them (memory/hf_layers.py): llama's ``attention_bias`` (q, k, v and o_proj, not the MLP), the
MLP's ``mlp_bias`` alone, gpt_neox without ``attention_bias`` (the MLP's biases only). A bias adds
parameters (so gradients and optimizer state) and no saved tensor: measured as the one-term delta
(feature on against off) on transformers' models on CPU, and on a real megatron-core GPT with the
same biases; parameters against ``named_parameters()``.

Tiny configs (tests/test_hf_config.py): 2 layers, h = 64, 4 heads, 2 key/value heads, head_dim d = 16,
intermediate 96; one micro-batch of b = 2 sequences of s = 16 tokens."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from megatron_flops.memory.activations import chunk_activations
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters, parameter_counts
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.model.spec import ModelSpec

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import test_hf_config  # noqa: E402  (the families' tiny configs)
from hf_tiny import saved_bytes, tiny_model  # noqa: E402

SEQ, MBS, LAYERS, H, FFN = 16, 2, 2, 64, 96
DENSE = test_hf_config.DENSE
# (model_type, keywords with the biases, keywords without, parameters the biases add). Per layer:
# - attention_bias: q [4 x 16], k and v [2 x 16], o_proj [64]: 64 + 32 + 32 + 64 = 192.
# - mlp_bias: gate_proj and up_proj [96], down_proj [64]: 256.
# - gpt_neox's attention_bias (the fused query_key_value [3 x 64], dense [64]): 256.
# - the MLA families' attention_bias (deepseek_v3: 3 layers, q_lora 24, kv_lora 16, rope 8): q_a_proj [24],
#   kv_a_proj_with_mqa [16 + 8], o_proj [64]: 112 (deepseek_v2, direct q: q_proj has none: 88). Every layer
#   dense (first_k_dense_replace 3): the routed experts' tokens would depend on the weights drawn.
MLA_FAMILIES = {k: dict(test_hf_config.FAMILIES[k], first_k_dense_replace=3) for k in ("deepseek_v2", "deepseek_v3")}
PARTIAL = {
    "llama attention_bias": ("llama", dict(DENSE, attention_bias=True), dict(DENSE), LAYERS * 192),
    "llama mlp_bias": ("llama", dict(DENSE, mlp_bias=True), dict(DENSE), LAYERS * 256),
    "gpt_neox without attention_bias": ("gpt_neox", dict(DENSE), dict(DENSE, attention_bias=False), LAYERS * 256),
    "deepseek_v3 attention_bias": ("deepseek_v3", dict(MLA_FAMILIES["deepseek_v3"], attention_bias=True),
                                   MLA_FAMILIES["deepseek_v3"], 3 * 112),
    "deepseek_v2 attention_bias": ("deepseek_v2", dict(MLA_FAMILIES["deepseek_v2"], attention_bias=True),
                                   MLA_FAMILIES["deepseek_v2"], 3 * 88),
}


def _raw(model_type: str, kw: dict[str, Any]) -> dict[str, Any]:
    return json.loads(transformers.AutoConfig.for_model(model_type, **kw).to_json_string())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(PARTIAL))
def test_biases_add_parameters_and_no_saved_tensor(case, dtype):
    model_type, with_kw, without_kw, added = PARTIAL[case]
    (_, with_bias), (_, without) = tiny_model(model_type, **with_kw), tiny_model(model_type, **without_kw)
    # transformers: F.linear with a bias (addmm) saves its input and weight as without.
    assert saved_bytes(with_bias, seq=SEQ, batch=MBS, dtype=dtype) == saved_bytes(without, seq=SEQ, batch=MBS,
                                                                                  dtype=dtype)
    assert sum(p.numel() for p in with_bias.parameters()) - sum(p.numel() for p in without.parameters()) == added
    # The report: the same parameters added, the same activations.
    training = Training(seq_length=SEQ, micro_batch_size=MBS, params_dtype="bf16")
    counted = {}
    for name, kw in (("with", with_kw), ("without", without_kw)):
        raw = _raw(model_type, kw)
        spec, options = ModelSpec.from_hf_config(raw), DecoderOptions.from_mapping(raw, hf=True)
        counted[name] = (parameter_counts(spec, options, seq_length=SEQ)["total"],
                         chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0))
    assert counted["with"][0] - counted["without"][0] == added
    assert counted["with"][1] == counted["without"][1]


@pytest.mark.parametrize("case", list(PARTIAL))
def test_options_name_each_linear_layers_bias(case):
    model_type, with_kw, without_kw, _ = PARTIAL[case]
    expected = {"llama attention_bias": (True, True, False), "llama mlp_bias": (False, False, True),
                "gpt_neox without attention_bias": (False, False, True), "deepseek_v3 attention_bias": (True, True, False),
                "deepseek_v2 attention_bias": (True, True, False)}[case]
    options = DecoderOptions.from_mapping(_raw(model_type, with_kw if "without" not in case else without_kw), hf=True)
    assert (options.add_qkv_bias, options.proj_bias, options.mlp_bias) == expected
    assert not options.add_bias_linear  # (megatron-core's one switch would put biases on all four)


# A real megatron-core GPT (local spec, fp32, LayerNorms: torch's CPU RMSNorm saves more than CUDA's; hidden
# dropout 0 as the Hugging Face path sets) built with
# add_bias_linear and the biases a Hugging Face layer lacks removed (set to None: megatron-core's linear
# layers and bias-dropout-add then run without them): (fields, biases removed, DecoderOptions' bias fields).
MCORE_CASES = {
    # llama's attention_bias: q, k, v and o_proj biases, a fused SwiGLU without.
    "o_proj's bias, SwiGLU without biases": (
        dict(num_query_groups=2, gated_linear_unit=True, activation_func="silu", bias_activation_fusion=True),
        ("mlp.linear_fc1", "mlp.linear_fc2"), dict(add_bias_linear=False, add_qkv_bias=True, hf_proj_bias=True,
                                                   hf_mlp_bias=False)),
    # gpt_neox without attention_bias: a fused bias-GELU MLP with biases, attention without.
    "the MLP's biases, attention without": (
        dict(bias_activation_fusion=True),
        ("self_attention.linear_qkv", "self_attention.linear_proj"),
        dict(add_bias_linear=False, hf_proj_bias=False, hf_mlp_bias=True)),
}


@pytest.mark.parametrize("name", list(MCORE_CASES))
def test_in_megatron_cores_layer_partial_biases_save_as_counted(mcore, name):
    from megatron_flops.memory.activations import in_flight, schedule_peak
    from test_memory_activations import BASE, MBS as MB, NUM_MB, SEQ as S, VOCAB
    from test_memory_hf_layers import _measure

    fields, removed, bias_fields = MCORE_CASES[name]
    fields = dict(BASE, add_bias_linear=True, **fields)
    torch.manual_seed(0)
    config = dict(fields, activation_func=torch.nn.functional.silu) if "activation_func" in fields else fields
    model = mcore.build_gpt(config, vocab_size=VOCAB, max_seq_len=S)
    for layer in model.decoder.layers:
        for path in removed:
            layer.get_submodule(path).bias = None
    model_file = dict(fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model_file)
    options = DecoderOptions.from_mapping(dict(model_file, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope", **bias_fields))
    assert [(p.name, p.numel) for p in chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0,
                                                        seq_length=S)] == \
        [(n, p.numel()) for n, p in model.named_parameters()]
    training = Training(seq_length=S, micro_batch_size=MB, num_microbatches=NUM_MB, params_dtype="fp32")
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0)
    forward, peak = _measure(model)
    assert forward == [act.forward + act.shared] * NUM_MB
    assert peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]
    # The same figures as the model with every bias (megatron-core's add_bias_linear): biases save nothing.
    every = dataclasses.replace(options, add_bias_linear=True, hf_proj_bias=None, hf_mlp_bias=None)
    assert chunk_activations(spec, every, Parallelism(), training, pp_rank=0, chunk=0) == act


@pytest.mark.parametrize("impl, down, reduced", [("transformer_engine", 24, 64 + 24 + 24), ("local", 12, 64)])
def test_mla_down_projection_biases_under_tensor_parallelism(impl, down, reduced):
    # deepseek_v3's attention_bias under TP2 + SP (a formula: megatron-core's MLA has no down-projection
    # biases, so no TP run has them; labelled unmeasured). Transformer Engine's duplicated down projections
    # keep theirs whole ([q_lora] = 24, [kv_lora + rope] = 24), their gradients all-reduced over TP with
    # o_proj's [64] (row parallel); the local spec splits them as the weights' rows (24 / 2 = 12), not
    # reduced. 3 layers, fp32 gradients: tp/all_reduce grows by 3 x reduced x 4 B.
    from megatron_flops.memory.report import decoder_memory

    par = Parallelism(tp=2, sequence_parallel=True)
    training = Training(seq_length=SEQ, micro_batch_size=MBS, params_dtype="fp32", grad_reduce_in_fp32=False)
    reports, biases = {}, {}
    for bias in (True, False):
        raw = _raw("deepseek_v3", dict(test_hf_config.FAMILIES["deepseek_v3"], attention_bias=bias))
        spec = ModelSpec.from_hf_config(raw)
        options = dataclasses.replace(DecoderOptions.from_mapping(raw, hf=True), transformer_impl=impl)
        reports[bias] = decoder_memory(spec, options, par, training)
        biases[bias] = {p.name.split(".")[-2]: p.numel for p in chunk_parameters(spec, options, par, pp_rank=0, chunk=0,
                                                                                 seq_length=SEQ)
                        if p.name.startswith("decoder.layers.0.") and p.name.endswith(".bias")}
    assert biases[True] == {"linear_proj": 64, "linear_q_down_proj": down, "linear_kv_down_proj": down}
    assert biases[False] == {}
    comm = [reports[b].per_gpu.communication for b in (True, False)]
    assert comm[0]["tp/all_reduce"] - comm[1]["tp/all_reduce"] == 3 * reduced * 4
    assert {k: v for k, v in comm[0].items() if k != "tp/all_reduce"} == \
        {k: v for k, v in comm[1].items() if k != "tp/all_reduce"}
    assert reports[True].per_gpu.activations == reports[False].per_gpu.activations
    assert any(u.startswith("the multi-latent attention down projections' biases") for u in reports[True].unmeasured)
    assert not any(u.startswith("the multi-latent attention down projections' biases") for u in reports[False].unmeasured)
