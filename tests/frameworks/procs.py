"""Start the ranks of one real training run as local processes, with a bounded wait (test-only).

Each rank is ``python tests/frameworks/rank_main.py ARGS`` with the torch.distributed environment
variables set (gloo on 127.0.0.1), one thread, its own output file and its own trace file
(``MEGATRON_FLOPS_TRACE``). A run that exceeds its timeout, or whose rank fails, has every rank
still running killed by its process group (each rank is started in a new session), so a test
never hangs and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RANK_MAIN = Path(__file__).with_name("rank_main.py")
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class Rank:
    rank: int
    returncode: int  # negative: killed (a signal), as after a timeout
    output: str
    trace_path: Path

    def trace(self) -> list[dict] | None:
        """The rank's trace lines (parsed), or None when it wrote no trace."""
        if not self.trace_path.exists():
            return None
        return [json.loads(line) for line in self.trace_path.read_text().splitlines() if line.strip()]


class RunFailed(AssertionError):
    def __init__(self, message: str, ranks: list[Rank]) -> None:
        tails = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-4000:]}" for r in ranks)
        super().__init__(f"{message}\n{tails}")
        self.ranks = ranks


def child_env(pythonpath: list[Path] = ()) -> dict[str, str]:
    """The environment of a framework process: the repository (and ``pythonpath``) importable, one
    thread, and no ``MEGATRON_FLOPS*`` inherited (each run says what it wants). E1: torch.compile
    off (megatron-core compiles a few element-wise fusions; on a CPU that builds C++ per process)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_FLOPS")}
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1", TORCHDYNAMO_DISABLE="1",
                PYTHONPATH=os.pathsep.join(str(p) for p in [REPO, REPO / "tests", *pythonpath]))
    return base


def launch(python: str | Path, rank_args: list[str], *, world_size: int, workdir: Path, timeout_s: float,
           pythonpath: list[Path] = ()) -> list[Rank]:
    """Run ``world_size`` ranks of ``rank_main.py rank_args`` under ``python``; their results in
    rank order. Raises ``RunFailed`` (with each rank's output tail) when a rank fails or the run
    times out."""
    workdir.mkdir(parents=True, exist_ok=True)
    import mcore_cpu

    base = child_env(pythonpath)
    store = mcore_cpu.rendezvous_store(world_size)  # the ranks join it (no rank binds a port); held until they end
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), **mcore_cpu.AGENT_STORE_ENV,
                WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    procs, logs = [], []
    for rank in range(world_size):
        log = open(workdir / f"rank{rank}.log", "w+")
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank),
                        MEGATRON_FLOPS_TRACE=str(workdir / f"trace.rank{rank}.jsonl"))
        procs.append(subprocess.Popen([str(python), str(RANK_MAIN), *rank_args], cwd=workdir, env=rank_env,
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True))
        logs.append(log)
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # a peer is gone: the others would wait for it until their timeout
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the rank's own session: it and its children
                p.wait()
    ranks = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        ranks.append(Rank(rank=rank, returncode=p.returncode, output=log.read(),
                          trace_path=workdir / f"trace.rank{rank}.jsonl"))
        log.close()
    if timed_out:
        raise RunFailed(f"the run did not finish within {timeout_s:.0f} s", ranks)
    if any(r.returncode != 0 for r in ranks):
        raise RunFailed("a rank failed", ranks)
    return ranks


def run_json(venv: str, script: str, arg: object, *, timeout_s: float = 1800) -> Any:
    """``python -c script JSON(arg)`` in the framework venv ``venv`` (the calling test skips where it
    cannot be made), with tests/ importable and as the working directory; the last line of its stdout,
    parsed as JSON. A failure shows the tail of its stderr."""
    import pytest

    from frameworks import envs

    try:
        python = envs.ensure(venv)
    except envs.Unavailable as exc:
        pytest.skip(str(exc))
    tests = REPO / "tests"
    done = subprocess.run([str(python), "-c", script, json.dumps(arg)], capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL, cwd=tests,
                          env={**os.environ, "PYTHONPATH": str(tests)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
