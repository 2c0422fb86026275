"""Cross-attention and the WAN-2.1-style DiT: formulas vs FlopCounterMode on the small WAN-like model
of ``examples/wan_dit_fsdp2.py`` (plain ``torch.nn``, forward + backward, clips of different
video/text lengths packed in one pass), hand-derived cases, one-term deltas, the WAN-2.1-14B
preset, bad inputs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron_flops.flops.dit import DiTSpec, cross_attention_flops, dit_forward_flops, seqlens_from_cu_seqlens
from megatron_flops.flops.dit_passes import dit_training_flops
from megatron_flops.flops.formulas import FLOPS_PER_MAC, TRAIN_PASSES, gemm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import wan_dit_fsdp2 as wan  # noqa: E402  (the example's model is the oracle)

# Tiny WAN-like stacks: 2 blocks, width 32 (4 heads of 8), FFN 48; text features 24 wide, CLIP
# features 20 wide with 5 tokens per image.
T2V = DiTSpec(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=48, in_channels=4, out_channels=3,
              patch_size=(1, 2, 2), freq_dim=16, text_dim=24, text_len=7)
I2V = dataclasses.replace(T2V, in_channels=6, image_dim=20, image_len=5)
# Samples: latent grid (frames, height, width) and text length. Tokens after the (1, 2, 2) patch:
# 2*2*3 = 12, 1*3*2 = 6, 3*1*1 = 3.
SAMPLES = [((2, 4, 6), 5), ((1, 6, 4), 7), ((3, 2, 2), 2)]
VIDEO = [12, 6, 3]
TEXT = [5, 7, 2]


# ---- the oracle: the example's WAN-like model in plain torch.nn --------------------------------


def _clips(spec: DiTSpec, samples, seed: int = 0):
    """Latents, timesteps, text and CLIP features of ``samples`` (grid, text length)."""
    gen = torch.Generator().manual_seed(seed)
    latents = [torch.randn(spec.in_channels, *grid, generator=gen) for grid, _ in samples]
    text = [torch.randn(c, spec.text_dim, generator=gen) for _, c in samples]
    clip = [torch.randn(spec.image_len, spec.image_dim, generator=gen) for _ in samples] if spec.image_dim else None
    return latents, torch.tensor([37 * i + 1 for i in range(len(samples))]), text, clip


def _measure(spec: DiTSpec, samples, *, train: bool) -> int:
    """FlopCounterMode total of one packed forward (+ backward) over the samples."""
    torch.manual_seed(0)
    model = wan.WanLike(spec)
    counter = FlopCounterMode(display=False)
    with counter:
        if train:
            model(*_clips(spec, samples)).sum().backward()
        else:
            with torch.no_grad():
                model(*_clips(spec, samples))
    return counter.get_total_flops()


# ---- (a) measured == formula -----------------------------------------------------------------


@pytest.mark.parametrize("spec", [T2V, I2V], ids=["t2v", "i2v"])
def test_training_measured_equals_formula(spec):
    assert _measure(spec, SAMPLES, train=True) == dit_training_flops(spec, VIDEO, TEXT).total


@pytest.mark.parametrize("spec", [T2V, I2V], ids=["t2v", "i2v"])
def test_forward_measured_equals_formula(spec):
    assert _measure(spec, SAMPLES, train=False) == sum(dit_forward_flops(spec, VIDEO, TEXT).values())


def test_default_text_length_is_text_len():
    # WAN pads every prompt to text_len tokens: the default prices text_len = 7 per sample.
    padded = [(grid, T2V.text_len) for grid, _ in SAMPLES]
    assert _measure(T2V, padded, train=True) == dit_training_flops(T2V, VIDEO).total


# ---- (b) hand-derived ------------------------------------------------------------------------


def test_cross_attention_hand_derived():
    # Two samples: 3 and 5 queries (width 8) over 4 and 2 keys (context width 6), 2 heads of 4.
    # q: 2*8*8*8 = 1024; kv: 2*6*6*16 = 1152; core: 2*2*8*(3*4 + 5*2) = 704; out: 2*8*8*8 = 1024.
    flops = cross_attention_flops(query_seqlens=[3, 5], kv_seqlens=[4, 2], hidden_size=8, context_dim=6,
                                  num_heads=2, head_dim=4)
    assert flops == {"q": 1024, "kv": 1152, "core": 704, "out": 1024}
    by_cu = cross_attention_flops(query_seqlens=seqlens_from_cu_seqlens([0, 3, 8]),
                                  kv_seqlens=seqlens_from_cu_seqlens([0, 4, 6]), hidden_size=8, context_dim=6,
                                  num_heads=2, head_dim=4)
    assert by_cu == flops


def test_t2v_forward_hand_derived():
    # S = 12 + 6 + 3 = 21 video tokens, C = 5 + 7 + 2 = 14 text tokens, B = 3 samples, h = 32,
    # patch volume 4, sum s^2 = 144 + 36 + 9 = 189, sum s*c = 60 + 42 + 6 = 108, L = 2.
    expected = {
        "dit/patch_embed": 2 * 21 * (4 * 4) * 32,  # 21,504
        "dit/text_embed": 2 * 14 * 24 * 32 + 2 * 14 * 32 * 32,  # 21,504 + 28,672
        "dit/time_embed": 2 * 3 * 16 * 32 + 2 * 3 * 32 * 32,  # 3,072 + 6,144
        "dit/modulation": 2 * 3 * 32 * 192,  # 36,864
        "dit/self_attn/qkv": 2 * (2 * 21 * 32 * 96),  # 258,048
        "dit/self_attn/core": 2 * (2 * 2 * 32 * 189),  # 48,384
        "dit/self_attn/out": 2 * (2 * 21 * 32 * 32),  # 86,016
        "dit/cross_attn/q": 2 * (2 * 21 * 32 * 32),  # 86,016
        "dit/cross_attn/kv": 2 * (2 * 14 * 32 * 64),  # 114,688
        "dit/cross_attn/core": 2 * (2 * 2 * 32 * 108),  # 27,648
        "dit/cross_attn/out": 2 * (2 * 21 * 32 * 32),  # 86,016
        "dit/mlp": 2 * (2 * 21 * 32 * 48 * 2),  # 258,048
        "dit/head": 2 * 21 * 32 * (3 * 4),  # 16,128
    }
    assert dit_forward_flops(T2V, VIDEO, TEXT) == expected


def test_training_passes_hand_derived():
    # TRAIN_PASSES x forward, minus the input gradients of the three data-fed GEMMs: the patch
    # embedding (latents), text_embedding.0 (T5 features), time_embedding.0 (sinusoid).
    fwd = dit_forward_flops(T2V, VIDEO, TEXT)
    train = dit_training_flops(T2V, VIDEO, TEXT).components
    assert train["dit/patch_embed"] == 2 * fwd["dit/patch_embed"]
    assert train["dit/text_embed"] == TRAIN_PASSES * fwd["dit/text_embed"] - gemm(14, 24, 32)
    assert train["dit/time_embed"] == TRAIN_PASSES * fwd["dit/time_embed"] - gemm(3, 16, 32)
    rest = set(fwd) - {"dit/patch_embed", "dit/text_embed", "dit/time_embed"}
    assert all(train[k] == TRAIN_PASSES * fwd[k] for k in rest)
    dense = dit_training_flops(T2V, VIDEO, TEXT, convention="train_passes").components
    assert dense == {k: TRAIN_PASSES * v for k, v in fwd.items()}


def test_i2v_adds_image_terms_only():
    # The CLIP tokens add img_emb, k_img/v_img and their attention; patch embedding widens with
    # the in_channels of the conditioning latents (6 vs 4). M = 3 samples x 5 tokens = 15.
    t2v = dit_forward_flops(dataclasses.replace(T2V, in_channels=6), VIDEO, TEXT)
    i2v = dit_forward_flops(I2V, VIDEO, TEXT)
    assert set(i2v) - set(t2v) == {"dit/image_embed", "dit/cross_attn/image_kv", "dit/cross_attn/image_core"}
    assert all(i2v[k] == t2v[k] for k in t2v)
    assert i2v["dit/image_embed"] == 2 * 15 * 20 * 20 + 2 * 15 * 20 * 32
    assert i2v["dit/cross_attn/image_kv"] == 2 * (2 * 15 * 32 * 64)
    # sum s_i * 5 = 21 * 5 = 105 query/key pairs per block.
    assert i2v["dit/cross_attn/image_core"] == 2 * (FLOPS_PER_MAC * 2 * 32 * 105)


# ---- (c) one-term deltas ---------------------------------------------------------------------


def test_one_text_token_more_moves_text_terms_only():
    # Sample 1 gets one more text token: text_embed (+1 row), cross k/v (+1 row per block) and
    # cross core (+6 pairs per block) move; nothing else.
    base = dit_forward_flops(T2V, VIDEO, TEXT)
    more = dit_forward_flops(T2V, VIDEO, [5, 8, 2])
    delta = {k: more[k] - base[k] for k in base if more[k] != base[k]}
    assert delta == {
        "dit/text_embed": gemm(1, 24, 32) + gemm(1, 32, 32),
        "dit/cross_attn/kv": 2 * gemm(1, 32, 64),
        "dit/cross_attn/core": 2 * FLOPS_PER_MAC * 2 * 32 * 6,
    }


def test_one_video_token_more_moves_token_terms():
    # Sample 2 grows from 3 to 4 video tokens: self-attention pairs grow by 4^2 - 3^2 = 7, cross
    # pairs by its 2 text tokens; the per-sample embeddings and text terms stay.
    base = dit_forward_flops(T2V, VIDEO, TEXT)
    more = dit_forward_flops(T2V, [12, 6, 4], TEXT)
    unchanged = {"dit/text_embed", "dit/time_embed", "dit/modulation", "dit/cross_attn/kv"}
    assert all(more[k] == base[k] for k in unchanged)
    assert more["dit/self_attn/core"] - base["dit/self_attn/core"] == 2 * FLOPS_PER_MAC * 2 * 32 * 7
    assert more["dit/cross_attn/core"] - base["dit/cross_attn/core"] == 2 * FLOPS_PER_MAC * 2 * 32 * 2
    assert more["dit/mlp"] - base["dit/mlp"] == 2 * (gemm(1, 32, 48) + gemm(1, 48, 32))


# ---- (d) the WAN-2.1-14B preset --------------------------------------------------------------


def test_wan21_14b_preset():
    data = json.loads((EXAMPLES / "wan21_14b_dit.json").read_text())
    spec = DiTSpec.from_mapping(data["dit"])
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.ffn_hidden_size) == (40, 5120, 40, 13824)
    assert (spec.text_dim, spec.text_len, spec.patch_size, spec.in_channels, spec.out_channels) == (
        4096, 512, (1, 2, 2), 16, 16)
    # 81 frames at 480x832: VAE latent 21 x 60 x 104, patches 21 x 30 x 52 = 32,760 tokens.
    s, c, h, L = 32_760, 512, 5120, 40
    fwd = dit_forward_flops(spec, [s])
    assert fwd["dit/self_attn/core"] == L * 4 * h * s * s
    assert fwd["dit/cross_attn/core"] == L * 4 * h * s * c
    assert fwd["dit/mlp"] == L * 4 * s * h * 13824
    assert fwd["dit/modulation"] == 2 * h * 6 * h


def test_cli_dit_model_file():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_flops", "estimate", "--model", str(EXAMPLES / "wan21_14b_dit.json"),
         "--seqlens", "[32760, 8190]", "--kv-seqlens", "[512, 300]", "--json"],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(out.stdout)
    spec = DiTSpec.from_mapping(json.loads((EXAMPLES / "wan21_14b_dit.json").read_text())["dit"])
    assert report["total_flops"] == dit_training_flops(spec, [32760, 8190], [512, 300]).total
    assert sum(report["components"].values()) == report["total_flops"]


# ---- (e) bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(query_seqlens=[3, 5], kv_seqlens=[4]), "query_seqlens has 2 samples but kv_seqlens has 1"),
        (dict(query_seqlens=[3, 0], kv_seqlens=[4, 2]), "query_seqlens must be >= 1"),
        (dict(query_seqlens=[3], kv_seqlens=[-1]), "kv_seqlens must be >= 1"),
        (dict(query_seqlens="35", kv_seqlens=[4]), "query_seqlens must be a list"),
        (dict(query_seqlens=[3.0], kv_seqlens=[4]), "query_seqlens must hold integers"),
    ],
)
def test_cross_attention_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cross_attention_flops(hidden_size=8, context_dim=8, num_heads=2, head_dim=4, **kwargs)


@pytest.mark.parametrize(
    "cu, message", [([0, 3, 3], "strictly increasing"), ([1, 4], "start at 0"), ([0], "at least two")]
)
def test_cu_seqlens_bad_input(cu, message):
    with pytest.raises(ValueError, match=message):
        seqlens_from_cu_seqlens(cu, name="cu_seqlens_kv")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_heads=5), "num_heads=5 does not divide hidden_size=32"),
        (dict(patch_size=[1, 2]), "patch_size must be three integers"),
        (dict(num_layers=0), "num_layers must be >= 1"),
        (dict(num_layer=2), r"unknown DiT key\(s\) 'num_layer' \(did you mean 'num_layers'\?\)"),
        (dict(image_dim="wide"), "image_dim must hold integers"),
    ],
)
def test_dit_spec_bad_input(changes, message):
    data = {**dict(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=48), **changes}
    with pytest.raises(ValueError, match=message):
        DiTSpec.from_mapping(data)


def test_dit_bad_lengths():
    with pytest.raises(ValueError, match="video_seqlens has 3 samples but text_seqlens has 2"):
        dit_forward_flops(T2V, VIDEO, [5, 7])
    with pytest.raises(ValueError, match="video_seqlens is empty"):
        dit_forward_flops(T2V, [])
    with pytest.raises(ValueError, match="unknown model FLOPs convention"):
        dit_training_flops(T2V, VIDEO, convention="6N")


def test_attention_helper_matches_sdpa():
    # The oracle's attention is ordinary softmax attention within each clip (same numbers as SDPA's
    # math path per clip): clips of 5 and 2 queries over 3 and 4 keys, 2 heads of 4.
    q, k, v = torch.randn(7, 8), torch.randn(7, 8), torch.randn(7, 8)
    ours = wan.attend(q, k, v, [5, 2], [3, 4], 2)
    for (qs, ks), (q0, k0) in zip(((slice(0, 5), slice(0, 3)), (slice(5, 7), slice(3, 7))), ((0, 0), (5, 3))):
        split = lambda t: t.unflatten(-1, (2, 4)).transpose(0, 1)  # noqa: E731
        ref = F.scaled_dot_product_attention(split(q[qs]), split(k[ks]), split(v[ks])).transpose(0, 1).flatten(1)
        assert torch.allclose(ours[qs], ref, atol=1e-6)
