"""The process-global accounting session that the framework adapters share (torch level).

A session owns a :class:`FlopsTracker` (or a :class:`~megatron_flops.tracking.dit_tracker.DiTFlopsTracker`)
and a :class:`ThroughputMeter`, times each training step and writes the per-step trace. An adapter brackets the framework's train step with
``begin_step()`` / ``end_step()`` on every rank (``end_step`` runs the tracker's one all-reduce);
micro-batches reach the tracker only while a step is open, whether a ``forward_step`` records them
(``record()``) or an adapter observes them as the data iterator hands them over (``observe()``),
so evaluation forward passes, which run outside the train step, are not counted. A train step that
raises is closed with ``abort_step()``: nothing of it is counted. The log hook asks ``report()``
for the interval's numbers.

Step time is the wall time from ``begin_step()`` to the end of ``end_step()``'s reduction, which
waits for the step's device work (its result is read on the host): the forward-backward passes
and the optimizer step, without the logging, evaluation and checkpointing between steps.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_flops import __version__
from megatron_flops.reporting.meter import IntervalReport, ThroughputMeter
from megatron_flops.tracking.result import StepResult
from megatron_flops.reporting.trace import TraceWriter, run_header, trace_path
from megatron_flops.tracking.tracker import FlopsTracker

if TYPE_CHECKING:
    from megatron_flops.tracking.dit_tracker import DiTFlopsTracker

logger = logging.getLogger("megatron_flops")


@dataclass(frozen=True, kw_only=True)
class _Step:
    iteration: int
    result: StepResult
    elapsed_s: float
    framework_flops: int | None = None


class Session:
    """One training run's accounting: the tracker, the meter and the step clock.

    Build it with :func:`install_session`. The latest ended step is held back from the meter and
    the trace until the next ``begin_step()``, ``report()`` or ``close()`` so that the framework's
    own FLOPs number, computed after its train step returns, can still be attached with
    ``set_framework_flops()``. The stock full-row number (``static``) is the tracker's own.
    """

    def __init__(
        self,
        tracker: FlopsTracker | DiTFlopsTracker,
        *,
        peak_flops_per_s: int | None,
        warmup_iterations: int,
        world_size: int,
        clock: Callable[[], float],
        trace: TraceWriter | None = None,
    ) -> None:
        self.tracker = tracker
        self.meter = ThroughputMeter(
            world_size=world_size, peak_flops_per_s=peak_flops_per_s, warmup_iterations=warmup_iterations
        )
        self.trace = trace
        self._clock = clock
        self._open = False
        self._num_begun = 0  # the step index the tracker's reduction compares across ranks
        self._started = 0.0
        self._pending: _Step | None = None
        self._last_iteration = 0
        self._num_unreported = 0
        self._warned: set[str] = set()

    def begin_step(self) -> None:
        """Open a step: start its clock and let micro-batches through. Call it on every rank."""
        if self._open:  # the previous step was neither ended nor aborted: none of it counts
            self.abort_step()
        self._flush()  # the previous step's trace line, before this step's clock starts
        self._open = True
        self._num_begun += 1
        self._started = self._clock()

    def record(self, **kwargs: Any) -> None:
        """Forward one micro-batch to the tracker if a step is open; otherwise ignore it.

        Never raises, unless the tracker validates (``validate=True``): a failure marks the
        step as fallen back to the static number and is logged once.
        """
        if not self._open:
            return
        try:
            self.tracker.record(**kwargs)
        except Exception as exc:
            if self.tracker.validate:
                raise
            self.tracker.fail_step()  # every rank falls back: the failure travels in the reduction
            self.warn_once("record() failed", exc)

    def observing(self, model: Any) -> bool:
        """Whether a micro-batch given to ``model`` (a model chunk) now counts: a step is open and
        the chunk owns its micro-batches (see ``FlopsTracker.owns``)."""
        tracker = self.tracker
        if not self._open or not isinstance(tracker, FlopsTracker):  # a DiT tracker observes nothing
            return False
        try:
            return tracker.owns(model)
        except Exception as exc:
            tracker.observe_failed(exc)
            return False

    def observe(self, read: Callable[[Any], dict[str, Any]], batch: Any) -> dict[str, Any] | None:
        """Observe one micro-batch as a data iterator handed it over, if a step is open:
        ``read(batch)`` gives ``FlopsTracker.observe`` arguments, which are returned (None: no
        step is open, or ``read`` failed). Never raises: a batch that ``read`` cannot understand
        makes the step fall back on every rank, logged once."""
        if not self._open:
            return None
        tracker = self.tracker
        assert isinstance(tracker, FlopsTracker)  # only a session observing() a chunk is handed its batches
        try:
            fields = read(batch)
        except Exception as exc:
            if tracker.validate:
                raise
            tracker.observe_failed(exc)
            return None
        tracker.observe(**fields)
        return fields

    def abort_step(self) -> None:
        """Close the open step without counting it (its train step raised): no collective, and
        nothing recorded or observed in it reaches a later step."""
        if self._open:
            self._open = False
            self.tracker.discard_step()

    def end_step(self, *, elapsed_s: float | None = None, iteration: int | None = None) -> StepResult:
        """Close the step opened by ``begin_step()``: reduce and price it (the tracker's one
        collective: every rank must call this) and keep it for the next report.

        ``elapsed_s``: the step's wall time (default: measured since ``begin_step()``).
        ``iteration``: its number (default: the previous one plus 1, starting at 1).
        """
        if not self._open:
            raise ValueError("end_step() called without begin_step()")
        self._open = False
        result = self.tracker.end_step(step=self._num_begun)
        if elapsed_s is None:
            elapsed_s = self._clock() - self._started
        if result.ok and result.num_microbatches == 0:
            # NB: no rank counted anything: the step fell back (observation missed the batches).
            self.warn_once("no micro-batch was recorded or observed in a training step", ValueError(
                "the step reports the framework's stock FLOPs"))
            result = replace(result, ok=False)
        iteration = self._last_iteration + 1 if iteration is None else iteration
        self._flush()
        self._pending = _Step(iteration=iteration, result=result, elapsed_s=elapsed_s)
        self._last_iteration = iteration
        return result

    def set_framework_flops(self, flops: float) -> None:
        """Attach the framework's own FLOPs number to the latest ended step (a no-op when that
        step was already reported). Rounded to an integer; Megatron computes it in floats."""
        if not (math.isfinite(flops) and flops >= 0):
            raise ValueError(f"the framework's FLOPs must be a non-negative finite number, got {flops!r}")
        if self._pending is not None:
            self._pending = replace(self._pending, framework_flops=round(flops))

    def report(self) -> IntervalReport | None:
        """The steps ended since the previous report, as one interval; None if there are none."""
        self._flush()
        if not self._num_unreported:
            return None
        self._num_unreported = 0
        return self.meter.interval()

    def summary(self) -> IntervalReport | None:
        """Every step after the warm-up (see ``ThroughputMeter.summary``)."""
        self._flush()
        return self.meter.summary()

    def warn_once(self, what: str, exc: BaseException) -> None:
        """Log an accounting failure once per kind (``what``); training is not interrupted."""
        if what in self._warned:
            return
        self._warned.add(what)
        logger.warning(
            "megatron-flops: %s (%s: %s); the framework's own throughput numbers are unchanged "
            "(logged once)", what, type(exc).__name__, exc,
        )

    def close(self) -> None:
        """Hand the last ended step to the meter and the trace, and close the trace file."""
        self._flush()
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def _flush(self) -> None:
        step, self._pending = self._pending, None
        if step is not None:
            self.meter.record(
                iteration=step.iteration, result=step.result, elapsed_s=step.elapsed_s,
                framework_flops=step.framework_flops,
            )
            self._num_unreported += 1
            if self.trace is not None:
                try:
                    self.trace.write_step(iteration=step.iteration, result=step.result, elapsed_s=step.elapsed_s,
                                          framework_flops=step.framework_flops)
                except Exception as exc:  # a full disk never stops training
                    self.warn_once("writing the trace failed", exc)


_session: Session | None = None


def install_session(
    tracker: FlopsTracker | DiTFlopsTracker,
    *,
    peak_flops_per_s: int | None = None,
    warmup_iterations: int = 2,
    world_size: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    trace: str | os.PathLike[str] | None = None,
    framework: str = "custom",
    framework_version: str | None = None,
) -> Session:
    """Make a new session the process-global one (replacing and closing any previous) and
    return it.

    Install it on every rank. ``world_size``: the number of GPUs the step totals are spread over
    (default: the initialised process group's size, else 1). ``peak_flops_per_s``: one GPU's
    dense peak (None: no MFU/HFU). ``clock``: seconds, monotonic. ``trace``: a file that the rank
    printing the log (the last rank) appends the per-step trace to (``megatron_flops.reporting.trace``; a
    ``{rank}`` in the path: every rank writes its own); ``framework`` and ``framework_version``
    go into its header. The trace's last step is written by ``close()``, at the latest at exit. A
    trace that cannot be written (an unwritable path, a full disk, another run writing it) is
    skipped with a warning: the session is installed on every rank all the same.
    """
    global _session
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    header: dict[str, Any] | None = None
    path: str | None = None
    if trace is not None:
        header = run_header(tracker=tracker, framework=framework, framework_version=framework_version,
                            world_size=world_size, warmup_iterations=warmup_iterations,
                            peak_flops_per_s=peak_flops_per_s, megatron_flops_version=__version__)
        path = trace_path(trace, rank=dist.get_rank() if initialised else 0,
                          world_size=dist.get_world_size() if initialised else 1)
    uninstall_session()  # first: its trace writer may hold the same file
    writer = None if path is None or header is None else _open_trace(path, header)
    _session = Session(
        tracker,
        peak_flops_per_s=peak_flops_per_s,
        warmup_iterations=warmup_iterations,
        world_size=world_size,
        clock=clock,
        trace=writer,
    )
    return _session


def _open_trace(path: str, header: dict[str, Any]) -> TraceWriter | None:
    """The trace writer, or None with a warning when the file cannot be opened, is held by
    another run, or its header cannot be written: the session is installed all the same, so
    every rank takes the same path (only the writing rank knows of the failure)."""
    try:
        return TraceWriter(path, header)
    except (OSError, ValueError) as exc:
        logger.warning("megatron-flops: no per-step trace: cannot write %s (%s: %s); training and its "
                       "accounting continue", path, type(exc).__name__, exc)
        return None


def get_session() -> Session | None:
    """The process-global session, or None when none is installed."""
    return _session


def uninstall_session() -> Session | None:
    """Remove the process-global session (the adapters then only call the originals), closing
    it (see ``Session.close``); returns it."""
    global _session
    session, _session = _session, None
    if session is not None:
        session.close()
    return session


atexit.register(uninstall_session)  # the trace's last step, at the latest at exit


def record(**kwargs: Any) -> None:
    """Record one micro-batch in the installed session (``FlopsTracker.record`` or ``DiTFlopsTracker.record`` arguments).

    For custom loops (the Megatron-LM and Megatron-Bridge adapters observe the batches without
    it; a step that calls it is priced from its calls only). A no-op when no session is
    installed or no train step is open (evaluation); never raises (see ``Session.record``).
    """
    session = _session
    if session is not None:
        session.record(**kwargs)
