"""Checks of one micro-batch's tensors, and where a tensor counts as on the host (torch).

What these read costs no host sync: dtypes, shapes, and host values (ints, CPU tensors). The
values of a tensor on a device are read only when the tracker validates (``validate=True``: for
debugging); otherwise a malformed value is counted as given and caught after the step's
reduction.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_flops.flops.vision import VisionSpec, parse_grids

INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
# Where a tensor counts as on the host (the trackers read or price it there). Tests empty it to run
# the device path on CPU tensors.
HOST_DEVICE_TYPES = frozenset({"cpu"})


def on_host(value: Any) -> bool:
    """Whether ``value`` is a host tensor (anything else takes the checked device path)."""
    return isinstance(value, torch.Tensor) and value.is_cpu and "cpu" in HOST_DEVICE_TYPES


def all_on_host(*values: Any) -> bool:
    """Whether every value that is not None is a host tensor."""
    for value in values:
        if value is not None and not on_host(value):
            return False
    return True


def host_int(value: Any, name: str) -> int:
    """An int, or the one value of a host tensor or one-element list (never a device read)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            raise ValueError(f"{name} must be a host value (a CPU tensor of one element or an int) to read "
                             f"without a sync, got {tuple(value.shape)} on {value.device}")
        return int(value.reshape(()))
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def offset_rows(cu: torch.Tensor, num_rows: int) -> int:
    """How many rows of offsets ``cu`` holds: 1 for ``[n]`` and ``[1, n]`` (offsets into the
    micro-batch's tokens as one stream), ``b`` for ``[b, n]`` with one row of offsets per token
    row (row-local: Megatron-LM core_v0.19.0 collates a row's offsets, padded to ``S + 1``
    entries with copies of ``S``, into ``[mbs, S + 1]``). Raises ``ValueError`` for any other shape."""
    shape = cu.shape
    if len(shape) == 1 or (len(shape) == 2 and shape[0] in (1, num_rows)):
        return 1 if len(shape) == 1 else shape[0]
    per_row = f" or [{num_rows}, n] (one row of offsets per token row)" if num_rows > 1 else ""
    raise ValueError(f"cu_seqlens must be [n] or [1, n] (one packed stream){per_row}, got shape {tuple(shape)}")


def check_offsets(cu: Any, argmin: Any, name: str, num_rows: int, row_len: int, *, validate: bool) -> Any:
    """Host checks of a cu_seqlens (its dtype and shape; its values only when validating) for a
    micro-batch of ``num_rows`` rows of ``row_len`` token slots; returns its argmin: None, an
    int, or a one-element CPU tensor (read at ``end_step``). Row-local offsets (``[b, n]``,
    ``b > 1``) take no argmin (they are padded with zero-length entries, not cut)."""
    if not isinstance(cu, torch.Tensor) or cu.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must be a tensor of integers, got {getattr(cu, 'dtype', type(cu).__name__)}")
    rows = offset_rows(cu, num_rows)
    if cu.shape[-1] < 2:
        raise ValueError(f"{name} needs at least two entries, got shape {tuple(cu.shape)}")
    if rows > 1 and argmin is not None:
        raise ValueError(f"{name}: an end marker (argmin) applies to one row of offsets, got shape {tuple(cu.shape)}")
    if isinstance(argmin, torch.Tensor):
        if argmin.numel() != 1 or argmin.device.type != "cpu":
            argmin = host_int(argmin, f"{name} argmin")  # raises: not a host value of one element
    elif argmin is not None:
        argmin = host_int(argmin, f"{name} argmin")
    if validate:
        if rows > 1:
            for row in cu:
                _check_values(row, name, row_len, "a row")
        else:
            _check_values(trim(cu, argmin, name), name, num_rows * row_len, "the micro-batch")
    return argmin


def trim(cu: torch.Tensor, argmin: torch.Tensor | int | None, name: str) -> torch.Tensor:
    """``cu`` as one dimension, cut at its end marker ``argmin`` (a host value) when given; row-local
    offsets (``[b, n]``, ``b > 1``) stay as they are."""
    if cu.dim() == 2 and cu.shape[0] > 1:
        return cu
    cu = cu.reshape(-1)
    if argmin is None:
        return cu
    argmin = host_int(argmin, f"{name} argmin")
    if argmin < 2:
        raise ValueError(f"{name} needs at least two entries before its end marker, got {argmin}")
    return cu[:argmin]


def _check_values(cu: torch.Tensor, name: str, num_tokens: int, where: str) -> None:
    """Validation mode only (it syncs the host with the device)."""
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] > num_tokens:
        raise ValueError(f"{name} ends at {values[-1]} but {where} holds {num_tokens} tokens")


def check_lengths(lengths: torch.Tensor, name: str, row_len: int, *, validate: bool) -> None:
    """Host checks of ``[b]`` sequence lengths (their dtype; their values only when validating)."""
    if lengths.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must hold integers, got {lengths.dtype}")
    if validate:
        values = lengths.tolist()
        if any(v < 0 or v > row_len for v in values):
            raise ValueError(f"{name} must lie in [0, {row_len}], got {values}")


def check_grid(grid: Any, vision: VisionSpec, *, validate: bool) -> None:
    """Host checks of a ``grid_thw`` tensor (its dtype and shape; its rows only when validating)."""
    if not isinstance(grid, torch.Tensor) or grid.dtype not in INT_DTYPES or grid.shape[-1:] != (3,):
        raise ValueError(f"grid_thw must be an integer tensor of [t, h, w] rows, got {grid!r:.80}")
    if validate:
        parse_grids(grid.reshape(-1, 3).tolist(), spatial_merge_size=vision.spatial_merge_size)
