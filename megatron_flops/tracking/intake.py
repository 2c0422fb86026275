"""Where one micro-batch's tensors go (torch): host tensors to the step's ``HostBatches``, device
tensors to the ``DeviceStats`` accumulator, what their shapes tell to host counters.

Each tensor is checked on the host first (``batch_checks``: dtypes, shapes, host values); nothing
here syncs with a device or runs a tensor operation on a host tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_flops.tracking.batch_checks import (all_on_host, check_grid, check_lengths, check_offsets, host_int, offset_rows,
                                         on_host, trim)
from megatron_flops.tracking.device_stats import DeviceStats
from megatron_flops.tracking.host_stats import HostBatches
from megatron_flops.flops.vision import VisionSpec


class BatchIntake:
    """Adds micro-batches into a step's ``HostBatches`` and the tracker's ``DeviceStats``.

    ``validate`` also checks tensor values (a host sync); ``warn_once(what, why)`` logs what is
    left out (grids without a vision spec).
    """

    def __init__(self, device: DeviceStats, *, vision: VisionSpec | None, validate: bool,
                 warn_once: Callable[[str, BaseException], None]) -> None:
        self.device = device
        self.vision = vision
        self.validate = validate
        self.warn_once = warn_once

    def add(self, step: HostBatches, rows: int, row_len: int, cu, argmin, cu_pad, pad_argmin, limit,
             seq_lengths, grids, *, defer_device: bool) -> None:
        """One micro-batch into ``step`` (host tensors and shape counters) and, for device
        tensors, the device accumulator (or ``step.device_batches`` with ``defer_device``)."""
        if grids is not None and not isinstance(grids, (list, tuple)):
            grids = (grids,)
        if defer_device and not all_on_host(cu, cu_pad, seq_lengths, *(grids or ())):
            step.device_batches.append(dict(rows=rows, row_len=row_len, cu=cu, argmin=argmin, cu_pad=cu_pad,
                                            pad_argmin=pad_argmin, limit=limit, seq_lengths=seq_lengths,
                                            grids=grids))
            return
        counters = step.counters
        counters["num_microbatches"] += 1
        counters["num_rows"] += rows
        counters["num_padded_tokens"] += rows * row_len
        if grids:
            self._grids(step, grids)
        if cu is not None:
            self._packed(step, rows, row_len, cu, argmin, cu_pad, pad_argmin, limit)
        elif seq_lengths is None:
            # Full-length unpacked rows: everything is known from the shape.
            counters["num_sequences"] += rows
            step.add_full_rows(rows, row_len, real=True)
        else:
            self._padded_rows(step, rows, row_len, seq_lengths)

    def _padded_rows(self, step: HostBatches, rows: int, row_len: int, seq_lengths: torch.Tensor) -> None:
        """Dynamically padded rows: one sequence each, of its ``seq_lengths`` entry."""
        step.counters["num_sequences"] += rows
        if seq_lengths.numel() != rows:
            raise ValueError(f"seq_lengths must hold one length per row ({rows}), got shape {tuple(seq_lengths.shape)}")
        check_lengths(seq_lengths, "seq_lengths", row_len, validate=self.validate)
        # NB: a dynamically padded row attends over its padded length.
        step.add_full_rows(rows, row_len, real=False)
        if on_host(seq_lengths):
            step.lengths.append(seq_lengths)
        else:
            self.device.add_lengths(seq_lengths)

    def _packed(self, step: HostBatches, rows: int, row_len: int, cu, argmin, cu_pad, pad_argmin, limit) -> None:
        """Packed rows: lengths are the differences of cu_seqlens (global under CP), one stream of
        offsets or one row of them per token row (``batch_checks.offset_rows``)."""
        argmin = check_offsets(cu, argmin, "cu_seqlens", rows, row_len, validate=self.validate)
        if cu_pad is not None:
            pad_argmin = check_offsets(cu_pad, argmin if pad_argmin is None else pad_argmin, "cu_seqlens_padded",
                                       rows, row_len, validate=self.validate)
        if limit is not None:
            if offset_rows(cu, rows) > 1:
                raise ValueError("num_real_tokens applies to one packed row, not to row-local offsets "
                                 f"of shape {tuple(cu.shape)}")
            limit = host_int(limit, "num_real_tokens")
        host, pad_host = on_host(cu), cu_pad is None or on_host(cu_pad)
        if host:
            step.add_offsets(cu, argmin, limit, real=True, padded=cu_pad is None and limit is None)
            if cu_pad is None and limit is not None:
                step.add_offsets(cu, argmin, None, real=False, padded=True)
        if cu_pad is not None and pad_host:
            step.add_offsets(cu_pad, pad_argmin, None, real=False, padded=True)
        if not (host and pad_host):
            self._device_offsets(step, cu, argmin, cu_pad, pad_argmin, limit)

    def _device_offsets(self, step: HostBatches, cu, argmin, cu_pad, pad_argmin, limit) -> None:
        """The device path of a packed row: trimmed at the host argmins, summed on the device."""
        if limit is not None:
            raise ValueError("num_real_tokens needs host (CPU) cu_seqlens")
        on_device = not on_host(cu)
        cu = trim(cu, argmin, "cu_seqlens")
        if cu_pad is None:  # cu is on the device; without sub-sequence padding it counts for both
            self.device.add_offsets(cu, cu)
            return
        pad_on_device = not on_host(cu_pad)
        cu_pad = trim(cu_pad, pad_argmin, "cu_seqlens_padded")
        self.device.add_offsets(cu if on_device else None, cu_pad if pad_on_device else None)

    def _grids(self, step: HostBatches, grids: Sequence[torch.Tensor]) -> None:
        if self.vision is None:
            message = "grid_thw needs FlopsTracker(..., vision=VisionSpec)"
            if self.validate:
                raise ValueError(message)
            # NB: the decoder stays exact; only the vision tower is left out, and said so once.
            self.warn_once("vision tower not counted", ValueError(message))
            return
        for grid in grids:
            check_grid(grid, self.vision, validate=self.validate)
            if on_host(grid):
                step.grids.append(grid)
            else:
                self.device.add_grid(grid)
