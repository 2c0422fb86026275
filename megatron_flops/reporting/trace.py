"""Per-step trace: one JSON object per training iteration, one line each (JSON Lines; stdlib only).

A trace file is appended to, never replaced: each run (or restart) first appends its own header
line, ``{"run": {...}}``, then one line per iteration, each flushed as it is written. A file can
thus hold several segments; a reader starts a segment at every header line.

Header (``"format": "megatron-flops-trace/1"``): ``megatron_flops_version``, ``framework``
(``megatron-lm``, ``megatron-bridge``, ``custom`` or ``demo``), ``framework_version``,
``world_size``, ``model`` (the ``ModelSpec`` fields, nested ones flattened as ``moe.num_experts``),
``conventions`` (``attention``, ``model_flops``, ``recompute``, ``peft``), ``warmup_iterations``,
``peak_flops_per_s``, ``started_at`` (ISO 8601, UTC) and ``run_id`` (random hex, one per writer).

One writer at a time: a writer holds an exclusive lock on the file (``flock``, released when it
closes or its process ends) and a second writer on the same path is refused, so two runs never
interleave their lines in one file.

Iteration: ``iteration``, ``flops`` and ``executed_flops`` (what the meter counts, ours; when the
step fell back, the framework's number, else the static one), ``static_flops`` (the stock
full-row formula: every row one ``seq_length`` sequence), ``framework_flops`` (the framework's
own per-step number, null when it has none), ``num_tokens``, ``num_padded_tokens``, ``num_sequences``,
``num_microbatches`` (global totals of the step), ``elapsed_s`` (the step's own time) and ``ok``
(false when the step fell back). Keys may be added in later versions of the format, never renamed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import uuid
from datetime import datetime, timezone
from typing import IO, Any

from megatron_flops.tracking.result import StepResult

FORMAT = "megatron-flops-trace/1"
FRAMEWORKS = ("megatron-lm", "megatron-bridge", "custom", "demo")
RANK_FIELD = "{rank}"
# The environment variable that names the trace file (adapters, launcher, demo, sweep).
TRACE_ENV = "MEGATRON_FLOPS_TRACE"
# One encoder for every line (json.dumps with an option builds a new one per call).
_ENCODER = json.JSONEncoder(allow_nan=False)


class TraceWriter:
    """Appends a header line at creation, then one line per ``write_step()``, flushed each time.

    ``OSError`` when the file cannot be opened or its header written; ``ValueError`` when another
    writer holds it (the file is then left as it was)."""

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any]) -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file: IO[str] | None = _open_regular(self.path)
        try:
            _lock(self._file, self.path)
            self._write({"run": {**header, "run_id": uuid.uuid4().hex[:16]}})
        except BaseException:
            self.close()
            raise

    def write_step(self, *, iteration: int, result: StepResult, elapsed_s: float,
                   framework_flops: int | None = None) -> None:
        """One iteration's line (``framework_flops``: the framework's own number, if it has one)."""
        stock = result.static_flops if framework_flops is None else framework_flops
        fell_back = not result.ok and stock is not None
        self._write({
            "iteration": iteration,
            "flops": stock if fell_back else result.flops,
            "executed_flops": stock if fell_back else result.executed_flops,
            "static_flops": result.static_flops,
            "framework_flops": framework_flops,
            "num_tokens": result.num_tokens,
            "num_padded_tokens": result.num_padded_tokens,
            "num_sequences": result.num_sequences,
            "num_microbatches": result.num_microbatches,
            "elapsed_s": elapsed_s,
            "ok": result.ok,
        })

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"trace {self.path} is closed")
        try:
            self._file.write(_ENCODER.encode(record) + "\n")
            self._file.flush()
        except BaseException:
            # NB: a failed write may leave half a line: writing on after it (a disk that frees up)
            # would put a torn line mid-file. Stop here: the file stays readable, the torn last
            # line skipped.
            with contextlib.suppress(OSError):
                self.close()
            self._file = None
            raise


def _open_regular(path: str) -> IO[str]:
    """``path`` opened to append, never waiting: a FIFO without a reader fails at once, and
    anything but a regular file (a FIFO, a device) is refused."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"trace {path} is not a regular file")
        return os.fdopen(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def _lock(file: IO[str], path: str) -> None:
    """An exclusive, non-blocking advisory lock on ``file`` (none where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"trace {path} is being written by another run; give each run its own file") from None


def trace_path(path: str | os.PathLike[str], *, rank: int, world_size: int) -> str | None:
    """Where ``rank`` writes ``path``'s trace, or None if it writes none.

    The rank that prints the log writes it: the last rank (Megatron's ``print_rank_last``). A
    ``{rank}`` in the path gives every rank its own file instead.
    """
    path = os.fspath(path)
    if not path:
        raise ValueError("the trace path is empty")
    if RANK_FIELD in path:
        return path.replace(RANK_FIELD, str(rank))
    return path if rank == world_size - 1 else None


def run_header(
    *,
    tracker: Any,
    framework: str,
    framework_version: str | None,
    world_size: int,
    warmup_iterations: int,
    peak_flops_per_s: int | None,
    megatron_flops_version: str,
) -> dict[str, Any]:
    """The header of a run: what it trains and under which conventions (``tracker``: a
    ``FlopsTracker`` or a ``DiTFlopsTracker``)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    return {
        "format": FORMAT,
        "megatron_flops_version": megatron_flops_version,
        "framework": framework,
        "framework_version": framework_version,
        "world_size": world_size,
        "model": spec_summary(tracker.spec),
        "conventions": {
            "attention": getattr(tracker, "attention", "full"),  # a DiT attends fully
            "model_flops": tracker.convention,
            "recompute": recompute_summary(tracker.recompute),
            "peft": peft_summary(tracker.peft),
        },
        "warmup_iterations": warmup_iterations,
        "peak_flops_per_s": peak_flops_per_s,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def spec_summary(spec: Any) -> dict[str, Any]:
    """A dataclass's fields as a flat JSON-safe mapping: nested dataclasses under dotted keys,
    tuples as lists; ``num_layers`` too where it is a property."""
    num_layers = getattr(spec, "num_layers", None)
    out: dict[str, Any] = {} if not isinstance(num_layers, int) else {"num_layers": num_layers}
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{field.name}.{k}": v for k, v in spec_summary(value).items()})
        else:
            out[field.name] = _json_safe(value)
    return out


def recompute_summary(recompute: Any) -> str | None:
    """``full/uniform/2`` (granularity/method/layers), ``selective:core_attn,mlp``, or None."""
    if recompute is None:
        return None
    if recompute.granularity == "selective":
        return "selective:" + ",".join(recompute.modules)
    return f"{recompute.granularity}/{recompute.method}/{recompute.num_layers}"


def peft_summary(peft: Any) -> str | None:
    """``frozen``, ``lora:r8:linear_qkv,linear_proj``, ``frozen+lora:...``, or None."""
    if peft is None:
        return None
    parts = ["frozen"] if peft.frozen else []
    if peft.lora_rank is not None:
        parts.append(f"lora:r{peft.lora_rank}:" + ",".join(peft.lora_targets))
    return "+".join(parts) or None


def _json_safe(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
