"""Activations of a WAN-style DiT's blocks (``examples/wan_dit_fsdp2.py``'s ``WanAttentionBlock``),
fully trained, with and without per-block checkpointing (stdlib only: ints in, ints out).

What one block saves for backward, distinct storages (``T`` video tokens, ``C`` text and ``M``
CLIP tokens of the micro-batch, ``h`` hidden, ``f`` FFN, ``a`` bytes of the compute dtype):

- ``adaln``: the modulation sum ``[T, 6, h]`` (its chunks 2 and 5 gate the residuals), ``1 + scale``
  twice and the two modulated norms' outputs: ``10 T h a``;
- ``norm``: the three LayerNorms' inputs and statistics: ``3 (T h a + 2 T s)``;
- ``self_attn``: q/k/v's input, q and k RMSNorms, normalised q, k and v, ``o``'s input and output
  (gated): ``6 T h a`` + 2 RMSNorms + the core attention;
- ``cross_attn``: ``q``'s input (norm3's output), its RMSNorm and output, ``o``'s input; per key/value
  source (text, CLIP image) its ``k`` RMSNorm, normalised keys and values: ``3 T h a`` + RMSNorms + core;
- ``ffn``: its input, the GELU's input and output ``[T, f]``, the second linear's output (gated).

NB: an RMSNorm is torch's composite ``nn.RMSNorm``: an fp32 copy of its input, fp32 ``rstd`` per
token and the fp32 normalised product (``2 N h 4 + N 4`` for ``N`` rows), then its output in ``a``.
NB: LayerNorm statistics in fp32 (``s = 4``), as CUDA's kernel keeps them.
NB: the text and image embeddings every block reads (``C h a``, ``M h a``) are saved once per forward.
NB: core attention, ``local``: the example's explicit matmuls keep the softmax output per clip
``[heads, s_i, kv_i]``; ``flash``: the kernel keeps fp32 log-sum-exp ``[heads, T]`` per call and
its output (``o``'s input already, except for image-to-video, where ``o`` reads the sum of the
text and image outputs: ``+ 2 T h a``). ``flash`` is a convention: not measured on CPU.
NB: a checkpointed block keeps its inputs until its backward: the hidden states ``T h a`` each,
and once per forward the per-token modulation input ``[T, 6, h]`` (text/image embeddings as
above); backward re-runs one block at a time, which saves a whole block again except its input.
FSDP2 runs forward and backward of one micro-batch before the next: one micro-batch in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_flops.flops.dit import DiTSpec

LAYER_NORM_STATS_BYTES = 4  # fp32 mean and rstd per token (CUDA)
ATTENTION_CONVENTIONS = ("local", "flash")


@dataclass(frozen=True, kw_only=True)
class DiTBatch:
    """One micro-batch's clips: video, text and (image-to-video) CLIP tokens per clip."""

    video: tuple[int, ...]
    text: tuple[int, ...]
    image: tuple[int, ...] | None = None

    @classmethod
    def uniform(cls, spec: DiTSpec, *, video_tokens: int, num_clips: int) -> DiTBatch:
        """``num_clips`` clips of ``video_tokens`` tokens with WAN's padded ``text_len`` text tokens."""
        return cls(video=(video_tokens,) * num_clips, text=(spec.text_len,) * num_clips,
                   image=None if spec.image_dim is None else (spec.image_len,) * num_clips)


@dataclass(frozen=True, kw_only=True)
class DiTActivations:
    """Bytes per micro-batch: ``block`` (one block's own saved storages, by part), ``shared`` (the
    text/image embeddings all blocks save), ``kept`` (what the checkpointed blocks keep),
    ``recompute`` (the largest region re-run in backward), ``total`` (the peak of saved storages)."""

    block: dict[str, int]
    shared: int
    kept: int
    recompute: int
    total: int


def _rms_norm(rows: int, h: int) -> int:
    return 2 * rows * h * 4 + rows * 4


def _core(spec: DiTSpec, batch: DiTBatch, a: int, attention: str) -> tuple[int, int]:
    """(self-attention core, cross-attention core) bytes."""
    T, heads = sum(batch.video), spec.num_heads
    if attention == "flash":
        lse = heads * T * 4
        return lse, lse * (1 if batch.image is None else 2) + (0 if batch.image is None else 2 * T * spec.hidden_size * a)
    cross = sum(s * c for s, c in zip(batch.video, batch.text))
    if batch.image is not None:
        cross += sum(s * m for s, m in zip(batch.video, batch.image))
    return heads * sum(s * s for s in batch.video) * a, heads * cross * a


def dit_block_saved(spec: DiTSpec, batch: DiTBatch, *, act_bytes: int, attention: str = "flash",
                    layer_norm_stats_bytes: int = LAYER_NORM_STATS_BYTES) -> dict[str, int]:
    """One block's own saved bytes per part (see the module NB); the shared embeddings excluded."""
    if attention not in ATTENTION_CONVENTIONS:
        raise ValueError(f"DiT attention must be one of {ATTENTION_CONVENTIONS}, got {attention!r}")
    T, h, a = sum(batch.video), spec.hidden_size, act_bytes
    self_core, cross_core = _core(spec, batch, a, attention)
    sources = [sum(batch.text)] + ([] if batch.image is None else [sum(batch.image)])
    return {
        "adaln": 10 * T * h * a,
        "norm": 3 * (T * h * a + 2 * T * layer_norm_stats_bytes),
        "self_attn": 6 * T * h * a + 2 * _rms_norm(T, h) + self_core,
        "cross_attn": 3 * T * h * a + _rms_norm(T, h) + sum(_rms_norm(n, h) + 2 * n * h * a for n in sources)
        + cross_core,
        "ffn": 2 * T * h * a + 2 * T * spec.ffn_hidden_size * a,
    }


def dit_activations(spec: DiTSpec, batch: DiTBatch, *, act_bytes: int, attention: str = "flash",
                    checkpointed_blocks: int = 0,
                    layer_norm_stats_bytes: int = LAYER_NORM_STATS_BYTES) -> DiTActivations:
    """Peak saved bytes of the blocks for one micro-batch, the first ``checkpointed_blocks``
    blocks checkpointed (see the module NB)."""
    if not 0 <= checkpointed_blocks <= spec.num_layers:
        raise ValueError(f"checkpointing {checkpointed_blocks} of {spec.num_layers} blocks")
    block = dit_block_saved(spec, batch, act_bytes=act_bytes, attention=attention,
                            layer_norm_stats_bytes=layer_norm_stats_bytes)
    own = sum(block.values())
    T, h, a = sum(batch.video), spec.hidden_size, act_bytes
    shared = sum(n * h * a for n in (sum(batch.text), sum(batch.image or ())))
    kept = checkpointed_blocks * T * h * a + (6 * T * h * a if checkpointed_blocks else 0)
    recompute = own - T * h * a if checkpointed_blocks else 0  # its input is kept already
    total = (spec.num_layers - checkpointed_blocks) * own + shared + kept + recompute
    return DiTActivations(block=block, shared=shared, kept=kept, recompute=recompute, total=total)
