"""Model descriptions from every source, and the bad-input contract of the spec and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from megatron_flops.cli import main
from megatron_flops.flops.formulas import parse_rows
from megatron_flops.model.spec import ModelOptions, ModelSpec, load_model_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128)


def test_vocab_padding_uses_divisor_times_tp():
    # 50257 padded to a multiple of 128 * 2 = 256: 197 * 256 = 50432.
    spec = ModelSpec.from_mapping(dict(BASE, vocab_size=50257, tensor_model_parallel_size=2))
    assert spec.padded_vocab_size == 50432
    assert ModelSpec.from_mapping(dict(BASE, vocab_size=50257, make_vocab_size_divisible_by=1)).padded_vocab_size == 50257


def test_moe_layer_freq_int_and_list():
    # int freq 2 over 4 layers: layers 0 and 2 are MoE (i % 2 == 0), as megatron-core reads it.
    spec = ModelSpec.from_mapping(dict(BASE, num_layers=4, num_moe_experts=4, moe_layer_freq=2))
    assert [f for _, f in spec.layers] == ["moe", "mlp", "moe", "mlp"]
    spec = ModelSpec.from_mapping(dict(BASE, num_layers=3, num_moe_experts=4, moe_layer_freq=[0, 1, 1]))
    assert [f for _, f in spec.layers] == ["mlp", "moe", "moe"]
    assert spec.moe.router_topk == 2 and spec.moe.ffn_hidden_size == 256


def test_moe_layer_freq_megatron_lm_string():
    # Megatron-LM's --moe-layer-freq "([0]*1+[1]*3)": first layer dense, then MoE.
    spec = ModelSpec.from_mapping(dict(BASE, num_layers=4, num_moe_experts=4, moe_layer_freq="([0]*1+[1]*3)"))
    assert [f for _, f in spec.layers] == ["mlp", "moe", "moe", "moe"]
    with pytest.raises(ValueError, match="not a sum of"):
        ModelSpec.from_mapping(dict(BASE, num_moe_experts=4, moe_layer_freq="__import__('os')"))


def test_window_skip_freq_as_megatron_core():
    # window_attn_skip_freq=3: layers 3, 6 (1-based) keep full attention.
    spec = ModelSpec.from_mapping(dict(BASE, num_layers=6, window_size=[128, 0], window_attn_skip_freq=3))
    assert [m for m, _ in spec.layers] == ["window", "window", "attention"] * 2


def test_hybrid_pattern():
    spec = ModelSpec.from_mapping(dict(BASE, num_layers=4, hybrid_override_pattern="M*-M"))
    assert spec.layers == (("mamba", "none"), ("attention", "none"), ("none", "mlp"), ("mamba", "none"))
    # Megatron-LM's Mamba defaults: state 128, head dim 64, 8 groups, heads = 2h / 64.
    assert (spec.mamba.state_dim, spec.mamba.num_heads) == (128, 2)


def test_transformer_config_source():
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    import torch.nn.functional as F

    config = tc.TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
        gated_linear_unit=True, activation_func=F.silu, num_moe_experts=4, moe_router_topk=2,
        moe_layer_freq=[1, 0], tensor_model_parallel_size=1,
    )
    spec = ModelSpec.from_transformer_config(config, vocab_size=100)
    assert (spec.num_query_groups, spec.activation, spec.gated_linear_unit, spec.padded_vocab_size) == (2, "silu", True, 128)
    assert [f for _, f in spec.layers] == ["moe", "mlp"]


def test_megatron_lm_args_source():
    args = Namespace(
        num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        kv_channels=16, ffn_hidden_size=128, swiglu=True, num_experts=None, padded_vocab_size=256,
        vocab_size=None, untie_embeddings_and_output_weights=True, multi_latent_attention=False,
        q_lora_rank=None, kv_lora_rank=32, mtp_num_layers=None, moe_layer_freq=1,
    )
    spec = ModelSpec.from_megatron_args(args)
    assert (spec.num_query_groups, spec.gated_linear_unit, spec.padded_vocab_size, spec.tied_output) == (2, True, 256, False)
    assert spec.mla is None and spec.moe is None


HF = {
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=160, vocab_size=1000, hidden_act="silu"),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=160, vocab_size=1000,
                  tie_word_embeddings=True, use_sliding_window=False, sliding_window=4096),
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=160, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                      vocab_size=1000),
    "mixtral": dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=160, num_local_experts=8, num_experts_per_tok=2,
                    vocab_size=1000, sliding_window=None),
    "mistral window": dict(model_type="mistral", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=160, vocab_size=1000, sliding_window=4096),
}


def test_hf_families():
    llama = ModelSpec.from_hf_config(HF["llama"])
    # A Hugging Face vocab_size is the embedding as built: no Megatron padding by default.
    assert (llama.kv_channels, llama.gated_linear_unit, llama.padded_vocab_size, llama.tied_output) == (16, True, 1000, False)
    qwen3 = ModelSpec.from_hf_config(HF["qwen3"])
    assert (qwen3.kv_channels, qwen3.window_size, qwen3.tied_output) == (32, None, True)
    moe = ModelSpec.from_hf_config(HF["qwen3_moe"])
    assert [f for _, f in moe.layers] == ["mlp", "moe", "moe", "moe"]
    assert (moe.moe.num_experts, moe.moe.router_topk, moe.moe.ffn_hidden_size) == (8, 2, 32)
    mixtral = ModelSpec.from_hf_config(HF["mixtral"])
    assert (mixtral.moe.ffn_hidden_size, [f for _, f in mixtral.layers]) == (160, ["moe", "moe"])
    # HF's sliding_window counts the query itself: 4096 tokens = 4095 to the left.
    assert ModelSpec.from_hf_config(HF["mistral window"]).window_size == 4095


def test_deepseek_v3_example():
    spec, _ = load_model_file(EXAMPLES / "deepseek_v3_hf_config.json")
    assert [f for _, f in spec.layers[:4]] == ["mlp", "mlp", "mlp", "moe"] and spec.num_layers == 61
    # num_nextn_predict_layers is not counted unless asked for (transformers does not run it).
    assert spec.moe.shared_expert_ffn_hidden_size == 2048 and spec.mtp_num_layers == 0
    assert (spec.mla.q_lora_rank, spec.mla.kv_lora_rank, spec.mla.qk_pos_emb_head_dim) == (1536, 512, 64)
    spec, _ = load_model_file(EXAMPLES / "deepseek_v3_hf_config.json", options=ModelOptions(mtp_num_layers=1))
    assert (spec.mtp_num_layers, spec.mtp_ffn) == (1, "moe")


def test_yaml_model_file(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "m.yaml"
    f.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 128\nactivation_func: gelu\n")
    spec, _ = load_model_file(f)
    assert spec.ffn_hidden_size == 256


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(BASE, hiden_size=64), "'hiden_size' \\(did you mean 'hidden_size'\\?\\)"),
        (dict(BASE, activation_func="swishy"), "unknown activation_func 'swishy'"),
        (dict(BASE, num_attention_heads=5), "num_attention_heads=5 does not divide hidden_size=64"),
        (dict(BASE, num_moe_experts=4, moe_router_topk=5), "moe_router_topk=5 > num_moe_experts=4"),
        (dict(BASE, num_moe_experts=4, moe_layer_freq=[1, 0, 1]), "'moe_layer_freq' has 3 entries but the model has 2"),
        (dict(BASE, num_layers=0), "'num_layers' must be >= 1"),
        (dict(BASE, hidden_size="64"), "'hidden_size' must be an integer"),
        (dict(BASE, num_query_groups=3), "num_query_groups=3 does not divide"),
        (dict(BASE, window_size=[4, 4]), "only causal sliding windows"),
        (dict(BASE, hybrid_override_pattern="M*X-"), "may only use the symbols"),
    ],
)
def test_bad_model_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_mapping(fields)


def test_kv_channels_lifts_the_divisibility_rule():
    assert ModelSpec.from_mapping(dict(BASE, num_attention_heads=5, kv_channels=16)).kv_channels == 16


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "the list of rows is empty"),
        ([0], "rows\\[0\\]: length must be positive, got 0"),
        ([8, -3], "rows\\[1\\]: length must be positive"),
        ([8, []], "rows\\[1\\]: length is empty"),
        ([8, [4, 2.5]], "rows\\[1\\]: length must hold integers, got 2.5"),
        (["8"], "rows\\[0\\]: length must be an integer"),
        ([{"seqlens": [4], "pad_to": 3}], "rows\\[0\\]: pad_to=3 is shorter"),
        ([{"seqlens": [4, 4], "padded_seqlens": [4]}], "rows\\[0\\]: padded_seqlens must pair"),
        ([{"lens": [4]}], "rows\\[0\\]: unknown key 'lens'"),
        ([{"seqlen": [4]}], "unknown key 'seqlen' \\(did you mean 'seqlens'\\?\\)"),
        ({"seqlens": [4]}, "got a mapping \\(one row: wrap it in a list"),
    ],
)
def test_bad_rows(rows, message):
    with pytest.raises(ValueError, match=message):
        parse_rows(rows)


def _model_file(tmp_path, **extra) -> str:
    f = tmp_path / "model.json"
    f.write_text(json.dumps(dict(BASE, **extra)))
    return str(f)


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["--seqlens", "[8, 0]"], "--seqlens: rows[1]: length must be positive"),
        (["--seqlens", "[8, [3, 1.5]]"], "rows[1]"),
        (["--seqlens", "not-json-or-file"], "neither a JSON list nor a readable file"),
        (["--seq-length", "8"], "--batch-size"),
        (["--seq-length", "-8", "--batch-size", "1"], "must be positive"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, argv_tail, message):
    rc = main(["estimate", "--model", _model_file(tmp_path), *argv_tail])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_bad_model_file_exits_2(tmp_path, capsys):
    rc = main(["estimate", "--model", _model_file(tmp_path, nmu_layers=3), "--seq-length", "8", "--batch-size", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "'nmu_layers' (did you mean 'num_layers'?)" in err


def test_cli_human_output_and_json_agree(tmp_path):
    model = _model_file(tmp_path)
    cmd = [sys.executable, "-m", "megatron_flops", "estimate", "--model", model, "--seqlens", "[[5, 7], 12]"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    report = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True).stdout)
    assert f"{report['total_flops']:,}" in text and "attn/core" in text
    # Static: 2 rows priced as 12 tokens each, against real rows of 12 tokens with 5^2 + 7^2 pairs.
    assert report["static_seq_length"] == 12 and report["over_report_factor"] > 1


def test_cli_llama_example_with_packed_file():
    cmd = [sys.executable, "-m", "megatron_flops", "estimate", "--model", str(EXAMPLES / "llama3_8b.json"),
           "--seqlens", str(EXAMPLES / "packed_rows_8k.json"), "--json"]
    report = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert report["num_tokens"] == 8 * 8192 and report["num_sequences"] == 63
    assert report["static_flops"] > report["total_flops"]
