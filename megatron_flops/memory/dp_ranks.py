"""Which data-parallel rank holds the most optimizer state, found without walking every rank
(stdlib only).

NB: under the distributed optimizer and Megatron-FSDP every rank of a data-parallel group holds
buffers of the same size; ranks differ only in how much real parameter data (not alignment gaps
or bucket padding) their shard of each bucket covers, and so in their optimizer state. A bucket
padded to ``n x part`` elements gives rank ``r`` the slice ``[origin + r x part, origin + (r + 1)
x part)``; a parameter spanning ``[lo, hi)`` adds its overlap with each slice: part of the first
and last slices it touches, ``part`` to each one between. Summed over parameters, a rank's real
elements are a step function of the rank with at most six steps per parameter, so the most loaded
rank is found at the breakpoints, in time independent of the data-parallel size.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator

from megatron_flops.memory.states import Bucket

# (rank, change): from that rank on, a rank's real elements change by this much.
Step = tuple[int, int]


def span_steps(spans: Iterable[tuple[int, int]], *, origin: int, part: int) -> Iterator[Step]:
    """The steps of the real elements per rank that parameters at ``[lo, hi)`` put in slices of
    ``part`` elements from ``origin`` (each rank's slice, as ``min(hi, end) - max(lo, start)``
    clipped at 0 summed over the spans)."""
    for lo, hi in spans:
        if hi <= lo:
            continue
        first, last = (lo - origin) // part, (hi - 1 - origin) // part
        if first == last:
            yield from ((first, hi - lo), (first + 1, lo - hi))
            continue
        head, tail = origin + (first + 1) * part - lo, hi - origin - last * part
        yield from ((first, head), (first + 1, part - head), (last, tail - part), (last + 1, -tail))


class _Loads:
    """A step function given by its steps: its value at any rank in O(log steps)."""

    def __init__(self, steps: Iterable[Step]) -> None:
        change: dict[int, int] = {}
        for rank, delta in steps:
            change[rank] = change.get(rank, 0) + delta
        self.ranks = sorted(change)
        self.values: list[int] = []
        total = 0
        for rank in self.ranks:
            total += change[rank]
            self.values.append(total)

    def at(self, rank: int) -> int:
        i = bisect.bisect_right(self.ranks, rank)
        return self.values[i - 1] if i else 0


def most_loaded_rank(dense: Iterable[Step], *, ranks: int, expert: Iterable[Step] = (),
                     expert_rank: Callable[[int], int] | None = None) -> int:
    """The lowest rank ``d`` in ``range(ranks)`` holding the most real elements: the ``dense``
    steps' value at ``d`` plus the ``expert`` steps' at ``expert_rank(d)`` (a non-decreasing map
    to the expert data-parallel rank)."""
    own, theirs = _Loads(dense), _Loads(expert)
    candidates = {0, *(r for r in own.ranks if 0 <= r < ranks)}
    if expert_rank is not None:
        # The first rank whose expert rank reaches each breakpoint (expert_rank is monotone).
        candidates.update(bisect.bisect_left(range(ranks), e, key=expert_rank) for e in theirs.ranks)
        candidates.discard(ranks)

    def load(d: int) -> int:
        return own.at(d) + (theirs.at(expert_rank(d)) if expert_rank is not None else 0)

    return max(sorted(candidates), key=lambda d: (load(d), -d))


def bucket_steps(buckets: Iterable[Bucket], ranks: int) -> Iterator[Step]:
    """The steps of the distributed optimizer's shards of ``buckets`` over ``ranks`` ranks
    (:func:`~megatron_flops.memory.states.shard_numel` for every rank at once)."""
    for bucket in buckets:
        yield from span_steps(((start, end) for _, start, end in bucket.params), origin=bucket.start,
                              part=bucket.numel // ranks)
