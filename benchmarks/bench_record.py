"""Per-micro-batch cost of the tracker on CPU, beside the upstream-style reference.

Reference (what Megatron-LM/Megatron-Bridge do per micro-batch): diff the cu_seqlens, square,
sum, add into an accumulator. Ours:

- ``record()``, device path: the same statistics added into the device accumulator per call
  (run here on CPU tensors by counting the CPU as a device);
- ``record()``, host path: a CPU batch is kept by reference, priced at ``end_step()`` in one
  vectorised pass over the step's micro-batches;
- observed: what the adapters do with no edit to ``forward_step``: the data iterator's ``next()``
  reads the batch's keys and hands them to ``FlopsTracker.observe``, priced at ``end_step()``.

The host and observed rows charge each micro-batch its share of the end-of-step pass (a step of
``--micro-batches`` micro-batches, default 8). Run: python benchmarks/bench_record.py
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from megatron_flops.tracking import batch_checks
from megatron_flops.adapters._observe import BatchReader, ObservedIterator
from megatron_flops.reporting.session import install_session, uninstall_session
from megatron_flops.model.spec import ModelSpec
from megatron_flops.tracking.tracker import FlopsTracker

N_STEPS = 100
REPEATS = 30


def _time_steps(call: Callable[[], None], settle: Callable[[], None], micro_batches: int) -> tuple[float, float]:
    """One run of N_STEPS steps of ``micro_batches`` calls each: (us per call, us per micro-batch
    with its share of ``settle``)."""
    in_calls = in_settle = 0.0
    for _ in range(N_STEPS):
        start = time.perf_counter()
        for _ in range(micro_batches):
            call()
        middle = time.perf_counter()
        settle()
        in_calls += middle - start
        in_settle += time.perf_counter() - middle
    n = N_STEPS * micro_batches
    return in_calls / n * 1e6, (in_calls + in_settle) / n * 1e6


_VIEWS_AND_METADATA = {"__get__", "dim", "numel", "size", "reshape", "view", "unsqueeze", "expand", "__getitem__"}


class _CountKernels(TorchFunctionMode):
    """Counts the tensor operations that launch a kernel (views and metadata reads excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in _VIEWS_AND_METADATA:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _kernels(fn: Callable[[], None]) -> list[str]:
    with _CountKernels() as mode:
        fn()
    return mode.names


def _describe(names: list[str]) -> str:
    return f"{len(names)} ({', '.join(names) or '-'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (default 8)")
    micro_batches = parser.parse_args().micro_batches
    logging.getLogger("megatron_flops").setLevel(logging.ERROR)  # the plain batch's note on its rows
    torch.set_num_threads(1)
    spec = ModelSpec.from_mapping(
        dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
             ffn_hidden_size=14336, gated_linear_unit=True, activation_func="silu", vocab_size=128256)
    )
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 256, (64,), generator=gen)
    # As Megatron-LM's data loader yields a packed SFT micro-batch: [1, n] int32 offsets.
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).reshape(1, -1)
    packed_tokens = torch.zeros(1, int(cu[0, -1]), dtype=torch.long)
    plain_tokens = torch.zeros(4, 4096, dtype=torch.long)
    packed_batch = {"tokens": packed_tokens, "cu_seqlens": cu, "max_seqlen": lengths.max().reshape(1)}
    plain_batch = {"tokens": plain_tokens}
    acc = torch.zeros(2, dtype=torch.int64)

    def reference_packed() -> None:
        flat = cu[0]
        acc[0].add_((flat[1:] - flat[:-1]).to(torch.int64).square().sum())

    def reference_plain() -> None:
        # Upstream prices a plain batch from the shape too, but adds it into the device tensor.
        acc[1].add_(plain_tokens.shape[0] * plain_tokens.shape[1] ** 2)

    print(f"torch {torch.__version__}, 1 thread, {micro_batches} micro-batches per step; fastest of {REPEATS} "
          f"interleaved runs of {N_STEPS} steps (other processes only add time); us per micro-batch")
    print("| case | path | call | with its share of end_step | ratio to reference | kernels per micro-batch "
          "| torch ops per step at end_step |")
    print("|---|---|---:|---:|---:|---|---|")
    for name, reference, batch in (("packed row, 64 sub-sequences", reference_packed, packed_batch),
                                   ("plain batch [4, 4096]", reference_plain, plain_batch)):
        paths = {"reference": (reference, lambda: None, frozenset({"cpu"})), **_paths(spec, batch)}
        best: dict[str, tuple[float, float]] = {}
        for _ in range(REPEATS):
            for path, (call, settle, host_types) in paths.items():
                batch_checks.HOST_DEVICE_TYPES = host_types
                per_call, total = _time_steps(call, settle, micro_batches)
                old = best.get(path, (float("inf"), float("inf")))
                best[path] = (min(old[0], per_call), min(old[1], total))
        ref = best["reference"][1]
        for path, (call, settle, host_types) in paths.items():
            batch_checks.HOST_DEVICE_TYPES = host_types
            kernels = _kernels(call)
            for _ in range(micro_batches - 1):
                call()
            ops = "-" if path == "reference" else str(len(_kernels(settle)))
            per_call, total = best[path]
            print(f"| {name} | {path} | {per_call:.1f} | {total:.1f} | {total / ref:.2f} | {_describe(kernels)} | {ops} |")
        batch_checks.HOST_DEVICE_TYPES = frozenset({"cpu"})
        uninstall_session()


def _paths(spec: ModelSpec, batch: dict) -> dict[str, tuple[Callable[[], None], Callable[[], None], frozenset]]:
    """(one micro-batch's call, the end-of-step pass, the device types counted as the host) per path."""
    keys = {k: v for k, v in batch.items() if k in ("tokens", "cu_seqlens")}
    device, host = FlopsTracker(spec), FlopsTracker(spec)
    session = install_session(FlopsTracker(spec), world_size=1, peak_flops_per_s=10**15)
    session.begin_step()
    observed = ObservedIterator(itertools.repeat(batch), session, BatchReader())
    cpu = frozenset({"cpu"})
    return {
        "record(), device path": (lambda: device.record(**keys), device._settle, frozenset()),
        "record(), host path": (lambda: host.record(**keys), host._settle, cpu),
        "observed (no forward_step edit)": (lambda: next(observed), session.tracker._settle, cpu),
    }


if __name__ == "__main__":
    main()
