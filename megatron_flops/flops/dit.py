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

Also here: the LoRA target names of a DiT block and parameter counts. Training passes with a
frozen base, LoRA and per-block checkpointing: :mod:`megatron_flops.flops.dit_passes`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from megatron_flops.flops.formulas import Gemm, attention_gemm, gemm
from megatron_flops.flops.passes import PeftSpec


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
    ``qk_norm`` and ``cross_attn_norm`` (WAN's defaults) add norm weights: parameter counts only.
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
    qk_norm: bool = True
    cross_attn_norm: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("qk_norm", "cross_attn_norm"):
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be true or false, got {value!r}")
            elif f.name == "patch_size":
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


@dataclass(frozen=True, kw_only=True)
class DiTStats:
    """Additive statistics of DiT samples: all the FLOPs depend on. Sample ``i`` has ``s_i`` video
    tokens, ``c_i`` text tokens and ``m_i`` image (CLIP) tokens."""

    num_samples: int = 0
    num_video_tokens: int = 0
    num_text_tokens: int = 0
    num_image_tokens: int = 0
    sum_video_seqlen_squared: int = 0
    sum_text_pairs: int = 0  # sum s_i * c_i
    sum_image_pairs: int = 0  # sum s_i * m_i

    @classmethod
    def from_seqlens(
        cls,
        spec: DiTSpec,
        video_seqlens: Sequence[int],
        text_seqlens: Sequence[int] | None = None,
        image_seqlens: Sequence[int] | None = None,
    ) -> DiTStats:
        """Per-sample lengths; text defaults to ``text_len`` per sample, image (image-to-video
        only) to ``image_len``."""
        video = _ints(video_seqlens, "video_seqlens", minimum=1)
        if not video:
            raise ValueError("video_seqlens is empty")
        text = (spec.text_len,) * len(video) if text_seqlens is None else text_seqlens
        video, text = _paired(video, text, "video_seqlens", "text_seqlens")
        if spec.image_dim is None:
            if image_seqlens is not None:
                raise ValueError("image_seqlens given for a text-to-video DiT (no image_dim)")
            image: tuple[int, ...] = (0,) * len(video)
        else:
            _, image = _paired(video, (spec.image_len,) * len(video) if image_seqlens is None else image_seqlens,
                               "video_seqlens", "image_seqlens")
        return cls(
            num_samples=len(video),
            num_video_tokens=sum(video),
            num_text_tokens=sum(text),
            num_image_tokens=sum(image),
            sum_video_seqlen_squared=sum(v * v for v in video),
            sum_text_pairs=sum(v * c for v, c in zip(video, text)),
            sum_image_pairs=sum(v * m for v, m in zip(video, image)),
        )


    @classmethod
    def full_context(
        cls, spec: DiTSpec, *, num_samples: int, num_video_tokens: int, sum_video_seqlen_squared: int
    ) -> DiTStats:
        """Samples with these video totals, each with the full ``text_len`` text (and, image-to-video,
        ``image_len`` CLIP) tokens: what a fixed-shape formula assumes."""
        image_len = 0 if spec.image_dim is None else spec.image_len
        return cls(
            num_samples=num_samples,
            num_video_tokens=num_video_tokens,
            num_text_tokens=num_samples * spec.text_len,
            num_image_tokens=num_samples * image_len,
            sum_video_seqlen_squared=sum_video_seqlen_squared,
            sum_text_pairs=num_video_tokens * spec.text_len,
            sum_image_pairs=num_video_tokens * image_len,
        )


@dataclass(frozen=True, kw_only=True)
class DiTForward:
    """Every forward GEMM of a DiT over some samples: the embeddings, one block (every block runs
    the same GEMMs, ``num_blocks`` times), then the head."""

    embeddings: tuple[Gemm, ...]
    block: tuple[Gemm, ...]
    head: tuple[Gemm, ...]
    num_blocks: int

    def flops(self) -> dict[str, int]:
        """Forward FLOPs per component."""
        out: dict[str, int] = {}
        for gemms, times in ((self.embeddings, 1), (self.block, self.num_blocks), (self.head, 1)):
            for g in gemms:
                out[g.key] = out.get(g.key, 0) + times * g.flops
        return out


def dit_forward_gemms(spec: DiTSpec, stats: DiTStats) -> DiTForward:
    """The forward GEMMs over ``stats``, named after ``WanModel``'s modules (block GEMMs without
    the ``blocks.{i}.`` prefix; core attention is ``*.scores`` and ``*.context``)."""
    h, n, d = spec.hidden_size, spec.num_heads, spec.head_dim
    B, S, C, M = stats.num_samples, stats.num_video_tokens, stats.num_text_tokens, stats.num_image_tokens
    patch = math.prod(spec.patch_size)
    out: list[Gemm] = []

    def linear(key: str, name: str, rows: int, d_in: int, d_out: int) -> None:
        out.append(Gemm(key=key, name=name, flops=gemm(rows, d_in, d_out), shape=(rows, d_in, d_out)))

    def core(key: str, name: str, pairs: int) -> None:
        # Per head and (query, key) pair: scores q.k, then context p*v: d MACs each, every pair of
        # each sample (no mask).
        for part in ("scores", "context"):
            out.append(Gemm(key=key, name=f"{name}{part}", flops=attention_gemm(n, d, pairs)))

    # patch_embedding: Conv3d, stride = kernel: [S, C_in*pt*ph*pw] @ [C_in*pt*ph*pw, h].
    linear("dit/patch_embed", "patch_embedding", S, spec.in_channels * patch, h)
    # text_embedding: [C, text_dim] @ [text_dim, h], then [C, h] @ [h, h].
    linear("dit/text_embed", "text_embedding.0", C, spec.text_dim, h)
    linear("dit/text_embed", "text_embedding.2", C, h, h)
    # time_embedding: [B, freq_dim] @ [freq_dim, h], then [B, h] @ [h, h] (one timestep per sample).
    linear("dit/time_embed", "time_embedding.0", B, spec.freq_dim, h)
    linear("dit/time_embed", "time_embedding.2", B, h, h)
    # time_projection: [B, h] @ [h, 6h], shared by every block (see the module NB).
    linear("dit/modulation", "time_projection.1", B, h, 6 * h)
    if spec.image_dim is not None:
        # img_emb: [M, 1280] @ [1280, 1280], then [M, 1280] @ [1280, h].
        linear("dit/image_embed", "img_emb.proj.1", M, spec.image_dim, spec.image_dim)
        linear("dit/image_embed", "img_emb.proj.3", M, spec.image_dim, h)
    embeddings, out = tuple(out), []
    # Self-attention: q, k, v [S, h] @ [h, h]; full attention within each sample; o [S, h] @ [h, h].
    for name in ("self_attn.q", "self_attn.k", "self_attn.v"):
        linear("dit/self_attn/qkv", name, S, h, h)
    core("dit/self_attn/core", "self_attn.", stats.sum_video_seqlen_squared)
    linear("dit/self_attn/out", "self_attn.o", S, h, h)
    # Cross-attention: q on the video tokens; k, v on the text tokens (already h wide).
    linear("dit/cross_attn/q", "cross_attn.q", S, h, h)
    linear("dit/cross_attn/kv", "cross_attn.k", C, h, h)
    linear("dit/cross_attn/kv", "cross_attn.v", C, h, h)
    core("dit/cross_attn/core", "cross_attn.", stats.sum_text_pairs)
    if spec.image_dim is not None:
        # k_img, v_img on the CLIP tokens, attended by the same queries; the two results are
        # summed before o.
        linear("dit/cross_attn/image_kv", "cross_attn.k_img", M, h, h)
        linear("dit/cross_attn/image_kv", "cross_attn.v_img", M, h, h)
        core("dit/cross_attn/image_core", "cross_attn.image_", stats.sum_image_pairs)
    linear("dit/cross_attn/out", "cross_attn.o", S, h, h)
    # FFN: [S, h] @ [h, ffn], [S, ffn] @ [ffn, h].
    linear("dit/mlp", "ffn.0", S, h, spec.ffn_hidden_size)
    linear("dit/mlp", "ffn.2", S, spec.ffn_hidden_size, h)
    block, out = tuple(out), []
    # head: [S, h] @ [h, C_out*pt*ph*pw].
    linear("dit/head", "head.head", S, h, spec.out_channels * patch)
    return DiTForward(embeddings=embeddings, block=block, head=tuple(out), num_blocks=spec.num_layers)


def dit_forward_flops(
    spec: DiTSpec,
    video_seqlens: Sequence[int],
    text_seqlens: Sequence[int] | None = None,
    image_seqlens: Sequence[int] | None = None,
) -> dict[str, int]:
    """Forward FLOPs per component over samples of ``video_seqlens[i]`` video tokens (after
    patchifying), ``text_seqlens[i]`` text tokens (default ``text_len``) and, image-to-video,
    ``image_seqlens[i]`` CLIP tokens (default ``image_len``)."""
    return dit_forward_gemms(spec, DiTStats.from_seqlens(spec, video_seqlens, text_seqlens, image_seqlens)).flops()


# ---- LoRA targets and parameter counts -------------------------------------------------------

# The projections of a block a LoRA adapter can wrap, named as in ``WanAttentionBlock``
# (``blocks.{i}.self_attn.q``, ...): ``ffn.0`` and ``ffn.2`` are the FFN's in and out Linear.
DIT_LORA_MODULES = (
    "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
    "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o",
    "cross_attn.k_img", "cross_attn.v_img",
    "ffn.0", "ffn.2",
)
# A target matches a module whose name ends with it at a dot (PEFT's ``target_modules``): ``q``
# adapts ``self_attn.q`` and ``cross_attn.q``. NB: bare ``0``/``2`` are refused: in ``WanModel``
# they would also match ``text_embedding.0``, ``time_embedding.2``, ...
DIT_LORA_TARGETS = ("q", "k", "v", "o", "k_img", "v_img", *DIT_LORA_MODULES)
DEFAULT_DIT_LORA_TARGETS = ("q", "k", "v", "o")


@dataclass(frozen=True, kw_only=True)
class DiTPeftSpec(PeftSpec):
    """Frozen base and LoRA for a DiT: ``lora_targets`` from :data:`DIT_LORA_TARGETS`, matched by
    module-name suffix; every block gets the same adapters. Adapters carry no bias."""

    KNOWN_TARGETS: ClassVar[tuple[str, ...]] = DIT_LORA_TARGETS

    lora_targets: tuple[str, ...] = DEFAULT_DIT_LORA_TARGETS

    def adapts(self, module: str) -> bool:
        """Whether a block module (``self_attn.q``, ...) gets an adapter."""
        return self.lora_rank is not None and any(
            module == t or module.endswith("." + t) for t in self.lora_targets)

    @classmethod
    def of(cls, peft: PeftSpec | None) -> DiTPeftSpec:
        """``peft`` with its target names checked against the DiT's (a plain ``PeftSpec``'s
        defaults are decoder names)."""
        if peft is None or isinstance(peft, cls):
            return peft or cls()
        return cls(frozen=peft.frozen, lora_rank=peft.lora_rank, lora_targets=peft.lora_targets)


def dit_adapted_modules(spec: DiTSpec, peft: PeftSpec | None) -> tuple[str, ...]:
    """The block modules that get an adapter; ValueError for a target that matches none."""
    peft = DiTPeftSpec.of(peft)
    if peft.lora_rank is None:
        return ()
    present = _block_projections(spec)
    for target in peft.lora_targets:
        if not any(DiTPeftSpec(lora_rank=1, lora_targets=(target,)).adapts(m) for m in present):
            raise ValueError(f"lora target {target!r} matches no projection of this DiT "
                             f"(projections: {', '.join(present)})")
    return tuple(m for m in present if peft.adapts(m))


@dataclass(frozen=True, kw_only=True)
class DiTParameters:
    """Parameter counts of a ``WanModel`` (weights, biases, norms, modulation tables) and its
    LoRA adapters (A: in x r, B: r x out, no bias)."""

    num_params: int  # base + adapters
    num_trainable_params: int
    num_block_params: int  # one block, base
    num_adapters: int  # adapted projections, all blocks
    num_adapter_params: int  # all adapters

    @property
    def num_base_params(self) -> int:
        return self.num_params - self.num_adapter_params


@dataclass(frozen=True)
class DiTParam:
    """One parameter of a ``WanModel`` as ``named_parameters()`` gives it (a block's without its
    ``blocks.{i}.`` prefix), LoRA-wrapped projections named as PEFT names them."""

    name: str
    shape: tuple[int, ...]
    trainable: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_adapter(self) -> bool:
        return ".lora_" in self.name


def dit_block_parameters(spec: DiTSpec, peft: PeftSpec | None = None) -> tuple[DiTParam, ...]:
    """The parameters of one block (every block has the same), in ``named_parameters()`` order:
    the adaLN table [1, 6, h], the attentions' projections and norms (q/k RMSNorm weights,
    ``norm3``'s LayerNorm weight and bias; ``norm1``/``norm2`` have none), the FFN."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    params = _ParamList(spec, peft)
    params.add("modulation", (1, 6, h))
    for m in ("q", "k", "v", "o"):
        params.linear(f"self_attn.{m}", h, h)
    if spec.qk_norm:
        params.add("self_attn.norm_q.weight", (h,)).add("self_attn.norm_k.weight", (h,))
    if spec.cross_attn_norm:
        params.add("norm3.weight", (h,)).add("norm3.bias", (h,))
    for m in ("q", "k", "v", "o"):
        params.linear(f"cross_attn.{m}", h, h)
    if spec.qk_norm:
        params.add("cross_attn.norm_q.weight", (h,)).add("cross_attn.norm_k.weight", (h,))
    if spec.image_dim is not None:
        params.linear("cross_attn.k_img", h, h).linear("cross_attn.v_img", h, h)
        if spec.qk_norm:
            params.add("cross_attn.norm_k_img.weight", (h,))
    params.linear("ffn.0", h, f).linear("ffn.2", f, h)
    return tuple(params.out)


def dit_root_parameters(spec: DiTSpec, peft: PeftSpec | None = None) -> tuple[DiTParam, ...]:
    """The parameters outside the blocks: the embeddings, the time projection, the head (with its
    adaLN table [1, 2, h]) and, image-to-video, ``img_emb`` (LayerNorm, Linear, GELU, Linear,
    LayerNorm)."""
    h, patch = spec.hidden_size, math.prod(spec.patch_size)
    params = _ParamList(spec, peft)
    params.add("patch_embedding.weight", (h, spec.in_channels, *spec.patch_size)).add("patch_embedding.bias", (h,))
    params.linear("text_embedding.0", spec.text_dim, h).linear("text_embedding.2", h, h)
    params.linear("time_embedding.0", spec.freq_dim, h).linear("time_embedding.2", h, h)
    params.linear("time_projection.1", h, 6 * h)
    params.add("head.modulation", (1, 2, h)).linear("head.head", h, spec.out_channels * patch)
    if spec.image_dim is not None:
        w = spec.image_dim
        params.add("img_emb.proj.0.weight", (w,)).add("img_emb.proj.0.bias", (w,))
        params.linear("img_emb.proj.1", w, w).linear("img_emb.proj.3", w, h)
        params.add("img_emb.proj.4.weight", (h,)).add("img_emb.proj.4.bias", (h,))
    return tuple(params.out)


class _ParamList:
    """Parameters in order: base ones train unless the base is frozen; adapted block projections
    get PEFT's ``base_layer`` plus ``lora_A`` [r, in] and ``lora_B`` [out, r] (no bias)."""

    def __init__(self, spec: DiTSpec, peft: PeftSpec | None) -> None:
        self.adapted = frozenset(dit_adapted_modules(spec, peft))
        self.rank = None if peft is None else peft.lora_rank
        self.base = not (peft is not None and peft.frozen)
        self.out: list[DiTParam] = []

    def add(self, name: str, shape: tuple[int, ...]) -> _ParamList:
        self.out.append(DiTParam(name, shape, self.base))
        return self

    def linear(self, name: str, d_in: int, d_out: int) -> _ParamList:
        """``nn.Linear(d_in, d_out)`` with its bias."""
        if name not in self.adapted:
            return self.add(f"{name}.weight", (d_out, d_in)).add(f"{name}.bias", (d_out,))
        assert self.rank is not None  # only a LoRA rank adapts a module
        self.add(f"{name}.base_layer.weight", (d_out, d_in)).add(f"{name}.base_layer.bias", (d_out,))
        self.out += [DiTParam(f"{name}.lora_A.weight", (self.rank, d_in), True),
                     DiTParam(f"{name}.lora_B.weight", (d_out, self.rank), True)]
        return self


def dit_parameter_counts(spec: DiTSpec, peft: PeftSpec | None = None) -> DiTParameters:
    """Parameters of the model ``spec`` describes, with ``peft``'s adapters (from
    :func:`dit_block_parameters` and :func:`dit_root_parameters`: no loop over the blocks)."""
    layers, block = spec.num_layers, dit_block_parameters(spec, peft)
    block_base = sum(p.numel for p in block if not p.is_adapter)
    adapter = layers * sum(p.numel for p in block if p.is_adapter)
    base = sum(p.numel for p in dit_root_parameters(spec, peft)) + layers * block_base
    frozen = peft is not None and peft.frozen
    return DiTParameters(
        num_params=base + adapter,
        num_trainable_params=adapter + (0 if frozen else base),
        num_block_params=block_base,
        num_adapters=layers * len(dit_adapted_modules(spec, peft)),
        num_adapter_params=adapter,
    )


def _block_projections(spec: DiTSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one block."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    shapes = {m: (h, h) for m in DIT_LORA_MODULES}
    shapes["ffn.0"], shapes["ffn.2"] = (h, f), (f, h)
    if spec.image_dim is None:
        del shapes["cross_attn.k_img"], shapes["cross_attn.v_img"]
    return shapes


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
