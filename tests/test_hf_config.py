"""Hugging Face config.json files are read as transformers' modeling code reads them: FLOPs that
FlopCounterMode measures on the transformers model equal the estimate, layer by layer placement
of MoE and sliding-window layers matches the instantiated model, and what the file does not say
is refused rather than guessed."""

from __future__ import annotations

import json

import pytest

from megatron_flops.cli import main
from megatron_flops.flops.formulas import estimate, parse_rows
from megatron_flops.model.spec import ModelOptions, ModelSpec

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

DENSE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100)
MLA = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, num_hidden_layers=3, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, num_key_value_heads=4)
# model_type -> config keywords: each family's distinctive keys, small enough to run on CPU.
FAMILIES = {
    "llama": dict(DENSE),
    "qwen3": dict(DENSE, head_dim=24, tie_word_embeddings=True),
    "qwen2_moe": dict(DENSE, num_hidden_layers=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2),
    "qwen3_moe": dict(DENSE, num_hidden_layers=3, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      mlp_only_layers=[0], head_dim=16),
    "mixtral": dict(DENSE, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(DENSE, **MLA, q_lora_rank=None),
    "deepseek_v3": dict(DENSE, **MLA, q_lora_rank=24, n_group=1, topk_group=1),
}


def _hf_model(model_type: str, **kw):
    config = transformers.AutoConfig.for_model(model_type, **kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # The per-expert loop runs torch.mm that FlopCounterMode sees (grouped kernels it may not).
    model.set_experts_implementation("eager")
    return config, model


def _measure(model, seqlens: list[int]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    total = 0
    for s in seqlens:
        ids = torch.randint(0, 100, (1, s))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids).logits.float().sum().backward()
        total += counter.get_total_flops()
    return total


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_transformers_model_flops_equal_estimate(model_type, tmp_path, capsys):
    config, model = _hf_model(model_type, **FAMILIES[model_type])
    seqlens = [12, 7]
    measured = _measure(model, seqlens)
    # The config.json as save_pretrained writes it, through the CLI.
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    assert main(["estimate", "--model", str(path), "--seqlens", json.dumps([seqlens]), "--attention", "full",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_flops"] == measured
    assert report["padded_vocab_size"] == 100  # the embedding as built: no padding


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
