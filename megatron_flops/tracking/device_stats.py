"""The decoder's per-micro-batch statistics of device tensors (torch).

A micro-batch whose offsets, lengths or grids are on a device is summed there, into the step's
one preallocated int64 accumulator: a fixed handful of kernels per micro-batch, no host sync, no
data-dependent shape, no allocation after the first. Values are not checked here (that would
sync): a malformed one shows as a negative or inconsistent total after the step's reduction.
"""

from __future__ import annotations

import torch

from megatron_flops.tracking.step_tracker import DeviceAccumulator
from megatron_flops.flops.vision import VisionSpec
from megatron_flops.tracking.vision_torch import VISION_SLOTS, vision_stats_tensor

# Slots of the accumulator and of the reduced vector, in order (then the vision slots, with a
# vision tower). Adjacent pairs are written by one add: (sum s, sum s^2) for real and padded
# lengths, and (sum x, sum x^2) of the window excess x = max(s - window, 0), from which the band
# pairs follow (see ``pricing``).
SLOTS = (
    "num_microbatches",
    "num_rows",
    "num_sequences",
    "num_padded_tokens",
    "num_tokens",
    "sum_seqlen_squared",
    "sum_padded_seqlens",  # scratch: the device sum of padded lengths (tokens come from shapes)
    "sum_padded_seqlen_squared",
    "window_excess",
    "window_excess_squared",
    "padded_window_excess",
    "padded_window_excess_squared",
)
# The slots known from tensor shapes alone (host counts; num_sequences also gets the non-zero
# lengths of device offsets, counted on the device): they still travel when a rank fails, so
# the static number stays known.
SHAPE_SLOTS = ("num_microbatches", "num_rows", "num_sequences", "num_padded_tokens")


class DeviceStats(DeviceAccumulator):
    """The accumulator of a decoder's device micro-batches, with views made once on it."""

    def __init__(self, *, window: int | None, vision: VisionSpec | None) -> None:
        super().__init__(SLOTS + (tuple(f"vision/{name}" for name in VISION_SLOTS) if vision else ()))
        self.window = window
        self.vision = vision
        self._exps = torch.tensor([1, 2], dtype=torch.int64)  # moved to the accumulator's device

    def _allocated(self, acc: torch.Tensor) -> None:
        self._exps = self._exps.to(acc.device)
        # [real, padded] x (sum s, sum s^2), and the same for the window excess.
        i, j = SLOTS.index("num_tokens"), SLOTS.index("window_excess")
        self._both = acc[i : i + 4].view(2, 2)
        self._window_both = acc[j : j + 4].view(2, 2)
        self._real, self._padded = self._both[0], self._both[1]
        self._window_real, self._window_padded = self._window_both[0], self._window_both[1]
        self._vision = acc[len(SLOTS) :]
        self._sequences = acc[SLOTS.index("num_sequences")]

    def add_lengths(self, lengths: torch.Tensor) -> None:
        """Real lengths ``[b]`` of dynamically padded rows (their padded length comes from the shape)."""
        self.on(lengths.device)
        self._add_pairs(lengths.reshape(-1), self._real, self._window_real)

    def add_offsets(self, real: torch.Tensor | None, padded: torch.Tensor | None) -> None:
        """The lengths of trimmed offsets, ``[n]`` or row-local ``[b, n]`` (differences along the
        last dimension: rows stay apart): ``real`` into the real channel and the sequence count
        (its non-zero lengths: a zero-length entry pads, it is no sequence), ``padded`` into the
        padded one (the same tensor for both: packed rows without sub-sequence padding)."""
        first = padded if real is None else real
        assert first is not None, "offsets for at least one channel"
        self.on(first.device)
        if real is padded:
            # No sub-sequence padding: the real lengths count for both (broadcast into [2, 2]).
            lengths = torch.diff(first).reshape(-1)
            self._count(lengths)
            self._add_pairs(lengths, self._both, self._window_both)
        elif real is not None and padded is not None and real.shape == padded.shape:
            both = torch.diff(torch.stack((real, padded))).reshape(2, -1)
            self._count(both[0])
            self._add_pairs(both, self._both, self._window_both)
        else:
            if real is not None:
                lengths = torch.diff(real).reshape(-1)
                self._count(lengths)
                self._add_pairs(lengths, self._real, self._window_real)
            if padded is not None:
                self._add_pairs(torch.diff(padded).reshape(-1), self._padded, self._window_padded)

    def _count(self, lengths: torch.Tensor) -> None:
        self._sequences.add_(torch.count_nonzero(lengths))

    def add_grid(self, grid: torch.Tensor) -> None:
        """A ``[n, 3]`` (or ``[..., 3]``) ``grid_thw`` tensor into the vision slots."""
        assert self.vision is not None  # the tracker passes grids only with a vision spec
        self.on(grid.device)
        self._vision.add_(vision_stats_tensor(self.vision, grid.reshape(-1, 3)))

    def _add_pairs(self, lengths: torch.Tensor, target: torch.Tensor, window_target: torch.Tensor) -> None:
        """Add ``(sum s, sum s^2)`` of ``[n]`` or ``[k, n]`` lengths into the ``[2]``/``[k, 2]`` view
        ``target`` (and the window excess into ``window_target``)."""
        # [..., n, 1] ** [2] -> [..., n, 2] (int64), summed over n: (sum s, sum s^2).
        target.add_(torch.pow(lengths.unsqueeze(-1), self._exps).sum(-2))
        if self.window is not None:
            excess = (lengths - self.window).clamp_(min=0)
            window_target.add_(torch.pow(excess.unsqueeze(-1), self._exps).sum(-2))
