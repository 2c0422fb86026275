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
