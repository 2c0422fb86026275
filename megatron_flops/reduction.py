"""The one per-step reduction: a fixed-shape int64 vector summed over the ranks (torch).

Every rank calls :meth:`StepReducer.reduce` once per step, whatever failed locally, so the ranks'
collectives always pair; what went wrong travels in the vector instead:

- the payload (device accumulator + host counts), each value split into 32-bit halves so that the
  sum over ranks is exact for any number of ranks (up to 2^31);
- per rank: a 1 (the number of ranks), whether its payload failed (zeroed), whether it may have
  overflowed int64 (zeroed), whether its shape counts are missing, whether the vector is a
  resynchronisation filler, a one-hot of its step index modulo ``STEP_WINDOW``, and the number
  of negative payload values (a wrapped or malformed value).

After the all-reduce (the one host sync of the step) every rank holds the same vector and so takes
the same decision: price it, fall back, or, when the ranks were on different steps, fall back and
resynchronise (the ranks ahead by ``k`` steps run ``k`` filler all-reduces at once, which pair
with the lagging ranks' next ``k`` steps; those steps fall back too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

INT64_LIMIT = 2**63
# A step index is reduced as a one-hot over its residue modulo STEP_WINDOW: ranks fewer than
# STEP_WINDOW // 2 steps apart can be told apart and resynchronised; farther apart, every step
# falls back until they meet again.
STEP_WINDOW = 16
_CONTROL = ("num_ranks", "num_failed", "num_overflowed", "num_without_shapes", "num_fillers")
_LOW_BITS = 32
_LOW_MASK = (1 << _LOW_BITS) - 1


@dataclass(frozen=True, kw_only=True)
class Reduction:
    """What one step's reduction agreed on: the same on every rank of the group.

    ``totals``: every slot summed over every rank, exact; None unless ``problem`` is None.
    ``shapes``: the shape slots summed over every rank (known even when the payload is not);
    None when not every rank's shape counts arrived in this step's collective.
    ``problem``: why the step cannot be priced (None when it can).
    ``local_error``: the exception this rank hit building its vector, if any (for the log).
    """

    totals: Mapping[str, int] | None = None
    shapes: Mapping[str, int] | None = None
    problem: str | None = None
    local_error: BaseException | None = None


class StepReducer:
    """Sums a fixed-shape int64 vector laid out as ``slots`` over ``group`` (default: the world).

    ``shape_slots``: the slots known from host-side shapes alone; they still travel when a rank's
    payload fails, so that the static number stays known.
    """

    def __init__(self, slots: Sequence[str], *, shape_slots: Sequence[str], group: Any = None) -> None:
        self.slots = tuple(slots)
        self.group = group
        self._shape_index = frozenset(self.slots.index(name) for name in shape_slots)
        self._world_size: int | None = None

    def reduce(
        self, acc: torch.Tensor | None, host: Sequence[int], *, step: int, failed: bool, bound: int,
    ) -> Reduction:
        """The totals of ``acc + host`` over every rank: one all-reduce (plus fillers when the ranks
        were on different steps). Never raises.

        ``step``: this step's index (the same on every rank when the ranks are in step).
        ``failed``: this rank's statistics are wrong (its payload is replaced by zeros).
        ``bound``: an upper bound of every payload value of this rank for valid inputs; at or past
        2^63 the int64 accumulator may have wrapped, so the payload is replaced by zeros.
        """
        error: BaseException | None = None
        try:
            device = self._collective_device()
            try:
                vec = self._local_vector(acc, host, device, step=step, failed=failed, bound=bound)
            except Exception as exc:  # whatever failed locally, this rank still joins the collective
                error = exc
                vec = self._control_vector(device, step, failed=True, without_shapes=True)
            summed = self._all_reduce(vec)
        except Exception as exc:
            return Reduction(problem=f"the all-reduce failed ({type(exc).__name__}: {exc})", local_error=error)
        try:
            return self._decide(summed, step, device, error)
        except Exception as exc:  # an invariant broke: fall back rather than report it
            return Reduction(problem=f"the reduced vector could not be read ({type(exc).__name__}: {exc})",
                             local_error=error)

    # ---- this rank's vector ---------------------------------------------------------------------

    def _local_vector(self, acc, host, device, *, step: int, failed: bool, bound: int) -> torch.Tensor:
        values = list(host)
        if not all(isinstance(v, int) and v >= 0 for v in values):
            raise ValueError(f"host counts must be non-negative ints, got {values}")
        shapes_fit = all(values[i] < INT64_LIMIT for i in self._shape_index)
        overflowed = not bound < INT64_LIMIT or not all(v < INT64_LIMIT for v in values)
        if failed or overflowed:
            # A zeroed payload; the shape counts travel when they fit.
            values = [v if i in self._shape_index and shapes_fit else 0 for i, v in enumerate(values)]
            vec = torch.tensor(values, dtype=torch.int64, device=device)
        else:
            vec = torch.tensor(values, dtype=torch.int64).to(device)
            if acc is not None:
                vec = vec + acc.to(device)
        control = self._control(step, failed=failed, overflowed=overflowed, without_shapes=not shapes_fit)
        negative = (vec < 0).sum().view(1)  # on the device: no sync
        halves = (vec & _LOW_MASK, vec >> _LOW_BITS)
        return torch.cat((*halves, torch.tensor(control, dtype=torch.int64, device=device), negative))

    def _control_vector(self, device: torch.device, step: int | None, **flags: bool) -> torch.Tensor:
        """A zero payload, this rank's control slots, no negative value."""
        values = [0] * (2 * len(self.slots)) + self._control(step, **flags) + [0]
        return torch.tensor(values, dtype=torch.int64, device=device)

    @staticmethod
    def _control(
        step: int | None, *, failed: bool = False, overflowed: bool = False, without_shapes: bool = False,
        filler: bool = False,
    ) -> list[int]:
        """The control slots (``_CONTROL``), then the one-hot of the step's residue (none for a filler)."""
        steps = [0] * STEP_WINDOW
        if step is not None:
            steps[step % STEP_WINDOW] = 1
        return [1, int(failed), int(overflowed), int(without_shapes), int(filler)] + steps

    # ---- the collective and what every rank concludes ------------------------------------------

    def _all_reduce(self, vec: torch.Tensor) -> list[int]:
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        return vec.tolist()  # the one host sync of the step

    def _decide(self, summed: list[int], step: int, device: torch.device, error: BaseException | None) -> Reduction:
        n = len(self.slots)
        totals = {name: (summed[n + i] << _LOW_BITS) + summed[i] for i, name in enumerate(self.slots)}
        control = dict(zip(_CONTROL, summed[2 * n : 2 * n + len(_CONTROL)]))
        steps = summed[2 * n + len(_CONTROL) : -1]
        negative = summed[-1]
        world = self._group_size()
        if control["num_ranks"] != world or sum(steps) + control["num_fillers"] != world:
            return Reduction(problem=f"the reduced vector does not add up ({control['num_ranks']} ranks of {world})",
                             local_error=error)
        occupied = [r for r, count in enumerate(steps) if count]
        if len(occupied) > 1 or control["num_fillers"]:
            lag = _lag(occupied, step)
            for _ in range(lag or 0):
                self._all_reduce(self._control_vector(device, None, without_shapes=True, filler=True))
            where = "resynchronised" if lag is not None else "too far apart to resynchronise"
            return Reduction(problem=f"the ranks were on different steps (step residues {occupied}, "
                                     f"{control['num_fillers']} fillers; {where})", local_error=error)
        shapes = None if control["num_without_shapes"] else {self.slots[i]: totals[self.slots[i]]
                                                             for i in sorted(self._shape_index)}
        problem = None
        if control["num_overflowed"]:
            problem = (f"{control['num_overflowed']} rank(s) past the exact int64 range "
                       f"(a rank's token slots in one step, squared, reach 2^63)")
        elif control["num_failed"]:
            problem = f"{control['num_failed']} rank(s) failed to record or reduce this step"
        elif negative:
            problem = f"{negative} negative statistics (a wrapped or malformed value)"
        return Reduction(totals=None if problem else totals, shapes=shapes, problem=problem, local_error=error)

    def _collective_device(self) -> torch.device:
        if dist.is_available() and dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _group_size(self) -> int:
        if self._world_size is None:
            initialized = dist.is_available() and dist.is_initialized()
            self._world_size = dist.get_world_size(group=self.group) if initialized else 1
        return self._world_size


def _lag(occupied: list[int], step: int) -> int | None:
    """How many steps this rank is ahead of the lowest step among the ranks (None: ambiguous)."""
    for low in occupied:
        if max((r - low) % STEP_WINDOW for r in occupied) < STEP_WINDOW // 2:
            return (step - low) % STEP_WINDOW
    return None
