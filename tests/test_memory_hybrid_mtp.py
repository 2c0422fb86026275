"""A hybrid pattern's MTP part after '/' (memory/mtp_layers.py): megatron-core 0.19's
``HybridModel`` builds each MTP depth as a ``MultiTokenPredictionLayer`` around a ``HybridStack``
of the part's layers (0.16.1's hybrid models have no MTP).

Measured: the real 0.19.0 ``HybridModel`` in its Python 3.12 venv (tests/frameworks/envs.py;
skipped where it cannot be made), from local layers in 2 gloo processes, run by
tests/hybrid_mtp_019.py: every parameter's name and size (Mamba layers too, built with a stand-in
for mamba_ssm's norm); for parts of attention and MLP layers (Mamba's kernels do not run on CPU)
every storage one forward saves for backward, the GEMM FLOPs of a forward and backward
(``FlopCounterMode``, against ``estimate``) and every ``tp/*`` payload, at TP 1 and TP 2 with and
without sequence parallelism. Formulas: exact integers with the derivation."""

from __future__ import annotations

import json
import re

import pytest

from megatron_flops.cli import main
from megatron_flops.flops.formulas import estimate, parse_rows
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.memory.activations import chunk_activations
from megatron_flops.memory.comm import step_communication
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.mla_mtp import mla_mtp_tensor_parallel
from megatron_flops.memory.mtp_layers import mtp_moe_layers
from megatron_flops.memory.recompute import selective_rerun_communication
from megatron_flops.memory.ssm import mamba_cp_all_to_all
from megatron_flops.model.spec import ModelSpec

SEQ, MBS, VOCAB = 16, 2, 128
# 4 heads of 16, ffn 128; Mamba: 8 heads of 16 (inner 128), 2 groups, state 16 (tests/test_memory_ssm.py's).
LAYER = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, mamba_state_dim=16, mamba_head_dim=16,
             mamba_num_groups=2, normalization="LayerNorm")
FIELDS = dict(LAYER, add_bias_linear=False, vocab_size=VOCAB, padded_vocab_size=VOCAB)
OPTIONS = DecoderOptions.from_mapping(dict(FIELDS, attention_backend="local", transformer_impl="local",
                                           position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0))
FP32 = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=1, params_dtype="fp32")


# Multi-latent attention ('+'): q and kv latents of 32, 4 heads of 16 + a RoPE part of 16.
MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16,
           v_head_dim=16)


def _spec(pattern: str, **fields) -> ModelSpec:
    return ModelSpec.from_mapping(dict(FIELDS, hybrid_override_pattern=pattern, **fields))


def _params(pattern: str, par: Parallelism = Parallelism(), **fields) -> list[tuple[str, int]]:
    return [(p.name, p.numel) for p in chunk_parameters(_spec(pattern, **fields), OPTIONS, par, pp_rank=0, chunk=0,
                                                        seq_length=SEQ)]


def _saved(pattern: str, par: Parallelism = Parallelism(), **fields) -> int:
    act = chunk_activations(_spec(pattern, **fields), OPTIONS, par, FP32, pp_rank=0, chunk=0)
    return act.forward + act.shared


def _tp_traffic(pattern: str, par: Parallelism, **fields) -> dict[str, int]:
    """Activation traffic of one micro-batch (no gradient buffers: no DP or gradient reductions)."""
    return step_communication(_spec(pattern, **fields), OPTIONS, par, FP32, pp_rank=0, buffers={})


def test_each_mtp_depth_lists_its_hybrid_layers():
    mtp = [(n, k) for n, k in _params("M*-M/*-") if n.startswith("mtp.") and not n.endswith(".bias")]
    p = "mtp.layers.0."
    layer = p + "mtp_model_layer.layers."
    assert mtp == [
        (p + "enorm.weight", 64), (p + "hnorm.weight", 64), (p + "eh_proj.weight", 64 * 128),  # [h, 2h]
        (layer + "0.input_layernorm.weight", 64), (layer + "0.self_attention.linear_proj.weight", 64 * 64),
        (layer + "0.self_attention.linear_qkv.weight", 3 * 64 * 64),  # [(4 + 2 x 4) x 16, h]
        (layer + "1.pre_mlp_layernorm.weight", 64), (layer + "1.mlp.linear_fc1.weight", 128 * 64),
        (layer + "1.mlp.linear_fc2.weight", 64 * 128), (p + "final_layernorm.weight", 64),
    ]
    # (Each LayerNorm's bias [64] after its weight.) One depth: 5 norms x 2 x 64 + eh_proj 8,192 +
    # attention 16,384 + MLP 16,384 = 41,600; the whole model: embedding 128 x 64 = 8,192, two
    # attention + MLP pairs 2 x 33,024 (with their norms), the final norm 128, the MTP depth: 115,968
    # (measured: 0.19's HybridModel, tied).
    assert sum(k for n, k in _params("*-*-/*-") if n.startswith("mtp.")) == 41_600
    assert sum(k for _, k in _params("*-*-/*-")) == 8_192 + 2 * 33_024 + 128 + 41_600 == 115_968
    # Two depths of two sub-layers each: mtp.layers.1's layers are numbered from 0 again.
    names = [n for n, _ in _params("*-/*-*-/*-*-")]
    assert "mtp.layers.1.mtp_model_layer.layers.3.mlp.linear_fc2.weight" in names


def test_saved_bytes_are_the_part_layers_plus_the_mtp_wrapper():
    # T = 32 tokens, h = 64, fp32. An MTP depth of "*-" saves what one more decoder pair "*-" saves,
    # and around it: the rolled ids 32 x 8 = 256; enorm, hnorm and the final norm, each its input
    # 8,192 and LayerNorm's fp32 mean and rstd 256; eh_proj's input [T, 2h] 16,384; the MTP loss
    # (fp32 softmax [T, V], bool target mask, int64 targets, the rolled fp32 loss mask and the
    # scaled per-token loss) 32 x (512 + 1 + 8) + 128 + 128 = 16,928; and one more [T, h] of the
    # output layer's (main + MTP) input, 8,192. Measured (0.19's HybridModel): 483,776.
    wrapper = 256 + 3 * (8_192 + 256) + 16_384 + 16_928 + 8_192
    assert _saved("*-*-/*-") == _saved("*-*-*-") + wrapper == 416_672 + 67_104 == 483_776
    # TP 2 (no SP): the vocab-parallel lookup's bool mask 32 more; the softmax [T, V/2] halves
    # (8,192 less); the layers' and norms' as a decoder pair's at TP 2. Measured: 332,288.
    assert _saved("*-*-/*-", Parallelism(tp=2)) == _saved("*-*-*-", Parallelism(tp=2)) + wrapper + 32 - 8_192


def test_tp_traffic_counts_each_sub_block_and_the_acceptance_gather():
    # T = 32, fp32: one [T, h] activation is 8,192 bytes. Without SP each sub-block all-reduces 2
    # (forward, backward); the embedding and the output layer's input gradient 1 each. Main "*-": 2
    # sub-blocks + 2 = 6; each MTP depth: embedding 1, eh_proj's input gradient 2, the part's 4
    # sub-blocks 8, its output-layer call 1 = 12; cross-entropy's 3 fp32 reductions [T] per loss
    # (main + 2 MTP) 3 x 384. eh_proj's output all-gathered (8,192 per depth), and 0.19's acceptance
    # count gathers the max logit (fp32) and its int64 index per token and depth from both ranks:
    # 2 x 2 x 32 x 12 = 1,536. Measured: the same.
    assert (6 + 2 * 12) * 8_192 + 3 * 384 == 246_912 and 2 * 8_192 + 1_536 == 17_920
    assert _tp_traffic("*-/*-*-/*-*-", Parallelism(tp=2)) == {"tp/all_reduce": 246_912, "tp/all_gather": 17_920}
    # With SP: a sub-block gathers 3 and reduce-scatters 2; the main part 3 + 3 (and the embedding's 1
    # gather, the output layer's 2) and 2 + 2 (the embedding's and the output layer's 1 each); an
    # MTP depth gathers 15 as a dense depth (tests/test_memory_mla_mtp.py) + 2 extra sub-blocks x 3,
    # reduce-scatters 8 + 2 x 2. Measured: the same.
    assert (9 + 2 * 21) * 8_192 + 1_536 == 419_328 and (6 + 2 * 12) * 8_192 == 245_760
    assert _tp_traffic("*-/*-*-/*-*-", Parallelism(tp=2, sequence_parallel=True)) == {
        "tp/all_gather": 419_328, "tp/reduce_scatter": 245_760, "tp/all_reduce": 3 * 384}


def test_flops_price_every_sub_layer_of_every_depth():
    parts = estimate(_spec("*-*-/*-*-/*-*-"), parse_rows([SEQ] * MBS)).components
    # 2 depths of 2 attention and 2 MLP layers: 4 of each, as many as the main part's 2 x 2.
    assert parts["mtp/attn/qkv"] == 2 * parts["attn/qkv"] and parts["mtp/mlp"] == 2 * parts["mlp"]
    mamba = estimate(_spec("M*-M/M-"), parse_rows([SEQ] * MBS)).components
    assert 2 * mamba["mtp/mamba/in_proj"] == mamba["mamba/in_proj"] and mamba["mtp/mlp"] == mamba["mlp"]


def test_moe_and_mamba_sub_layers_of_the_mtp_part():
    moe = _spec("M*EM/*E", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    assert mtp_moe_layers(moe, last=True) == 1 and mtp_moe_layers(moe, last=False) == 0
    names = [n for n, _ in _params("M*-M/M-")]
    assert "mtp.layers.0.mtp_model_layer.layers.0.mixer.in_proj.weight" in names


def test_cli_labels_the_hybrid_mtp_part(tmp_path, capsys):
    model = tmp_path / "hybrid_mtp.json"
    model.write_text(json.dumps(dict(FIELDS, hybrid_override_pattern="M*-M/M-")))
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--tp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["per_gpu"]["activations_bytes"] > 0 and not report["not_modelled"]
    assert any("a hybrid pattern's MTP part after '/' as megatron-core 0.19's HybridModel" in a
               for a in report["assumptions"])
    assert any("activations of Mamba layers" in u for u in report["unmeasured"])  # (the MTP part's Mamba layer)
    assert main(["memory", "--model", str(model), "--seq-length", "16", "--pp", "2", "--num-microbatches", "2"]) == 0
    assert "a hybrid MTP part under pipeline parallelism" in capsys.readouterr().out


def test_a_pattern_without_mtp_parts_builds_no_mtp():
    # megatron-core 0.19's HybridModel builds MTP depths from the parts after '/' only (Megatron-LM
    # warns "Hybrid model with --mtp-num-layers but no MTP pattern" and trains none); 0.16.1's
    # MambaModel has no MTP. So mtp_num_layers=2 beside "*-*-" is "*-*-": no MTP parameters, saved
    # tensors, FLOPs or traffic (measured: 0.19's HybridModel with mtp_num_layers=1).
    assert _spec("*-*-", mtp_num_layers=2).mtp_num_layers == 0
    assert _params("*-*-", mtp_num_layers=2) == _params("*-*-")
    assert sum(k for _, k in _params("*-*-", mtp_num_layers=2)) == 8_192 + 2 * 33_024 + 128 == 74_368
    assert _saved("*-*-", mtp_num_layers=2) == _saved("*-*-")
    parts = estimate(_spec("*-*-", mtp_num_layers=2), parse_rows([SEQ] * MBS)).components
    assert parts == estimate(_spec("*-*-"), parse_rows([SEQ] * MBS)).components and "mtp/logits" not in parts
    # TP 2: 2 layers x 2 sub-blocks x 2 all-reduces + the embedding's + the output layer's = 10 x
    # [T, h] (8,192 bytes), cross-entropy's 3 fp32 [T] reductions 384; no acceptance gather.
    assert 10 * 8_192 + 384 == 82_304
    assert _tp_traffic("*-*-", Parallelism(tp=2), mtp_num_layers=2) == {"tp/all_reduce": 82_304}


def test_estimate_notes_an_mtp_count_a_hybrid_pattern_without_slash_ignores(tmp_path, capsys):
    model = tmp_path / "hybrid.json"
    model.write_text(json.dumps(dict(FIELDS, hybrid_override_pattern="*-*-", mtp_num_layers=2)))
    assert main(["estimate", "--model", str(model), "--seq-length", "16", "--batch-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [n for n in report["notes"] if n.startswith("mtp_num_layers=2 is not counted")]
    assert not [k for k in report["components"] if k.startswith("mtp/")]
    model.write_text(json.dumps(dict(FIELDS, hybrid_override_pattern="*-*-/*-")))  # (an MTP part: no note)
    assert main(["estimate", "--model", str(model), "--seq-length", "16", "--batch-size", "2", "--json"]) == 0
    assert "notes" not in json.loads(capsys.readouterr().out)


def test_legacy_mtp_pattern_option_becomes_the_parts_after_slash():
    # Megatron-LM 0.19's validate_args: --mtp-hybrid-override-pattern P with --mtp-num-layers N beside
    # a pattern without '/' is the unified pattern's N parts "/P"; without it, no MTP (above).
    from megatron_flops.model.megatron_args import load_megatron_args, model_spec

    line = ("--hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --vocab-size 128 --mamba-state-dim 16 "
            "--mamba-head-dim 16 --mamba-num-groups 2 --hybrid-layer-pattern M*-M --mtp-num-layers 2")
    legacy = model_spec(*load_megatron_args(line + " --mtp-hybrid-override-pattern '*-'"))
    unified = model_spec(*load_megatron_args(line.replace("M*-M", "M*-M/*-/*-")))
    assert legacy == unified and legacy.mtp_num_layers == 2
    assert model_spec(*load_megatron_args(line)).mtp_num_layers == 0


def test_hybrid_mla_layers_under_tp_count_the_attention_layers_only():
    # "+-+-" with MLA at TP 2: the latent collectives of its 2 MLA layers, not of 4 (its MLP layers
    # have none). T = 32, fp32. Without SP: the dense part 10 x 8,192 + 384 (as "*-*-"); per MLA
    # layer the q and kv latents all-gathered T x (32 + 32 + 16) x 4 = 10,240, and the second down
    # projection's and the up projections' input gradients all-reduced T x (64 + 32 + 32) x 4 =
    # 16,384 (as 2 GPT MLA layers, tests/test_memory_mla_mtp.py). Measured: the same.
    assert 82_304 + 2 * 16_384 == 115_072 and 32 * (32 + 32 + 16) * 4 == 10_240 and 32 * 128 * 4 == 16_384
    assert _tp_traffic("+-+-", Parallelism(tp=2), **MLA) == {"tp/all_reduce": 115_072, "tp/all_gather": 20_480}
    # With SP: the dense part gathers 15 and reduce-scatters 10 x 8,192; per MLA layer forward
    # T x (64 + 32 + 48 + 32 + 32) and backward T x (64 + 32 + 32 + 32 + 32) gathered (51,200 bytes),
    # T x (64 + 32 + 32) reduce-scattered (16,384). Measured: the same.
    assert 32 * (208 + 192) * 4 == 51_200 and 15 * 8_192 + 2 * 51_200 == 225_280
    assert 10 * 8_192 + 2 * 16_384 == 114_688
    assert _tp_traffic("+-+-", Parallelism(tp=2, sequence_parallel=True), **MLA) == {
        "tp/all_gather": 225_280, "tp/reduce_scatter": 114_688, "tp/all_reduce": 384}
    # An MTP part "+-" (one depth): all-reduced, the main "+-" 6 x 8,192, the depth 8 x 8,192 (the
    # embedding 1, eh_proj's input gradient 2, its 2 sub-blocks 4, its output-layer call 1), each
    # of the 2 MLA layers 16,384 and 2 losses' 384; gathered, the 2 MLA layers' latents, eh_proj's
    # output 8,192 and the acceptance count 2 ranks x 32 x (4 + 8) = 768. Measured: the same.
    assert (6 + 8) * 8_192 + 2 * 16_384 + 2 * 384 == 148_224 and 2 * 10_240 + 8_192 + 768 == 29_440
    assert _tp_traffic("+-/+-", Parallelism(tp=2), **MLA) == {"tp/all_reduce": 148_224, "tp/all_gather": 29_440}


def test_a_gpt_mtp_layer_names_the_release_its_tp_traffic_follows():
    # A GPT's MTP layers follow megatron-core 0.16.1 (no acceptance counts, measured there); 0.19's
    # gather of them under TP is named in the assumptions, not counted. A hybrid MTP part counts it.
    from megatron_flops.memory.mla_mtp import mla_mtp_assumptions

    gpt = ModelSpec.from_mapping(dict(FIELDS, num_layers=2, mtp_num_layers=1))
    note = [a for a in mla_mtp_assumptions(gpt, Parallelism(tp=2), duplicated=False) if "acceptance" in a]
    assert len(note) == 1 and "megatron-core 0.16.1's GPTModel" in note[0] and "not counted" in note[0]
    assert not [a for a in mla_mtp_assumptions(gpt, Parallelism(), duplicated=False) if "acceptance" in a]
    assert not [a for a in mla_mtp_assumptions(_spec("*-/*-"), Parallelism(tp=2), duplicated=False)
                if "acceptance" in a]
    # (gathered: eh_proj's output [T, h] only, 8,192 bytes; 0.19 would gather 2 x 32 x (4 + 8) = 768 more)
    traffic = step_communication(gpt, OPTIONS, Parallelism(tp=2), FP32, pp_rank=0, buffers={})
    assert traffic["tp/all_gather"] == 8_192


# (pattern, TP, SP, run a step, fields): steps only without Mamba layers (their kernels are CUDA-only).
CASES = [("M*-M/*-", 1, False, False, {}), ("M*-M/M-", 1, False, False, {}), ("*-*-/*-", 1, False, True, {}),
         ("*-/*-*-/*-*-", 2, False, True, {}), ("*-/*-*-/*-*-", 2, True, True, {}),
         ("*-*-", 2, False, True, {"mtp_num_layers": 1}), ("+-+-", 2, False, True, MLA),
         ("+-+-", 2, True, True, MLA), ("+-/+-", 2, False, True, MLA)]
# 0.19's names for what 0.16.1's (and this listing's) call otherwise, in the main decoder's and MTP parts'
# Mamba layers (their order in the layer differs too) and the stack's final norm.
RENAMES = {r"\.mixer\.conv1d_(weight|bias)$": r".mixer.conv1d.\1", r"(layers\.\d+)\.norm\.": r"\1.input_layernorm.",
           r"^decoder\.final_norm\.": "decoder.final_layernorm."}


def _renamed(name: str) -> str:
    for old, new in RENAMES.items():
        name = re.sub(old, new, name)
    return name


@pytest.mark.dist
def test_measured_in_megatron_core_019():
    from frameworks import procs

    cases = [dict(pattern=p, model=dict(LAYER, **{k: v for k, v in fields.items() if k != "mtp_num_layers"},
                                        **({"rope_type": "rope"} if fields.get("multi_latent_attention") else {})),
                  vocab=VOCAB, seq=SEQ, mbs=MBS, tp=tp, sp=sp, run=run, **{k: v for k, v in fields.items()
                                                                              if k == "mtp_num_layers"})
             for p, tp, sp, run, fields in CASES]
    done = procs.run_json("megatron-lm-0.19.0", "import hybrid_mtp_019; hybrid_mtp_019.main()", cases)
    for (pattern, tp, sp, run, fields), measured in zip(CASES, done):
        par = Parallelism(tp=tp, sequence_parallel=sp)
        theirs = [(_renamed(n), k) for n, k in measured["params"]]
        ours = _params(pattern, par, **fields)
        assert sorted(theirs) == sorted(ours), pattern
        if "M" not in pattern.split("/")[-1]:  # (the MTP part in order)
            assert [p for p in theirs if p[0].startswith("mtp.")] == [p for p in ours if p[0].startswith("mtp.")]
        if run:
            assert measured["saved"] == _saved(pattern, par, **fields), (pattern, tp, sp)
            assert measured["flops"] == estimate(_spec(pattern, **fields), parse_rows([SEQ] * MBS),
                                                 attention="full").total // tp
            assert measured["comm"] == _tp_traffic(pattern, par, **fields), (pattern, tp, sp)


def test_full_recompute_reruns_the_mla_layers_of_each_mtp_depth():
    # Under full uniform recompute a checkpointed MTP depth re-runs every layer of its part: each
    # MLA layer's forward latent collectives once more, none for a part without MLA. TP 2 + SP,
    # T = 32, fp32: per MLA layer forward T x (64 + 32 + 48 + 32 + 32) = 6,656 and backward
    # T x (64 + 32 + 32 + 32 + 32) = 6,144 elements gathered, so a re-run one 2 x 6,656 + 6,144.
    # One depth of "+-+-" against one of "M-" (the same MTP wrapper terms): 2 re-run MLA layers.
    full = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
    sp = Parallelism(tp=2, sequence_parallel=True)

    def gathered(pattern: str) -> int:
        return mla_mtp_tensor_parallel(_spec(pattern, **MLA), sp, FP32, num_layers=1, rerun=1, last=True, loss=True,
                                       recompute=full, learned_positions=False, duplicated=False)["tp/all_gather"]

    assert 2 * (2 * 6_656 + 6_144) * 4 == 155_648
    assert gathered("M+-M/+-+-") - gathered("M+-M/M-") == 155_648


def test_selective_recompute_reruns_the_moe_and_mla_layers_of_the_mtp_part():
    # Selective moe re-runs every MoE layer's shared experts, the MTP part's too: "M*EM/*E*E" has 1
    # main and 2 MTP MoE layers, each a dense-MLP-sized run under TP 2 + SP, fc1's input gathered and
    # fc2's output reduce-scattered, T x h x 4 = 32 x 64 x 4 = 8,192 bytes each.
    moe = _spec("M*EM/*E*E", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                moe_shared_expert_intermediate_size=32)
    sp = Parallelism(tp=2, sequence_parallel=True)
    rerun_moe = RecomputeSpec(granularity="selective", modules=("moe",))
    assert selective_rerun_communication(moe, sp, FP32, pp_rank=0, recompute=rerun_moe, peft=None) == {
        "tp/all_gather": 3 * 8_192, "tp/reduce_scatter": 3 * 8_192}
    # Selective mla_up_proj gathers each MLA layer's latents again, T x (32 + 32) x 4 = 8,192: the
    # main "+" only, the MTP part "M-" has no MLA layer.
    mla = _spec("M+-M/M-", **MLA)
    rerun_up = RecomputeSpec(granularity="selective", modules=("mla_up_proj",))
    assert selective_rerun_communication(mla, sp, FP32, pp_rank=0, recompute=rerun_up, peft=None) == {
        "tp/all_gather": 8_192}


def test_full_recompute_reruns_one_sub_block_per_hybrid_layer():
    # Full uniform recompute re-runs each layer's forward: a hybrid layer's one sub-block gathers
    # its column-parallel input and reduce-scatters its row-parallel output once more under TP 2 +
    # SP, T x h x 4 = 8,192 bytes each. "M*-M": 4 sub-blocks, +4 of each. An MTP depth "*-*-" (4
    # sub-blocks) re-runs its wrapper (eh_proj's gathers, the output layer's call: 3 gathers) and
    # its 4 sub-blocks: +7 gathers, +4 reduce-scatters; a depth "M" (1 sub-block) +4 and +1.
    full = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
    sp = Parallelism(tp=2, sequence_parallel=True)

    def added(pattern: str) -> tuple[int, int]:
        def traffic(recompute: RecomputeSpec | None) -> dict[str, int]:
            return step_communication(_spec(pattern), OPTIONS, sp, FP32, pp_rank=0, buffers={}, recompute=recompute)
        before, after = traffic(None), traffic(full)
        return tuple(after[k] - before[k] for k in ("tp/all_gather", "tp/reduce_scatter"))

    assert added("M*-M") == (4 * 8_192, 4 * 8_192)
    assert added("M*-M/*-*-") == ((4 + 7) * 8_192, (4 + 4) * 8_192)
    assert added("M*-M/M") == ((4 + 4) * 8_192, (4 + 1) * 8_192)


def test_full_recompute_reruns_the_mamba_all_to_alls_of_the_mtp_part_under_cp():
    # Under CP each Mamba layer all-to-alls forward and backward, and once more when full recompute
    # re-runs it: "M*-M/M*" at CP 2 has 2 main and 1 MTP Mamba layer, all re-run (uniform; the MTP
    # depth checkpointed as a whole): 3 more passes than without recompute.
    full = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
    spec, cp = _spec("M*-M/M*"), Parallelism(cp=2)
    one = mamba_cp_all_to_all(spec, tokens=SEQ * MBS, tp=1, cp=2, act=4)  # (the tokens step_communication is given)

    def all_to_all(recompute: RecomputeSpec | None) -> int:
        return step_communication(spec, OPTIONS, cp, FP32, pp_rank=0, buffers={}, recompute=recompute)["cp/all_to_all"]

    assert all_to_all(None) == 6 * one and all_to_all(full) == 9 * one
