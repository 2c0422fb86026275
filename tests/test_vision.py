"""Vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): formulas vs FlopCounterMode on the real Hugging
Face towers, hand-derived cases, one-term deltas, bad inputs, device statistics vs pure."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_flops.flops.formulas import FLOPS_PER_MAC, TRAIN_PASSES, gemm
from megatron_flops.flops.vision import (
    VisionSpec,
    VisionStats,
    parse_grids,
    vision_forward_flops,
    vision_report,
    vision_training_flops,
)
from megatron_flops.tracking.vision_torch import VISION_SLOTS, vision_stats_from_vector, vision_stats_tensor

try:
    import transformers
except ImportError:  # pragma: no cover - depends on the environment
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

# Qwen2-VL-like: plain MLP (int(32 * 3) = 96), 4 heads of 8, every block full attention.
PLAIN = VisionSpec(depth=2, hidden_size=32, num_heads=4, intermediate_size=96, gated_mlp=False,
                   patch_size=2, out_hidden_size=48)
# Qwen2.5-VL-like: gated MLP, windows of 8 // 2 // 2 = 2 merged tokens, block 1 full attention.
WINDOWED = VisionSpec(depth=3, hidden_size=32, num_heads=2, intermediate_size=40, gated_mlp=True,
                      patch_size=2, out_hidden_size=48, window_size=8, fullatt_block_indexes=(1,))


# ---- (a) the real Hugging Face towers under FlopCounterMode -----------------------------------

# model_type -> (vision_config, grids): mixed image sizes and a video (t > 1).
HF_CASES = {
    "qwen2_vl": (
        dict(depth=2, embed_dim=32, hidden_size=48, mlp_ratio=3, num_heads=4, patch_size=2),
        [[1, 4, 6], [1, 2, 2], [3, 6, 4]],
    ),
    "qwen2_5_vl": (
        # Windows of 12 // 2 // 2 = 3 merged tokens over merged grids 5x3, 2x2, 3x4 (two frames)
        # and 7x5: whole windows, edge windows of 1 and 2, a grid smaller than one window.
        dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=2, window_size=12,
             out_hidden_size=48, fullatt_block_indexes=[1]),
        [[1, 10, 6], [1, 4, 4], [2, 6, 8], [1, 14, 10]],
    ),
    "qwen3_vl": (
        dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=2, out_hidden_size=48,
             deepstack_visual_indexes=[0, 2], num_position_embeddings=16),
        [[1, 4, 6], [1, 2, 2], [3, 6, 4]],
    ),
}
TEXT_CONFIG = dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                   intermediate_size=64, vocab_size=100)


def _hf_config(model_type: str, vision_config: dict):
    configs = {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig", "qwen3_vl": "Qwen3VLConfig"}
    return getattr(transformers, configs[model_type])(vision_config=vision_config, text_config=TEXT_CONFIG)


def _hf_tower(model_type: str, config):
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as cls
    elif model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as cls
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as cls
    torch.manual_seed(0)
    return cls(config.vision_config).float()


# Forward GEMMs of each component, from FlopCounterMode's per-module counts (module names below
# the tower's root). Core attention is the attention module less its two projections.
_MODULES = {
    "vit/patch_embed": r"patch_embed",
    "vit/attn/qkv": r"blocks\.\d+\.attn\.qkv",
    "vit/attn/out": r"blocks\.\d+\.attn\.proj",
    "attn": r"blocks\.\d+\.attn",
    "vit/mlp": r"blocks\.\d+\.mlp",
    "vit/merger": r"merger",
    "vit/deepstack_merger": r"deepstack_merger_list\.\d+",
}


def _measure(model, grids: list[list[int]]) -> tuple[dict[str, int], int, int]:
    """(forward FLOPs per component, forward total, backward total) of one training pass."""
    cfg = model.config
    grid = torch.tensor(grids)
    num_patches = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    pixels = torch.randn(num_patches, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2)
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            out = model(pixels, grid_thw=grid)
        loss = out.pooler_output.sum()
        for feature in getattr(out, "deepstack_features", None) or []:
            loss = loss + feature.sum()
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    root = type(model).__name__
    counts = fwd.get_flop_counts()
    per = {
        key: sum(sum(v.values()) for name, v in counts.items() if re.fullmatch(rf"{root}\.{pattern}", name))
        for key, pattern in _MODULES.items()
    }
    per["vit/attn/core"] = per.pop("attn") - per["vit/attn/qkv"] - per["vit/attn/out"]
    return {k: v for k, v in per.items() if v}, fwd.get_total_flops(), bwd.get_total_flops()


@needs_hf
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", sorted(HF_CASES))
def test_formula_equals_flop_counter_on_hf_tower(model_type, impl):
    vision_config, grids = HF_CASES[model_type]
    config = _hf_config(model_type, vision_config)
    model = _hf_tower(model_type, config)
    model.set_attn_implementation(impl)
    measured, fwd_total, bwd_total = _measure(model, grids)

    raw = config.to_dict()
    spec = VisionSpec.from_hf_vision_config(model_type, raw["vision_config"])
    stats = VisionStats.from_grids(spec, grids)
    fwd = vision_forward_flops(spec, stats)
    assert measured == fwd  # every forward GEMM, component by component
    assert fwd_total == sum(fwd.values())
    train = vision_training_flops(spec, stats)
    # Backward: two GEMMs per forward GEMM, but only the weight gradient of the patch embedding.
    assert fwd_total + bwd_total == train.total
    assert bwd_total == 2 * fwd_total - fwd["vit/patch_embed"]
    # The CLI helper reads the whole model file (the text decoder is ignored) and agrees.
    report = vision_report(raw, grids)
    assert report["total_flops"] == fwd_total + bwd_total
    assert report["components"] == dict(train.components)


@needs_hf
def test_pair_statistics_equal_hf_cu_seqlens():
    # The attention segments Hugging Face builds: per frame (cu_seqlens) and per window
    # (cu_window_seqlens); the pairs are the sums of squared segment lengths.
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    rng = random.Random(0)
    for _ in range(40):
        m, p = rng.choice([1, 2, 3]), rng.choice([1, 2, 14])
        window = rng.randint(m * p, 6 * m * p)
        spec = dataclasses.replace(WINDOWED, patch_size=p, spatial_merge_size=m, window_size=window)
        grids = [[rng.randint(1, 3), m * rng.randint(1, 9), m * rng.randint(1, 9)] for _ in range(rng.randint(1, 4))]
        stats = VisionStats.from_grids(spec, grids)
        grid = torch.tensor(grids)
        frames = get_vision_cu_seqlens(grid).diff()
        _, cu_windows = get_vision_window_index(grid, spatial_merge_size=m, window_size=window, patch_size=p)
        assert stats.sum_frame_patches_squared == int((frames.long() ** 2).sum())
        assert stats.window_pairs == int((cu_windows.diff().long() ** 2).sum())


@needs_hf
def test_qwen2_vl_merger_width_falls_back_to_text_hidden_size():
    vision_config, grids = HF_CASES["qwen2_vl"]
    raw = _hf_config("qwen2_vl", vision_config).to_dict()
    del raw["vision_config"]["hidden_size"]
    raw["text_config"]["hidden_size"] = 40
    spec = VisionSpec.from_hf_vision_config("qwen2_vl", raw["vision_config"], text_hidden_size=40)
    assert (spec.hidden_size, spec.out_hidden_size, spec.intermediate_size) == (32, 40, 96)
    assert vision_report(raw, grids)["components"]["vit/merger"] == vision_training_flops(
        spec, VisionStats.from_grids(spec, grids)).components["vit/merger"]


# ---- (b) hand-derived cases -------------------------------------------------------------------


def test_hand_derived_single_image():
    spec = VisionSpec(depth=1, hidden_size=4, num_heads=2, intermediate_size=8, gated_mlp=False, patch_size=2,
                      out_hidden_size=6)
    stats = VisionStats.from_grids(spec, [[1, 2, 2]])
    # 1 image, 1 frame, P = 1*2*2 = 4 patches (one merged token), one frame of 4: 16 pairs.
    assert stats == VisionStats(num_images=1, num_frames=1, num_patches=4, sum_frame_patches_squared=16)
    # patch_embed [4, 3*2*2*2=24] @ [24, 4] = 2*4*24*4 = 768; qkv [4,4]@[4,12] = 384;
    # core 2 * 2 heads * (2+2) * 16 = 256; out [4,4]@[4,4] = 128; mlp 2*4*4*8 + 2*4*8*4 = 512;
    # merger [1,16]@[16,16] + [1,16]@[16,6] = 512 + 192 = 704.
    assert vision_forward_flops(spec, stats) == {
        "vit/patch_embed": 768, "vit/attn/qkv": 384, "vit/attn/core": 256, "vit/attn/out": 128,
        "vit/mlp": 512, "vit/merger": 704,
    }
    train = vision_training_flops(spec, stats)
    # Patch embedding: forward + weight gradient = 2 * 768; the rest x3.
    assert train.components == {
        "vit/patch_embed": 1536, "vit/attn/qkv": 1152, "vit/attn/core": 768, "vit/attn/out": 384,
        "vit/mlp": 1536, "vit/merger": 2112,
    }
    assert train.total == 7488 and train.attention == "full"


def test_video_frames_attend_separately():
    # 12 patches either way: a 3-frame 2x2 video has 3 * 4^2 = 48 pairs, a 2x6 image 12^2 = 144.
    video = VisionStats.from_grids(PLAIN, [[3, 2, 2]])
    image = VisionStats.from_grids(PLAIN, [[1, 2, 6]])
    assert (video.num_patches, video.num_frames, video.sum_frame_patches_squared) == (12, 3, 48)
    assert (image.num_patches, image.num_frames, image.sum_frame_patches_squared) == (12, 1, 144)
    # Only core attention differs: 2 blocks * 2 * 4 heads * (8+8) * (144 - 48) pairs, forward.
    a, b = vision_forward_flops(PLAIN, image), vision_forward_flops(PLAIN, video)
    assert {k for k in a if a[k] != b[k]} == {"vit/attn/core"}
    assert a["vit/attn/core"] - b["vit/attn/core"] == 2 * 2 * 4 * 16 * 96 == 24576


def test_hand_derived_windows():
    # Window 8 px / (merge 2 * patch 2) = 2 merged tokens. A 10x6 image is a 5x3 merged grid:
    # row windows 2, 2, 1 by column windows 2, 1 -> merged sizes 4, 2, 4, 2, 2, 1, i.e. 16, 8,
    # 16, 8, 8, 4 patches: 256 + 64 + 256 + 64 + 64 + 16 = 720 pairs (a full frame: 60^2 = 3600).
    stats = VisionStats.from_grids(WINDOWED, [[1, 10, 6]])
    assert (stats.window_pairs, stats.sum_frame_patches_squared) == (720, 3600)
    # An 8x8 frame (4x4 merged) holds four whole 2x2 windows of 16 patches: 4 * 256 = 1024; x3 frames.
    assert VisionStats.from_grids(WINDOWED, [[3, 8, 8]]).window_pairs == 3 * 1024
    # Window 11 px floors to 2 merged tokens too (as in Hugging Face).
    assert VisionStats.from_grids(dataclasses.replace(WINDOWED, window_size=11), [[1, 10, 6]]).window_pairs == 720
    # A window wider than the grid is the whole frame.
    assert VisionStats.from_grids(dataclasses.replace(WINDOWED, window_size=40), [[1, 10, 6]]).window_pairs == 3600
    # Core: 1 full block * 3600 + 2 window blocks * 720, times 2 * 2 heads * (16+16).
    assert vision_forward_flops(WINDOWED, stats)["vit/attn/core"] == 2 * 2 * 32 * (3600 + 2 * 720) == 645120


def test_statistics_are_additive():
    grids = [[1, 10, 6], [2, 4, 4], [3, 6, 8]]
    parts = [VisionStats.from_grids(WINDOWED, [g]) for g in grids]
    assert parts[0] + parts[1] + parts[2] == VisionStats.from_grids(WINDOWED, grids)
    assert VisionStats.from_grids(WINDOWED, []) == VisionStats()


# ---- (c) one-term deltas ----------------------------------------------------------------------


def _moved(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in a.keys() | b.keys() if a.get(k, 0) != b.get(k, 0)}


STATS = VisionStats.from_grids(WINDOWED, [[1, 10, 6], [2, 4, 4]])


@pytest.mark.parametrize(
    "field, delta",
    [
        # One more full-attention pair: 1 full block * 2 * 2 heads * (16+16), x3.
        ("sum_frame_patches_squared", {"vit/attn/core": TRAIN_PASSES * 1 * FLOPS_PER_MAC * 2 * 32}),
        # One more window pair: 2 window blocks.
        ("window_pairs", {"vit/attn/core": TRAIN_PASSES * 2 * FLOPS_PER_MAC * 2 * 32}),
        # Row and frame counts price nothing.
        ("num_images", {}),
        ("num_frames", {}),
    ],
)
def test_one_statistic_moves_one_component(field, delta):
    before = vision_training_flops(WINDOWED, STATS).components
    after = vision_training_flops(WINDOWED, dataclasses.replace(STATS, **{field: getattr(STATS, field) + 1})).components
    assert _moved(before, after) == delta


P, N = STATS.num_patches, STATS.num_patches // 4  # 92 patches, 23 merged tokens


@pytest.mark.parametrize(
    "change, delta",
    [
        # One more output channel of the merger: [N, 128] @ [128, 1], x3.
        (dict(out_hidden_size=49), {"vit/merger": TRAIN_PASSES * gemm(N, 128, 1)}),
        # One more input channel: [P, 2*2*2] @ [8, 32], forward + weight gradient only.
        (dict(in_channels=4), {"vit/patch_embed": (TRAIN_PASSES - 1) * gemm(P, 8, 32)}),
        # One more MLP channel: gate+up [P, 32] @ [32, 2] and down [P, 1] @ [1, 32], in 3 blocks, x3.
        (dict(intermediate_size=41), {"vit/mlp": TRAIN_PASSES * 3 * (gemm(P, 32, 2) + gemm(P, 1, 32))}),
        # Block 0 turns full: one block's pairs go from window to full.
        (dict(fullatt_block_indexes=(0, 1)),
         {"vit/attn/core": TRAIN_PASSES * FLOPS_PER_MAC * 2 * 32
          * (STATS.sum_frame_patches_squared - STATS.window_pairs)}),
        # A deep-stack block adds one merger of the main merger's shapes.
        (dict(deepstack_visual_indexes=(2,)),
         {"vit/deepstack_merger": TRAIN_PASSES * (gemm(N, 128, 128) + gemm(N, 128, 48))}),
    ],
)
def test_one_spec_field_moves_one_component(change, delta):
    before = vision_training_flops(WINDOWED, STATS).components
    after = vision_training_flops(dataclasses.replace(WINDOWED, **change), STATS).components
    assert _moved(before, after) == delta


def test_patch_embed_input_grad_adds_one_gemm():
    before = vision_training_flops(WINDOWED, STATS).components
    after = vision_training_flops(WINDOWED, STATS, patch_embed_input_grad=True).components
    # [P, 3*2*2*2] @ [24, 32]: the input gradient's GEMM has the forward's size.
    assert _moved(before, after) == {"vit/patch_embed": gemm(P, 24, 32)}


# ---- (d) bad inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grids, match",
    [
        ({"t": 1}, "grids must be a list"),
        ([[1, 2]], r"grid row 0: must be \[t, h, w\]"),
        ([[1, 2, 2], 5], r"grid row 1: must be \[t, h, w\]"),
        ([[1, 2, 2], [1, 0, 2]], "grid row 1: h must be a positive integer"),
        ([[-1, 2, 2]], "grid row 0: t must be a positive integer"),
        ([[1, 2.0, 2]], "grid row 0: h must be a positive integer"),
        ([[True, 2, 2]], "grid row 0: t must be a positive integer"),
        ([[1, 4, 4], [1, 3, 4]], "grid row 1: h=3 and w=4 must be multiples of spatial_merge_size=2"),
    ],
)
def test_bad_grids(grids, match):
    with pytest.raises(ValueError, match=match):
        VisionStats.from_grids(PLAIN, grids)


def test_parse_grids_without_merge_accepts_odd_sizes():
    assert parse_grids([[1, 3, 5], (2, 1, 1)]) == ((1, 3, 5), (2, 1, 1))


QWEN25 = dict(depth=4, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=2, window_size=8,
              out_hidden_size=48, fullatt_block_indexes=[3])


@pytest.mark.parametrize(
    "model_type, config, match",
    [
        ("llava", QWEN25, "vision model_type must be one of"),
        ("qwen2_5_vl", [1, 2], "vision_config must be a mapping"),
        ("qwen2_5_vl", {**QWEN25, "depth": None}, "qwen2_5_vl vision_config: missing 'depth' or 'num_hidden_layers'"),
        ("qwen2_5_vl", {**QWEN25, "num_heads": 3}, "num_heads=3 does not divide hidden_size=32"),
        ("qwen2_5_vl", {**QWEN25, "in_channels": 3, "in_chans": 4}, "aliases disagree: in_channels=3, in_chans=4"),
        ("qwen2_5_vl", {**QWEN25, "window_size": 3}, "window_size=3 is smaller than one merged patch"),
        ("qwen2_5_vl", {**QWEN25, "fullatt_block_indexes": [4]},
         r"fullatt_block_indexes must be a tuple of block indexes in \[0, 4\)"),
        ("qwen2_5_vl", {**QWEN25, "fullatt_block_indexes": [1, 1]}, "fullatt_block_indexes has duplicates"),
        ("qwen2_5_vl", {**QWEN25, "fullatt_block_indexes": 3}, "'fullatt_block_indexes' must be a list"),
        ("qwen2_5_vl", {**QWEN25, "patch_size": [2, 2]}, "patch_size must be a positive integer"),
        ("qwen2_5_vl", {**QWEN25, "intermediate_size": 0}, "intermediate_size must be a positive integer"),
        ("qwen3_vl", {k: v for k, v in QWEN25.items() if "window" not in k and "fullatt" not in k},
         "missing 'deepstack_visual_indexes'"),
        ("qwen2_vl", dict(depth=2, embed_dim=32, num_heads=4, patch_size=2, mlp_ratio=4), "missing 'hidden_size'"),
        ("qwen2_vl", dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=2),
         "missing 'mlp_ratio' or 'intermediate_size'"),
        ("qwen2_vl", dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=2, mlp_ratio=4,
                          intermediate_size=100), "intermediate_size=100 disagrees with embed_dim \\* mlp_ratio = 128"),
    ],
)
def test_bad_vision_configs(model_type, config, match):
    with pytest.raises(ValueError, match=match):
        VisionSpec.from_hf_vision_config(model_type, config)


def test_real_config_spellings():
    # Qwen2.5-VL-7B's vision_config as published (in_chans, spatial_patch_size, tokens_per_second).
    published = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                 "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                 "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                 "tokens_per_second": 2, "temporal_patch_size": 2}
    spec = VisionSpec.from_hf_vision_config("qwen2_5_vl", published)
    assert (spec.merged_window_size, spec.num_full_attention_blocks, spec.num_window_attention_blocks) == (4, 4, 28)
    assert spec.gated_mlp and spec.head_dim == 80
    # Qwen2-VL: embed_dim is the tower, hidden_size the merger output, mlp_ratio the MLP.
    spec = VisionSpec.from_hf_vision_config(
        "qwen2_vl_vision", {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                            "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2})
    assert (spec.hidden_size, spec.intermediate_size, spec.out_hidden_size, spec.gated_mlp) == (1280, 5120, 1536, False)


def test_bad_convention_and_model_file():
    with pytest.raises(ValueError, match="vision attention is bidirectional"):
        vision_training_flops(PLAIN, STATS, attention="causal")
    with pytest.raises(ValueError, match="needs 'model_type'"):
        vision_report({"vision_config": QWEN25}, [[1, 2, 2]])
    with pytest.raises(ValueError, match="'vision_config' must be a mapping"):
        vision_report({"model_type": "qwen2_5_vl"}, [[1, 2, 2]])
    with pytest.raises(ValueError, match="grid row 0"):
        vision_report({"model_type": "qwen2_5_vl", "vision_config": QWEN25}, [[1, 2, 3]])


def test_direct_spec_validation():
    with pytest.raises(ValueError, match="fullatt_block_indexes needs window_size"):
        dataclasses.replace(PLAIN, fullatt_block_indexes=(0,))
    with pytest.raises(ValueError, match="deepstack_visual_indexes has duplicates"):
        dataclasses.replace(PLAIN, deepstack_visual_indexes=(1, 1))
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        dataclasses.replace(PLAIN, depth=0)


# ---- (e) device statistics == pure statistics -------------------------------------------------


@pytest.mark.parametrize("spec", [PLAIN, WINDOWED, dataclasses.replace(WINDOWED, spatial_merge_size=1, window_size=6)],
                         ids=["full", "windowed", "windowed-merge1"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tensor_statistics_equal_pure(spec, dtype):
    rng = random.Random(1)
    m = spec.spatial_merge_size
    for _ in range(30):
        grids = [[rng.randint(1, 4), m * rng.randint(1, 40), m * rng.randint(1, 40)] for _ in range(rng.randint(0, 6))]
        vec = vision_stats_tensor(spec, torch.tensor(grids, dtype=dtype).reshape(-1, 3))
        assert vec.dtype == torch.int64 and vec.shape == (len(VISION_SLOTS),)
        assert vision_stats_from_vector(vec.tolist()) == VisionStats.from_grids(spec, grids)


def test_tensor_statistics_have_no_data_dependent_ops():
    # On the meta device any .item(), .tolist(), nonzero or data-dependent shape would raise.
    vec = vision_stats_tensor(WINDOWED, torch.empty(7, 3, dtype=torch.int64, device="meta"))
    assert vec.shape == (len(VISION_SLOTS),) and vec.device.type == "meta"


def test_tensor_bad_inputs():
    with pytest.raises(ValueError, match=r"grid_thw must be \[n, 3\], got shape \(3,\)"):
        vision_stats_tensor(PLAIN, torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match="grid_thw must hold integers, got torch.float32"):
        vision_stats_tensor(PLAIN, torch.ones(1, 3))
    with pytest.raises(ValueError, match="grid_thw must be a tensor"):
        vision_stats_tensor(PLAIN, [[1, 2, 2]])
    with pytest.raises(ValueError, match="expected 5 values"):
        vision_stats_from_vector([1, 2, 3])


@needs_hf
def test_cli_vision_only_model_file_equals_measured(tmp_path):
    # The contract: estimate --model FILE --grid-thw GRIDS --json, FILE holding only model_type
    # and vision_config; total_flops is the executed forward + backward that FlopCounterMode measures.
    import json
    import subprocess
    import sys

    vision_config, grids = HF_CASES["qwen2_5_vl"]
    config = _hf_config("qwen2_5_vl", vision_config)
    _, fwd_total, bwd_total = _measure(_hf_tower("qwen2_5_vl", config), grids)
    model_file = tmp_path / "vision.json"
    model_file.write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": vision_config}))
    out = subprocess.run(
        [sys.executable, "-m", "megatron_flops", "estimate", "--model", str(model_file),
         "--grid-thw", json.dumps(grids), "--json"],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(out.stdout)
    assert report["total_flops"] == fwd_total + bwd_total
    assert sum(report["components"].values()) == report["total_flops"]


def test_cli_bad_grid_exits_2(tmp_path, capsys):
    import json

    from megatron_flops.cli import main

    model_file = tmp_path / "vision.json"
    model_file.write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": HF_CASES["qwen2_5_vl"][0]}))
    assert main(["estimate", "--model", str(model_file), "--grid-thw", "[[1, 4]]"]) == 2
    assert "grid row 0" in capsys.readouterr().err
