"""The one per-step reduction of the tracker's statistics (torch).

Every rank calls :meth:`StepReducer.reduce` once per step: it adds the host-side counts to the
device accumulator and sums the vector over the process group with one ``all_reduce``, then
reads it on the host (the one host sync of the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class StepReducer:
    """Sums a fixed-shape int64 vector laid out as ``slots`` over ``group`` (default: the world)."""

    def __init__(self, slots: Sequence[str], *, group: Any = None) -> None:
        self.slots = tuple(slots)
        self.group = group

    def reduce(self, acc: torch.Tensor | None, host: Sequence[int]) -> dict[str, int]:
        """The totals of ``acc + host`` over every rank of the group."""
        device = self._collective_device()
        host_vec = torch.tensor(list(host), dtype=torch.int64)
        vec = host_vec.to(device) if acc is None else acc.to(device) + host_vec.to(device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        return dict(zip(self.slots, vec.tolist()))  # the one host sync of the step

    def _collective_device(self) -> torch.device:
        if dist.is_available() and dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
