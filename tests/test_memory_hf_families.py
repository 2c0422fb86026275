"""``megatron-flops memory`` on Hugging Face config.json files: every family's parameters equal the
transformers model's ``named_parameters()`` (a tiny config each, tests/test_hf_config.py), or differ
by exactly what megatron-core's GPT layer cannot express, named in ``not_modelled`` (gemma2,
gemma3 and glm4's norms after the sublayers: as Megatron-Bridge's gemma2/gemma3 spec, exact); and ``memory``
reads a model with each of ``estimate``'s model-reading flags."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_flops.cli import main
from megatron_flops.memory.decoder import DecoderOptions

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

import test_hf_config  # noqa: E402  (the families' tiny configs)

CASES = test_hf_config.CASES
SEQ = 16
# transformers' parameters minus the report's, where megatron-core cannot express the layer. Tiny
# configs: L = 2 layers (falcon: 2), h = 64, head_dim d = 16, 4 heads, 2 key/value groups.
PARAMETER_DIFFERENCES: dict[str, int] = {
    # (None now: parallel attention and MLP, memory/hf_parallel.py; q/k norms per head or over the whole
    # projections, memory/hf_qk_norms.py.)
}
# Cases with a named difference: those above, and layers with the same parameters that save other tensors.
NAMED: set[str] = {*PARAMETER_DIFFERENCES}


def _config_file(tmp_path: Path, family: str, kw: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """The tiny config as save_pretrained writes it, ``extra`` keys replaced."""
    raw = json.loads(transformers.AutoConfig.for_model(family, **kw).to_json_string())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, **(extra or {})}))
    return path


def _memory(*argv: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameters_equal_transformers_or_the_difference_is_named(case, tmp_path):
    model_type, kw = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **kw)
    hf = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    report = _memory("--model", str(_config_file(tmp_path, model_type, kw)), "--seq-length", str(SEQ),
                     "--pad-vocab-to-multiple", "1")
    family = case.split()[0]
    assert hf - report["parameters"]["total"] == PARAMETER_DIFFERENCES.get(case, 0)
    named = [r for r in report["not_modelled"] if r.startswith(f"Hugging Face {family}: ")]
    assert bool(named) == (case in NAMED)


@pytest.mark.parametrize("model_type, kw, expected", [
    ("glm", dict(test_hf_config.FAMILIES["glm"]), dict(rotary_percent=0.5, add_qkv_bias=True)),
    ("stablelm", dict(test_hf_config.FAMILIES["stablelm"]),
     dict(rotary_percent=0.25, normalization="LayerNorm", add_qkv_bias=True, add_bias_linear=False)),
    ("gpt_neox", dict(test_hf_config.FAMILIES["gpt_neox"]),
     dict(rotary_percent=0.25, normalization="LayerNorm", add_bias_linear=True, position_embedding_type="rope")),
    ("nemotron", dict(test_hf_config.FAMILIES["nemotron"]), dict(rotary_percent=0.5, normalization="LayerNorm")),
    ("hunyuan_v1_dense", dict(test_hf_config.FAMILIES["hunyuan_v1_dense"]), dict(qk_layernorm=True)),
    ("cohere", dict(test_hf_config.FAMILIES["cohere"], use_qk_norm=False), dict(qk_layernorm=False)),
    ("falcon", dict(test_hf_config.FAMILIES["falcon"], alibi=True), dict(position_embedding_type="none")),
])
def test_options_carry_the_family_layers(model_type, kw, expected):
    raw = json.loads(transformers.AutoConfig.for_model(model_type, **kw).to_json_string())
    options = DecoderOptions.from_mapping(raw, hf=True)
    assert {k: getattr(options, k) for k in expected} == expected
    # A file written before transformers 5 (the fraction at the top level, or gpt_neox's rotary_pct)
    # and one without it (the family's default) read the same.
    rope = raw.pop("rope_parameters")
    for older in ({**raw, "partial_rotary_factor": rope.get("partial_rotary_factor")}, raw):
        older = {k: v for k, v in older.items() if v is not None}
        assert DecoderOptions.from_mapping(older, hf=True).rotary_percent == options.rotary_percent


def test_partial_rotary_saves_cos_and_sin_of_the_rotated_part_only(tmp_path):
    # glm rotates half of each head: RoPE's cos and sin [s, d/2] (two each, for q and for k; bf16: 2
    # bytes) against [s, d] read as llama: 4 x 16 x (16 - 8) x 2 = 1024 bytes less per layer, 2 layers.
    model_type, kw = CASES["glm"]
    reports = [_memory("--model", str(_config_file(tmp_path, model_type, kw, extra)), "--seq-length", str(SEQ),
                       "--attention-backend", "local")
               for extra in ({}, {"model_type": "llama", "architectures": None})]
    glm, llama = (r["per_gpu"]["activations_per_microbatch"][0]["attention"] for r in reports)
    assert llama - glm == 2 * 4 * SEQ * 8 * 2


def test_hf_family_reads_an_unknown_model_type_with_that_familys_layers(tmp_path):
    model_type, kw = CASES["stablelm"]
    known = _memory("--model", str(_config_file(tmp_path, model_type, kw)), "--seq-length", str(SEQ))
    unknown = _config_file(tmp_path, model_type, kw, dict(model_type="my_stablelm", architectures=None))
    with pytest.raises(AssertionError):  # unknown model_type: refused (exit 2)
        _memory("--model", str(unknown), "--seq-length", str(SEQ))
    assert _memory("--model", str(unknown), "--seq-length", str(SEQ), "--hf-family", "stablelm") == known


def test_pad_vocab_to_multiple(tmp_path):
    # vocab 100: 128 x TP by default (256 rows at TP 2), 100 with --pad-vocab-to-multiple 1; tied
    # embeddings are counted once: (256 - 100) x h = 156 x 64 parameters.
    model_type, kw = CASES["qwen3"]
    path = str(_config_file(tmp_path, model_type, kw))
    padded, exact = (_memory("--model", path, "--seq-length", str(SEQ), "--tp", "2", *flags)["parameters"]["total"]
                     for flags in ([], ["--pad-vocab-to-multiple", "1"]))
    assert padded - exact == 156 * 64


def test_mtp_num_layers_counts_deepseek_v3s_nextn_layer(tmp_path):
    model_type, kw = CASES["deepseek_v3"]
    path = str(_config_file(tmp_path, model_type, dict(kw, num_nextn_predict_layers=1)))
    plain, mtp = (_memory("--model", path, "--seq-length", str(SEQ), *flags)
                  for flags in ([], ["--mtp-num-layers", "1"]))
    # An MTP layer: enorm, hnorm, eh_proj [h, 2h], a MoE decoder layer and its final norm.
    assert mtp["parameters"]["total"] > plain["parameters"]["total"] + 2 * 64 * 64


MEGATRON_ARGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
                 "--max-position-embeddings 16 --vocab-size 100 --tensor-model-parallel-size 2 --sequence-parallel "
                 "--use-distributed-optimizer --bf16")
MCORE_FIELDS = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
                    bias_activation_fusion=True, attention_softmax_in_fp32=False)


def test_megatron_args_read_as_the_same_model_file(tmp_path):
    # The command line's model and layout (TP 2, sequence parallel, distributed optimizer, bf16) equal
    # the same model as megatron-core fields with those flags (Megatron-LM's defaults: LayerNorm,
    # biases, learned positions, dropout 0.1, fused bias-GELU, softmax in the activation dtype; its
    # valued options: tests/test_memory_megatron_args.py).
    path = tmp_path / "model.json"
    path.write_text(json.dumps(MCORE_FIELDS))
    from_args = _memory("--megatron-args", MEGATRON_ARGS, "--dp", "2")
    from_file = _memory("--model", str(path), "--seq-length", "16", "--tp", "2", "--sequence-parallel",
                        "--distributed-optimizer", "--params-dtype", "bf16", "--dp", "2")
    assert from_args == from_file
    # A flag given overrides the command line.
    assert _memory("--megatron-args", MEGATRON_ARGS, "--tp", "1")["assumptions"][3].startswith("1 GPUs (TP 1")


def test_megatron_release(tmp_path):
    assert _memory("--megatron-args", MEGATRON_ARGS, "--megatron-release", "core_v0.16.1")["parameters"] == \
        _memory("--megatron-args", MEGATRON_ARGS)["parameters"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["memory", "--megatron-args", MEGATRON_ARGS, "--megatron-release", "0.1"]) == 2
    assert "is not one of" in err.getvalue()
