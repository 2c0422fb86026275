"""Weights, gradients and optimizer state per rank under megatron-core's DDP and distributed
optimizer (stdlib only).

NB: bytes are those of the storages megatron-core allocates, padding included. Per model chunk,
DDP puts the parameters that train into one contiguous gradient buffer per group (dense, and
expert-parallel ones when EP > 1), laid out in reverse ``named_parameters()`` order. With the
distributed optimizer the weights move into a parameter buffer of the same layout, every
parameter starts at a multiple of 64 elements, the tied embedding/output weight of a pipeline
(PP > 1) gets a bucket of its own, and every bucket is padded to a multiple of
``lcm(data-parallel size, 128)`` elements so it shards evenly (``_ParamAndGradBuffer``).
Frozen parameters stay outside the buffers and have no gradient or optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_flops.memory.decoder import Param
from megatron_flops.memory.layout import Training


@dataclass(frozen=True)
class Bucket:
    """One bucket of a buffer: ``[start, end)`` in elements, and its parameters' ranges."""

    start: int
    end: int
    params: tuple[tuple[Param, int, int], ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


def buffer_buckets(
    params: Sequence[Param], *, dp: int, distributed_optimizer: bool, bucket_size: int | None
) -> tuple[Bucket, ...]:
    """The buckets megatron-core's ``_ParamAndGradBuffer`` lays ``params`` (all trainable, in
    ``named_parameters()`` order) out in, for a data-parallel group of ``dp`` ranks."""
    if not params:
        return ()
    divisor = math.lcm(dp, 128)

    def pad_bucket_end(index: int) -> int:
        return -(-index // divisor) * divisor if distributed_optimizer else index

    buckets: list[Bucket] = []
    members: list[tuple[Param, int, int]] = []
    bucket_start = start = 0

    def close(end: int) -> int:
        nonlocal members, bucket_start
        padded = pad_bucket_end(end)
        buckets.append(Bucket(bucket_start, padded, tuple(members)))
        members, bucket_start = [], padded
        return padded

    for param in reversed(params):
        if distributed_optimizer:
            start = -(-start // 64) * 64
        separate = param.shared_embedding and distributed_optimizer
        if separate and members:
            start = close(start)
        end = start + param.numel
        members.append((param, start, end))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or separate:
            start = close(end)
        else:
            start = end
    if members:
        close(end)
    return tuple(buckets)


def shard_numel(bucket: Bucket, dp: int, dp_rank: int) -> int:
    """Elements of real parameters in ``dp_rank``'s shard of ``bucket`` (the distributed
    optimizer keeps main copies and moments for these only, not for padding)."""
    size = bucket.numel // dp
    lo = bucket.start + dp_rank * size
    hi = lo + size
    return sum(max(0, min(hi, end) - max(lo, start)) for _, start, end in bucket.params)


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes of model and optimizer state on one rank, keyed ``weights``, ``gradients``,
    ``optimizer/main_params``, ``optimizer/exp_avg``, ``optimizer/exp_avg_sq`` (Adam) or
    ``optimizer/momentum_buffer`` (SGD)."""

    components: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.components.values())


def optimizer_keys(training: Training) -> tuple[str, ...]:
    """State per main parameter. NB: Adam's per-tensor ``step`` scalar is not counted."""
    moments = ("exp_avg", "exp_avg_sq") if training.optimizer == "adam" else ("momentum_buffer",)
    main = ("main_params",) if training.needs_main_params else ()
    return tuple(f"optimizer/{k}" for k in main + moments)


def chunk_buffers(
    params: Sequence[Param], *, dp: int, expert_dp: int, distributed_optimizer: bool, bucket_size: int | None
) -> dict[str, tuple[Bucket, ...]]:
    """The buckets of one model chunk's DDP buffers: ``dp`` (dense parameters) and ``expt_dp``
    (expert-parallel ones). ``bucket_size`` is the DDP bucket size this chunk uses (None for
    chunks after the first and for pipeline ranks after the first, as megatron-core sets it)."""
    return {
        group: buffer_buckets([p for p in params if p.trainable and p.expert == expert], dp=size,
                              distributed_optimizer=distributed_optimizer, bucket_size=bucket_size)
        for group, expert, size in (("dp", False, dp), ("expt_dp", True, expert_dp))
    }


def chunk_state_bytes(
    params: Sequence[Param],
    buffers: dict[str, tuple[Bucket, ...]],
    training: Training,
    *,
    sizes: dict[str, int],
    ranks: dict[str, int],
    distributed_optimizer: bool,
) -> StateBytes:
    """State bytes of one model chunk (one megatron-core ``DistributedDataParallel``) on the rank
    with data-parallel ranks ``ranks`` (``dp``, ``expt_dp``) in groups of ``sizes``."""
    frozen = sum(p.numel for p in params if not p.trainable)
    weights = frozen * training.param_bytes
    grads = optimizer_numel = 0
    for group, buckets in buffers.items():
        numel = sum(b.numel for b in buckets)
        grads += numel * training.grad_bytes
        # NB: with the distributed optimizer the trainable weights live in a parameter buffer of
        # the gradient buffer's layout, padding included; under DDP they are their own tensors.
        weights += numel * training.param_bytes
        if distributed_optimizer:
            optimizer_numel += sum(shard_numel(b, sizes[group], ranks[group]) for b in buckets)
        else:
            optimizer_numel += numel
    components = {"weights": weights, "gradients": grads}
    for key in optimizer_keys(training):
        components[key] = optimizer_numel * 4
    return StateBytes(components=components)
