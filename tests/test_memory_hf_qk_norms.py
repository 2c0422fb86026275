"""Hugging Face q/k norms megatron-core has no module for (cohere's per-head weights, stablelm's
LayerNorm per head, olmo2/olmo3's whole-projection RMSNorms) and falcon's ALiBi, as :mod:`megatron_flops.memory.hf_qk_norms` counts
them, against transformers' layers on CPU: what the feature adds to the bytes autograd saves in one
training forward (saved-tensor hooks over distinct storages, :func:`hf_tiny.saved_bytes`), with the
feature and without it, in fp32 and bf16; and transformers' norm modules put in a real megatron-core
GPT's q/k norm places, where the report counts them.

Tiny configs (tests/test_hf_config.py): 2 layers, h = 64, 4 heads, 2 key/value heads, head_dim d = 16;
one micro-batch of b = 2 sequences of s = 16 tokens: T = 32."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_flops.cli import main
from megatron_flops.memory.activations import chunk_activations
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.hf_qk_norms import PER_HEAD_LAYERNORM, PER_HEAD_WEIGHT, WHOLE_PROJECTION, qk_norm_saved_bytes
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.model.spec import ModelSpec

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import test_hf_config  # noqa: E402  (the families' tiny configs)
from hf_tiny import saved_bytes, tiny_model  # noqa: E402

SEQ, MBS, LAYERS, HEADS, GROUPS, D = 16, 2, 2, 4, 2, 16
T = SEQ * MBS
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Per layer, what the q and k norms save (rows = T x (heads + groups) = 192 (token, head) rows of d):
# - cohere (CohereLayerNorm, fp32 inside): x - mean twice, x_hat = (x - mean) * rstd (for the weight's
#   gradient; not with a frozen weight) [rows, d] fp32 each, rstd [rows] fp32; in bf16 also
#   weight.to(float32), [(4 + 2), d] fp32: 192 x (3 x 16 + 1) x 4 = 37632 (+ 6 x 16 x 4 = 384 in bf16);
#   frozen: 192 x 33 x 4 = 25344 (+ 384).
# - olmo2 (Olmo2RMSNorm over [T, 4d] and [T, 2d]): its fp32 input (the input itself in fp32, a copy in
#   bf16) and x * rstd [rows x d] fp32 each, rstd [T] fp32 twice: 3072 x 8 + 2 x 32 x 4 = 24832;
#   frozen: 3072 x 4 + 256 = 12544.
PER_LAYER = {
    ("cohere", True): {"fp32": 37632, "bf16": 37632 + 384}, ("cohere", False): {"fp32": 25344, "bf16": 25344 + 384},
    ("olmo2", True): {"fp32": 24832, "bf16": 24832}, ("olmo2", False): {"fp32": 12544, "bf16": 12544},
}
KINDS = {"cohere": PER_HEAD_WEIGHT, "olmo2": WHOLE_PROJECTION}


def _with_and_without(family: str, trainable: bool) -> tuple[Any, Any]:
    """The tiny model (q/k norm weights frozen unless ``trainable``) and the same model without its q/k
    norms (cohere: ``use_qk_norm`` false; olmo2: ``q_norm``/``k_norm`` replaced by identities)."""
    kw = test_hf_config.FAMILIES[family]
    config, model = tiny_model(family, **kw)
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.requires_grad_(trainable)
    if family == "cohere":
        return model, tiny_model(family, **dict(kw, use_qk_norm=False))[1]
    _, plain = tiny_model(family, **kw)
    for layer in plain.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
    return model, plain


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("trainable", [True, False], ids=["trained", "frozen norm weights"])
@pytest.mark.parametrize("family", list(KINDS))
def test_qk_norms_save_as_transformers_layers(family, trainable, dtype):
    model, plain = _with_and_without(family, trainable)
    measured = (saved_bytes(model, seq=SEQ, batch=MBS, dtype=DTYPES[dtype])
                - saved_bytes(plain, seq=SEQ, batch=MBS, dtype=DTYPES[dtype]))
    assert measured == LAYERS * PER_LAYER[family, trainable][dtype]
    formula = qk_norm_saved_bytes(KINDS[family], tokens=T, heads=HEADS, groups=GROUPS, head_dim=D,
                                  act=2 if dtype == "bf16" else 4, trainable=trainable)
    assert formula == PER_LAYER[family, trainable][dtype]


STABLELM = "stablelm qk_layernorm"  # (tests/test_hf_config.py: a sequential layer, partial rotary, no biases)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("trainable", [True, False], ids=["trained", "frozen norm weights"])
def test_stablelm_per_head_layernorms_save_a_layernorms_tensors(trainable, dtype):
    # stablelm with qk_layernorm against the same model without: each head's nn.LayerNorm (native_layer_norm)
    # keeps its input, a view of q_proj's or k_proj's output that nothing else keeps, [T, heads + groups, d]:
    # 192 x 16 x act, and mean and rstd per (token, head) row: 2 x 192 in the input dtype on CPU (CUDA keeps
    # them in fp32, as the report counts); trained or frozen weights alike. fp32: 12288 + 1536 = 13824 per
    # layer; bf16: 6144 + 768 = 6912.
    _, kw = test_hf_config.CASES[STABLELM]
    _, model = tiny_model("stablelm", **kw)
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_layernorm, layer.self_attn.k_layernorm):
            norm.requires_grad_(trainable)
    plain = tiny_model("stablelm", **dict(kw, qk_layernorm=False))[1]
    act = 2 if dtype == "bf16" else 4
    measured = (saved_bytes(model, seq=SEQ, batch=MBS, dtype=DTYPES[dtype])
                - saved_bytes(plain, seq=SEQ, batch=MBS, dtype=DTYPES[dtype]))
    assert measured == LAYERS * T * (HEADS + GROUPS) * (D + 2) * act
    # The report counts them as megatron-core's LayerNorm q/k norms over head_dim (whose saved tensors in
    # megatron-core's layer: test_in_megatron_cores_layer_the_norms_save_as_counted).
    assert qk_norm_saved_bytes(PER_HEAD_LAYERNORM, tokens=T, heads=HEADS, groups=GROUPS, head_dim=D, act=act,
                               trainable=trainable) is None


@pytest.mark.parametrize("backend", ["unfused", "flash"])
def test_the_report_saves_stablelms_norms_as_megatron_cores_layernorms(backend):
    raw = _raw(STABLELM)
    spec = ModelSpec.from_hf_config(raw)
    options = dataclasses.replace(DecoderOptions.from_mapping(raw, hf=True), attention_backend=backend)
    assert (options.qk_layernorm, options.hf_qk_norm, options.normalization) == (True, PER_HEAD_LAYERNORM, "LayerNorm")
    training = Training(seq_length=SEQ, micro_batch_size=MBS, params_dtype="bf16")
    stablelm, mcore = (chunk_activations(spec, o, Parallelism(), training, pp_rank=0, chunk=0)
                       for o in (options, dataclasses.replace(options, hf_qk_norm=None)))
    assert stablelm == mcore


def _raw(family: str, **extra: Any) -> dict[str, Any]:
    model_type, kw = test_hf_config.CASES[family]
    return {**json.loads(transformers.AutoConfig.for_model(model_type, **kw).to_json_string()), **extra}


@pytest.mark.parametrize("backend", ["unfused", "flash"])
@pytest.mark.parametrize("family", list(KINDS))
def test_the_report_adds_what_the_norms_save(family, backend):
    # The config.json read as the report reads it, against the same options without q/k norms: the
    # difference is the q/k norms' term alone (q and k are fresh storages after RoPE either way).
    raw = _raw(family)
    spec = ModelSpec.from_hf_config(raw)
    options = dataclasses.replace(DecoderOptions.from_mapping(raw, hf=True), attention_backend=backend)
    assert (options.qk_layernorm, options.hf_qk_norm) == (True, KINDS[family])
    training = Training(seq_length=SEQ, micro_batch_size=MBS, params_dtype="bf16")
    with_norms, without = (chunk_activations(spec, o, Parallelism(), training, pp_rank=0, chunk=0).forward
                           for o in (options, dataclasses.replace(options, qk_layernorm=False)))
    assert with_norms - without == LAYERS * PER_LAYER[family, True]["bf16"]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_alibi_saves_nothing_beyond_attention_without_position_embeddings(attention, dtype, monkeypatch):
    # transformers' falcon with ALiBi against the same layers without it and with RoPE made an identity
    # (no position embeddings). Eager (the local unfused attention's convention): the bias is added to
    # the scores, and no op saves it: 0. sdpa: the [b, heads, s, s] bias, materialised once per forward
    # in the activation dtype, is saved (once: every layer reads the same tensor), where without ALiBi
    # sdpa saves its float copy of the bool mask [b, 1, s, s] per layer:
    # (2 x 4 x 16 x 16 - 2 layers x 2 x 16 x 16) x 4 = 4096 bytes in fp32 (2048 in bf16).
    from transformers.models.falcon import modeling_falcon

    _, kw = test_hf_config.VARIANTS["falcon MHA alibi serial"]
    act = 2 if dtype == "bf16" else 4
    alibi = saved_bytes(tiny_model("falcon", **kw)[1], seq=SEQ, batch=MBS, dtype=DTYPES[dtype], attention=attention)
    monkeypatch.setattr(modeling_falcon, "apply_rotary_pos_emb", lambda q, k, *args, **kwargs: (q, k))
    none = saved_bytes(tiny_model("falcon", **dict(kw, alibi=False))[1], seq=SEQ, batch=MBS, dtype=DTYPES[dtype],
                       attention=attention)
    expected = 0 if attention == "eager" else (MBS * HEADS * SEQ * SEQ - LAYERS * MBS * SEQ * SEQ) * act
    assert alibi - none == expected
    # The report counts ALiBi as attention without position embeddings.
    options = DecoderOptions.from_mapping(_raw("falcon MHA alibi serial"), hf=True)
    assert (options.alibi, options.position_embedding_type) == (True, "none")


def _memory(tmp_path: Path, raw: dict[str, Any], *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["memory", "--model", str(path), "--seq-length", str(SEQ), "--pad-vocab-to-multiple", "1", *flags])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("backend", ["local", "flash"])
def test_alibi_kernel_assumption_is_printed(tmp_path, backend):
    rc, out, _ = _memory(tmp_path, _raw("falcon MHA alibi serial"), "--attention-backend", backend)
    assert rc == 0
    assert ("megatron-core's local softmax" if backend == "local" else "from per-head slopes") in out
    assert "not modelled" not in out


def test_olmo2_under_tp_is_refused_with_the_reason(tmp_path):
    rc, _, err = _memory(tmp_path, _raw("olmo2"), "--tp", "2")
    assert rc == 2
    assert "need statistics over every head, and no framework splits them over TP" in err


@pytest.mark.parametrize("case, key, module", [("cohere", "use_qk_norm", "CohereLayerNorm"),
                                                (STABLELM, "qk_layernorm", "StableLmLayerNormPerHead")])
def test_per_head_norms_under_tp_split_the_norm_weights_by_head_unmeasured(tmp_path, case, key, module):
    # The model's q/k norm weights: 2 layers x (4 + 2) x d = 192; each of 2 TP ranks holds its heads' rows,
    # 96 (bf16: 192 bytes), against the same model without q/k norms.
    raw = _raw(case)
    reports = {}
    for name, config, tp in (("1", raw, 1), ("2", raw, 2), ("2 without", dict(raw, **{key: False}), 2)):
        rc, out, _ = _memory(tmp_path, config, "--tp", str(tp), "--json")
        assert rc == 0
        reports[name] = json.loads(out)
    assert reports["2"]["parameters"]["total"] - reports["2 without"]["parameters"]["total"] == 192
    assert reports["2"]["per_gpu"]["weights_bytes"] - reports["2 without"]["per_gpu"]["weights_bytes"] == 96 * 2
    assert any(f"{module}) under TP 2" in u for u in reports["2"]["unmeasured"])
    assert not any(module in u for u in reports["1"]["unmeasured"])
    # Their gradients are not all-reduced over TP (megatron-core's [d] q/k norms' are): the step's
    # traffic is that of the model without q/k norms.
    assert reports["2"]["communication_per_step"] == reports["2 without"]["communication_per_step"]


@pytest.mark.parametrize("family", list(KINDS))
def test_norm_weights_have_transformers_shapes(family):
    # Each layer's q_layernorm/k_layernorm weight: transformers' q_norm/k_norm numel and dim 0 (FSDP2 shards it).
    from megatron_flops.memory.decoder import chunk_parameters

    raw = _raw(family)
    params = chunk_parameters(ModelSpec.from_hf_config(raw), DecoderOptions.from_mapping(raw, hf=True), Parallelism(),
                              pp_rank=0, chunk=0, seq_length=SEQ)
    ours = [(p.numel, p.rows) for p in params if "q_layernorm" in p.name or "k_layernorm" in p.name]
    _, model = tiny_model(family, **test_hf_config.FAMILIES[family])
    theirs = [(w.numel(), w.shape[0] if w.dim() > 1 else None) for layer in model.model.layers
              for w in (layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)]
    assert ours == theirs


def test_stablelm_norm_weights_are_transformers_per_head_weights():
    # A [d] weight per head, named as transformers' ModuleList names them (1-D: FSDP2 shards each over d).
    from megatron_flops.memory.decoder import chunk_parameters

    raw = _raw(STABLELM)
    params = chunk_parameters(ModelSpec.from_hf_config(raw), DecoderOptions.from_mapping(raw, hf=True), Parallelism(),
                              pp_rank=0, chunk=0, seq_length=SEQ)
    ours = [(p.name.split("self_attention.")[1], p.numel, p.rows) for p in params if "_layernorm.norms." in p.name]
    _, model = tiny_model("stablelm", **test_hf_config.CASES[STABLELM][1])
    theirs = [(n, w.numel(), None) for layer in model.model.layers for part in ("q_layernorm", "k_layernorm")
              for n, w in getattr(layer.self_attn, part).named_parameters(prefix=part)]
    assert ours == theirs


def _hf_norms_in_megatron_core(model: Any, kind: str, heads: int, groups: int) -> None:
    """Put transformers' q/k norm modules in each megatron-core layer's q_layernorm/k_layernorm places
    (megatron-core hands them q and k as [s, b, heads or groups, head_dim])."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.stablelm.modeling_stablelm import StableLmLayerNormPerHead

    class WholeProjection(Olmo2RMSNorm):
        def forward(self, x):  # over [s, b, n x head_dim], as olmo2 applies it to q_proj's output
            return super().forward(x.reshape(*x.shape[:-2], -1)).view(x.shape)

    class PerHead(StableLmLayerNormPerHead):
        def forward(self, x):  # [s, b, n, head_dim]: split by head as stablelm does on [b, n, s, head_dim]
            return super().forward(x.transpose(1, 2)).transpose(1, 2)

    modules = {PER_HEAD_WEIGHT: lambda n: CohereLayerNorm((n, D)), WHOLE_PROJECTION: lambda n: WholeProjection(n * D),
               PER_HEAD_LAYERNORM: lambda n: PerHead(D, n)}
    for layer in model.decoder.layers:
        attn = layer.self_attention
        for name, n in (("q_layernorm", heads), ("k_layernorm", groups)):
            setattr(attn, name, modules[kind](n))


MCORE_CASES = {
    "cohere, GQA": (PER_HEAD_WEIGHT, dict(num_query_groups=2)),
    "cohere, MHA, selective core_attn": (PER_HEAD_WEIGHT, dict(recompute_granularity="selective",
                                                               recompute_modules=["core_attn"])),
    "stablelm, GQA": (PER_HEAD_LAYERNORM, dict(num_query_groups=2)),
    "stablelm, MHA, selective core_attn": (PER_HEAD_LAYERNORM, dict(recompute_granularity="selective",
                                                                    recompute_modules=["core_attn"])),
    "olmo2, GQA": (WHOLE_PROJECTION, dict(num_query_groups=2)),
    "olmo2, MHA": (WHOLE_PROJECTION, {}),
}


@pytest.mark.parametrize("name", list(MCORE_CASES))
def test_in_megatron_cores_layer_the_norms_save_as_counted(mcore, name):
    # The report puts the norms where megatron-core's are: a real megatron-core GPT (local spec, fp32,
    # LayerNorms: torch's CPU kernel keeps fp32 statistics as CUDA's do) with transformers' modules
    # there saves what the report counts, per micro-batch and at the schedule's peak, and has its
    # parameters in order.
    from megatron_flops.flops.passes import RecomputeSpec
    from megatron_flops.memory.activations import in_flight, schedule_peak
    from megatron_flops.memory.decoder import chunk_parameters
    from test_memory_activations import BASE, MBS as MB, NUM_MB, SEQ as S, VOCAB
    from test_memory_hf_layers import _measure

    kind, extra = MCORE_CASES[name]
    fields = dict(BASE, add_bias_linear=False, qk_layernorm=True, **extra)
    torch.manual_seed(0)
    model = mcore.build_gpt(fields, vocab_size=VOCAB, max_seq_len=S)
    heads = fields["num_attention_heads"]
    _hf_norms_in_megatron_core(model, kind, heads, fields.get("num_query_groups", heads))
    model_file = dict(fields, vocab_size=VOCAB)
    spec = ModelSpec.from_mapping(model_file)
    options = DecoderOptions.from_mapping(dict(model_file, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope", hf_qk_norm=kind))
    assert [(p.name, p.numel) for p in chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0,
                                                        seq_length=S)] == \
        [(n, p.numel()) for n, p in model.named_parameters()]
    training = Training(seq_length=S, micro_batch_size=MB, num_microbatches=NUM_MB, params_dtype="fp32")
    act = chunk_activations(spec, options, Parallelism(), training, pp_rank=0, chunk=0,
                            recompute=RecomputeSpec.from_mapping(model_file))
    forward, peak = _measure(model)
    assert forward == [act.forward + act.shared] * NUM_MB
    assert peak == schedule_peak([act], in_flight(Parallelism(), NUM_MB, 0))[0]
