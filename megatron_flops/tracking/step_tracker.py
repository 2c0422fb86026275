"""One training step of a tracker: its counts, its one reduction, and exact pricing or the static
number (torch).

Both trackers (:class:`~megatron_flops.tracking.tracker.FlopsTracker` for decoders and VLMs,
:class:`~megatron_flops.tracking.dit_tracker.DiTFlopsTracker` for video DiTs) add each micro-batch into
host counts (exact Python ints) and a device accumulator (int64, on the data's device), laid out
as the same slots. ``end_step()`` runs on every rank once per step, whatever failed on it: the one
fixed-shape all-reduce (:class:`~megatron_flops.tracking.reduction.StepReducer`), then the tracker's
:class:`StepPricing` prices the totals, or, when they cannot be priced exactly, every rank reports
the static number with ``ok=False`` (from the step's shapes, else the latest step's) and logs the
reason once.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from megatron_flops.tracking.reduction import Reduction, StepReducer
from megatron_flops.tracking.result import StepResult

logger = logging.getLogger("megatron_flops")


class StepPricing(Protocol):
    """What a tracker's reduced slots mean: how they are priced, and the static number."""

    def problem(self, totals: Mapping[str, int]) -> str | None:
        """Why ``totals`` cannot come from valid inputs (they are then not priced), or None."""

    def exact(self, totals: Mapping[str, int]) -> StepResult:
        """The step priced from its totals, with its static number."""

    def static(self, shapes: Mapping[str, int]) -> int | None:
        """The static number from the shape slots alone (None: they do not fix it)."""

    def fallback(self, shapes: Mapping[str, int] | None, static: int | None, problem: str | None) -> StepResult:
        """The step reported as ``static`` with ``ok=False`` (``shapes`` None: they did not arrive)."""


class DeviceAccumulator:
    """A step's device statistics: one int64 vector laid out as ``slots``, allocated on the device
    of the first device micro-batch and zeroed in place after each step, so that the
    per-micro-batch path allocates nothing after the first."""

    def __init__(self, slots: Sequence[str]) -> None:
        self.slots = tuple(slots)
        self.tensor: torch.Tensor | None = None

    def on(self, device: torch.device) -> torch.Tensor:
        """The accumulator (allocated on ``device`` at the first call)."""
        if self.tensor is None:
            self.tensor = torch.zeros(len(self.slots), dtype=torch.int64, device=device)
            self._allocated(self.tensor)
        return self.tensor

    def _allocated(self, tensor: torch.Tensor) -> None:
        """Runs once the accumulator exists (a subclass makes its views of it here)."""

    def zero(self) -> None:
        """Zero the accumulator in place; if that fails, drop it (the next device micro-batch
        allocates a fresh one) and raise."""
        if self.tensor is not None:
            try:
                self.tensor.zero_()
            except Exception:
                self.tensor = None
                raise


class StepTracker(ABC):
    """The per-step part of a tracker: the reduction, pricing or fallback, and logging once.

    A subclass adds its micro-batches into ``_host`` (by slot) and ``_device``, sets ``_failed``
    when one cannot be counted, and bounds its statistics (``_token_slots``).
    """

    def __init__(self, device: DeviceAccumulator, pricing: StepPricing, *, shape_slots: Sequence[str],
                 validate: bool, group: Any) -> None:
        self.validate = validate
        self.group = group
        self._device = device
        self._pricing = pricing
        self._host = [0] * len(device.slots)
        self._failed = False
        self._reducer = StepReducer(device.slots, shape_slots=shape_slots, group=group)
        self._num_steps = 0
        self._last_static: int | None = None  # the static number of the latest step that had one
        self._warned: set[str] = set()

    def end_step(self, *, step: int | None = None) -> StepResult:
        """Reduce this step's statistics over all ranks and price them. Every rank must call it
        once per step: it runs the step's one all-reduce whatever failed on this rank.

        ``step``: the training iteration (the same on every rank, one more each step); with it the
        reduction detects a rank that skipped or repeated ``end_step()`` (every rank then falls
        back and the ranks resynchronise). Default: the number of ``end_step()`` calls, which
        cannot show such a rank. When the step cannot be priced exactly, every rank returns the
        static number with ``ok=False`` and logs the reason once.
        """
        self._settle()
        self._num_steps += 1
        failed, self._failed = self._failed, False
        reduction = self._reducer.reduce(self._device.tensor, self._host,
                                         step=self._num_steps if step is None else step, failed=failed,
                                         token_slots=self._token_slots())
        self._reset()
        if reduction.local_error is not None:
            self._warn_once("this rank could not build its statistics vector", reduction.local_error)
        return self._price(reduction, failed_here=failed)

    def fail_step(self) -> None:
        """Make this step fall back on every rank (a micro-batch could not be handed over): the
        failure travels in the step's reduction."""
        self._failed = True

    def discard_step(self) -> None:
        """Drop everything recorded or observed since the last ``end_step()``, without a
        collective (for a step that raised, see ``Session.abort_step``: its micro-batches are
        not counted anywhere)."""
        self._failed = False
        self._reset()

    def _settle(self) -> None:
        """Fold what the step held back into the host counts before the reduction (default:
        nothing is held back)."""

    @abstractmethod
    def _token_slots(self) -> int:
        """This rank's token slots in the step, T, from the host counts: with valid lengths no
        statistic exceeds T^2 (see ``StepReducer.reduce``)."""

    def _reset(self) -> None:
        self._host = [0] * len(self._host)
        try:
            self._device.zero()
        except Exception as exc:
            self._warn_once("the accumulator could not be reset", exc)

    def _price(self, reduction: Reduction, *, failed_here: bool) -> StepResult:
        shapes, totals, problem = reduction.shapes, reduction.totals, reduction.problem
        if totals is not None:
            problem = self._pricing.problem(totals)
            if problem is None:
                try:
                    result = self._pricing.exact(totals)
                except Exception as exc:  # the same totals on every rank: every rank falls back
                    problem = f"pricing failed ({type(exc).__name__}: {exc})"
                else:
                    self._remember(result.static_flops)
                    return result
        if not failed_here:  # a rank that failed to record has said why already
            self._warn_once("the step fell back to the static number", problem or "no totals")
        # The shapes did not arrive or do not fix the static number: the latest known one.
        static = self._remember(None if shapes is None else self._pricing.static(shapes))
        if static is None:
            self._warn_once("no static number is known for a failed step", "it reports 0 FLOPs with ok=False")
        return self._pricing.fallback(shapes, static, problem)

    def _remember(self, static: int | None) -> int | None:
        """``static`` when it is known and not 0 (kept for later failed steps), else the latest such."""
        if static:
            self._last_static = static
            return static
        return self._last_static

    def _warn_once(self, what: str, why: BaseException | str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            if isinstance(why, BaseException):
                why = f"{type(why).__name__}: {why}"
            logger.warning("megatron-flops: %s (%s) (logged once)", what, why)
