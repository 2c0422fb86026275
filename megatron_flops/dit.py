"""Exact GEMM FLOPs of cross-attention and of a WAN-2.1-style video diffusion transformer (DiT)
(stdlib only: ints in, ints out).

Counted: every matrix multiply of the WAN-2.1 ``WanModel`` (Wan-Video/Wan2.1,
``wan/modules/model.py``), as ``torch.utils.flop_counter`` counts them:

- ``patch_embedding``: Conv3d with stride = kernel = ``patch_size``, one GEMM per video token.
- ``text_embedding``: Linear(text_dim, dim), GELU, Linear(dim, dim) on every text token.
- ``time_embedding``: Linear(freq_dim, dim), SiLU, Linear(dim, dim), once per sample (one
  timestep per sample); ``time_projection``: SiLU, Linear(dim, 6 dim), once per sample.
- Per block: self-attention (q, k, v, o: Linear(dim, dim) on video tokens; full attention within
  each sample), cross-attention (q, o on video tokens, k, v on text tokens), image-to-video's
  second key/value pair (``k_img``, ``v_img`` on the CLIP tokens, attended by the same queries,
  the two results summed before ``o``), and the FFN Linear(dim, ffn), GELU, Linear(ffn, dim).
- ``img_emb`` (image-to-video): LayerNorm, Linear(image_dim, image_dim), GELU,
  Linear(image_dim, dim), LayerNorm on the CLIP tokens.
- ``head``: Linear(dim, out_channels x prod(patch_size)) on video tokens.

NB: adaLN modulation runs one GEMM per sample, ``time_projection``. Each block's six
shift/scale/gate vectors (and the head's two) are a learned table *added* to that projection
(``self.modulation + e``): no per-block GEMM. Not counted: norms (incl. q/k RMSNorm), activations,
softmax, RoPE, the sinusoidal embedding, the modulation adds and multiplies, bias adds.

NB: model FLOPs use real lengths. WAN pads the text to ``text_len`` tokens and runs
cross-attention over all of them (``context_lens=None``), so its default text length per sample
is ``text_len``; give the real lengths where an implementation packs them (Megatron-Bridge's
WAN). WAN's batched path also pads video tokens to the batch maximum: not counted.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from megatron_flops.formulas import TRAIN_PASSES, FlopsBreakdown, attention_gemm, gemm
from megatron_flops.passes import MODEL_FLOPS_CONVENTIONS


def seqlens_from_cu_seqlens(cu_seqlens: Sequence[int], *, name: str = "cu_seqlens") -> tuple[int, ...]:
    """Per-sample lengths from cumulative offsets ``[0, s_0, s_0 + s_1, ...]``."""
    values = _ints(cu_seqlens, name, minimum=0)
    if len(values) < 2 or values[0] != 0:
        raise ValueError(f"{name} must start at 0 and hold at least two offsets, got {list(values)!r}")
    lengths = tuple(b - a for a, b in zip(values, values[1:]))
    if any(n <= 0 for n in lengths):
        raise ValueError(f"{name} must be strictly increasing, got {list(values)!r}")
    return lengths


def cross_attention_flops(
    *,
    query_seqlens: Sequence[int],
    kv_seqlens: Sequence[int],
    hidden_size: int,
    context_dim: int,
    num_heads: int,
    head_dim: int,
) -> dict[str, int]:
    """Forward FLOPs of one cross-attention layer: keys ``q``, ``kv``, ``core``, ``out``.

    Sample ``i`` has ``query_seqlens[i]`` query tokens (width ``hidden_size``) attending to
    ``kv_seqlens[i]`` key/value tokens (width ``context_dim``), without a mask.
    """
    queries, kvs = _paired(query_seqlens, kv_seqlens, "query_seqlens", "kv_seqlens")
    for name, value in (("hidden_size", hidden_size), ("context_dim", context_dim),
                        ("num_heads", num_heads), ("head_dim", head_dim)):
        _ints([value], name, minimum=1)
    width = num_heads * head_dim
    return {
        # q: [Sq, hidden] @ [hidden, heads*d].
        "q": gemm(sum(queries), hidden_size, width),
        # k and v: [Skv, context] @ [context, heads*d] each.
        "kv": gemm(sum(kvs), context_dim, 2 * width),
        # Per head and (query, key) pair: scores q.k and context p*v, d MACs each, every pair of
        # each sample (no causal mask).
        "core": 2 * attention_gemm(num_heads, head_dim, sum(q * k for q, k in zip(queries, kvs))),
        # out: [Sq, heads*d] @ [heads*d, hidden].
        "out": gemm(sum(queries), width, hidden_size),
    }


@dataclass(frozen=True, kw_only=True)
class DiTSpec:
    """A WAN-2.1-style DiT stack (``WanModel``), as far as GEMM FLOPs are concerned.

    ``image_dim`` (CLIP feature width, 1280 in WAN image-to-video) turns on the image
    cross-attention over ``image_len`` CLIP tokens per sample; ``None``: text-to-video.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    freq_dim: int = 256
    text_dim: int = 4096
    text_len: int = 512
    image_dim: int | None = None
    image_len: int = 257

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "patch_size":
                if not isinstance(value, tuple) or len(value) != 3:
                    raise ValueError(f"patch_size must be three integers (t, h, w), got {value!r}")
                _ints(value, "patch_size", minimum=1)
            elif not (f.name == "image_dim" and value is None):
                _ints([value], f.name, minimum=1)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "model file") -> DiTSpec:
        """From a mapping of this class's field names (a model file's ``"dit"`` section)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: 'dit' must be a mapping of DiTSpec fields")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in data if k not in known]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"{source}: unknown DiT key(s) {', '.join(hints)}")
        values = dict(data)
        if isinstance(values.get("patch_size"), list):
            values["patch_size"] = tuple(values["patch_size"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"{source}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def dit_forward_flops(
    spec: DiTSpec, video_seqlens: Sequence[int], text_seqlens: Sequence[int] | None = None
) -> dict[str, int]:
    """Forward FLOPs per component of the DiT over samples of ``video_seqlens[i]`` video tokens
    (after patchifying) and ``text_seqlens[i]`` text tokens (default: ``text_len`` each)."""
    video = _ints(video_seqlens, "video_seqlens", minimum=1)
    if not video:
        raise ValueError("video_seqlens is empty")
    text = (spec.text_len,) * len(video) if text_seqlens is None else text_seqlens
    video, text = _paired(video, text, "video_seqlens", "text_seqlens")
    h, n, d, L = spec.hidden_size, spec.num_heads, spec.head_dim, spec.num_layers
    num_samples, tokens, text_tokens = len(video), sum(video), sum(text)
    patch = math.prod(spec.patch_size)
    out: dict[str, int] = {}
    # patch_embedding: Conv3d, stride = kernel: [S, C_in*pt*ph*pw] @ [C_in*pt*ph*pw, h].
    out["dit/patch_embed"] = gemm(tokens, spec.in_channels * patch, h)
    # text_embedding: [C, text_dim] @ [text_dim, h], then [C, h] @ [h, h].
    out["dit/text_embed"] = gemm(text_tokens, spec.text_dim, h) + gemm(text_tokens, h, h)
    # time_embedding: [B, freq_dim] @ [freq_dim, h], then [B, h] @ [h, h] (one timestep per sample).
    out["dit/time_embed"] = gemm(num_samples, spec.freq_dim, h) + gemm(num_samples, h, h)
    # time_projection: [B, h] @ [h, 6h], shared by every block (see the module NB).
    out["dit/modulation"] = gemm(num_samples, h, 6 * h)
    if spec.image_dim is not None:
        images = num_samples * spec.image_len
        # img_emb: [M, 1280] @ [1280, 1280], then [M, 1280] @ [1280, h].
        out["dit/image_embed"] = gemm(images, spec.image_dim, spec.image_dim) + gemm(images, spec.image_dim, h)
    # Self-attention: q, k, v [S, h] @ [h, h] each; full attention within each sample; o [S, h] @ [h, h].
    self_attn = cross_attention_flops(query_seqlens=video, kv_seqlens=video, hidden_size=h,
                                      context_dim=h, num_heads=n, head_dim=d)
    out["dit/self_attn/qkv"] = L * (self_attn["q"] + self_attn["kv"])
    out["dit/self_attn/core"] = L * self_attn["core"]
    out["dit/self_attn/out"] = L * self_attn["out"]
    # Cross-attention: the text context is already h wide (text_embedding).
    cross = cross_attention_flops(query_seqlens=video, kv_seqlens=text, hidden_size=h,
                                  context_dim=h, num_heads=n, head_dim=d)
    out["dit/cross_attn/q"] = L * cross["q"]
    out["dit/cross_attn/kv"] = L * cross["kv"]
    out["dit/cross_attn/core"] = L * cross["core"]
    if spec.image_dim is not None:
        image = cross_attention_flops(query_seqlens=video, kv_seqlens=(spec.image_len,) * num_samples,
                                      hidden_size=h, context_dim=h, num_heads=n, head_dim=d)
        # k_img, v_img on the CLIP tokens and their attention; q and o are shared with the text.
        out["dit/cross_attn/image_kv"] = L * image["kv"]
        out["dit/cross_attn/image_core"] = L * image["core"]
    out["dit/cross_attn/out"] = L * cross["out"]
    # FFN: [S, h] @ [h, ffn], [S, ffn] @ [ffn, h].
    out["dit/mlp"] = L * (gemm(tokens, h, spec.ffn_hidden_size) + gemm(tokens, spec.ffn_hidden_size, h))
    # head: [S, h] @ [h, C_out*pt*ph*pw].
    out["dit/head"] = gemm(tokens, h, spec.out_channels * patch)
    return out


def dit_training_flops(
    spec: DiTSpec,
    video_seqlens: Sequence[int],
    text_seqlens: Sequence[int] | None = None,
    *,
    convention: str = "needed",
) -> FlopsBreakdown:
    """Forward + backward FLOPs per component.

    NB (``"needed"``, as :mod:`megatron_flops.passes` defines it): the GEMMs fed by data (video
    latents into the patch embedding, frozen-T5 features into ``text_embedding``'s first
    Linear, the sinusoid into ``time_embedding``'s first Linear) run forward + weight gradient
    only; every other GEMM all TRAIN_PASSES (``img_emb``'s first Linear follows a LayerNorm
    with trainable weights, so it needs its input gradient). ``"train_passes"``: TRAIN_PASSES x
    every GEMM.
    """
    if convention not in MODEL_FLOPS_CONVENTIONS:
        raise ValueError(f"unknown model FLOPs convention {convention!r}; use one of {MODEL_FLOPS_CONVENTIONS}")
    fwd = dit_forward_flops(spec, video_seqlens, text_seqlens)
    components = {k: TRAIN_PASSES * v for k, v in fwd.items()}
    if convention == "needed":
        num_samples = len(video_seqlens)
        text_tokens = sum(text_seqlens) if text_seqlens is not None else spec.text_len * num_samples
        components["dit/patch_embed"] -= fwd["dit/patch_embed"]
        components["dit/text_embed"] -= gemm(text_tokens, spec.text_dim, spec.hidden_size)
        components["dit/time_embed"] -= gemm(num_samples, spec.freq_dim, spec.hidden_size)
    return FlopsBreakdown(components=components, attention="full")


def _ints(values: Any, name: str, *, minimum: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must hold integers, got {v!r}")
        if v < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return tuple(values)


def _paired(a: Any, b: Any, name_a: str, name_b: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    first, second = _ints(a, name_a, minimum=1), _ints(b, name_b, minimum=1)
    if len(first) != len(second):
        raise ValueError(f"{name_a} has {len(first)} samples but {name_b} has {len(second)}")
    return first, second


def dit_report(
    section: Mapping[str, Any],
    video_seqlens: Sequence[int],
    text_seqlens: Sequence[int] | None = None,
    *,
    convention: str = "needed",
) -> dict[str, Any]:
    """What ``estimate --json`` prints for a model file's ``"dit"`` section: model FLOPs under
    ``convention``, components, statistics. ``executed_flops`` is the ``"needed"`` count (see
    the module NB on padding)."""
    spec = DiTSpec.from_mapping(section)
    model = dit_training_flops(spec, video_seqlens, text_seqlens, convention=convention)
    text = tuple(text_seqlens) if text_seqlens is not None else (spec.text_len,) * len(video_seqlens)
    # NB: the static number prices every sample at the longest video of the batch with the full
    # text length, as fixed-shape formulas (and a batch padded to its longest sample) do.
    longest = max(video_seqlens)
    static = dit_training_flops(spec, [longest] * len(video_seqlens), None, convention=convention).total
    return {
        "total_flops": model.total,
        "static_flops": static,
        "static_seq_length": longest,
        "over_report_factor": static / model.total,
        "components": dict(model.components),
        "executed_flops": dit_training_flops(spec, video_seqlens, text_seqlens).total,
        "model_flops_convention": convention,
        "attention": "full",
        "num_samples": len(video_seqlens),
        "num_video_tokens": sum(video_seqlens),
        "num_text_tokens": sum(text),
        "sum_video_seqlen_squared": sum(s * s for s in video_seqlens),
        "sum_cross_pairs": sum(s * c for s, c in zip(video_seqlens, text)),
    }
