"""Wrappers that the framework adapters install (no framework import).

Hook choice. ``train_step`` is wrapped to open and close the session's step: the training loop
calls it once per iteration on every rank (pipeline stages included), before any logging, and
evaluation runs outside it. So the tracker's all-reduce in ``end_step`` is reached by every
rank every iteration, evaluation micro-batches are not counted, and the step clock covers the
step only. The same wrapper hands the original the forward step wrapped by ``_observe``, so the
micro-batches are observed with no edit to ``forward_step``. If the original raises, the step is
closed uncounted (``Session.abort_step``, no collective) and the exception propagates. ``training_log`` is wrapped for the output: its own log line is amended while it is
printed (``print_rank_last``, looked up in ``training_log``'s module globals, is swapped for the
duration of the call), and the interval's scalars are written after it returns. The original
functions always run, with the caller's arguments, and their results are returned unchanged;
an accounting failure is logged once and leaves the framework's own line as it was.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from megatron_flops.adapters._crosscheck import ModelInputCheck
from megatron_flops.adapters._observe import BatchReader, observe_forward_step
from megatron_flops.reporting.meter import IntervalReport, format_log_fields
from megatron_flops.reporting.session import Session, get_session

logger = logging.getLogger("megatron_flops")

ORIGINAL_ATTR = "__megatron_flops_original__"
PRINTER = "print_rank_last"
# The stock throughput field of Megatron-LM's and Megatron-Bridge's log line; ours go right after it.
_STOCK_FIELD = re.compile(r" throughput per GPU \(TFLOP/s/GPU\): [^|]*\|")
# A text every version's iteration log line carries (and no other line printed by training_log).
_LOG_LINE_MARK = "elapsed time per iteration (ms)"


def keep_warnings_visible() -> None:
    """Take Megatron's ``warning_filter`` off the ``megatron_flops`` logger, so that this package's
    few warnings (a step that falls back, and why; each logged once) reach the framework's log.

    Megatron's ``setup_logging`` (Megatron-LM's, and Megatron-Bridge's with its default
    ``cfg.logger.filter_warnings``; ``megatron.training.utils.log_utils`` in core 0.19) adds a
    filter that drops every WARNING record to every logger existing at that time, this package's
    included. Only that filter is removed; a user's ``modules_to_filter`` stays."""
    package_logger = logging.getLogger("megatron_flops")
    for log_filter in list(package_logger.filters):
        if (getattr(log_filter, "__name__", None) == "warning_filter"
                and str(getattr(log_filter, "__module__", "")).startswith("megatron.")):
            package_logger.removeFilter(log_filter)


class Adapter:
    """What differs between frameworks: how a session is built and where the log's iteration
    and writers are. Subclasses override the hooks; ``bound`` holds the wrapped call's arguments."""

    name = "framework"
    failed = False  # building the session failed: not retried
    _reader: BatchReader | None = None
    _unmuted = False  # keep_warnings_visible() ran (at the first train step: after the framework's logging set-up)
    _check: ModelInputCheck | None = None
    _observed: tuple[Any, Session, Any, Callable[..., Any]] | None = None  # (forward step, session, reader, wrapper)

    def session(self, bound: inspect.BoundArguments) -> Session | None:
        """The installed session, else a new one from the framework's configuration, else None."""
        if not self._unmuted:
            self._unmuted = True
            keep_warnings_visible()
        session = get_session()
        if session is not None or self.failed:
            return session
        try:
            return self.new_session(bound)
        except Exception as exc:
            # It depends on the configuration only, so every rank fails alike and none opens a step.
            self.failed = True
            logger.warning("megatron-flops: cannot set up accounting from the %s configuration (%s: %s); "
                           "training continues with the stock numbers", self.name, type(exc).__name__, exc)
            return None

    def new_session(self, bound: inspect.BoundArguments) -> Session:
        raise NotImplementedError

    def reader(self, bound: inspect.BoundArguments, forward_step_func: Callable[..., Any]) -> Callable[[Any], dict]:
        """How this step's batches are read (the frameworks' keys; see ``BatchReader``)."""
        if self._reader is None:
            self._reader = BatchReader()
        return self._reader

    def check(self) -> ModelInputCheck:
        """The cross-check of what the model chunks receive (``_crosscheck``), made once."""
        if self._check is None:
            self._check = ModelInputCheck()
        return self._check

    def observed(self, bound: inspect.BoundArguments, forward_step_func: Callable[..., Any],
                 session: Session) -> Callable[..., Any]:
        """``forward_step_func`` observed by ``session`` (``_observe.observe_forward_step``), wrapped
        once for as long as the forward step, the session and the reader stay the same."""
        reader = self.reader(bound, forward_step_func)
        cached = self._observed
        if cached is None or cached[0] is not forward_step_func or cached[1] is not session or cached[2] is not reader:
            wrapper = observe_forward_step(forward_step_func, session, reader, self.check())
            cached = self._observed = (forward_step_func, session, reader, wrapper)
        return cached[3]

    def on_step_begin(self, bound: inspect.BoundArguments, session: Session) -> None:
        """Called before the original train step, after ``session.begin_step()``."""

    def on_log(self, bound: inspect.BoundArguments, session: Session) -> None:
        """Called before the original ``training_log``."""

    def log_iteration(self, bound: inspect.BoundArguments) -> int:
        raise NotImplementedError

    def writers(self, bound: inspect.BoundArguments, namespace: MutableMapping[str, Any]) -> tuple[Any, Any]:
        """(TensorBoard writer, W&B writer) for the log call; either may be None."""
        raise NotImplementedError


def is_wrapped(fn: Any) -> bool:
    """Whether ``fn`` is one of this package's wrappers."""
    return getattr(fn, ORIGINAL_ATTR, None) is not None


def _mark(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    setattr(wrapper, ORIGINAL_ATTR, original)
    return wrapper


def wrap_train_step(original: Callable[..., Any], adapter: Adapter) -> Callable[..., Any]:
    """``original`` bracketed by the session's ``begin_step()`` / ``end_step()``, its
    ``forward_step_func`` argument observed (``_observe.observe_forward_step``).

    Once a rank has opened a step it always closes it: with ``end_step()`` (a collective) when
    the original returns; with ``abort_step()`` (none) when it raises, and the exception then
    propagates unchanged.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # the original reports the bad call
        session = adapter.session(bound)
        call_args, call_kwargs = args, kwargs
        if session is not None:
            try:
                session.begin_step()
                adapter.on_step_begin(bound, session)
                call_args, call_kwargs = _observed_call(bound, adapter, session)
            except Exception as exc:
                session.warn_once(f"{adapter.name} train_step hook failed", exc)
        try:
            result = original(*call_args, **call_kwargs)
        except BaseException:
            if session is not None:
                try:
                    session.abort_step()
                except Exception as exc:
                    session.warn_once(f"{adapter.name} closing a failed step failed", exc)
            raise
        if session is not None:
            try:
                session.end_step()
            except Exception as exc:
                session.warn_once(f"{adapter.name} end of step failed", exc)
        return result

    return _mark(train_step, original)


def _observed_call(bound: inspect.BoundArguments, adapter: Adapter, session: Session) -> tuple[tuple, dict]:
    """The original's arguments with its ``forward_step_func`` observed."""
    forward = bound.arguments.get("forward_step_func")
    if forward is None:
        return bound.args, bound.kwargs
    observed = inspect.BoundArguments(bound.signature, dict(bound.arguments))
    observed.arguments["forward_step_func"] = adapter.observed(bound, forward, session)
    return observed.args, observed.kwargs


def wrap_static_flops(original: Callable[..., Any], adapter: Adapter) -> Callable[..., Any]:
    """``original`` (the framework's stock FLOPs function) whose result is also attached to the
    session's latest step as the framework's own number (``Session.set_framework_flops``)."""

    @functools.wraps(original)
    def framework_flops(*args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        session = get_session()
        if session is not None:
            try:
                session.set_framework_flops(value)
            except Exception as exc:
                session.warn_once(f"{adapter.name} stock FLOPs hook failed", exc)
        return value

    return _mark(framework_flops, original)


def wrap_training_log(original: Callable[..., Any], adapter: Adapter) -> Callable[..., Any]:
    """``original`` whose iteration log line gains the corrected fields and whose log interval
    also writes ``IntervalReport.scalars()`` to the framework's writers."""
    signature = inspect.signature(original)
    namespace = inspect.unwrap(original).__globals__

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        session = get_session()
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            bound = None
        if session is None or bound is None:
            return original(*args, **kwargs)
        try:
            adapter.on_log(bound, session)
        except Exception as exc:
            session.warn_once(f"{adapter.name} training_log hook failed", exc)
        line = _LogLine(session, adapter.name)
        with _swapped(namespace, PRINTER, line.amend):
            result = original(*args, **kwargs)
        if line.report is not None:
            try:
                tb_writer, wandb_writer = adapter.writers(bound, namespace)
                write_scalars(line.report, adapter.log_iteration(bound), tb_writer, wandb_writer)
            except Exception as exc:
                session.warn_once(f"{adapter.name} scalar logging failed", exc)
        return result

    return _mark(training_log, original)


def insert_fields(line: str, fields: str) -> str:
    """``line`` with ``fields`` right after its stock throughput field, or at its end."""
    match = _STOCK_FIELD.search(line)
    if match is None:
        return line + fields
    return line[: match.end()] + fields + line[match.end():]


def write_scalars(report: IntervalReport, iteration: int, tb_writer: Any, wandb_writer: Any) -> None:
    """``report.scalars()`` at ``iteration``: one ``add_scalar`` per key, one W&B ``log``."""
    scalars = report.scalars()
    if tb_writer is not None:
        for key, value in scalars.items():
            tb_writer.add_scalar(key, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)


class _LogLine:
    """Amends the first iteration log line printed during one ``training_log`` call."""

    def __init__(self, session: Session, name: str) -> None:
        self.session = session
        self.name = name
        self.report: IntervalReport | None = None
        self._done = False

    def amend(self, message: Any) -> Any:
        if self._done or not isinstance(message, str) or _LOG_LINE_MARK not in message:
            return message
        self._done = True
        try:
            self.report = self.session.report()
            return message if self.report is None else insert_fields(message, format_log_fields(self.report))
        except Exception as exc:
            self.report = None
            self.session.warn_once(f"{self.name} log line", exc)
            return message


@contextlib.contextmanager
def _swapped(namespace: MutableMapping[str, Any], name: str, amend: Callable[[Any], Any]) -> Iterator[None]:
    printer = namespace.get(name)
    if printer is None:  # renamed since install(): print unamended
        yield
        return

    @functools.wraps(printer)
    def amended(message: Any, *args: Any, **kwargs: Any) -> Any:
        return printer(amend(message), *args, **kwargs)

    namespace[name] = amended
    try:
        yield
    finally:
        namespace[name] = printer
