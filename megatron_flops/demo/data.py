"""Synthetic micro-batches for the demo: packed rows and dynamically padded batches (torch).

Each document is an arithmetic progression of token ids modulo the vocabulary (a random start
and stride), so the next token is learnable and the loss falls within a few iterations. A
micro-batch is, at random, either

- a packed row ``[1, seq_length]``: documents of random lengths packed whole until the next one
  does not fit, the tail padded; described by ``cu_seqlens`` (the real documents only), or
- a dynamically padded batch ``[num_padded_rows, S]``: one document per row, ``S`` the longest
  length rounded up to ``pad_multiple``; described by ``seq_lengths``.

The local attention cannot run packed (THD) rows, so a packed row runs as one unpacked sequence
with a block-diagonal causal mask: each token attends to exactly the tokens it would under THD
attention. Position ids restart at every document (RoPE ignores them; being relative, it scores
a document the same at any offset in the row). Each micro-batch also carries its
rows as :class:`~megatron_flops.flops.formulas.Row` (the statistics the tracker must find).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_flops.flops.formulas import Row

PAD_ID = 0


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Shape of the synthetic data; document lengths are log-uniform in ``[min_length, seq_length]``."""

    seq_length: int = 256
    vocab_size: int = 1024
    num_padded_rows: int = 4
    pad_multiple: int = 8
    min_length: int = 8
    packed_fraction: float = 0.5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_padded_rows", "pad_multiple", "min_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_length < self.min_length:
            raise ValueError(f"seq_length (the packed row length) must be >= the shortest document "
                             f"({self.min_length} tokens), got {self.seq_length}")
        if not 0.0 <= self.packed_fraction <= 1.0:
            raise ValueError(f"packed_fraction must be in [0, 1], got {self.packed_fraction}")


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """Model inputs ``[b, s]``; ``attention_mask`` is ``[b or 1, 1, s, s]``, True = masked."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None
    seq_lengths: torch.Tensor | None
    rows: tuple[Row, ...]


def microbatches(config: DataConfig, *, seed: int, dp_rank: int) -> Iterator[MicroBatch]:
    """The endless micro-batch stream of one data-parallel rank (the same on every pipeline
    stage and model chunk of that rank; different across ranks)."""
    rng = random.Random(seed * 1_000_003 + dp_rank)
    while True:
        if rng.random() < config.packed_fraction:
            yield _packed_row(config, rng)
        else:
            yield _padded_batch(config, rng)


def _length(config: DataConfig, rng: random.Random) -> int:
    low, high = math.log(config.min_length), math.log(config.seq_length)
    return min(config.seq_length, round(math.exp(rng.uniform(low, high))))


def _document(config: DataConfig, rng: random.Random, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and next-token labels of one document."""
    start, stride = rng.randrange(config.vocab_size), rng.randrange(1, 8)
    ids = (start + stride * torch.arange(length + 1)) % config.vocab_size
    return ids[:-1], ids[1:]


def _packed_row(config: DataConfig, rng: random.Random) -> MicroBatch:
    s = config.seq_length
    lengths: list[int] = []
    while True:
        length = _length(config, rng)
        if sum(lengths) + length > s:
            break
        lengths.append(length)
    tokens = torch.full((1, s), PAD_ID)
    labels = torch.full((1, s), PAD_ID)
    loss_mask = torch.zeros(1, s)
    position_ids = torch.zeros(1, s, dtype=torch.long)
    # Segment id per position: document i, and one more segment for the tail padding.
    segment = torch.full((s,), len(lengths))
    start = 0
    for i, length in enumerate(lengths):
        end = start + length
        tokens[0, start:end], labels[0, start:end] = _document(config, rng, length)
        loss_mask[0, start:end] = 1.0
        position_ids[0, start:end] = torch.arange(length)
        segment[start:end] = i
        start = end
    position_ids[0, start:] = torch.arange(s - start)
    causal = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)
    mask = causal | (segment[:, None] != segment[None, :])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return MicroBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        position_ids=position_ids,
        attention_mask=mask.view(1, 1, s, s),
        cu_seqlens=cu_seqlens,
        seq_lengths=None,
        rows=(Row(seqlens=tuple(lengths), padded_seqlens=tuple(lengths), num_padded_tokens=s),),
    )


def _padded_batch(config: DataConfig, rng: random.Random) -> MicroBatch:
    b = config.num_padded_rows
    lengths = [_length(config, rng) for _ in range(b)]
    s = min(config.seq_length, -(-max(lengths) // config.pad_multiple) * config.pad_multiple)
    tokens = torch.full((b, s), PAD_ID)
    labels = torch.full((b, s), PAD_ID)
    loss_mask = torch.zeros(b, s)
    for i, length in enumerate(lengths):
        tokens[i, :length], labels[i, :length] = _document(config, rng, length)
        loss_mask[i, :length] = 1.0
    seq_lengths = torch.tensor(lengths)
    causal = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)
    key_is_padding = torch.arange(s)[None, :] >= seq_lengths[:, None]  # [b, s_k]
    mask = causal[None, :, :] | key_is_padding[:, None, :]
    return MicroBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        position_ids=torch.arange(s).expand(b, s).contiguous(),
        attention_mask=mask.view(b, 1, s, s),
        cu_seqlens=None,
        seq_lengths=seq_lengths,
        # NB: a dynamically padded row attends over its padded length (as the tracker counts it).
        rows=tuple(Row(seqlens=(length,), padded_seqlens=(s,), num_padded_tokens=s) for length in lengths),
    )
