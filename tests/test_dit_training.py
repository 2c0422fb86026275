"""A DiT in training: frozen base, LoRA (PEFT-style suffix targets) and per-block checkpointing.

Hand-derived passes, one-term deltas, parameter counts, FlopCounterMode on the example's WAN-like
model (``examples/wan_dit_fsdp2.py``: forward + backward, non-reentrant ``torch.utils.checkpoint``)
equal to the executed count, the model file setup, the CLI and its bad input."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_flops import cli
from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec, DiTStats, dit_adapted_modules, dit_parameter_counts
from megatron_flops.flops.dit_passes import dit_recompute, dit_report, dit_setup, dit_training_passes, price_dit
from megatron_flops.flops.formulas import TRAIN_PASSES
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import wan_dit_fsdp2 as wan  # noqa: E402  (the example's model is the oracle)

# ---- pure: hand-derived ----------------------------------------------------------------------

# L = 2 blocks, h = 8 (2 heads of 4), ffn 16, patch 1x1x1 over 1 channel, freq 4, text_dim 4.
# Clips: video [4, 2] (S = 6, sum s^2 = 20), text [3, 1] (C = 4, sum s*c = 12 + 2 = 14), B = 2.
TINY = DiTSpec(num_layers=2, hidden_size=8, num_heads=2, ffn_hidden_size=16, in_channels=1, out_channels=1,
               patch_size=(1, 1, 1), freq_dim=4, text_dim=4, text_len=3)
TINY_STATS = DiTStats.from_seqlens(TINY, [4, 2], [3, 1])
LORA_Q = DiTPeftSpec(frozen=True, lora_rank=2, lora_targets=("q",))


def test_frozen_lora_hand_derived():
    # Rank 2 on q ("q" adapts self_attn.q and cross_attn.q), base frozen. Forward per block:
    # q, k, v, o, cross q, o 2*6*8*8 = 768 each; cross k, v 2*4*8*8 = 512 each; self core 2 x
    # 2*2*4*20 = 320; cross core 2 x 2*2*4*14 = 224; ffn 2 x 2*6*8*16 = 1536; adapter A 2*6*8*2 =
    # 192, B 192. Once: patch 96; text 256 + 512; time 128 + 256; time_projection 2*2*8*48 = 1536;
    # head 96.
    passes = dit_training_passes(TINY, TINY_STATS, peft=LORA_Q)
    assert passes.forward == {
        "dit/patch_embed": 96, "dit/text_embed": 768, "dit/time_embed": 384, "dit/modulation": 1536,
        "dit/self_attn/qkv": 4608, "dit/lora/self_attn.q": 768, "dit/self_attn/core": 1280,
        "dit/self_attn/out": 1536, "dit/cross_attn/q": 1536, "dit/lora/cross_attn.q": 768,
        "dit/cross_attn/kv": 2048, "dit/cross_attn/core": 896, "dit/cross_attn/out": 1536,
        "dit/mlp": 6144, "dit/head": 96,
    }
    # Block 0's input and the text need no gradient: its q, k, v and adapter A run no dgrad, the
    # cores one per operand fed by q (scores: q; context: probs), everything after q all of them.
    # Block 1: every dgrad but cross k, v (text). No embedding runs a backward; the head its dgrad.
    assert passes.input_grad == {
        "dit/patch_embed": 0, "dit/text_embed": 0, "dit/time_embed": 0, "dit/modulation": 0,
        "dit/self_attn/qkv": 3 * 768, "dit/lora/self_attn.q": 192 + (192 + 192), "dit/self_attn/core": 320 * 6,
        "dit/self_attn/out": 1536, "dit/cross_attn/q": 1536, "dit/lora/cross_attn.q": 768,
        "dit/cross_attn/kv": 0, "dit/cross_attn/core": 4 * 224, "dit/cross_attn/out": 1536,
        "dit/mlp": 6144, "dit/head": 96,
    }
    # Only the adapters train.
    assert passes.weight_grad == dict.fromkeys(passes.forward, 0) | {"dit/lora/self_attn.q": 768,
                                                                     "dit/lora/cross_attn.q": 768}
    assert passes.model().total == 24000 + 17312 + 1536
    assert passes.model("train_passes").total == TRAIN_PASSES * 24000
    # Plain torch autograd runs nothing unneeded, and nothing is checkpointed.
    assert passes.executed().total == passes.model().total
    assert not any(passes.unneeded.values()) and not any(passes.recompute.values())


def test_checkpointing_hand_derived():
    # Checkpointing re-runs a block's forward, adapters included: 9792 + 768 = 10,560 per block.
    def recomputed(blocks: int | None, peft: PeftSpec | None = LORA_Q) -> int:
        return price_dit(TINY, TINY_STATS, peft=peft, recompute=dit_recompute(TINY, blocks)).recompute_flops

    assert recomputed(1) == 10560
    assert recomputed(None) == recomputed(2) == 2 * 10560
    assert recomputed(None, None) == 2 * 9792
    uniform = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
    assert price_dit(TINY, TINY_STATS, recompute=uniform).recompute_flops == 2 * 9792
    # Model FLOPs do not see recompute; executed FLOPs add exactly it.
    plain, redo = price_dit(TINY, TINY_STATS, peft=LORA_Q), price_dit(TINY, TINY_STATS, peft=LORA_Q,
                                                                        recompute=dit_recompute(TINY))
    assert redo.model.components == plain.model.components
    assert redo.executed.total - plain.executed.total == 2 * 10560


def test_frozen_base_delta():
    # The same adapters on a trainable base: every base weight gradient (forward sizes, no core:
    # 24000 - 1536 adapters - 1280 - 896 = 20,288) and the dgrads a frozen base skips: block 0's q,
    # k, v (3 x 768) and adapter A (192); cross k, v of both blocks (4 x 512); the core operands fed
    # by them (block 0's self k and v: 2 x 320; both blocks' text k and v: 4 x 224);
    # text_embedding.2 (512), time_embedding.2 (256), time_projection (1536). The data-fed GEMMs
    # (patch, text_embedding.0, time_embedding.0) run no dgrad either way.
    trained = price_dit(TINY, TINY_STATS, peft=dataclasses.replace(LORA_Q, frozen=False)).model.total
    frozen = price_dit(TINY, TINY_STATS, peft=LORA_Q).model.total
    assert trained - frozen == 20288 + 3 * 768 + 192 + 4 * 512 + 2 * 320 + 4 * 224 + 512 + 256 + 1536


def test_no_peft_is_every_pass_but_data_dgrads():
    # Fully trainable: TRAIN_PASSES x forward (24000 without the 4 x 384 of adapters = 22,464)
    # minus the dgrads of the data-fed GEMMs: patch (96), text_embedding.0 (2*4*4*8 = 256),
    # time_embedding.0 (2*2*4*8 = 128).
    assert dit_training_passes(TINY, TINY_STATS).model().total == TRAIN_PASSES * 22464 - 96 - 256 - 128


def test_blocks_after_the_first_priced_alike_a_million_blocks():
    # Every block after the first sees the same gradient flow (frozen base, LoRA on q: block 0's
    # input needs no gradient, every later one's does), so a DiT of L >= 2 blocks is the 2-block
    # DiT plus (L - 2) times the third block's passes, per component and pass; checkpointing the
    # first 3 blocks re-runs block 0 and two later blocks. Priced without a loop over the blocks.
    def passes(num_layers: int) -> dict[str, dict[str, int]]:
        spec = dataclasses.replace(TINY, num_layers=num_layers)
        out = dit_training_passes(spec, DiTStats.from_seqlens(spec, [4, 2], [3, 1]), peft=LORA_Q,
                                  recompute=dit_recompute(spec, 3))
        return {"forward": out.forward, "input_grad": out.input_grad, "weight_grad": out.weight_grad,
                "recompute": out.recompute}

    three, four, million = passes(3), passes(4), passes(10**6)
    for kind, by_key in million.items():
        for key, value in by_key.items():
            later = four[kind][key] - three[kind][key]
            if kind == "recompute":  # blocks 3 .. L-1 are not checkpointed
                assert value == three[kind][key] and later == 0, key
            else:
                assert value == three[kind][key] + (10**6 - 3) * later, (kind, key)


# ---- LoRA targets and parameter counts -------------------------------------------------------

T2V = DiTSpec(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=48, in_channels=4, out_channels=3,
              patch_size=(1, 2, 2), freq_dim=16, text_dim=24, text_len=7)
I2V = dataclasses.replace(T2V, in_channels=6, image_dim=20, image_len=5)


def test_targets_match_by_suffix():
    def adapted(spec: DiTSpec, *targets: str) -> tuple[str, ...]:
        return dit_adapted_modules(spec, DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=targets))

    assert adapted(I2V, "q") == ("self_attn.q", "cross_attn.q")
    # "k" is not a suffix of "k_img" at a dot.
    assert adapted(I2V, "k") == ("self_attn.k", "cross_attn.k")
    assert adapted(I2V, "cross_attn.q", "k_img") == ("cross_attn.q", "cross_attn.k_img")
    assert adapted(T2V, *DiTPeftSpec().lora_targets) == (
        "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
        "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o")
    assert adapted(T2V, "ffn.0", "ffn.2") == ("ffn.0", "ffn.2")
    # A plain PeftSpec is read with DiT names: its decoder default targets are refused.
    with pytest.raises(ValueError, match="unknown lora target 'linear_qkv'"):
        dit_adapted_modules(T2V, PeftSpec(frozen=True, lora_rank=4))


@pytest.mark.parametrize(
    "spec, targets, message",
    [
        (T2V, ("qkv",), r"unknown lora target 'qkv'.*known: q, k, v, o, k_img, v_img, self_attn.q"),
        (T2V, ("0",), "unknown lora target '0'"),
        (T2V, ("k_img",), r"lora target 'k_img' matches no projection of this DiT \(projections: self_attn.q"),
    ],
)
def test_bad_targets(spec, targets, message):
    with pytest.raises(ValueError, match=message):
        dit_adapted_modules(spec, DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=targets))


def test_wan21_14b_parameter_counts():
    # WAN-2.1-T2V-14B: d = 5120, f = 13824, 40 blocks. Per block: 8 (d^2 + d) attention
    # projections, 4d q/k RMSNorms, 2d norm3, d f + f + f d + d FFN, 6d adaLN table = 351,394,304.
    spec = DiTSpec.from_mapping(json.loads((EXAMPLES / "wan21_14b_dit.json").read_text())["dit"])
    d, f = 5120, 13824
    block = 8 * (d * d + d) + 4 * d + 2 * d + 2 * d * f + f + d + 6 * d
    embed = (16 * 4 * d + d) + (4096 * d + d + d * d + d) + (256 * d + d + d * d + d) + (6 * d * d + 6 * d) \
        + (d * 64 + 64 + 2 * d)
    params = dit_parameter_counts(spec)
    assert params.num_block_params == block == 351_394_304
    assert params.num_params == params.num_trainable_params == embed + 40 * block == 14_288_491_584
    # LoRA rank 32 on q, k, v, o of both attentions: 8 x 32 x (d + d) per block, 320 adapters.
    lora = dit_parameter_counts(spec, DiTPeftSpec(frozen=True, lora_rank=32))
    assert (lora.num_adapters, lora.num_adapter_params) == (320, 40 * 8 * 32 * 2 * d)
    assert lora.num_trainable_params == 104_857_600 and lora.num_base_params == 14_288_491_584


@pytest.mark.parametrize("spec", [T2V, I2V, dataclasses.replace(T2V, qk_norm=False, cross_attn_norm=False)],
                         ids=["t2v", "i2v", "no-norms"])
@pytest.mark.parametrize("targets", [("q", "k", "v", "o"), ("ffn.0", "cross_attn.v"), None])
def test_parameter_counts_equal_the_module(spec, targets):
    model = wan.WanLike(spec)
    if not spec.qk_norm:  # the example always builds q/k norms and norm3: drop them to compare
        for block in model.blocks:
            for attn in (block.self_attn, block.cross_attn):
                attn.norm_q, attn.norm_k = torch.nn.Identity(), torch.nn.Identity()
            block.norm3 = torch.nn.LayerNorm(spec.hidden_size, elementwise_affine=False)
    peft = None
    if targets is not None:
        num_adapters = wan.add_lora(model, targets, 3)
        peft = DiTPeftSpec(frozen=True, lora_rank=3, lora_targets=targets)
    params = dit_parameter_counts(spec, peft)
    assert params.num_params == sum(p.numel() for p in model.parameters())
    assert params.num_trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    base_block = sum(p.numel() for n, p in model.blocks[0].named_parameters() if "lora_" not in n)
    assert params.num_block_params == base_block
    if targets is not None:
        assert params.num_adapters == num_adapters


# ---- measured: FlopCounterMode on the example's model ----------------------------------------


def _measure(spec: DiTSpec, targets, *, frozen: bool, checkpoint_blocks: int) -> tuple[int, DiTStats]:
    """Forward + backward FLOPs of three random clips, and their statistics."""
    torch.manual_seed(0)
    model = wan.WanLike(spec, checkpoint_blocks=checkpoint_blocks)
    if targets is not None:
        wan.add_lora(model, targets, 3)
        model.requires_grad_(not frozen)
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad or "lora_" in name)
    clips = wan.clips(spec, random.Random(1), 3)
    counter = FlopCounterMode(display=False)
    with counter:
        out = model([c.latent for c in clips], torch.tensor([5, 9, 100]), [c.text for c in clips],
                    [c.image for c in clips] if spec.image_dim else None)
        out.sum().backward()
    stats = DiTStats.from_seqlens(spec, [wan.video_tokens(spec, c) for c in clips], [c.text.shape[0] for c in clips])
    return counter.get_total_flops(), stats


@pytest.mark.parametrize(
    "spec, targets, frozen, blocks",
    [
        (T2V, ("q", "k", "v", "o"), True, 2),  # the example's setup: LoRA, frozen base, every block
        (T2V, ("q", "k", "v", "o"), True, 0),
        (T2V, ("ffn.0",), True, 1),  # block 0 runs forward only up to ffn.0, yet recomputes whole
        (T2V, ("cross_attn.k", "ffn.2"), False, 1),
        (I2V, ("k_img",), True, 2),
        (I2V, ("q", "k", "v", "o"), True, 1),
        (I2V, None, False, 2),
    ],
)
def test_executed_flops_equal_measurement(spec, targets, frozen, blocks):
    measured, stats = _measure(spec, targets, frozen=frozen, checkpoint_blocks=blocks)
    peft = None if targets is None else DiTPeftSpec(frozen=frozen, lora_rank=3, lora_targets=targets)
    priced = price_dit(spec, stats, peft=peft, recompute=dit_recompute(spec, blocks) if blocks else None)
    assert measured == priced.executed.total
    if not blocks:
        assert measured == priced.model.total


# ---- model files and the CLI -----------------------------------------------------------------


def test_model_file_setup():
    raw = json.loads((EXAMPLES / "wan_tiny_dit.json").read_text())
    setup = dit_setup(raw)
    assert setup.peft == DiTPeftSpec(frozen=True, lora_rank=4, lora_targets=("q", "k", "v", "o"))
    assert setup.recompute == RecomputeSpec(granularity="full", method="block", num_layers=2)
    # Flags override the file: 1 block, rank 8 on the FFN.
    setup = dit_setup(raw, lora_rank=8, lora_targets=["ffn.0", "ffn.2"], recompute_num_layers=1)
    assert (setup.peft.lora_rank, setup.peft.lora_targets, setup.recompute.num_layers) == (8, ("ffn.0", "ffn.2"), 1)
    # A "lora" section without target_modules takes the DiT default.
    assert dit_setup({"dit": raw["dit"], "lora": {"dim": 2}}).peft.lora_targets == ("q", "k", "v", "o")


@pytest.mark.parametrize(
    "changes, kwargs, message",
    [
        ({"num_attention_heads": 4}, {}, r"decoder-style key\(s\) 'num_attention_heads' do not apply"),
        ({"recompute_granularity": "selective"}, {}, "a DiT checkpoints whole blocks"),
        ({"recompute_num_layers": 1}, {}, "need recompute_granularity 'full'"),
        ({}, dict(recompute="full", recompute_num_layers=3), "checkpointing 3 blocks, but the DiT has 2"),
        ({}, dict(frozen=True), "a frozen base without LoRA adapters has nothing to train"),
        ({}, dict(lora_targets=["q"]), "lora targets need a lora rank"),
        ({"lora": {"dim": 2, "target_modules": ["linear_qkv"]}}, {}, "unknown lora target 'linear_qkv'"),
    ],
)
def test_model_file_bad_input(changes, kwargs, message):
    raw = {"dit": dataclasses.asdict(TINY) | {"patch_size": [1, 1, 1]}, **changes}
    with pytest.raises(ValueError, match=message):
        dit_setup(raw, **kwargs)


def test_cli_lora_checkpointing_json():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_flops", "estimate", "--model", str(EXAMPLES / "wan21_14b_dit.json"),
         "--seqlens", "[32760, 8190]", "--kv-seqlens", "[512, 300]", "--frozen", "--lora-rank", "32",
         "--recompute", "full", "--recompute-num-layers", "20", "--json"],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(out.stdout)
    spec = DiTSpec.from_mapping(json.loads((EXAMPLES / "wan21_14b_dit.json").read_text())["dit"])
    peft = DiTPeftSpec(frozen=True, lora_rank=32)
    priced = price_dit(spec, DiTStats.from_seqlens(spec, [32760, 8190], [512, 300]), peft=peft,
                       recompute=dit_recompute(spec, 20))
    assert report["total_flops"] == priced.model.total == sum(report["components"].values())
    assert report["executed_flops"] == priced.executed.total
    assert report["recompute_flops"] == priced.recompute_flops > 0
    assert (report["num_adapters"], report["num_trainable_params"], report["checkpointed_blocks"]) == (320, 104_857_600, 20)
    assert report["lora_modules"] == list(dit_adapted_modules(spec, peft))


def test_report_image_lengths():
    setup = dit_setup({"dit": dataclasses.asdict(I2V) | {"patch_size": [1, 2, 2]}})
    report = dit_report(setup, [12, 6], [5, 7], [5, 3])
    # Image pairs: 12 * 5 + 6 * 3 = 78 over 8 CLIP tokens.
    assert (report["num_image_tokens"], report["sum_image_pairs"]) == (8, 78)
    with pytest.raises(ValueError, match="image_seqlens given for a text-to-video DiT"):
        dit_report(dit_setup({"dit": dataclasses.asdict(T2V) | {"patch_size": [1, 2, 2]}}), [12], None, [5])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lora-rank", "8", "--lora-targets", "q,qkv"], "unknown lora target 'qkv'.*known: q, k, v, o, k_img"),
        (["--kv-seqlens", "[512]"], "--kv-seqlens has 1 lengths but --seqlens has 2 samples"),
        (["--kv-seqlens", "[512, 0]"], "--kv-seqlens: rows\\[1\\]: length must be positive"),
        (["--recompute", "selective"], "a DiT checkpoints whole blocks"),
        (["--recompute", "full", "--recompute-modules", "mlp"], "--recompute-modules do not apply"),
        (["--image-seqlens", "[257, 257]"], "image_seqlens given for a text-to-video DiT"),
    ],
)
def test_cli_bad_input(args, message, capsys):
    code = cli.main(["estimate", "--model", str(EXAMPLES / "wan21_14b_dit.json"), "--seqlens", "[32760, 8190]", *args])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
