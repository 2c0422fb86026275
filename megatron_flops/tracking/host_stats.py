"""A step's host (CPU) micro-batches, priced in one vectorised pass at the end of the step.

Batches leave a data loader as CPU tensors. Recording one keeps references to its offsets,
lengths and grids and adds what its shape tells to integer counters: no tensor operation, no
device allocation, no sync. ``HostBatches.settle()`` then concatenates each kind of tensor once
(one torch ``cat``), and does the arithmetic in numpy over all of the step's micro-batches
together: a fixed handful of operations per step, whatever the number of micro-batches. Rows of
offsets whole in both channels (Megatron-LM's packed ``cu_seqlens``) take the shortest pass: one
``cat``, one difference, the row boundaries zeroed, two checks and three sums. Row-local
offsets ``[b, n]`` (Megatron-LM core_v0.19.0: each row's offsets padded to ``S + 1`` entries
with copies of ``S``) are ``b`` such rows; their padding entries are zero lengths, no sequence.

Sums of squares are taken in int64 only while they cannot overflow (the sum of a vector's
lengths is at most ``_SQUARE_SAFE``, so the sum of their squares is below 2**63); beyond that,
in Python integers.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from megatron_flops.flops.vision import VisionSpec
from megatron_flops.tracking.vision_torch import VISION_SLOTS, vision_stats_tensor

_SQUARE_SAFE = 3_037_000_499  # floor(sqrt(2**63 - 1))
_NO_LIMIT = 2**62
_PYTHON_PASS = 512  # a step's offsets of at most this many entries (whole rows, or the others) are summed in Python

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
        self.whole_offsets: list[torch.Tensor] = []  # rows whole in both channels (the common case)
        self.offsets: list[tuple[torch.Tensor, Any, int | None, bool, bool]] = []  # every other row
        self.lengths: list[torch.Tensor] = []
        self.grids: list[torch.Tensor] = []

    def add_full_rows(self, num_rows: int, length: int, *, real: bool) -> None:
        """``num_rows`` sequences of ``length`` into the padded channel (and the real one)."""
        key = (length, real)
        self.full_rows[key] = self.full_rows.get(key, 0) + num_rows

    def add_offsets(self, cu: torch.Tensor, argmin: Any, limit: int | None, *, real: bool, padded: bool) -> None:
        """A row of offsets into the real and/or padded channel, trimmed to ``argmin`` entries (an
        int or a one-element CPU tensor) and clipped to ``limit`` real tokens when given."""
        if argmin is None and limit is None and real and padded:
            self.whole_offsets.append(cu)
        else:
            self.offsets.append((cu, argmin, limit, real, padded))

    def settle(self) -> dict[str, int]:
        """The counters plus the sums over every kept tensor. Raises ``ValueError`` on values
        that no well-formed batch holds (decreasing offsets, negative lengths, bad grids)."""
        totals = dict.fromkeys(REAL_SLOTS + PADDED_SLOTS, 0) | self.counters
        for (length, counts_real), num_rows in self.full_rows.items():
            excess = 0 if self.window is None else max(length - self.window, 0)
            values = (length, length * length, excess, excess * excess)
            for slots in (REAL_SLOTS, PADDED_SLOTS) if counts_real else (PADDED_SLOTS,):
                for name, value in zip(slots, values):
                    totals[name] += num_rows * value
        channels: list[tuple[np.ndarray | list[int], tuple[tuple[str, ...], ...]]] = []  # 1-D lengths, their slots
        if self.whole_offsets:
            whole = _whole_lengths(self.whole_offsets)
            totals["num_sequences"] += len(whole) if isinstance(whole, list) else int(np.count_nonzero(whole))
            channels.append((whole, (REAL_SLOTS, PADDED_SLOTS)))
        if self.offsets:
            if sum(cu.numel() for cu, *_ in self.offsets) <= _PYTHON_PASS:
                real_list, padded_list = self._trimmed_lengths_python()
                totals["num_sequences"] += len(real_list)
                channels += [(real_list, (REAL_SLOTS,)), (padded_list, (PADDED_SLOTS,))]
            else:
                real, padded = self._trimmed_lengths()
                totals["num_sequences"] += int(np.count_nonzero(real))
                channels += [(real, (REAL_SLOTS,)), (padded, (PADDED_SLOTS,))]
        if self.lengths:
            lengths = _flat(self.lengths)
            if lengths.size and lengths.min() < 0:
                raise ValueError("seq_lengths must be non-negative")
            channels.append((lengths, (REAL_SLOTS,)))
        for channel, groups in channels:
            sums = self._sums(channel)
            for names in groups:
                for name, value in zip(names, sums):
                    totals[name] += value
        if self.grids:
            for name, value in zip(VISION_SLOTS, self._grid_sums()):
                totals[f"vision/{name}"] = value
        return totals

    def _trimmed_lengths_python(self) -> tuple[list[int], list[int]]:
        """``_trimmed_lengths`` in Python ints for a few hundred entries (see ``_whole_lengths``),
        the zero lengths left out; the same checks, in the same order."""
        rows: list[tuple[list[int], int, int | None, bool, bool]] = []  # entries, valid ones, limit, channels
        for cu, argmin, limit, real, padded in self.offsets:
            table = cu.tolist()
            n = argmin if isinstance(argmin, int) else int(argmin.item()) if argmin is not None else None
            for entries in table if cu.dim() == 2 else [table]:
                rows.append((entries, len(entries) if n is None else n, limit, real, padded))
        for entries, n, *_ in rows:
            if not 2 <= n <= len(entries):
                raise ValueError(f"cu_seqlens needs at least two entries before its end marker, got {n} of "
                                 f"{len(entries)}")
        if any(entries[0] for entries, *_ in rows):
            raise ValueError("cu_seqlens must start at 0")
        real_lengths: list[int] = []
        padded_lengths: list[int] = []
        negative = False
        for entries, n, limit, real, padded in rows:
            kept = entries[:n] if limit is None else [min(v, limit) for v in entries[:n]]
            lengths = [b - a for a, b in zip(kept, kept[1:])]
            negative = negative or min(lengths) < 0
            for flag, channel in ((real, real_lengths), (padded, padded_lengths)):
                if flag:
                    channel.extend(length for length in lengths if length)
        if negative:
            raise ValueError("cu_seqlens must be non-decreasing")
        return real_lengths, padded_lengths

    def _trimmed_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """The real and the padded lengths of every trimmed, clipped or one-channel row, as two
        1-D arrays of one length (a length dropped from a channel is 0 there)."""
        tensors: list[torch.Tensor] = []
        sizes: list[int] = []
        valid: list[int] = []
        limits: list[int] = []
        flags: tuple[list[bool], list[bool]] = ([], [])
        pending: list[tuple[int, torch.Tensor]] = []
        limited = False
        for cu, argmin, limit, real, padded in self.offsets:
            rows, size = (cu.shape[0], cu.shape[1]) if cu.dim() == 2 else (1, cu.shape[0])
            tensors.append(cu)
            if isinstance(argmin, torch.Tensor):
                pending.append((len(valid), argmin))
            n = argmin if isinstance(argmin, int) else size  # row-local offsets ([b, n]) carry no argmin
            sizes += [size] * rows
            valid += [n] * rows
            limits += [_NO_LIMIT if limit is None else limit] * rows
            flags[0].extend([real] * rows)
            flags[1].extend([padded] * rows)
            limited = limited or limit is not None
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
        # Diff i is kept in a channel when entries i and i + 1 are valid entries of one row in it:
        # per row, (valid - 1) kept diffs, then its dropped sentinel entries and the boundary to
        # the next row.
        counts = [c for size, n in zip(sizes, valid) for c in (n - 1, size - n + 1)]
        counts[-1] -= 1
        pattern = np.array([[f for flag in row for f in (flag, False)] for row in flags], dtype=np.int64)
        lengths = diffs * np.repeat(pattern, counts, axis=1)
        if lengths.min() < 0:
            raise ValueError("cu_seqlens must be non-decreasing")
        return lengths[0], lengths[1]

    def _sums(self, lengths: np.ndarray | list[int]) -> tuple[int, int, int, int]:
        """[sum s, sum s^2, sum x, sum x^2] of 1-D non-negative lengths (x: the window excess)."""
        total = sum(lengths) if isinstance(lengths, list) else int(lengths.sum())
        if isinstance(lengths, list) or total > _SQUARE_SAFE:  # int64 squares could wrap: Python integers
            values = lengths if isinstance(lengths, list) else lengths.tolist()
            excess = [] if self.window is None else [max(v - self.window, 0) for v in values]
            return total, sum(v * v for v in values), sum(excess), sum(x * x for x in excess)
        if self.window is None:
            return total, int(lengths @ lengths), 0, 0
        excess = np.maximum(lengths - self.window, 0)
        return total, int(lengths @ lengths), int(excess.sum()), int(excess @ excess)

    def _grid_sums(self) -> list[int]:
        assert self.vision is not None  # the tracker keeps grids only with a vision spec
        grids = torch.cat([g if g.dim() == 2 else g.reshape(-1, 3) for g in self.grids]).to(torch.int64)
        merge = self.vision.spatial_merge_size
        bad = torch.stack(((grids < 1).sum(), (grids[:, 1:] % merge).sum())).tolist()
        if bad[0] or bad[1]:
            raise ValueError(f"grid_thw rows must be positive with h and w multiples of {merge}")
        return vision_stats_tensor(self.vision, grids).tolist()


def _whole_lengths(tensors: list[torch.Tensor]) -> np.ndarray | list[int]:
    """The lengths of rows of offsets (``[n]``, ``[1, n]`` or row-local ``[b, n]``), each whole,
    concatenated: in numpy with a 0 between two rows, or, up to ``_PYTHON_PASS`` entries, as
    Python ints without the zero lengths (there a numpy call costs more than the loop, the more
    so when training has evicted numpy from the CPU's caches since the last step)."""
    flat = _flat(tensors)
    sizes = [t.shape[-1] for t in tensors for _ in range(t.shape[0] if t.dim() == 2 else 1)]
    starts = [0, *itertools.accumulate(sizes[:-1])]  # each row's first entry
    if flat.size <= _PYTHON_PASS:
        values = flat.tolist()
        if any(values[start] for start in starts):
            raise ValueError("cu_seqlens must start at 0")
        ends = {start - 1 for start in starts[1:]}  # from one row's last entry to the next row's first
        lengths = [values[i + 1] - values[i] for i in range(len(values) - 1) if i not in ends]
        if min(lengths) < 0:
            raise ValueError("cu_seqlens must be non-decreasing")
        return [length for length in lengths if length]
    if flat[starts].any():
        raise ValueError("cu_seqlens must start at 0")
    lengths = flat[1:] - flat[:-1]
    lengths[[start - 1 for start in starts[1:]]] = 0
    if lengths.min() < 0:
        raise ValueError("cu_seqlens must be non-decreasing")
    return lengths


def _flat(tensors: list[torch.Tensor]) -> np.ndarray:
    """The tensors' elements, flattened row by row and concatenated in order, as int64: one
    ``cat`` when every tensor is 1-D, or every one is ``[1, n]`` (a collated micro-batch of one
    row), or every one is ``[b, n]`` with the same ``n`` (row-local offsets)."""
    first = tensors[0]
    if all(t.dim() == 2 and t.shape[1] == first.shape[1] for t in tensors):
        flat = torch.cat(tensors)  # [sum b, n]: rows in order
    elif all(t.dim() == 1 or (t.dim() == 2 and t.shape[0] == 1) for t in tensors):
        try:
            flat = torch.cat(tensors, dim=-1)
        except RuntimeError:  # 1-D and [1, n] mixed
            flat = torch.cat([t.reshape(-1) for t in tensors])
    else:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat.numpy().reshape(-1).astype(np.int64, copy=False)
