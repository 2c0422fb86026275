"""The Python environments the real-framework tests run in, made on first use and cached (test-only).

- ``megatron-lm-0.16.1``: the test environment itself (``pip install -e ".[test]"`` brings
  megatron-core 0.16.1 and what Megatron-LM's training package imports).
- Every other release: a virtual environment of its own (``VENVS``: its pins clash with the test
  extra, or it needs another Python), created by ``ensure()`` and reused while its interpreter
  and requirement list are unchanged. ``megatron_flops`` itself is not installed there: the
  ranks import it from the repository (``PYTHONPATH``).
- Interpreter: the running Python, or a pyenv version (``pyenv prefix 3.12.1``; megatron-core
  >= 0.17 and Megatron-Bridge >= 0.4 need Python >= 3.12).
- Where: ``~/.cache/megatron-flops/venvs`` (outside the repository, so that a fresh clone, as CI
  makes, reuses them); ``MEGATRON_FLOPS_TEST_VENVS`` moves it.

Creating one takes a few minutes (torch alone is several GB for Python 3.12: PyPI serves its
CUDA build, which runs on CPU); a second run reuses it. A failed creation is reported as the
reason to skip (or to fail, under CI).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The Megatron-LM snapshots: scripts/get_megatron_lm_snapshots.sh puts them here (or anywhere,
# then named by MEGATRON_FLOPS_MLM_SNAPSHOTS).
SNAPSHOTS_ENV = "MEGATRON_FLOPS_MLM_SNAPSHOTS"
DEFAULT_UPSTREAM = REPO.parent / "shared" / "upstream" / "megatron-lm"
TORCH = "torch==2.13.0"
PY312 = "3.12.1"  # a pyenv version
# What Megatron-LM's training package imports beyond megatron-core (every snapshot). No triton pin:
# torch's own wheel pins the triton it needs (PyPI's CUDA torch 2.13.0: triton 3.7.1); the CPU
# build of Python 3.11 has none and gets ``TRITON_311``.
MEGATRON_LM_DEPS = ("six", "regex", "einops", "tqdm", "pyyaml", "pydantic")
TRITON_311 = "triton==3.9.0"


@dataclass(frozen=True, kw_only=True)
class Env:
    python: Path
    pythonpath: tuple[Path, ...] = ()  # before site-packages (the Megatron-LM snapshot)


@dataclass(frozen=True, kw_only=True)
class Venv:
    """How to make one venv: its interpreter (a pyenv version; None: the running Python) and its
    ``pip install`` steps (each one call; ``--no-deps`` steps pin everything themselves)."""

    steps: tuple[tuple[str, ...], ...]
    python: str | None = None


VENVS: dict[str, Venv] = {
    "megatron-lm-0.14.0": Venv(steps=((TORCH,), ("megatron-core==0.14.0", *MEGATRON_LM_DEPS, TRITON_311))),
    "megatron-lm-0.19.0": Venv(python=PY312, steps=((TORCH,), ("megatron-core==0.19.0", *MEGATRON_LM_DEPS))),
    "megatron-bridge-0.3.1": Venv(steps=(
        (TORCH,),
        # Megatron-Bridge's own pins ask for Transformer Engine (CUDA only): install it alone,
        # then what it imports on the pretrain() and vlm_step paths.
        ("--no-deps", "megatron-bridge==0.3.1"),
        ("megatron-core==0.16.1", "transformers>=4.57,<5", "datasets", "omegaconf", "hydra-core>=1.3,<1.4",
         "tensorboard", "rich", "accelerate", "nvidia-modelopt==0.47.0",
         "nvidia-resiliency-ext==0.4.1", *MEGATRON_LM_DEPS, TRITON_311),
    )),
    "megatron-bridge-0.6.2": Venv(python=PY312, steps=(
        (TORCH,),  # torch picks its own triton
        ("--no-deps", "megatron-bridge==0.6.2"),
        ("megatron-core==0.19.2", "transformers>=5.8,<=5.12.1", "datasets", "omegaconf", "hydra-core>=1.3,<1.4",
         "tensorboard", "rich", "accelerate", "nvidia-resiliency-ext", "megatron-energon~=7.0",
         "nvidia-modelopt==0.47.0", "requests", *MEGATRON_LM_DEPS),
    )),
}


class Unavailable(Exception):
    """The environment cannot be had here; the message says why (a test skips with it)."""


def upstream() -> Path:
    """Where the snapshots are: ``$MEGATRON_FLOPS_MLM_SNAPSHOTS``, else ``../shared/upstream/megatron-lm``."""
    return Path(os.environ.get(SNAPSHOTS_ENV) or DEFAULT_UPSTREAM)


def snapshot(version: str) -> Path:
    """The unmodified Megatron-LM training package at ``core_v{version}``."""
    path = upstream() / f"core_v{version}"
    if not (path / "pretrain_gpt.py").is_file():
        raise Unavailable(f"the Megatron-LM snapshot {path} is not here: get it with "
                          f"scripts/get_megatron_lm_snapshots.sh [DIR] (git clone of NVIDIA/Megatron-LM; "
                          f"then {SNAPSHOTS_ENV}=DIR if DIR is not {DEFAULT_UPSTREAM})")
    return path


def megatron_lm(version: str) -> Env:
    """The environment for Megatron-LM ``core_v{version}`` with its snapshot on ``PYTHONPATH``."""
    tree = snapshot(version)
    if version == "0.16.1":
        _check_here(("megatron.core", "0.16.1"), *MEGATRON_LM_DEPS, TRITON_311)
        return Env(python=Path(sys.executable), pythonpath=(tree,))
    return Env(python=ensure(f"megatron-lm-{version}"), pythonpath=(tree,))


def megatron_bridge(version: str = "0.3.1") -> Env:
    return Env(python=ensure(f"megatron-bridge-{version}"))



def _check_here(core: tuple[str, str], *requirements: str) -> None:
    from importlib import metadata

    missing = []
    for requirement in requirements:
        name = requirement.split("==")[0]
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    try:
        if metadata.version("megatron-core") != core[1]:
            missing.append(f"megatron-core=={core[1]}")
    except metadata.PackageNotFoundError:
        missing.append(f"megatron-core=={core[1]}")
    if missing:
        raise Unavailable(f"not installed in this environment: {', '.join(missing)} (pip install -e '.[test]')")


def root() -> Path:
    return Path(os.environ.get("MEGATRON_FLOPS_TEST_VENVS") or Path.home() / ".cache" / "megatron-flops" / "venvs")


def interpreter(version: str | None) -> Path:
    """The running Python (``version`` None), or pyenv's ``version`` (``pyenv prefix``)."""
    if version is None:
        return Path(sys.executable)
    try:
        found = subprocess.run(["pyenv", "prefix", version], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "PYENV_VERSION": version}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"Python {version} is needed, through pyenv, which could not run: {exc}") from exc
    python = Path(found.stdout.strip() or "/nonexistent") / "bin" / "python"
    if found.returncode != 0 or not python.is_file():
        raise Unavailable(f"Python {version} is needed (pyenv install {version}): `pyenv prefix {version}` "
                          f"said {(found.stderr or found.stdout).strip()!r}")
    return python


def ensure(name: str) -> Path:
    """The python of venv ``name``, created (under a file lock) unless a complete one with the same
    interpreter and requirements exists. Raises ``Unavailable`` with pip's last lines when it
    cannot be made."""
    spec = VENVS[name]
    base = interpreter(spec.python)
    # The running Python's venvs keep the stamp they had before interpreters were named (no rebuild).
    stamp_text = repr(spec.steps) if spec.python is None else f"{base}\n{spec.steps!r}"
    venv = root() / name
    python = venv / "bin" / "python"
    stamp = venv / ".megatron-flops-requirements"
    root().mkdir(parents=True, exist_ok=True)
    with open(root() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one creator at a time (pytest runs in parallel worktrees)
        if stamp.is_file() and stamp.read_text() == stamp_text and python.is_file():
            return python
        log = root() / f"{name}.log"
        with open(log, "w") as out:
            commands = [[str(base), "-m", "venv", "--clear", str(venv)]]
            commands += [[str(python), "-m", "pip", "install", "-q", *step] for step in spec.steps]
            for command in commands:
                out.write("$ " + " ".join(command) + "\n")
                out.flush()
                done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      timeout=1800)
                if done.returncode != 0:
                    tail = log.read_text().splitlines()[-8:]
                    raise Unavailable(f"could not create the {name} venv ({' '.join(command[3:])} failed; "
                                      f"log {log}):\n" + "\n".join(tail))
        stamp.write_text(stamp_text)
        return python


def prebuild() -> None:
    """Start creating the missing venvs in a background thread (Megatron-Bridge's first: their
    tests run first; a Megatron-LM release only where its snapshot is here), so that pip's minutes
    overlap the tests that run before the framework tests. A test that needs a venv still calls
    ``ensure()``, which waits on the same file lock; a failure here is reported there
    (``ensure()`` tries again and raises)."""
    import threading

    names = []
    for name in sorted(VENVS, key=lambda name: not name.startswith("megatron-bridge")):
        try:
            if name.startswith("megatron-lm-"):
                snapshot(name.removeprefix("megatron-lm-"))
            names.append(name)
        except Unavailable:
            pass

    def build() -> None:
        for name in names:
            try:
                ensure(name)
            except Exception:  # noqa: BLE001 - reported by the test's own ensure()
                pass

    threading.Thread(target=build, name="prebuild-venvs", daemon=True).start()
