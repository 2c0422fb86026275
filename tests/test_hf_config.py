"""Hugging Face config.json files are read as transformers' modeling code reads them: FLOPs that
FlopCounterMode measures on the transformers model equal the estimate, layer by layer placement
of MoE and sliding-window layers matches the instantiated model, and what the file does not say
is refused rather than guessed."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import pytest

from hf_tiny import estimate_report, measured_flops, tiny_model
from megatron_flops.cli import main
from megatron_flops.flops.formulas import estimate, parse_rows
from megatron_flops.model.hf_config import HF_FAMILIES
from megatron_flops.model.spec import ModelOptions, ModelSpec

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

DENSE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100)
MLA = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, num_hidden_layers=3, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, num_key_value_heads=4)
# model_type -> config keywords: each family's distinctive keys, small enough to run on CPU.
FAMILIES = {
    "llama": dict(DENSE),
    "mistral": dict(DENSE, sliding_window=16),  # a window on every layer, longer than the rows
    "qwen2": dict(DENSE),
    "qwen3": dict(DENSE, head_dim=24, tie_word_embeddings=True),
    "qwen2_moe": dict(DENSE, num_hidden_layers=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2),
    "qwen3_moe": dict(DENSE, num_hidden_layers=3, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      mlp_only_layers=[0], head_dim=16),
    "mixtral": dict(DENSE, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(DENSE, **MLA, q_lora_rank=None),
    "deepseek_v3": dict(DENSE, **MLA, q_lora_rank=24, n_group=1, topk_group=1),
    # head_dim != hidden / heads; key/value heads and head_dim have fixed defaults (given).
    "gemma": dict(DENSE, head_dim=24),
    # Alternating sliding/global layers (default layer_types), windows longer than the rows, logit
    # soft-capping (elementwise: not counted, as FlopCounterMode does not count it).
    "gemma2": dict(DENSE, num_hidden_layers=3, head_dim=16, sliding_window=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(DENSE, num_hidden_layers=3, head_dim=16, sliding_window=16, sliding_window_pattern=2),
    # Fused qkv_proj / gate_up_proj, partial rotary, a window on every layer.
    "phi3": dict(DENSE, partial_rotary_factor=0.5, sliding_window=16, pad_token_id=0),
    "olmo2": dict(DENSE),
    "granite": dict(DENSE, embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.2,
                    attention_multiplier=0.1),
    "glm": dict(DENSE, head_dim=16, pad_token_id=0),
    "glm4": dict(DENSE, head_dim=24, pad_token_id=0),
    # A plain (non-gated) GELU MLP with biases.
    "starcoder2": dict(DENSE, use_bias=True),
    # Attention and MLP in parallel from one norm; q/k layer norms.
    "cohere": dict(DENSE, use_qk_norm=True),
    # A plain relu^2 MLP, partial rotary.
    "nemotron": dict(DENSE),
    # Fused query_key_value, multi-head, plain GELU MLP, parallel residual, partial rotary.
    "gpt_neox": dict(DENSE),
    # Multi-query attention (the default): one key/value head; ffn_hidden_size defaults to 4h.
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100),
    # Further families with the same layer kinds.
    "helium": dict(DENSE, head_dim=16),  # its o_proj assumes head_dim = hidden / heads
    "olmo": dict(DENSE),
    "olmo3": dict(DENSE, num_hidden_layers=4, sliding_window=16),  # layers 0-2 slide, 3 is global
    "seed_oss": dict(DENSE, head_dim=24),
    "hunyuan_v1_dense": dict(DENSE, head_dim=16, use_qk_norm=True),  # head_dim must be given
    "ernie4_5": dict(DENSE, head_dim=16),
    "stablelm": dict(DENSE, partial_rotary_factor=0.25, use_parallel_residual=True, use_qkv_bias=True),
    "arcee": dict(DENSE),  # a plain relu^2 MLP
    "apertus": dict(DENSE),  # a plain xIELU MLP
}
# Further variants of a family: (model_type, config keywords).
VARIANTS = {
    "falcon new decoder": ("falcon", dict(FAMILIES["falcon"], new_decoder_architecture=True, num_kv_heads=2,
                                          ffn_hidden_size=96)),
    "falcon MHA alibi serial": ("falcon", dict(FAMILIES["falcon"], multi_query=False, alibi=True, parallel_attn=False,
                                               bias=True)),
    "gpt_neox serial": ("gpt_neox", dict(DENSE, use_parallel_residual=False, rotary_pct=1.0)),
    # Biases on some linear layers only: q, k, v and o_proj without the MLP's; the MLP's without attention's.
    "llama attention_bias": ("llama", dict(DENSE, attention_bias=True)),
    "gpt_neox without attention_bias": ("gpt_neox", dict(DENSE, attention_bias=False)),
    # q/k LayerNorms, one per head, in a sequential layer.
    "stablelm qk_layernorm": ("stablelm", dict(DENSE, partial_rotary_factor=0.25, qk_layernorm=True)),
    "gemma3 layer_types": ("gemma3_text", dict(FAMILIES["gemma3_text"], layer_types=[
        "full_attention", "sliding_attention", "sliding_attention"])),
}


def _measure(model, seqlens: list[int]) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Falcon runs SDPA whatever the config says: its math backend is bmm that FlopCounterMode sees.
    with sdpa_kernel(SDPBackend.MATH):
        return measured_flops(model, seqlens)


CASES = {**{t: (t, kw) for t, kw in FAMILIES.items()}, **VARIANTS}
# Rows shorter than every window here: eager attention computes the full square on windowed layers
# too (test_alternating_and_every_layer_windows_follow_transformers checks which layers slide).
SEQLENS = [12, 7]


@functools.cache
def measured_and_estimated(case: str) -> tuple[int, int]:
    """FLOPs of ``CASES[case]`` over SEQLENS: measured on the transformers model, and ``estimate
    --attention full`` of the config.json as save_pretrained writes it, through the CLI."""
    model_type, kw = CASES[case]
    config, model = tiny_model(model_type, **kw)
    report = estimate_report(config, [SEQLENS])
    assert report["padded_vocab_size"] == 100  # the embedding as built: no padding
    return _measure(model, SEQLENS), report["total_flops"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_model_flops_equal_estimate(case):
    measured, estimated = measured_and_estimated(case)
    assert measured == estimated


# Families whose measurement is the estimate plus named closed forms (the chunked delta-rule
# recurrence and the padded short convolution of transformers' torch fallback; transformers' dense
# masked DSA core): each measured in its own test, and listed under the table in docs/conventions.md.
MEASURED_WITH_REMAINDERS = {
    "qwen3_next": "tests/test_linear_attention.py", "kimi_linear": "tests/test_linear_attention.py",
    "deepseek_v32": "tests/test_sparse_attention.py", "glm_moe_dsa": "tests/test_sparse_attention.py",
}


def test_every_supported_family_is_verified_and_the_docs_table_is_the_scripts_output():
    # Supported means measured here: every family the reader knows has a case, and the table in
    # docs/conventions.md is exactly what scripts/conformance_table.py prints for these cases.
    assert {model_type for model_type, _ in CASES.values()} | set(MEASURED_WITH_REMAINDERS) == set(HF_FAMILIES)
    conventions = (Path(__file__).resolve().parents[1] / "docs" / "conventions.md").read_text()
    for model_type, test in MEASURED_WITH_REMAINDERS.items():
        assert f"`{model_type}` ({test})" in conventions
    root = Path(__file__).resolve().parents[1]
    script = importlib.util.spec_from_file_location("conformance_table", root / "scripts" / "conformance_table.py")
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    lines = module.hf_table_lines({case: (CASES[case][0], *measured_and_estimated(case)) for case in sorted(CASES)})
    docs = (root / "docs" / "conventions.md").read_text().splitlines()
    start = docs.index(lines[0])
    assert docs[start:start + len(lines) + 1] == [*lines, ""]
    assert f"`{json.dumps(SEQLENS)}`" in "\n".join(docs)


@pytest.mark.parametrize(
    "model_type, kw",
    [
        ("qwen2_moe", dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])),
        ("qwen3_moe", dict(num_hidden_layers=5, decoder_sparse_step=1, mlp_only_layers=[0, 4])),
        ("deepseek_v2", dict(num_hidden_layers=5, first_k_dense_replace=2)),
        ("deepseek_v3", dict(num_hidden_layers=4, first_k_dense_replace=0)),
    ],
)
def test_moe_layer_placement_follows_transformers(model_type, kw):
    base = {**FAMILIES[model_type], **kw}
    config = transformers.AutoConfig.for_model(model_type, **base)
    model = transformers.AutoModelForCausalLM.from_config(config)
    hf_moe = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert [ffn == "moe" for _, ffn in spec.layers] == hf_moe
    assert any(hf_moe)


@pytest.mark.parametrize(
    "model_type, kw",
    [
        ("mistral", dict(sliding_window=5)),
        ("mixtral", dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2)),
        ("qwen2", dict(num_hidden_layers=5, use_sliding_window=True, sliding_window=5, max_window_layers=2)),
        ("qwen3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=5, max_window_layers=3,
                       head_dim=16)),
        ("qwen2_moe", dict(num_hidden_layers=5, use_sliding_window=True, sliding_window=5, max_window_layers=4,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                           num_experts_per_tok=2)),
        ("qwen3_moe", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5, moe_intermediate_size=32,
                           num_experts=4, num_experts_per_tok=2)),
    ],
)
def test_sliding_window_layers_follow_transformers(model_type, kw):
    config = transformers.AutoConfig.for_model(model_type, **{**DENSE, **kw})
    # Which layers slide, as the modeling code decides: per-layer layer_types where the family has
    # them, else every layer when config.sliding_window is set.
    layer_types = getattr(config, "layer_types", None) if model_type.startswith("qwen2") or model_type == "qwen3" \
        else None
    expected = ([t == "sliding_attention" for t in layer_types] if layer_types is not None
                else [config.sliding_window is not None] * config.num_hidden_layers)
    for raw in (config.to_dict(), {k: v for k, v in config.to_dict().items() if k != "layer_types"}):
        spec = ModelSpec.from_hf_config(raw)
        assert [mixer == "window" for mixer, _ in spec.layers] == expected
        # HF's window of W tokens includes the query: megatron's (W - 1, 0).
        assert spec.window_size == 4
    assert any(expected)


def test_deepseek_moe_layer_freq_is_refused_as_ambiguous():
    # transformers ignores moe_layer_freq (every layer from first_k_dense_replace on is MoE)...
    kw = dict(FAMILIES["deepseek_v2"], num_hidden_layers=4, first_k_dense_replace=1, moe_layer_freq=2)
    config = transformers.AutoConfig.for_model("deepseek_v2", **kw)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert [hasattr(layer.mlp, "experts") for layer in model.model.layers] == [False, True, True, True]
    # ...while DeepSeek's own modeling code places one every moe_layer_freq-th: refused, not guessed.
    with pytest.raises(ValueError, match="moe_layer_freq=2: transformers ignores it"):
        ModelSpec.from_hf_config(config.to_dict())
    assert ModelSpec.from_hf_config({**config.to_dict(), "moe_layer_freq": 1}).layers[1:] == (("attention", "moe"),) * 3


def test_deepseek_v3_mtp_is_counted_only_on_request():
    kw = dict(FAMILIES["deepseek_v3"], num_nextn_predict_layers=1)
    raw = transformers.AutoConfig.for_model("deepseek_v3", **kw).to_dict()
    plain = ModelSpec.from_hf_config(raw)
    with_mtp = ModelSpec.from_hf_config(raw, options=ModelOptions(mtp_num_layers=1))
    assert (plain.mtp_num_layers, with_mtp.mtp_num_layers, with_mtp.mtp_ffn) == (0, 1, "moe")
    rows = parse_rows([12])
    delta = estimate(with_mtp, rows).components
    assert {k for k in delta if k.startswith("mtp/")} and estimate(plain, rows).components.keys() < delta.keys()


@pytest.mark.parametrize(
    "model_type, kw",
    [
        ("gemma2", dict(FAMILIES["gemma2"], num_hidden_layers=5, sliding_window=5)),
        ("gemma3_text", dict(FAMILIES["gemma3_text"], num_hidden_layers=7, sliding_window=5, sliding_window_pattern=3)),
        ("gemma3_text", dict(FAMILIES["gemma3_text"], num_hidden_layers=3, sliding_window=5,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        ("phi3", dict(FAMILIES["phi3"], sliding_window=5)),
        ("starcoder2", dict(FAMILIES["starcoder2"], sliding_window=5)),
        ("olmo3", dict(FAMILIES["olmo3"], num_hidden_layers=6, sliding_window=5)),
    ],
)
def test_alternating_and_every_layer_windows_follow_transformers(model_type, kw):
    config = transformers.AutoConfig.for_model(model_type, **kw)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Gemma 2/3 keep each attention's window on the module; phi3 and starcoder2 window every layer.
    expected = [getattr(layer.self_attn, "sliding_window", config.sliding_window) is not None
                for layer in model.model.layers]
    raw = config.to_dict()
    for data in (raw, {k: v for k, v in raw.items() if k != "layer_types"} if "layer_types" not in kw else raw):
        spec = ModelSpec.from_hf_config(data)
        assert [mixer == "window" for mixer, _ in spec.layers] == expected
        assert spec.window_size == 4  # a window of 5 tokens including the query: megatron's (4, 0)
    assert any(expected)
    if model_type.startswith("gemma"):
        assert not all(expected)


def test_gemma3_vlm_prices_its_text_decoder():
    text = dict(FAMILIES["gemma3_text"])
    config = transformers.AutoConfig.for_model("gemma3", text_config=text).to_dict()
    direct = transformers.AutoConfig.for_model("gemma3_text", **text).to_dict()
    assert ModelSpec.from_hf_config(config["text_config"]) == ModelSpec.from_hf_config(direct)


def _cli_error(tmp_path, capsys, raw: dict, family: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert main(["estimate", "--model", str(path), "--seqlens", "[[12]]", "--hf-family", family]) == 2
    return capsys.readouterr().err


# The cases: each priced silently wrong with --hf-family before (nemotron as llama +15.2%,
# gpt_neox +16.0%, starcoder2 as mistral +18.2%, gemma2/3 -0.63%, qwen3_next as qwen3_moe -69.7%).
OVERRIDES = [
    ("nemotron", FAMILIES["nemotron"], "llama", "'hidden_act'=|hidden_act='relu2'|partial_rotary"),
    ("gpt_neox", FAMILIES["gpt_neox"], "llama", "'use_parallel_residual'|partial_rotary"),
    ("starcoder2", FAMILIES["starcoder2"], "mistral", "hidden_act='gelu_pytorch_tanh'"),
    ("gemma2", FAMILIES["gemma2"], "gemma", "'(layer_types|attn_logit_softcapping|final_logit_softcapping)'"),
    ("gemma3_text", FAMILIES["gemma3_text"], "mistral", "'(layer_types|hidden_activation|head_dim)'"),
    ("qwen3_next", dict(DENSE, head_dim=16), "qwen3_moe", "'(linear_[a-z_]+|layer_types|full_attention_interval)'"),
]


@pytest.mark.parametrize("model_type, kw, family, tell", OVERRIDES, ids=[o[0] for o in OVERRIDES])
def test_hf_family_override_refuses_another_architecture(model_type, kw, family, tell, tmp_path, capsys):
    raw = transformers.AutoConfig.for_model(model_type, **kw).to_dict()
    # Under its own (supported) model_type: the family's own rules price it, the override is refused.
    if model_type != "qwen3_next":
        err = _cli_error(tmp_path, capsys, raw, family)
        assert f"model_type {model_type!r} is supported" in err
    # Renamed to a model_type we do not know: the key that shows the other architecture is named.
    err = _cli_error(tmp_path, capsys, {**raw, "model_type": "my_" + model_type}, family)
    assert re.search(tell, err), err


def test_hf_family_override_prices_an_identical_architecture_exactly(tmp_path, capsys):
    # OLMo-2 builds llama's GEMMs: under another name, --hf-family llama prices it exactly.
    config, model = tiny_model("olmo2", **FAMILIES["olmo2"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config.to_dict(), "model_type": "my_olmo"}))
    argv = ["estimate", "--model", str(path), "--seqlens", "[[12, 7]]", "--attention", "full", "--json"]
    assert main(argv) == 2  # unknown model_type: named, with the supported list
    assert "'my_olmo' is not supported (supported: " in capsys.readouterr().err
    assert main([*argv, "--hf-family", "llama"]) == 0
    assert json.loads(capsys.readouterr().out)["total_flops"] == _measure(model, [12, 7])
