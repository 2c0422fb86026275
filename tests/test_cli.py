"""The CLI's contract: every input ends in exit 0, or exit 2 with one line on stderr (no traceback),
with costs that do not grow with the layer count; and each documented convention and message."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from megatron_flops import __version__
from megatron_flops.cli import build_parser, main
from megatron_flops.flops.formulas import estimate, parse_rows
from megatron_flops.model.spec import ModelSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TC = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
          gated_linear_unit=True, activation_func="silu", vocab_size=100)
HF_LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=100)
MLM = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
       "--ffn-hidden-size 96 --swiglu --vocab-size 100 --seq-length 32 --micro-batch-size 1 --lr 3e-4")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _file(tmp_path: Path, data, name: str = "model.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _error(capsys, *argv: str) -> str:
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _json(capsys, *argv: str) -> dict:
    rc, out, err = _run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# ---- fuzz: mutated model files, rows and flags ----------------------------------------------

BASES = {
    "tc": TC,
    "tc moe window mtp": dict(TC, num_layers=4, num_moe_experts=4, moe_router_topk=2, moe_layer_freq="([0]+[1]*3)",
                              moe_shared_expert_intermediate_size=32, window_size=[8, 0], window_attn_skip_freq=2,
                              mtp_num_layers=1, recompute_granularity="selective", lora={"dim": 2}),
    "tc mla": dict(TC, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=16,
                   qk_pos_emb_head_dim=8, v_head_dim=16),
    "hybrid": dict(hidden_size=64, num_attention_heads=4, vocab_size=100, hybrid_override_pattern="M*-M"),
    "hf llama": HF_LLAMA,
    "hf qwen2_moe": dict(HF_LLAMA, model_type="qwen2_moe", num_hidden_layers=4, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                         decoder_sparse_step=2, mlp_only_layers=[0], use_sliding_window=True, sliding_window=8,
                         max_window_layers=3),
    "hf qwen3 window": dict(HF_LLAMA, model_type="qwen3", head_dim=16, use_sliding_window=True, sliding_window=8,
                            layer_types=["full_attention", "sliding_attention"]),
    "hf deepseek_v3": dict(HF_LLAMA, model_type="deepseek_v3", num_hidden_layers=3, moe_intermediate_size=32,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           num_nextn_predict_layers=1, moe_layer_freq=1),
    "hf vlm text": {"model_type": "qwen2_5_vl", "text_config": dict(HF_LLAMA, model_type="qwen2_5_vl_text")},
    "mlm dump": dict(num_layers=2, hidden_size=64, num_attention_heads=4, swiglu=True, group_query_attention=True,
                     num_query_groups=2, vocab_size=100, lr=3e-4, micro_batch_size=1, moe_layer_freq=1),
}
DEEP = json.loads("[" * 40 + "1" + "]" * 40)
VALUES = [None, True, False, 0, -1, 1, 2, 3, 7, 64, "2", "x", "", 2**63, 2**70, 10**6, 10**11, 1e11, 1.5,
          float("inf"), float("nan"), [], [0, 1], [1, 1, 1, 1], [[1]], {}, {"dim": "x"}, "([1]*3+[0])*2",
          "[1]*1000000000", "([1,0])*1000000000", "(" * 40 + "[1]" + ")" * 40, DEEP, "M*-E", "gelu", "swishy",
          ["full_attention"] * 2, ["sliding_attention", 3], [8, 0], [-1, 0], [8, 8], "qwen2", "gemma2", "a" * 5000]
KEYS = sorted({k for base in BASES.values() for k in base} | {
    "num_moe_experts", "moe_layer_freq", "window_size", "window_attn_skip_freq", "mtp_num_layers",
    "hybrid_override_pattern", "kv_channels", "padded_vocab_size", "make_vocab_size_divisible_by",
    "tensor_model_parallel_size", "layer_types", "max_window_layers", "first_k_dense_replace", "mlp_only_layers",
    "decoder_sparse_step", "sliding_window", "use_sliding_window", "head_dim", "text_config", "hidden_act",
    "num_local_experts", "tie_word_embeddings", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "recompute_modules", "lora", "group_query_attention", "swiglu", "num_experts", "untie_embeddings_and_output_weights",
})
ROWS = ["[8, [3, 5]]", "[[2, 3, 4], 9]", '[{"seqlens": 4, "pad_to": 8}]', '[{"seqlens": [4, 4], "pad_to": 12}]',
        "[16]", "[]", "{}", '{"seqlens": [4]}', "[0]", "[[]]", "[" * 60 + "]" * 60, '[{"seqlen": [4]}]',
        '[{"seqlens": [4, 4], "pad_to": 3}]', '[{"seqlens": 4, "padded_seqlens": 6, "pad_to": 8}]', "[1e3]",
        "[true]", "[99999999999999999999999999]", '"x"', "no-such-file", "[" + "1," * 3000 + "1]",
        '[{"seqlens": [2], "padded_seqlens": [1]}]', "[8", "[NaN]", '[{"seqlens": [2], "pad_to": "8"}]']
FLAGS = [[], ["--attention", "full"], ["--json"], ["--seq-length", "16"], ["--seq-length", "4"],
         ["--batch-size", "2"], ["--seq-length", "8", "--batch-size", "3"], ["--seq-length", "8k"], ["--frozen"],
         ["--lora-rank", "2"], ["--lora-rank", "2", "--lora-targets", "linear_qkv,bogus"], ["--frozen", "--lora-rank", "2"],
         ["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
         ["--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
         ["--recompute", "selective", "--recompute-modules", "mlp,moe"], ["--recompute-modules", "mlp"],
         ["--mtp-num-layers", "2"], ["--mtp-num-layers", "-1"], ["--pad-vocab-to-multiple", "64"],
         ["--pad-vocab-to-multiple", "0"], ["--hf-family", "llama"], ["--convention", "train_passes"],
         ["--kv-seqlens", "[3]"], ["--bogus"], ["--batch-size", str(2**40), "--seq-length", "8"]]


def _mutate(rng: random.Random, data: dict) -> dict:
    data = json.loads(json.dumps(data))
    target = data["text_config"] if isinstance(data.get("text_config"), dict) and rng.random() < 0.7 else data
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        op = rng.random()
        if op < 0.25 and target:
            del target[rng.choice(sorted(target))]
        elif op < 0.35 and target:
            key = rng.choice(sorted(target))
            cut = rng.randrange(len(key))
            target[key[:cut] + key[cut + 1:]] = target.pop(key)
        else:
            target[rng.choice(KEYS)] = rng.choice(VALUES)
    return data


def _mutate_command_line(rng: random.Random) -> str:
    tokens = MLM.split()
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(tokens))
        op = rng.random()
        if op < 0.3:
            del tokens[i]
        elif op < 0.6:
            tokens[i] = str(rng.choice(["$L", "8k", "-1", "0", "2" * 40, "'", "--num-layer", "--moe-layer-freq",
                                        "([1]*3)", "--window-size", "4,0", "--num-experts", "pretrain_gpt.py"]))
        else:
            tokens.insert(i, rng.choice(["--swiglu=1", "--recompute-modules", "--num-experts 2", "--no-such-flag",
                                         "--hybrid-override-pattern M*", "# comment", "\\\n"]))
    return " ".join(tokens)


def test_fuzzed_inputs_exit_0_or_2_with_one_line(tmp_path, capsys):
    rng = random.Random(20260611)
    outcomes = {0: 0, 2: 0}
    for case in range(1200):
        name = rng.choice(sorted(BASES))
        argv = ["estimate"]
        if name == "mlm dump" or rng.random() < 0.1:
            source = _file(tmp_path, _mutate(rng, BASES["mlm dump"]), "args.json") if name == "mlm dump" \
                else _mutate_command_line(rng)
            argv += ["--megatron-args", source]
        else:
            argv += ["--model", _file(tmp_path, _mutate(rng, BASES[name]), "m.yaml" if rng.random() < 0.1 else "m.json")]
        if rng.random() < 0.85:
            argv += ["--seqlens", rng.choice(ROWS[:5] if rng.random() < 0.5 else ROWS)]
        argv += rng.choice(FLAGS[:3] if rng.random() < 0.5 else FLAGS) + (rng.choice(FLAGS) if rng.random() < 0.2 else [])
        try:
            rc, out, err = _run(capsys, *argv)
        except BaseException as exc:  # noqa: BLE001 - the contract is that nothing escapes main()
            pytest.fail(f"case {case}: {argv!r} raised {exc!r}")
        assert rc in (0, 2), (case, argv, err)
        if rc == 2:
            assert err.count("\n") == 1 and err.startswith("megatron-flops") and "Traceback" not in err, (argv, err)
        else:
            assert out, argv
        outcomes[rc] += 1
    # Both outcomes are exercised (a fuzz that only ever fails would prove little).
    assert outcomes[0] > 100 and outcomes[2] > 400, outcomes


# ---- costs that do not grow with the layer count ---------------------------------------------


def _linear_in_layers(tmp_path, capsys, fields: dict, layers: int) -> None:
    # total(L) = total(1) + (L - 1) * (total(2) - total(1)): one layer's price, times L, exactly.
    def total(n: int) -> int:
        return _json(capsys, "estimate", "--model", _file(tmp_path, dict(fields, num_layers=n)),
                     "--seqlens", "[16, [5, 7]]")["total_flops"]

    one, two = total(1), total(2)
    assert total(layers) == one + (layers - 1) * (two - one)


@pytest.mark.parametrize("layers", [10**6, 2**63, 2**70])
def test_many_layers_are_priced_exactly(tmp_path, capsys, layers):
    _linear_in_layers(tmp_path, capsys, TC, layers)
    # Stored as one run: nothing in the spec (or the pricing) has one entry per layer.
    assert ModelSpec.from_mapping(dict(TC, num_layers=layers)).layer_runs == ((("attention", "mlp"), layers),)


def test_many_mtp_layers_and_periodic_layouts(tmp_path, capsys):
    # mtp 10^11 layers: the MTP terms scale linearly, exactly.
    def mtp(n: int) -> int:
        return _json(capsys, "estimate", "--model", _file(tmp_path, dict(TC, mtp_num_layers=n)),
                     "--seqlens", "[16]")["total_flops"]

    assert mtp(10**11) == mtp(0) + 10**11 * (mtp(1) - mtp(0))
    # A million layers alternating dense/MoE every 10^5: 20 runs, not 10^6 entries.
    spec = ModelSpec.from_mapping(dict(TC, num_layers=10**6, num_moe_experts=4, moe_layer_freq=10**5))
    assert len(spec.layer_runs) == 20 and spec.num_layers == 10**6
    # A layout changing kind every layer over a million layers is refused at once, not expanded.
    err = _error(capsys, "estimate", "--model", _file(tmp_path, dict(TC, num_layers=10**6, num_moe_experts=4,
                                                                    moe_layer_freq=2)), "--seqlens", "[8]")
    assert "changes layer kind more than 10,000 times" in err
    err = _error(capsys, "estimate", "--model", _file(tmp_path, dict(TC, num_layers=4, num_moe_experts=4,
                                                                    moe_layer_freq="([1,0])*1000000000000")),
                 "--seqlens", "[8]")
    assert "'moe_layer_freq'" in err


# ---- issue items: bad Hugging Face fields, each named ----------------------------------------

QWEN2_MOE = BASES["hf qwen2_moe"]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(moe_intermediate_size=None), "missing required key(s) 'moe_intermediate_size'"),
        (dict(decoder_sparse_step="2"), "'decoder_sparse_step' must be an integer, got '2'"),
        (dict(max_window_layers=None), "missing required key 'max_window_layers'"),
        (dict(mlp_only_layers="0"), "'mlp_only_layers' must be a list of layer indices"),
        (dict(mlp_only_layers=[9]), "'mlp_only_layers' must be a list of layer indices in [0, 4)"),
        (dict(sliding_window=float("inf")), "'sliding_window' must be an integer, got inf"),
        (dict(sliding_window=[8]), "'sliding_window' must be an integer, got [8]"),
        (dict(layer_types=3), "'layer_types' must be a list of 'full_attention' or 'sliding_attention'"),
        (dict(layer_types=["sliding_attention"]), "'layer_types' has 1 entries but num_hidden_layers=4"),
        (dict(num_experts_per_tok=True), "'num_experts_per_tok' must be an integer, got True"),
        (dict(hidden_act=7), "unknown hidden_act 7"),
    ],
)
def test_bad_hf_fields_exit_2_naming_the_hf_key(tmp_path, capsys, change, message):
    data = {k: v for k, v in {**QWEN2_MOE, **change}.items() if v is not None or k not in change}
    err = _error(capsys, "estimate", "--model", _file(tmp_path, data), "--seqlens", "[8]")
    assert message in err


def test_bad_deepseek_fields(tmp_path, capsys):
    base = BASES["hf deepseek_v3"]
    assert "'first_k_dense_replace' must be an integer" in _error(
        capsys, "estimate", "--model", _file(tmp_path, dict(base, first_k_dense_replace=[1])), "--seqlens", "[8]")
    assert "first_k_dense_replace=7 > num_hidden_layers=3" in _error(
        capsys, "estimate", "--model", _file(tmp_path, dict(base, first_k_dense_replace=7)), "--seqlens", "[8]")


def test_required_hf_fields_are_named_with_typo_hints(tmp_path, capsys):
    data = {k: v for k, v in HF_LLAMA.items() if k != "intermediate_size"}
    err = _error(capsys, "estimate", "--model", _file(tmp_path, data), "--seqlens", "[8]")
    # Before: priced silently with 4 x hidden (+9.4% on Llama-3-8B).
    assert "missing required key(s) 'intermediate_size'" in err
    data = {("num_hiden_layers" if k == "num_hidden_layers" else k): v for k, v in HF_LLAMA.items()}
    err = _error(capsys, "estimate", "--model", _file(tmp_path, data), "--seqlens", "[8]")
    assert "'num_hidden_layers' (the file has 'num_hiden_layers': a typo?)" in err


def test_unsupported_model_type_lists_families_and_can_be_overridden(tmp_path, capsys):
    path = _file(tmp_path, dict(HF_LLAMA, model_type="my_llama"))
    err = _error(capsys, "estimate", "--model", path, "--seqlens", "[8]")
    assert "model_type 'my_llama' is not supported (supported: apertus, arcee, cohere, deepseek_v2," in err
    assert "--hf-family" in err
    # A supported model_type built otherwise: its own rules price it, the override is refused.
    gemma2 = _file(tmp_path, dict(HF_LLAMA, model_type="gemma2", head_dim=32), "gemma2.json")
    assert "model_type 'gemma2' is supported" in _error(
        capsys, "estimate", "--model", gemma2, "--seqlens", "[8]", "--hf-family", "llama")
    llama = _json(capsys, "estimate", "--model", _file(tmp_path, HF_LLAMA, "llama.json"), "--seqlens", "[8]")
    assert _json(capsys, "estimate", "--model", path, "--seqlens", "[8]", "--hf-family", "llama") == llama
    assert "applies to a Hugging Face config.json" in _error(
        capsys, "estimate", "--model", _file(tmp_path, TC, "tc.json"), "--seqlens", "[8]", "--hf-family", "llama")


def test_invalid_yaml_is_one_line(tmp_path, capsys):
    pytest.importorskip("yaml")
    err = _error(capsys, "estimate", "--model", _file(tmp_path, "num_layers: [1, 2\nhidden_size: 4\n", "m.yaml"),
                 "--seqlens", "[8]")
    assert "m.yaml: invalid YAML at line" in err


def test_deeply_nested_inputs(tmp_path, capsys):
    assert "nested deeper than 32 levels" in _error(capsys, "estimate", "--model", _file(tmp_path, TC),
                                                    "--seqlens", "[" * 100000 + "]" * 100000)
    assert "nested deeper than 32 levels" in _error(capsys, "estimate", "--model",
                                                    _file(tmp_path, dict(TC, lora=DEEP)), "--seqlens", "[8]")


# ---- Megatron-LM args: a command line or a dump, with Megatron-LM's rules --------------------


def test_megatron_command_line_equals_the_model_file(capsys):
    # The README's example: the Llama-3-8B file and the Megatron-LM arguments it trains with.
    readme = ("--num-layers 32 \\\n    --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
              "--num-query-groups 8 \\\n    --ffn-hidden-size 14336 --swiglu --untie-embeddings-and-output-weights "
              "--vocab-size 128256 \\\n    --seq-length 32768 --micro-batch-size 1 --lr 3e-4")
    rows = str(EXAMPLES / "packed_sft_32k.json")
    from_file = _json(capsys, "estimate", "--model", str(EXAMPLES / "llama3_8b.json"), "--seqlens", rows,
                      "--seq-length", "32768")
    # The shell removes the backslash-newlines inside the double quotes.
    from_args = _json(capsys, "estimate", "--seqlens", rows, "--megatron-args", readme.replace("\\\n", ""))
    assert from_args == from_file
    assert (from_args["total_flops"], from_args["static_flops"]) == (6_084_464_895_590_400, 9_279_603_260_522_496)
    # A launch line as pasted, with its launcher, comments and line breaks.
    launch = ("torchrun --nproc-per-node 8 pretrain_gpt.py \\\n" + readme + " # the model\n"
              "    --normalization RMSNorm --position-embedding-type rope --bf16")
    assert _json(capsys, "estimate", "--seqlens", rows, "--megatron-args", launch) == from_file


def test_megatron_args_follow_megatron_lm_rules(tmp_path, capsys):
    # No --group-query-attention: MHA even though --num-query-groups defaults to 1 (was priced as MQA).
    # --swiglu with no --ffn-hidden-size: validate_args' int(4h * 2/3 / 64) * 64 = 1344 for h = 768... here
    # h = 96: int(4 * 96 * 2 / 3 / 64) * 64 = 256.
    spec_args = "--num-layers 2 --hidden-size 96 --num-attention-heads 4 --swiglu --vocab-size 100"
    report = _json(capsys, "estimate", "--megatron-args", spec_args, "--seqlens", "[8]")
    mha = ModelSpec.from_mapping(dict(num_layers=2, hidden_size=96, num_attention_heads=4, ffn_hidden_size=256,
                                      gated_linear_unit=True, activation_func="silu", vocab_size=100))
    assert report["total_flops"] == estimate(mha, parse_rows([8])).total
    # The same as an args dump (vars(args) as JSON, with keys megatron-flops does not read).
    dump = dict(num_layers=2, hidden_size=96, num_attention_heads=4, swiglu=True, vocab_size=100, lr=3e-4,
                micro_batch_size=1, num_query_groups=1, group_query_attention=False, ffn_hidden_size=256,
                params_dtype="torch.bfloat16")
    assert _json(capsys, "estimate", "--megatron-args", _file(tmp_path, dump, "args.json"),
                 "--seqlens", "[8]") == report
    # ... which --model refuses with the way out, rather than guessing TransformerConfig meanings.
    err = _error(capsys, "estimate", "--model", _file(tmp_path, dump, "dump.json"), "--seqlens", "[8]")
    assert "are Megatron-LM arguments, not TransformerConfig fields: read an args dump with --megatron-args" in err


@pytest.mark.parametrize(
    "line, message",
    [
        ("--num-layer 2", "unknown Megatron-LM argument '--num-layer' (did you mean --num-layers?) "
                          "(not in core_v0.14.0, core_v0.16.1, core_v0.19.0)"),
        ("--num-layers $L", "--num-layers expects an integer, got '$L' (expand shell variables first)"),
        ("--num-layers 2 --hidden-size 64 --num-attention-heads 4",
         "the vocabulary size is unknown: give '--vocab-size'"),
        ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 100 --num-experts 4 --moe-router-topk 8",
         "--moe-router-topk=8 > --num-experts=4"),
        ("--num-layers 'two", "cannot split the command line"),
        ("--num-layers 2 --swiglu=1", "--swiglu takes no value"),
    ],
)
def test_megatron_command_line_errors(capsys, line, message):
    assert message in _error(capsys, "estimate", "--megatron-args", line, "--seqlens", "[8]")


@pytest.mark.parametrize("version", ["0.14.0", "0.16.1", "0.19.0"])
def test_megatron_command_lines_of_each_release(version, capsys):
    # The command lines the framework tests train with on each release (core_v0.19.0's packed one
    # has --dataloader-inter-document-masking, one of its 193 options that core_v0.16.1 lacks): the
    # same model whichever release reads them. 4 layers, h 64, GELU MLP 256, vocabulary 4095 padded
    # to 4096, one 64-token row: 64 x 2,752,512 per token + 6 x 4 x 64 x 64^2 / 2 x 2 (causal core).
    from frameworks import megatron_lm as mlm

    line = " ".join(mlm.script_args(mlm.SCENARIOS["packed-mbs2-eval"], version))
    expected = 64 * mlm.per_token_flops() + mlm.attention_flops(64 * 64)
    assert expected == 64 * 2_752_512 + 6 * 4 * 64 * 4096 == 182_452_224
    for release in ([] if version == "0.14.0" else ["--megatron-release", f"core_v{version}"], []):
        report = _json(capsys, "estimate", "--megatron-args", line, *release, "--seqlens", "[64]")
        assert report["total_flops"] == expected


@pytest.mark.parametrize("options, release, message", [
    ("--dataloader-inter-document-masking", "core_v0.16.1",
     "'--dataloader-inter-document-masking' is not a Megatron-LM core_v0.16.1 argument (it is one of core_v0.19.0)"),
    ("--retro-add-retriever", "0.19.0",
     "'--retro-add-retriever' is not a Megatron-LM core_v0.19.0 argument (it is one of core_v0.14.0)"),
    ("--retro-add-retriever --dataloader-inter-document-masking", None,
     "no one Megatron-LM release has all these options"),
    ("--num-layer 2", "core_v0.19.0",
     "unknown Megatron-LM argument '--num-layer' (did you mean --num-layers?) (not in core_v0.19.0)"),
    ("", "core_v0.20.0", "Megatron-LM release 'core_v0.20.0' is not one of core_v0.14.0, core_v0.16.1, core_v0.19.0"),
])
def test_megatron_release_chooses_the_options(options, release, message, capsys):
    line = f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 100 {options}"
    chosen = [] if release is None else ["--megatron-release", release]
    assert message in _error(capsys, "estimate", "--megatron-args", line, *chosen, "--seqlens", "[8]")


def test_megatron_release_number_of_values(capsys):
    # --rampup-batch-size takes 3 values from core_v0.16.1 on, one or more on core_v0.14.0.
    line = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 100 --rampup-batch-size 4 4"
    for release in ([], ["--megatron-release", "core_v0.19.0"]):
        err = _error(capsys, "estimate", "--megatron-args", line, *release, "--seqlens", "[8]")
        assert "--rampup-batch-size expects 3 value(s)" in err
    assert _json(capsys, "estimate", "--megatron-args", line, "--megatron-release", "core_v0.14.0", "--seqlens", "[8]")
    assert "applies to --megatron-args" in _error(capsys, "estimate", "--model", str(EXAMPLES / "llama3_8b.json"),
                                                  "--megatron-release", "core_v0.19.0", "--seqlens", "[8]")


def test_megatron_dumps_of_core_v0_19(tmp_path, capsys):
    # Three dests new in core_v0.19.0 are near-misses of names we read; they are its arguments, not typos.
    dump = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, pad_vocab_size=True,
                mtp_hybrid_override_pattern=None, moe_shared_expert_glu_interleave_size=None)
    base = _json(capsys, "estimate", "--megatron-args", _file(tmp_path, dict(num_layers=2, hidden_size=64,
                 num_attention_heads=4, vocab_size=100), "a.json"), "--seqlens", "[8]")
    assert _json(capsys, "estimate", "--megatron-args", _file(tmp_path, dump, "b.json"), "--seqlens", "[8]") == base
    err = _error(capsys, "estimate", "--megatron-args", _file(tmp_path, dict(dump, paded_vocab_size=128), "c.json"),
                 "--seqlens", "[8]")
    assert "unknown Megatron-LM argument 'paded_vocab_size' (did you mean 'padded_vocab_size'?)" in err


def test_megatron_dump_typos_are_sensible(tmp_path, capsys):
    dump = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, lr=3e-4, micro_batch_size=1)
    assert _json(capsys, "estimate", "--megatron-args", _file(tmp_path, dump, "a.json"), "--seqlens", "[8]")
    err = _error(capsys, "estimate", "--megatron-args", _file(tmp_path, dict(dump, num_layer=3), "b.json"),
                 "--seqlens", "[8]")
    assert "unknown Megatron-LM argument 'num_layer' (did you mean 'num_layers'?)" in err


# ---- conventions: vocabulary padding, MTP, pad_to, --seq-length -----------------------------


def test_hf_vocab_is_not_padded_unless_asked(tmp_path, capsys):
    path = _file(tmp_path, HF_LLAMA)
    assert _json(capsys, "estimate", "--model", path, "--seqlens", "[8]")["padded_vocab_size"] == 100
    padded = _file(tmp_path, dict(HF_LLAMA, make_vocab_size_divisible_by=128), "padded.json")
    assert _json(capsys, "estimate", "--model", padded, "--seqlens", "[8]")["padded_vocab_size"] == 128
    assert _json(capsys, "estimate", "--model", path, "--seqlens", "[8]",
                 "--pad-vocab-to-multiple", "64")["padded_vocab_size"] == 128
    # megatron-core files keep Megatron-LM's default (128 x TP); the flag overrides it.
    tc = _file(tmp_path, TC, "tc.json")
    assert _json(capsys, "estimate", "--model", tc, "--seqlens", "[8]")["padded_vocab_size"] == 128
    assert _json(capsys, "estimate", "--model", tc, "--seqlens", "[8]",
                 "--pad-vocab-to-multiple", "1")["padded_vocab_size"] == 100


def test_deepseek_mtp_note_and_flag(capsys):
    path = str(EXAMPLES / "deepseek_v3_hf_config.json")
    rc, out, err = _run(capsys, "estimate", "--model", path, "--seqlens", "[4096]", "--json")
    assert rc == 0 and err.startswith("megatron-flops: note: num_nextn_predict_layers=1 (multi-token prediction) "
                                      "is not counted")
    plain = json.loads(out)
    assert plain["notes"] and not any(k.startswith("mtp/") for k in plain["components"])
    with_mtp = _json(capsys, "estimate", "--model", path, "--seqlens", "[4096]", "--mtp-num-layers", "1")
    assert "notes" not in with_mtp and with_mtp["total_flops"] > plain["total_flops"]
    # Counting MTP adds only the mtp/ terms.
    assert {k: v for k, v in with_mtp["components"].items() if not k.startswith("mtp/")} == plain["components"]


def test_seq_length_with_seqlens_prices_each_row_at_n(tmp_path, capsys):
    path = _file(tmp_path, TC)
    report = _json(capsys, "estimate", "--model", path, "--seqlens", "[1000, [600, 400], 2000]",
                   "--seq-length", "4096")
    spec = ModelSpec.from_mapping(TC)
    # Static: 3 rows, each one 4096-token sequence, as the stock formula with --seq-length 4096.
    assert report["static_flops"] == estimate(spec, parse_rows([4096] * 3)).total
    assert report["static_seq_length"] == 4096
    assert report["total_flops"] == estimate(spec, parse_rows([1000, [600, 400], 2000])).total
    # Without it, the longest row (2000) is the static length.
    assert _json(capsys, "estimate", "--model", path, "--seqlens", "[1000, 2000]")["static_seq_length"] == 2000
    assert "rows[1] holds 2,000 tokens, more than --seq-length 1,024" in _error(
        capsys, "estimate", "--model", path, "--seqlens", "[1000, 2000]", "--seq-length", "1024")
    assert "--batch-size goes with --seq-length alone" in _error(
        capsys, "estimate", "--model", path, "--seqlens", "[8]", "--batch-size", "2")


def test_pad_to_semantics(tmp_path, capsys):
    # An unpacked sequence (an int) padded to 8192 is one row of a padded batch: attention runs over
    # the padded 8192^2 square. A packed row (a list) keeps attention within its sub-sequences: a THD
    # kernel never attends the tail past cu_seqlens_padded[-1]; only the linear layers run over it.
    spec = ModelSpec.from_mapping(TC)
    path = _file(tmp_path, TC)

    def executed(rows: str) -> dict:
        return _json(capsys, "estimate", "--model", path, "--seqlens", rows)

    unpacked = executed('[{"seqlens": 3000, "pad_to": 8192}]')
    assert unpacked["executed_components"] == estimate(spec, parse_rows([8192]), include_padding=True).components
    packed = executed('[{"seqlens": [3000, 1000], "pad_to": 8192}]')
    core = estimate(spec, parse_rows([[3000, 1000]])).components["attn/core"]
    assert packed["executed_components"]["attn/core"] == core  # 3000^2 + 1000^2 pairs, not 8192^2
    assert packed["executed_components"]["mlp"] == estimate(spec, parse_rows([8192])).components["mlp"]
    # A packer that folds the tail into the last sub-sequence says so with padded_seqlens.
    folded = executed('[{"seqlens": [3000, 1000], "padded_seqlens": [3000, 5192]}]')
    assert folded["executed_components"]["attn/core"] == estimate(spec, parse_rows([[3000, 5192]])).components[
        "attn/core"]
    # A one-element list is a packed row too; model FLOPs never see padding.
    one = executed('[{"seqlens": [3000], "pad_to": 8192}]')
    assert one["executed_components"]["attn/core"] == estimate(spec, parse_rows([3000])).components["attn/core"]
    assert one["total_flops"] == unpacked["total_flops"] == estimate(spec, parse_rows([3000])).total


# ---- help and messages -----------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_has_no_rst_and_covers_every_option(capsys):
    parser = build_parser()
    parsers = {"": parser, **_subparsers(parser)}
    for name, sub in parsers.items():
        assert "``" not in sub.format_help() and "``" not in (sub.description or ""), name
        for action in sub._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.help, f"{name} {action.option_strings} has no help"
    seqlens = next(a for a in parsers["estimate"]._actions if "--seqlens" in a.option_strings)
    assert all(k in seqlens.help for k in ('"seqlens"', '"padded_seqlens"', '"pad_to"'))
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"megatron-flops {__version__}"


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["--seq-length", "8k"], "argument --seq-length: invalid int value: '8k'"),
        (["--seqlens", '{"seqlens": [4]}'], "expected a list of rows, got a mapping (one row: wrap it in a list"),
        (["--seqlens", '[8, {"seqlen": [4]}]'], "--seqlens: rows[1]: unknown key 'seqlen' (did you mean 'seqlens'?)"),
        (["--grid-thw", "[[1, 2, 2]]"], "--grid-thw prices a vision tower, but model.json has no 'vision_config'"),
    ],
)
def test_messages(tmp_path, capsys, argv_tail, message):
    assert message in _error(capsys, "estimate", "--model", _file(tmp_path, TC), *argv_tail)


def test_seqlens_file_holding_an_object(tmp_path, capsys):
    rows = _file(tmp_path, {"rows": [8]}, "rows.json")
    assert "--seqlens: expected a list of rows, got a mapping" in _error(
        capsys, "estimate", "--model", _file(tmp_path, TC), "--seqlens", rows)


def test_moe_layer_freq_without_experts_is_an_error(tmp_path, capsys):
    err = _error(capsys, "estimate", "--model", _file(tmp_path, dict(TC, moe_layer_freq=2)), "--seqlens", "[8]")
    assert "'moe_layer_freq' places MoE layers but 'num_moe_experts' is not set" in err
    # The TransformerConfig default (1) on a dense model is fine.
    assert _json(capsys, "estimate", "--model", _file(tmp_path, dict(TC, moe_layer_freq=1)), "--seqlens", "[8]")


def test_yaml_is_mentioned_with_the_extra(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "yaml", None)
    err = _error(capsys, "estimate", "--model", _file(tmp_path, "num_layers: 2\n", "m.yaml"), "--seqlens", "[8]")
    assert "pip install 'megatron-flops[yaml]'" in err


def test_seq_length_alone_is_one_row_and_text_shows_the_priced_vocabulary(tmp_path, capsys):
    path = _file(tmp_path, TC)  # vocab_size 100, padded to 128 (make_vocab_size_divisible_by 128)
    one = _json(capsys, "estimate", "--model", path, "--seq-length", "8")
    assert one == _json(capsys, "estimate", "--model", path, "--seq-length", "8", "--batch-size", "1")
    assert one["num_rows"] == 1 and one["vocab_size"] == 100 and one["padded_vocab_size"] == 128
    assert main(["estimate", "--model", path, "--seq-length", "8"]) == 0
    assert "vocabulary as priced: 128 (padded from 100)\n" in capsys.readouterr().out
