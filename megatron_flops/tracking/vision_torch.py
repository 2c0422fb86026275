"""Vision statistics of a ``grid_thw`` tensor on its device, without a host sync (torch).

``vision_stats_tensor`` evaluates the same per-row polynomials as ``VisionStats.from_grids``
(``vision.grid_row_terms``) elementwise on an ``[n, 3]`` integer tensor and sums them: no
``.item()``, no ``.tolist()``, no data-dependent shape, so a tracker can add the result into a
fixed-shape accumulator per micro-batch and all-reduce it once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_flops.flops.vision import VISION_STAT_FIELDS, VisionSpec, VisionStats, grid_row_terms

# Entries of the vector, in order: the VisionStats fields.
VISION_SLOTS: tuple[str, ...] = VISION_STAT_FIELDS


def vision_stats_tensor(spec: VisionSpec, grid_thw: torch.Tensor) -> torch.Tensor:
    """``[len(VISION_SLOTS)]`` int64 statistics of ``grid_thw`` (``[n, 3]`` rows ``t, h, w``) on
    its device. The values are not validated (that would sync): rows must be positive, with
    ``h`` and ``w`` multiples of ``spec.spatial_merge_size``."""
    if not isinstance(grid_thw, torch.Tensor):
        raise ValueError(f"grid_thw must be a tensor, got {type(grid_thw).__name__}")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be [n, 3], got shape {tuple(grid_thw.shape)}")
    if grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex or grid_thw.dtype == torch.bool:
        raise ValueError(f"grid_thw must hold integers, got {grid_thw.dtype}")
    t, h, w = grid_thw.to(torch.int64).unbind(1)
    terms = grid_row_terms(spec, t, h, w)
    columns = [torch.ones_like(t) if name == "num_images" else terms[name] for name in VISION_SLOTS]
    return torch.stack(columns, dim=1).sum(0)


def vision_stats_from_vector(values: Sequence[int]) -> VisionStats:
    """The VisionStats of a (reduced) vector laid out as VISION_SLOTS."""
    if len(values) != len(VISION_SLOTS):
        raise ValueError(f"expected {len(VISION_SLOTS)} values ({', '.join(VISION_SLOTS)}), got {len(values)}")
    return VisionStats(**{name: int(v) for name, v in zip(VISION_SLOTS, values)})
