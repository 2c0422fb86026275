"""The one per-step reduction: a fixed-shape int64 vector summed over the ranks (torch).

Every rank calls :meth:`StepReducer.reduce` once per step, whatever failed locally, so the ranks'
collectives always pair; what went wrong travels in the vector instead. Its layout:

- the payload (device accumulator + host counts), each value split into 32-bit halves so that
  the sum over ranks is exact for any number of ranks (up to 2^31);
- per rank: a 1 (the number of ranks); whether its payload failed or may have overflowed int64
  (the payload is then zeros); whether its shape counts are missing too; whether the vector is
  a resynchronisation filler; its step index (modulo 2^20) and the square of it; a one-hot of
  the step index modulo ``STEP_WINDOW``; the number of negative payload values (a wrapped or
  malformed value, counted on the device).

After the all-reduce (the one host sync of the step) every rank holds the same vector and so
takes the same decision: price the payload, or fall back. Ranks on different steps (a rank
skipped or repeated ``end_step``) fall back; when their steps had agreed at the previous
reduction and now lie fewer than ``STEP_WINDOW // 2`` apart, the ranks ahead by ``k`` steps run
``k`` filler all-reduces at once, which pair with the lagging ranks' next ``k`` steps (those fall
back too) and put every rank on the same step again. Otherwise every later step falls back.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

INT64_LIMIT = 2**63
STEP_WINDOW = 16
_STEP_MODULUS = 2**20  # step indices are compared modulo this: their squares summed over 2^23 ranks fit
_CONTROL = ("num_ranks", "num_failed", "num_overflowed", "num_without_shapes", "num_fillers",
            "step_sum", "step_sum_squares")
_LOW_BITS = 32
_LOW_MASK = (1 << _LOW_BITS) - 1
_CPU = torch.device("cpu")


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
        self._device: torch.device | None = None  # the collectives' device (see _collective_device)
        self._in_step = False  # whether every rank was on the same step at the previous reduction

    def reduce(
        self, acc: torch.Tensor | None, host: Sequence[int], *, step: int, failed: bool, token_slots: int,
    ) -> Reduction:
        """The totals of ``acc + host`` over every rank: one all-reduce (and fillers after a
        mis-paired step, see the module docstring). Never raises.

        ``step``: this step's index (the same on every rank for the same step).
        ``failed``: this rank's statistics are wrong: its payload travels as zeros.
        ``token_slots``: this rank's token slots in the step, T. With valid lengths no statistic
        exceeds T^2; at or past 2^63 the int64 accumulator may have wrapped, so the payload travels
        as zeros (Python and numpy integers are read exactly).
        """
        error: BaseException | None = None
        index: int | None
        try:
            index = operator.index(step)
        except TypeError as exc:  # no step index: the vector cannot add up, every rank falls back
            index, error, failed = None, exc, True
        try:
            device = self._collective_device()
            try:
                vec = self._local_vector(acc, host, device, step=index, failed=failed, token_slots=token_slots)
            except Exception as exc:  # whatever failed locally, this rank still joins the collective
                error = exc
                vec = self._host_vector(host, device, step=index, failed=True)
            summed = self._all_reduce(vec)
            return self._decide(summed, index, device, error)
        except Exception as exc:
            self._in_step = False
            return Reduction(problem=f"the all-reduce failed ({type(exc).__name__}: {exc})", local_error=error)

    # ---- this rank's vector ---------------------------------------------------------------------

    def _local_vector(self, acc, host, device, *, step: int | None, failed: bool, token_slots: int) -> torch.Tensor:
        host = [operator.index(v) for v in host]  # exact ints (a float or tensor raises)
        if any(v < 0 for v in host):
            raise ValueError(f"host counts must be non-negative, got {host}")
        overflowed = operator.index(token_slots) ** 2 >= INT64_LIMIT or any(v >= INT64_LIMIT for v in host)
        if failed or overflowed:
            return self._host_vector(host, device, step=step, failed=failed, overflowed=overflowed)
        if acc is None:  # every count is a host int in [0, 2^63): no negative value, one tensor
            return _vector(host, _control(step), device)
        # One host-to-device copy of the host counts and the control slots, then the device sums.
        head = torch.tensor(host + _control(step), dtype=torch.int64).to(device)
        n = len(host)
        vec = head[:n] + acc.to(device)
        negative = (vec < 0).sum().view(1)  # on the device: no sync
        return torch.cat((vec & _LOW_MASK, vec >> _LOW_BITS, head[n:], negative))

    def _host_vector(
        self, host: Sequence[Any], device: torch.device, *, step: int | None, failed: bool = False,
        overflowed: bool = False, filler: bool = False,
    ) -> torch.Tensor:
        """A zeroed payload but for the shape counts (when they are ints that fit), and the flags."""
        try:
            shapes = [operator.index(v) if i in self._shape_index else 0 for i, v in enumerate(host)]
            with_shapes = not filler and all(0 <= v < INT64_LIMIT for v in shapes)
        except TypeError:
            with_shapes = False
        if not with_shapes:
            shapes = [0] * len(self.slots)
        control = _control(step, failed=failed, overflowed=overflowed, without_shapes=not with_shapes, filler=filler)
        return _vector(shapes, control, device)

    # ---- the collective and what every rank concludes ------------------------------------------

    def _all_reduce(self, vec: torch.Tensor) -> list[int]:
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        return vec.tolist()  # the one host sync of the step

    def _decide(self, summed: list[int], step: int | None, device: torch.device, error: BaseException | None) -> Reduction:
        n = len(self.slots)
        totals = {name: (summed[n + i] << _LOW_BITS) + summed[i] for i, name in enumerate(self.slots)}
        control = dict(zip(_CONTROL, summed[2 * n : 2 * n + len(_CONTROL)]))
        residues = summed[2 * n + len(_CONTROL) : -1]
        negative = summed[-1]
        world = self._group_size()
        if control["num_ranks"] != world or sum(residues) + control["num_fillers"] != world:
            self._in_step = False
            return Reduction(problem=f"the reduced vector does not add up ({control['num_ranks']} ranks of {world})",
                             local_error=error)
        occupied = [r for r, count in enumerate(residues) if count]
        stepping = world - control["num_fillers"]
        if control["num_fillers"] or len(occupied) > 1 or (
                stepping * control["step_sum_squares"] != control["step_sum"] ** 2):  # all equal iff equality
            lag = _lag(residues, control["step_sum"], control["step_sum_squares"], step) if (
                step is not None and self._in_step and not control["num_fillers"]) else None
            self._in_step = False
            for _ in range(lag or 0):
                self._all_reduce(self._host_vector((), device, step=None, filler=True))
            what = ("this step pairs with resynchronisation fillers" if control["num_fillers"] else
                    "the ranks were resynchronised" if lag is not None else
                    "they cannot be resynchronised: every later step falls back")
            return Reduction(problem=f"the ranks called end_step() on different steps ({what})", local_error=error)
        self._in_step = True
        shapes = None if control["num_without_shapes"] else {
            self.slots[i]: totals[self.slots[i]] for i in sorted(self._shape_index)}
        problem = None
        if control["num_overflowed"]:
            problem = (f"{control['num_overflowed']} rank(s) past the exact int64 range "
                       "(a rank's token slots in one step, squared, reach 2^63)")
        elif control["num_failed"]:
            problem = f"{control['num_failed']} rank(s) failed to record or reduce this step"
        elif negative:
            problem = f"{negative} negative statistics (a wrapped or malformed value)"
        return Reduction(totals=None if problem else totals, shapes=shapes, problem=problem, local_error=error)

    def _collective_device(self) -> torch.device:
        """The device of the group's collectives, read once the group is initialised (a rank's
        backend and device do not change during training)."""
        if self._device is None:
            if not (dist.is_available() and dist.is_initialized()):
                return _CPU
            nccl = dist.get_backend(self.group) == "nccl"
            self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else _CPU
        return self._device

    def _group_size(self) -> int:
        if self._world_size is None:
            initialized = dist.is_available() and dist.is_initialized()
            self._world_size = dist.get_world_size(group=self.group) if initialized else 1
        return self._world_size


def _vector(payload: Sequence[int], control: list[int], device: torch.device) -> torch.Tensor:
    """The vector of host ints ``payload`` (each in [0, 2^63): its low then high 32-bit halves),
    the control slots and a negative count of 0, made from one list in one tensor."""
    return torch.tensor([v & _LOW_MASK for v in payload] + [v >> _LOW_BITS for v in payload] + control + [0],
                        dtype=torch.int64, device=device)


def _control(
    step: int | None, *, failed: bool = False, overflowed: bool = False, without_shapes: bool = False,
    filler: bool = False,
) -> list[int]:
    """This rank's control slots (``_CONTROL``), then the one-hot of its step (none for a filler)."""
    one_hot = [0] * STEP_WINDOW
    index = 0
    if step is not None:
        index = step % _STEP_MODULUS
        one_hot[step % STEP_WINDOW] = 1
    flags = [1, int(failed), int(overflowed), int(without_shapes), int(filler)]
    return flags + [index, index * index] + one_hot


def _lag(residues: Sequence[int], step_sum: int, step_sum_squares: int, step: int) -> int | None:
    """How many steps this rank is ahead of the lowest-step ranks, when the one-hot residues and
    the exact sums pin every rank's step down within ``STEP_WINDOW // 2``; else None."""
    occupied = [r for r, count in enumerate(residues) if count]
    for low in occupied:
        lags = {r: (r - low) % STEP_WINDOW for r in occupied}
        if max(lags.values()) >= STEP_WINDOW // 2:
            continue
        # The lowest step, if every rank sits at low + its residue's lag.
        base, rest = divmod(step_sum - sum(residues[r] * lag for r, lag in lags.items()), sum(residues))
        squares = sum(residues[r] * (base + lag) ** 2 for r, lag in lags.items())
        if rest or base % STEP_WINDOW != low or squares != step_sum_squares:
            return None
        return lags[step % STEP_WINDOW]
    return None
