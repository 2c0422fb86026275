"""Datasets with known document lengths, for the real training loops (test-only).

The counts a test expects come from here (the lengths the dataset was built with), never from
the tracker.
"""

from __future__ import annotations

import random


def doc_lengths(seed: int, index: int, row_length: int) -> list[int]:
    """The documents packed into row ``index``: whole documents filling exactly ``row_length``
    tokens (1 to 4 of them, cut at random points), a function of ``(seed, index)`` only."""
    rng = random.Random(seed * 1_000_003 + index)
    cuts = sorted(rng.sample(range(1, row_length), rng.randint(0, 3)))
    bounds = [0, *cuts, row_length]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def install_packed_mock_dataset(seed: int, *, row_local: bool = False) -> None:
    """Make megatron-core's ``MockGPTDataset`` yield packed rows in the layout Megatron-LM's
    ``SFTDataset`` gives ``pretrain_gpt.py`` (core_v0.16.1): ``tokens``, ``labels``,
    ``loss_mask``, ``position_ids`` (restarting per document), ``cu_seqlens`` (int32, ``[n + 1]``)
    and ``max_seqlen`` (0-d). Row ``i`` holds ``doc_lengths(seed, i, seq_length)``.

    ``row_local``: ``cu_seqlens`` padded to ``seq_length + 1`` entries with copies of
    ``seq_length``, as core_v0.19.0's ``GPTDataset`` makes them under
    ``--dataloader-inter-document-masking`` (so that rows collate into ``[mbs, S + 1]``).

    The sampler hands out indices in order, so iteration ``k`` of a run with global batch ``G``
    trains rows ``k*G .. k*G + G - 1`` (over all data-parallel ranks together).
    """
    import torch
    from megatron.core.datasets import gpt_dataset

    class PackedMockGPTDataset(gpt_dataset.MockGPTDataset):
        def __getitem__(self, idx):
            length = self.config.sequence_length
            docs = doc_lengths(seed, int(idx), length)
            gen = torch.Generator().manual_seed(seed * 7919 + int(idx))
            text = torch.randint(1, self.config.tokenizer.vocab_size, (length + 1,), generator=gen)
            bounds = torch.tensor([0, *docs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            if row_local:
                bounds = torch.cat([bounds, torch.full((length + 1 - len(bounds),), length, dtype=torch.int32)])
            return {
                "tokens": text[:-1],
                "labels": text[1:],
                "loss_mask": torch.ones(length, dtype=torch.float32),
                "position_ids": torch.cat([torch.arange(n) for n in docs]),
                "cu_seqlens": bounds,
                "max_seqlen": torch.tensor(max(docs), dtype=torch.int32),
            }

    gpt_dataset.MockGPTDataset = PackedMockGPTDataset
