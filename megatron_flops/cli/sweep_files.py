"""The files of a sweep's ``--out``: ``sweep.json`` (which sweep the directory belongs to), the
lock that keeps a second sweep out while one runs, and each run's ``run.json``.

Every problem with them is one ``ValueError`` naming the file (or ``--out``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from megatron_flops.model.inputs import read_text

LOCK = ".lock"
MAX_RECORD_BYTES = 2**20


def write_json(path: Path, obj: Any) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path, what: str) -> Any:
    text = read_text(path, what=what, limit=MAX_RECORD_BYTES)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, NaN, too deep
        raise ValueError(f"{what} {str(path)!r} is malformed ({str(exc).split(':')[0]})") from None


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a number")


def read_record(path: Path) -> dict[str, Any] | None:
    """A finished run's ``run.json`` (exit code, time-out, wall time), or None if it has none."""
    if not path.exists():
        return None
    record = _read_json(path, "run record")
    fields: dict[str, type | tuple[type, ...]] = {"returncode": int, "timed_out": bool, "wall_s": (int, float)}
    bad = [key for key, kind in fields.items() if not isinstance(record, dict) or not isinstance(record.get(key), kind)]
    if bad or not math.isfinite(record["wall_s"]):
        raise ValueError(f"run record {str(path)!r} is malformed ({', '.join(bad) or 'wall_s'}); "
                         "delete it to run that run again")
    return record


def claim_out(out: Path, identity: Mapping[str, Any], *, write: bool) -> None:
    """Make ``out`` this sweep's directory; ``ValueError`` if it holds anything else or cannot be
    written."""
    marker = out / "sweep.json"
    try:
        if marker.exists():
            theirs = _read_json(marker, f"--out {out}:")
            if not isinstance(theirs, dict):
                raise ValueError(f"--out {out}: {marker.name} is not a sweep's (not an object); choose another --out")
            for key in ("command", "params"):
                if theirs.get(key) != identity[key]:
                    raise ValueError(
                        f"--out {out} holds another sweep's results ({key}: {json.dumps(theirs.get(key))}); "
                        "choose another --out"
                    )
            return
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--out {out} exists and is not a sweep directory (no sweep.json); choose another --out")
        if write:
            out.mkdir(parents=True, exist_ok=True)
            write_json(marker, identity)
    except OSError as exc:
        raise ValueError(f"--out {out}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def hold_out(out: Path) -> Iterator[None]:
    """Hold ``out`` for this sweep: a second sweep on it (another process) is refused while this
    one runs. The lock (``flock`` on ``out/.lock``) goes with the process, however it ends."""
    path = out / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ValueError(f"--out {out} is not writable ({exc.strerror or exc})") from None
    try:
        _lock(fd, out)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def _lock(fd: int, out: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        raise ValueError(f"--out {out} is in use by another sweep (pid {holder or '?'}); wait for it to "
                         "finish or choose another --out") from None
