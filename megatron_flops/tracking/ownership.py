"""Which model chunk counts a micro-batch: once per model replica, whatever the parallel layout.

The owner is the first pipeline stage's first virtual chunk (``model.pre_process``) on tensor-
and context-parallel rank 0. The ranks come from the process groups the model carries, under the
attribute its megatron-core release uses: ``pg_collection`` (0.15 and later), ``model_comm_pgs``
(0.14). A model with neither falls back to megatron-core's global ``parallel_state`` when that
module is loaded and initialised (it is never imported here), else to rank 0.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

# Process-group attributes of megatron-core models, newest first.
GROUP_ATTRIBUTES = ("pg_collection", "model_comm_pgs")


class ChunkOwners:
    """Per model chunk: whether it records its micro-batches, and the context-parallel size
    (``context_parallel_size`` when given, else the model's), read once per chunk."""

    def __init__(self, context_parallel_size: int | None = None) -> None:
        self.context_parallel_size = context_parallel_size
        self._chunks: dict[int, tuple[bool, int]] = {}

    def lookup(self, model: Any, vp_stage: int | None = None, owner: bool | None = None) -> tuple[bool, int]:
        """(whether a micro-batch given to ``model`` counts, the context-parallel size). ``owner``
        overrides the rule; without a model, the first virtual chunk (``vp_stage`` None or 0) owns."""
        if owner is not None or model is None:
            is_owner = owner if owner is not None else vp_stage in (None, 0)
            return is_owner, self.context_parallel_size or 1
        cached = self._chunks.get(id(model))
        if cached is None:
            is_owner, cp_size = chunk_ownership(model, vp_stage)
            cached = self._chunks[id(model)] = (is_owner, self.context_parallel_size or cp_size)
        return cached


def unwrap(model: Any) -> Any:
    """The innermost module under DDP / Float16Module-style ``.module`` wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def chunk_ownership(model: Any, vp_stage: int | None = None) -> tuple[bool, int]:
    """(whether ``model`` owns its micro-batches, the context-parallel size)."""
    inner = unwrap(model)
    is_first = getattr(inner, "pre_process", None)
    if is_first is None:
        is_first = vp_stage in (None, 0)
    tp_rank, cp_rank, cp_size = parallel_ranks(inner)
    return bool(is_first) and tp_rank == 0 and cp_rank == 0, cp_size


def parallel_ranks(inner: Any) -> tuple[int, int, int]:
    """(tensor-parallel rank, context-parallel rank, context-parallel size) of an unwrapped model."""
    for attribute in GROUP_ATTRIBUTES:
        groups = getattr(inner, attribute, None)
        if groups is not None:
            tp, cp = getattr(groups, "tp", None), getattr(groups, "cp", None)
            return _group_rank(tp), _group_rank(cp), _group_size(cp)
    state = sys.modules.get("megatron.core.parallel_state")
    if state is not None and state.model_parallel_is_initialized():
        return (state.get_tensor_model_parallel_rank(), state.get_context_parallel_rank(),
                state.get_context_parallel_world_size())
    return 0, 0, 1


def _group_rank(group: Any) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group=group)


def _group_size(group: Any) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)
