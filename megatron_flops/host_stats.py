"""A step's host (CPU) micro-batches, priced in one vectorised pass at the end of the step.

Batches leave a data loader as CPU tensors. Recording one keeps references to its offsets,
lengths and grids and adds what its shape tells to integer counters: no tensor operation, no
device allocation, no sync. ``HostBatches.settle()`` then concatenates each kind of tensor once
(one torch ``cat``), and does the arithmetic in numpy over all of the step's micro-batches
together: a fixed handful of operations per step, whatever the number of micro-batches.

Sums of squares are taken in int64 only while they cannot overflow (the sum of a vector's
lengths is at most ``_SQUARE_SAFE``, so the sum of their squares is below 2**63); beyond that,
in Python integers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megatron_flops.vision import VisionSpec
from megatron_flops.vision_torch import VISION_SLOTS, vision_stats_tensor

_SQUARE_SAFE = 3_037_000_499  # floor(sqrt(2**63 - 1))
_NO_LIMIT = 2**62

# The (sum s, sum s^2, sum x, sum x^2) slots of each channel; x = max(s - window, 0).
REAL_SLOTS = ("num_tokens", "sum_seqlen_squared", "window_excess", "window_excess_squared")
PADDED_SLOTS = ("sum_padded_seqlens", "sum_padded_seqlen_squared", "padded_window_excess",
                "padded_window_excess_squared")


class HostBatches:
    """One step's host micro-batches: integer counters plus the tensors to settle.

    Offsets (``cu_seqlens``) go to the real channel, the padded channel or both; a sentinel-padded
    row is trimmed to ``argmin`` entries and ``limit`` (the row's real token count) clips a real
    row's offsets, so that trailing padding is no real sequence. Counters use the tracker's slot
    names; ``settle()`` adds the sums of the real and padded lengths to them.
    """

    def __init__(self, *, window: int | None, vision: VisionSpec | None) -> None:
        self.window = window
        self.vision = vision
        self.counters: dict[str, int] = dict.fromkeys(("num_microbatches", "num_rows", "num_padded_tokens",
                                                       "num_sequences"), 0)
        self.full_rows: dict[tuple[int, bool], int] = {}  # (length, counts as real) -> rows
        self.failed = False
        self.device_batches: list[dict[str, Any]] = []  # observed device tensors, for the device path
        self.offsets: list[tuple[torch.Tensor, Any, int | None, bool, bool]] = []
        self.lengths: list[torch.Tensor] = []
        self.grids: list[torch.Tensor] = []

    def add_full_rows(self, num_rows: int, length: int, *, real: bool) -> None:
        """``num_rows`` sequences of ``length`` into the padded channel (and the real one)."""
        key = (length, real)
        self.full_rows[key] = self.full_rows.get(key, 0) + num_rows

    def settle(self) -> dict[str, int]:
        """The counters plus the sums over every kept tensor. Raises ``ValueError`` on values
        that no well-formed batch holds (decreasing offsets, negative lengths, bad grids)."""
        totals = dict(self.counters)
        for (length, real), num_rows in self.full_rows.items():
            excess = 0 if self.window is None else max(length - self.window, 0)
            values = (length, length * length, excess, excess * excess)
            for names in (REAL_SLOTS, PADDED_SLOTS) if real else (PADDED_SLOTS,):
                for name, value in zip(names, values):
                    totals[name] = totals.get(name, 0) + num_rows * value
        # [k, n] lengths, and per row the slot groups its sums go to.
        blocks: list[tuple[np.ndarray, tuple[tuple[tuple[str, ...], ...], ...]]] = []
        if self.offsets:
            lengths, channels, num_sequences = self._offset_lengths()
            blocks.append((lengths, channels))
            totals["num_sequences"] += num_sequences
        if self.lengths:
            lengths = _flat(self.lengths).reshape(1, -1)
            if lengths.size and lengths.min() < 0:
                raise ValueError("seq_lengths must be non-negative")
            blocks.append((lengths, ((REAL_SLOTS,),)))
        for lengths, channels in blocks:
            for row, groups in zip(self._sums(lengths), channels):
                for names in groups:
                    for name, value in zip(names, row):
                        totals[name] = totals.get(name, 0) + value
        if self.grids:
            for name, value in zip(VISION_SLOTS, self._grid_sums()):
                totals[f"vision/{name}"] = totals.get(f"vision/{name}", 0) + value
        return totals

    def _offset_lengths(self) -> tuple[np.ndarray, tuple[tuple[tuple[str, ...], ...], ...], int]:
        """The lengths of every offsets row as ``[k, n]`` rows (masked lengths 0), the slot groups
        of each row, and the number of positive real lengths."""
        tensors, sizes, valid, limits, pending = [], [], [], [], []
        mixed = limited = False  # mixed: a row is trimmed, clipped, or in one channel only
        for i, (cu, argmin, limit, real, padded) in enumerate(self.offsets):
            size = cu.shape[-1]
            tensors.append(cu)
            sizes.append(size)
            limits.append(_NO_LIMIT if limit is None else limit)
            if argmin is None:
                valid.append(size)
            elif isinstance(argmin, torch.Tensor):
                pending.append((i, argmin))
                valid.append(size)
            else:
                valid.append(argmin)
            limited = limited or limit is not None
            mixed = mixed or argmin is not None or limited or not (real and padded)
        if pending:  # CPU argmin tensors, read in one go
            for (i, _), value in zip(pending, _flat([a for _, a in pending]).tolist()):
                valid[i] = value
        for n, size in zip(valid, sizes):
            if not 2 <= n <= size:
                raise ValueError(f"cu_seqlens needs at least two entries before its end marker, got {n} of {size}")
        flat = _flat(tensors)
        ends = np.array(sizes).cumsum()
        if flat[ends - sizes].any():  # the first entry of each row
            raise ValueError("cu_seqlens must start at 0")
        if limited:
            flat = np.minimum(flat, np.repeat(limits, sizes))
        diffs = np.diff(flat)
        if not mixed:  # every row whole in both channels: only the row boundaries are dropped
            diffs[ends[:-1] - 1] = 0
            lengths, channels = diffs.reshape(1, -1), ((REAL_SLOTS, PADDED_SLOTS),)
        else:
            # Diff i is kept in a channel when entries i and i + 1 are valid entries of one row in
            # it: per row, (valid - 1) kept diffs, then its dropped sentinel entries and the
            # boundary to the next row.
            counts = [c for size, n in zip(sizes, valid) for c in (n - 1, size - n + 1)]
            counts[-1] -= 1
            flags = ([real for *_, real, _ in self.offsets], [padded for *_, padded in self.offsets])
            pattern = np.array([[f for flag in row for f in (flag, False)] for row in flags], dtype=np.int64)
            lengths = diffs * np.repeat(pattern, counts, axis=1)
            channels = ((REAL_SLOTS,), (PADDED_SLOTS,))
        if lengths.min() < 0:
            raise ValueError("cu_seqlens must be non-decreasing")
        return lengths, channels, int(np.count_nonzero(lengths[0]))

    def _sums(self, lengths: np.ndarray) -> list[list[int]]:
        """Per row of ``[k, n]`` lengths: [sum s, sum s^2, sum x, sum x^2] (x: the window excess)."""
        sums = lengths.sum(axis=1)
        if sums.size and int(sums.max()) > _SQUARE_SAFE:  # int64 squares could wrap: Python integers
            rows = lengths.tolist()
            excess = rows if self.window is None else [[max(v - self.window, 0) for v in row] for row in rows]
            return [[sum(row), sum(v * v for v in row)] + ([0, 0] if self.window is None else
                                                            [sum(x), sum(v * v for v in x)])
                    for row, x in zip(rows, excess)]
        if self.window is None and len(lengths) == 1:
            row = lengths[0]
            return [[int(sums[0]), int(row @ row), 0, 0]]
        squares = np.einsum("ij,ij->i", lengths, lengths)
        if self.window is None:
            return [[s, q, 0, 0] for s, q in zip(sums.tolist(), squares.tolist())]
        excess = np.maximum(lengths - self.window, 0)
        return np.stack((sums, squares, excess.sum(axis=1), np.einsum("ij,ij->i", excess, excess)), axis=1).tolist()

    def _grid_sums(self) -> list[int]:
        assert self.vision is not None  # the tracker keeps grids only with a vision spec
        grids = torch.cat([g if g.dim() == 2 else g.reshape(-1, 3) for g in self.grids]).to(torch.int64)
        merge = self.vision.spatial_merge_size
        bad = torch.stack(((grids < 1).sum(), (grids[:, 1:] % merge).sum())).tolist()
        if bad[0] or bad[1]:
            raise ValueError(f"grid_thw rows must be positive with h and w multiples of {merge}")
        return vision_stats_tensor(self.vision, grids).tolist()


def _flat(tensors: list[torch.Tensor]) -> np.ndarray:
    """The tensors' elements, flattened and concatenated in order, as int64: one ``cat`` when
    every tensor is 1-D, or every one is ``[1, n]`` (a collated micro-batch of one row)."""
    try:
        flat = torch.cat(tensors, dim=-1)
    except RuntimeError:  # mixed shapes
        flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat.numpy().reshape(-1).astype(np.int64, copy=False)
