"""Exact GEMM FLOPs of Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers from ``grid_thw`` rows
(stdlib only: ints in, ints out).

Counted: every matrix multiply the Hugging Face vision tower runs, as
``torch.utils.flop_counter`` counts them: the Conv3d patch embedding (a stride-equals-kernel
convolution, i.e. one GEMM per patch), per block the fused QKV projection, core attention,
output projection and MLP, then the patch merger (and Qwen3-VL's deep-stack mergers).
Not counted: norms, activations, softmax, 2D RoPE, Qwen3-VL's interpolated position
embedding (an embedding lookup and weighted sum), bias adds, the window reordering.

A grid row ``(t, h, w)`` is an image (``t = 1``) or a video, in patches, as the image processor's
``image_grid_thw``/``video_grid_thw`` give it: ``t * h * w`` patches, ``t * h * w / m^2`` tokens
after the ``m x m`` spatial merge.

NB: vision attention is bidirectional: every block attends over whole frames (each of the ``t``
frames of a row attends within its own ``h * w`` patches, as ``cu_seqlens`` splits them), or over
windows of the merged grid (Qwen2.5-VL's window blocks). The only convention is ``"full"``: the
Megatron ``"causal"`` halving describes masked decoder attention and has no meaning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from megatron_flops.flops.formulas import TRAIN_PASSES, FlopsBreakdown, attention_gemm, gemm

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
VISION_ATTENTION_CONVENTIONS = ("full",)


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """A Qwen-VL vision tower, as far as GEMM FLOPs are concerned.

    ``window_size`` (pixels, Qwen2.5-VL) turns every block not in ``fullatt_block_indexes`` into a
    window-attention block over ``window_size // (spatial_merge_size * patch_size)``-wide windows
    of the merged grid; ``None``: every block attends over whole frames.
    ``deepstack_visual_indexes`` (Qwen3-VL): blocks whose output also feeds one extra merger.
    """

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    gated_mlp: bool
    patch_size: int
    out_hidden_size: int
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int | None = None
    fullatt_block_indexes: tuple[int, ...] = ()
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "out_hidden_size",
                     "temporal_patch_size", "in_channels", "spatial_merge_size"):
            _check_int(getattr(self, name), name)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}")
        if self.window_size is None:
            if self.fullatt_block_indexes:
                raise ValueError("fullatt_block_indexes needs window_size")
        else:
            _check_int(self.window_size, "window_size")
            unit = self.spatial_merge_size * self.patch_size
            if self.window_size < unit:
                raise ValueError(
                    f"window_size={self.window_size} is smaller than one merged patch "
                    f"(spatial_merge_size * patch_size = {unit} pixels)"
                )
        for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            indexes = getattr(self, name)
            if not isinstance(indexes, tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.depth for i in indexes
            ):
                raise ValueError(f"{name} must be a tuple of block indexes in [0, {self.depth}), got {indexes!r}")
            if len(set(indexes)) != len(indexes):
                raise ValueError(f"{name} has duplicates: {indexes!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_window_size(self) -> int | None:
        """Window side in merged tokens (Hugging Face's ``vit_merger_window_size``)."""
        if self.window_size is None:
            return None
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def num_full_attention_blocks(self) -> int:
        return self.depth if self.window_size is None else len(self.fullatt_block_indexes)

    @property
    def num_window_attention_blocks(self) -> int:
        return self.depth - self.num_full_attention_blocks

    @classmethod
    def from_hf_vision_config(
        cls, model_type: str, vision_config: Mapping[str, Any], *, text_hidden_size: int | None = None
    ) -> VisionSpec:
        """Build from a Hugging Face ``vision_config`` of ``model_type`` (see SUPPORTED_MODEL_TYPES).

        Qwen2-VL names the tower width ``embed_dim`` and the merger output ``hidden_size`` (the
        language model's width: ``text_hidden_size`` when the vision config lacks it) and sizes
        its MLP by ``mlp_ratio``; the later models name them ``hidden_size``/``out_hidden_size``/
        ``intermediate_size``. ``in_channels``, ``temporal_patch_size`` and ``spatial_merge_size``
        default to 3, 2, 2 as in every Hugging Face Qwen-VL vision config.
        """
        kind = model_type.removesuffix("_vision") if isinstance(model_type, str) else model_type
        if kind not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"vision model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        if not isinstance(vision_config, Mapping):
            raise ValueError(f"vision_config must be a mapping, got {type(vision_config).__name__}")
        source = f"{kind} vision_config"
        get = lambda names, default=None: _field(vision_config, names, default, source)  # noqa: E731
        out: dict[str, Any] = {
            "depth": get(("depth", "num_hidden_layers")),
            "num_heads": get(("num_heads", "num_attention_heads")),
            "patch_size": get(("patch_size",)),
            "temporal_patch_size": get(("temporal_patch_size",), 2),
            "in_channels": get(("in_channels", "in_chans"), 3),
            "spatial_merge_size": get(("spatial_merge_size",), 2),
        }
        if kind == "qwen2_vl":
            width = get(("embed_dim",))
            out["hidden_size"] = width
            out["out_hidden_size"] = get(("hidden_size",), text_hidden_size)
            out["intermediate_size"] = _qwen2_vl_mlp_size(vision_config, width, source)
            out["gated_mlp"] = False
        else:
            out["hidden_size"] = get(("hidden_size", "embed_dim"))
            out["out_hidden_size"] = get(("out_hidden_size",))
            out["intermediate_size"] = get(("intermediate_size",))
            # NB: Qwen2.5-VL's blocks run a gated (gate/up/down) MLP; Qwen2-VL's and Qwen3-VL's a plain fc1/fc2.
            out["gated_mlp"] = kind == "qwen2_5_vl"
        if kind == "qwen2_5_vl":
            out["window_size"] = get(("window_size",))
            out["fullatt_block_indexes"] = _indexes(get(("fullatt_block_indexes",)), "fullatt_block_indexes", source)
        if kind in ("qwen3_vl", "qwen3_vl_moe"):
            out["deepstack_visual_indexes"] = _indexes(
                get(("deepstack_visual_indexes",)), "deepstack_visual_indexes", source
            )
        try:
            return cls(**out)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def _qwen2_vl_mlp_size(config: Mapping[str, Any], width: Any, source: str) -> int:
    """Qwen2-VL's MLP width ``int(embed_dim * mlp_ratio)``, or an explicit ``intermediate_size``."""
    ratio, size = config.get("mlp_ratio"), config.get("intermediate_size")
    if ratio is None:
        if size is None:
            raise ValueError(f"{source}: missing 'mlp_ratio' or 'intermediate_size'")
        return size
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
        raise ValueError(f"{source}: 'mlp_ratio' must be a positive number, got {ratio!r}")
    if not _is_int(width):
        raise ValueError(f"{source}: 'embed_dim' must be a positive integer, got {width!r}")
    from_ratio = int(width * ratio)
    if size is not None and size != from_ratio:
        raise ValueError(f"{source}: intermediate_size={size!r} disagrees with embed_dim * mlp_ratio = {from_ratio}")
    return from_ratio


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value: Any, name: str) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _field(config: Mapping[str, Any], names: tuple[str, ...], default: Any, source: str) -> Any:
    """The value under the first of ``names`` present (aliases must agree), else ``default``."""
    present = [(n, config[n]) for n in names if config.get(n) is not None]
    if len({repr(v) for _, v in present}) > 1:
        raise ValueError(f"{source}: aliases disagree: {', '.join(f'{n}={v!r}' for n, v in present)}")
    if present:
        return present[0][1]
    if default is None:
        raise ValueError(f"{source}: missing {' or '.join(repr(n) for n in names)}")
    return default


def _indexes(value: Any, name: str, source: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(i) for i in value):
        raise ValueError(f"{source}: {name!r} must be a list of block indexes, got {value!r}")
    return tuple(value)


# ---- the data side: grid rows and their additive statistics ----------------------------------


def parse_grids(grids: Any, *, spatial_merge_size: int = 1) -> tuple[tuple[int, int, int], ...]:
    """Validate ``grids``: a list of ``[t, h, w]`` rows of positive integers (patches), with
    ``h`` and ``w`` multiples of ``spatial_merge_size``. An empty list means no images."""
    if not isinstance(grids, (list, tuple)):
        raise ValueError(f"grids must be a list of [t, h, w] rows, got {type(grids).__name__}")
    out = []
    for i, row in enumerate(grids):
        if not isinstance(row, (list, tuple)) or len(row) != 3:
            raise ValueError(f"grid row {i}: must be [t, h, w], got {row!r}")
        for name, v in zip("thw", row):
            if not _is_int(v) or v < 1:
                raise ValueError(f"grid row {i}: {name} must be a positive integer, got {v!r}")
        t, h, w = row
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(
                f"grid row {i}: h={h} and w={w} must be multiples of spatial_merge_size={spatial_merge_size}"
            )
        out.append((t, h, w))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class VisionStats:
    """Additive statistics of a set of grid rows: all that the vision formulas read from data.

    Each is a sum over rows of an integer polynomial in ``(t, h, w)`` (see ``grid_row_terms``):
    ``num_patches = sum t*h*w``; ``sum_frame_patches_squared = sum t*(h*w)^2`` (full-attention
    pairs: each frame attends within itself); ``window_pairs`` (window-attention pairs, 0 when
    the tower has no windows).
    """

    num_images: int = 0
    num_frames: int = 0
    num_patches: int = 0
    sum_frame_patches_squared: int = 0
    window_pairs: int = 0

    def __add__(self, other: VisionStats) -> VisionStats:
        return VisionStats(**{k: getattr(self, k) + getattr(other, k) for k in VISION_STAT_FIELDS})

    @classmethod
    def from_grids(cls, spec: VisionSpec, grids: Any) -> VisionStats:
        """Statistics of ``grids`` (validated with ``parse_grids``) for ``spec``."""
        rows = parse_grids(grids, spatial_merge_size=spec.spatial_merge_size)
        acc = dict.fromkeys(VISION_STAT_FIELDS, 0)
        acc["num_images"] = len(rows)
        for t, h, w in rows:
            for k, v in grid_row_terms(spec, t, h, w).items():
                acc[k] += v
        return cls(**acc)


VISION_STAT_FIELDS = tuple(f.name for f in fields(VisionStats))


def window_square_sum(n: Any, window: int) -> Any:
    """``sum`` of squared window extents when ``n`` cells are cut into ``window``-wide windows:
    ``n // window`` full windows and one remainder window of ``n % window``."""
    return (n // window) * window * window + (n % window) ** 2


def grid_row_terms(spec: VisionSpec, t: Any, h: Any, w: Any) -> dict[str, Any]:
    """Per-row terms of every VisionStats field but ``num_images`` (which counts rows).

    Written with integer operators only, so ``vision_torch`` applies it elementwise to int64
    tensors. Window attention (Qwen2.5-VL, Hugging Face ``get_vision_window_index``): each frame's
    merged ``H x W`` grid (``H = h/m``, ``W = w/m``) is cut into ``k x k`` windows, ``k`` the merged
    window size, edge windows truncated; a window of ``a x b`` merged tokens holds ``a*b*m^2``
    patches, so a frame's pairs are ``sum_{a,b} (a*b*m^2)^2 = m^4 * S(H) * S(W)`` with
    ``S = window_square_sum``.
    """
    hw = h * w
    m = spec.spatial_merge_size
    k = spec.merged_window_size
    return {
        "num_frames": t,
        "num_patches": t * hw,
        "sum_frame_patches_squared": t * hw * hw,
        "window_pairs": t * 0 if k is None else t * m**4 * window_square_sum(h // m, k) * window_square_sum(w // m, k),
    }


# ---- the model side: FLOPs of each component -------------------------------------------------


def vision_forward_flops(spec: VisionSpec, stats: VisionStats, *, attention: str = "full") -> dict[str, int]:
    """Forward-pass FLOPs of the vision tower per component over ``stats``."""
    _check_attention(attention)
    p = stats.num_patches
    d, f = spec.hidden_size, spec.intermediate_size
    m2 = spec.spatial_merge_size**2
    # Merger rows: m^2 neighbouring patches concatenated into one token.
    merged = p // m2
    out: dict[str, int] = {}
    # Conv3d with stride = kernel = (tp, p, p): [P, C*tp*p*p] @ [C*tp*p*p, D].
    # NB: priced as the GEMM it is (FlopCounterMode counts the convolution the same way).
    out["vit/patch_embed"] = gemm(p, spec.in_channels * spec.temporal_patch_size * spec.patch_size**2, d)
    # qkv: [P, D] @ [D, 3D], per block.
    out["vit/attn/qkv"] = spec.depth * gemm(p, d, 3 * d)
    # Per head and pair: scores q.k (head_dim MACs) and context p*v (head_dim MACs); full-attention
    # blocks over every frame's pairs, window blocks over the window pairs.
    # NB: a video's frames attend separately (one cu_seqlens segment per frame), so full attention
    # is sum t*(h*w)^2, not sum (t*h*w)^2.
    pairs = spec.num_full_attention_blocks * stats.sum_frame_patches_squared
    pairs += spec.num_window_attention_blocks * stats.window_pairs
    out["vit/attn/core"] = 2 * attention_gemm(spec.num_heads, spec.head_dim, pairs)
    # proj: [P, D] @ [D, D], per block.
    out["vit/attn/out"] = spec.depth * gemm(p, d, d)
    # fc1 [P, D] @ [D, F] (gate and up: [D, 2F] when gated), fc2/down [P, F] @ [F, D], per block.
    out["vit/mlp"] = spec.depth * (gemm(p, d, f * (2 if spec.gated_mlp else 1)) + gemm(p, f, d))
    # Merger MLP: [P/m^2, D*m^2] @ [D*m^2, D*m^2], then [P/m^2, D*m^2] @ [D*m^2, out].
    merger = gemm(merged, d * m2, d * m2) + gemm(merged, d * m2, spec.out_hidden_size)
    out["vit/merger"] = merger
    if spec.deepstack_visual_indexes:
        # One merger of the same shapes per deep-stack block.
        out["vit/deepstack_merger"] = len(spec.deepstack_visual_indexes) * merger
    return out


def vision_training_flops(
    spec: VisionSpec, stats: VisionStats, *, attention: str = "full", patch_embed_input_grad: bool = False
) -> FlopsBreakdown:
    """Forward + backward FLOPs per component: TRAIN_PASSES x the forward GEMMs, except the
    patch embedding's input gradient.

    NB: pixel values need no gradient, so the patch embedding's backward runs only its weight
    gradient (forward + 1 of the 2 backward GEMMs); ``patch_embed_input_grad=True`` prices the
    input gradient too. Every other GEMM runs all TRAIN_PASSES: the patch embedding's output
    carries a gradient, so every later input needs one. A frozen tower is not modelled.
    """
    fwd = vision_forward_flops(spec, stats, attention=attention)
    components = {k: TRAIN_PASSES * v for k, v in fwd.items()}
    if not patch_embed_input_grad:
        components["vit/patch_embed"] = (TRAIN_PASSES - 1) * fwd["vit/patch_embed"]
    return FlopsBreakdown(components=components, attention=attention)


def _check_attention(attention: str) -> None:
    if attention not in VISION_ATTENTION_CONVENTIONS:
        raise ValueError(
            f"vision attention convention must be one of {VISION_ATTENTION_CONVENTIONS} (vision attention "
            f"is bidirectional), got {attention!r}"
        )


# ---- model files -----------------------------------------------------------------------------


def vision_spec_from_model_mapping(data: Mapping[str, Any]) -> VisionSpec:
    """The vision tower of a Hugging Face style model mapping (``model_type`` + ``vision_config``)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"model file: the top level must be a mapping, got {type(data).__name__}")
    if "model_type" not in data:
        raise ValueError(f"model file: a vision tower needs 'model_type' (one of {SUPPORTED_MODEL_TYPES})")
    vision = data.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ValueError("model file: 'vision_config' must be a mapping")
    text = data.get("text_config")
    text_hidden = (text if isinstance(text, Mapping) else data).get("hidden_size")
    return VisionSpec.from_hf_vision_config(data["model_type"], vision, text_hidden_size=text_hidden)


def vision_report(raw_model_mapping: Mapping[str, Any], grids: Any) -> dict[str, Any]:
    """Training (forward + backward) FLOPs of the vision tower of ``raw_model_mapping`` over
    ``grids``: the executed count, as ``FlopCounterMode`` measures it. A text decoder in the
    mapping is ignored (priced by the decoder formulas)."""
    spec = vision_spec_from_model_mapping(raw_model_mapping)
    stats = VisionStats.from_grids(spec, grids)
    flops = vision_training_flops(spec, stats)
    return {
        "total_flops": flops.total,
        "components": dict(flops.components),
        "num_visual_tokens": stats.num_patches // spec.spatial_merge_size**2,
        **{k: getattr(stats, k) for k in VISION_STAT_FIELDS},
    }
