"""Megatron-Bridge's ``vlm_step.forward_step`` with a tiny ``Qwen25VLModelProvider`` on CPU: the model,
a dataset of images of known sizes and its expected numbers (test-only).

The language model: 2 layers, hidden 64, 4 heads, GELU 256, MRoPE, vocabulary 4096, rows of 64
tokens. The vision tower: Hugging Face's Qwen2.5-VL ViT, 2 blocks of hidden 32 (2 heads, gated MLP
64), 2x2-pixel patches over 2 frames, 2x2 spatial merge into 64-wide tokens; its attention window
(32 pixels) covers every test image, so windowed and full blocks both attend within each image.

Each sample is one image (a grid ``[1, h, w]`` of patches, sizes differing between micro-batches)
inside text: ``[vision_start, image x h*w/4, vision_end]`` at the start of the row. The batches carry
``pixel_values`` and ``image_grid_thw`` inside ``visual_inputs`` (``Qwen2_5_VLVisualInputs``), as
Megatron-Bridge's own VLM collate functions make them.
"""

from __future__ import annotations

import random

from frameworks import bridge

LAYERS, HIDDEN, HEADS, FFN, SEQ, VOCAB = 2, 64, 4, 256, 64, 4096
VIT_DEPTH, VIT_HIDDEN, VIT_HEADS, VIT_FFN, PATCH, MERGE, FRAMES = 2, 32, 2, 64, 2, 2, 2
PATCH_DIM = 3 * FRAMES * PATCH * PATCH  # one patch's pixels: channels x frames x patch x patch
TOKENS = dict(bos_token_id=4089, vision_start_token_id=4090, vision_end_token_id=4091, vision_token_id=4092,
              image_token_id=4093, video_token_id=4094, eos_token_id=4095)
# Patch grids [t, h, w] of the images, sample i takes GRIDS[i % 5]: sizes differ between micro-batches.
GRIDS = ((1, 4, 4), (1, 8, 4), (1, 4, 8), (1, 6, 6), (1, 8, 8))
# Real lengths of the rows under in-batch packing (padded with 0 to SEQ in the batch).
PACKED_LENGTHS = (40, 57, 23, 64, 31, 48)


def grid(index: int) -> tuple[int, int, int]:
    return GRIDS[index % len(GRIDS)]


def row_length(s: bridge.Scenario, index: int) -> int:
    """Real tokens of sample ``index``: PACKED_LENGTHS when packed, or on 0.6.2 (whose collate pads
    rows to a multiple of 16 only); SEQ otherwise."""
    return PACKED_LENGTHS[index % len(PACKED_LENGTHS)] if s.packed or s.release != "0.3.1" else SEQ


def width(lengths: list[int], multiple: int) -> int:
    """The micro-batch's row width: its longest row padded to ``multiple`` (at most SEQ)."""
    return min(SEQ, -(-max(lengths) // multiple) * multiple)


def sample(s: bridge.Scenario, index: int) -> dict:
    """Sample ``index``: ``input_ids`` (no 0: 0 pads the rows), its pixels and its grid."""
    import torch

    t, h, w = grid(index)
    rng = random.Random(index)
    n_image = t * h * w // (MERGE * MERGE)
    text = row_length(s, index) - n_image - 2
    assert text >= 1, (index, text)
    ids = ([TOKENS["vision_start_token_id"]] + [TOKENS["image_token_id"]] * n_image
           + [TOKENS["vision_end_token_id"]] + [rng.randrange(1, 4000) for _ in range(text)])
    pixels = torch.randn(t * h * w, PATCH_DIM, generator=torch.Generator().manual_seed(index))
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": [t, h, w]}


def collate(samples: list[dict], multiple: int = SEQ) -> dict:
    """Rows padded with 0 to ``width(multiple)`` (0.3.1: SEQ; 0.6.2: a multiple of 16, as its
    collate functions pad), next-token labels, and the images inside ``visual_inputs``."""
    import torch

    try:
        from megatron.bridge.training.utils.visual_inputs import Qwen2_5_VLVisualInputs as Visual  # 0.3.1
    except ImportError:
        from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs as Visual  # 0.6

    SEQ = width([len(item["input_ids"]) for item in samples], multiple)  # noqa: N806 (the batch's width)
    ids = torch.zeros(len(samples), SEQ, dtype=torch.long)
    for row, item in enumerate(samples):
        ids[row, : len(item["input_ids"])] = torch.tensor(item["input_ids"])
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    loss_mask = (labels != 0).float()
    labels[labels == 0] = -100
    return {
        "input_ids": ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(SEQ).expand(len(samples), SEQ).clone(),
        "visual_inputs": Visual(
            pixel_values=torch.cat([item["pixel_values"] for item in samples]),
            image_grid_thw=torch.tensor([item["image_grid_thw"] for item in samples]),
        ),
    }


def model_provider(s: bridge.Scenario):
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.models.qwen_vl.qwen25_vl_provider import Qwen25VLModelProvider
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    vision = Qwen2_5_VLVisionConfig(
        depth=VIT_DEPTH, hidden_size=VIT_HIDDEN, num_heads=VIT_HEADS, intermediate_size=VIT_FFN, patch_size=PATCH,
        spatial_merge_size=MERGE, temporal_patch_size=FRAMES, window_size=32, fullatt_block_indexes=[1],
        out_hidden_size=HIDDEN, hidden_act="silu",
    )
    return Qwen25VLModelProvider(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN, seq_length=SEQ,
        vocab_size=VOCAB, mrope_section=[2, 3, 3], vision_config=vision, transformer_layer_spec=local_layer_spec,
        **TOKENS, **bridge.CPU_MODEL_SETTINGS,
    )


def dataset_provider(s: bridge.Scenario):
    """A ``DatasetProvider`` over ``sample()`` with ``collate()``; ``pack_sequences_in_batch`` is the
    dataset option ``vlm_step`` reads for in-batch packing."""
    from dataclasses import dataclass

    import torch
    from megatron.bridge.training.config import DatasetProvider

    class Samples(torch.utils.data.Dataset):
        def __init__(self, size: int) -> None:
            self.size = size

        def __len__(self) -> int:
            return self.size

        def __getitem__(self, index: int) -> dict:
            return sample(s, index)

        def collate_fn(self, samples: list[dict]) -> dict:
            return collate(samples, SEQ if s.release == "0.3.1" else 16)

    @dataclass(kw_only=True)
    class Images(DatasetProvider):
        pack_sequences_in_batch: bool = False

        def build_datasets(self, context):
            return Samples(context.train_samples), None, None

    return Images(pack_sequences_in_batch=s.packed, dataloader_type="single", num_workers=0, pin_memory=False)


# ---- expected numbers ------------------------------------------------------------------------------


def lm_per_token_flops() -> int:
    """As ``megatron_lm.per_token_flops`` for this language model: 3 passes x 2 FLOPs x (QKV h x 3h,
    output h x h, MLP h x f and f x h per layer; logits h x V)."""
    return 3 * 2 * (LAYERS * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN) + HIDDEN * VOCAB)


def lm_attention_flops(sum_seqlen_squared: int) -> int:
    """Causal core attention: 3 passes x 2 FLOPs x 2 GEMMs x s^2/2 x h per layer and sequence."""
    return 3 * 2 * 2 * LAYERS * HIDDEN * sum_seqlen_squared // 2


def vision_flops(t: int, h: int, w: int) -> int:
    """Executed forward + backward FLOPs of the ViT on one image of t x h x w patches (P of them).

    The patch embedding (a Conv3d, a GEMM P x PATCH_DIM x d) runs forward and its weight gradient only
    (the pixels need no gradient): 2 passes. Every other GEMM runs 3 passes. Per block: QKV d x 3d,
    output d x d, gated MLP d x f (gate, up) and f x d, and full attention within each frame
    (QK^T and PV, 2 x (h*w)^2 x d per frame, no causal halving). The merger: its two GEMMs on
    P/4 merged tokens, 4d x 4d then 4d x D (D = the language model's hidden size)."""
    p, d, f, m2 = t * h * w, VIT_HIDDEN, VIT_FFN, MERGE * MERGE
    patch_embed = 2 * 2 * p * PATCH_DIM * d
    block = 2 * p * (3 * d * d + d * d + 3 * d * f) + 2 * 2 * t * (h * w) ** 2 * d
    merger = 2 * (p // m2) * (m2 * d) * (m2 * d + HIDDEN)
    return patch_embed + 3 * (VIT_DEPTH * block + merger)


def expected_step(s: bridge.Scenario, iteration: int) -> dict[str, int]:
    """The trace integers of one step (its static number is Megatron-Bridge's own and not derived here).

    Unpacked rows are full (SEQ tokens). Packed in the batch, each row counts its real length
    (``vlm_step`` drops the 0 padding and runs the rows as one THD row): nothing padded is executed."""
    first = (iteration - 1) * s.global_batch
    indices = range(first, first + s.global_batch)
    lengths = [row_length(s, i) for i in indices]
    if s.release != "0.3.1" and not s.packed:  # each micro-batch's rows run at its width
        lengths = [width(lengths[m:m + s.micro_batch], 16) for m in range(0, len(lengths), s.micro_batch)
                   for _ in range(s.micro_batch)]
    vit = sum(vision_flops(*grid(i)) for i in indices)
    flops = sum(lengths) * lm_per_token_flops() + lm_attention_flops(sum(n * n for n in lengths)) + vit
    return {
        "iteration": iteration,
        "flops": flops,
        "executed_flops": flops,
        "num_tokens": sum(lengths),
        "num_padded_tokens": sum(lengths),
        "num_sequences": len(lengths),
        "num_microbatches": s.num_microbatches,
    }


def framework_vision_flops(grids: list[tuple[int, int, int]]) -> float:
    """Megatron-Bridge 0.6.2's own ViT number for one step's images (``flop_utils.vit_flops``,
    a float): every image priced at the step's mean patch count, per block QKV and output
    (8 d^2), full attention over that mean (4 d P) and a two-GEMM MLP (4 d f: a gated MLP has
    three), the merger's two GEMMs; no patch embedding; x3 for training."""
    d, f, m2 = VIT_HIDDEN, VIT_FFN, MERGE * MERGE
    p = sum(t * h * w for t, h, w in grids) / len(grids)
    block = (8 * d * d + 4 * d * p + 4 * d * f) * p
    merger = (p // m2) * (2 * (m2 * d) ** 2 + 2 * m2 * d * HIDDEN)
    return (VIT_DEPTH * block + merger) * len(grids) * 3
