"""Cost of FlopsTracker.record() per call on CPU, beside the upstream-style reference.

Reference (what Megatron-LM/Megatron-Bridge do per micro-batch): diff the cu_seqlens, square,
sum, add into a device accumulator. Run: python benchmarks/bench_record.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

from megatron_flops.spec import ModelSpec
from megatron_flops.tracker import FlopsTracker

N_CALLS = 2000
REPEATS = 15


def _time_per_call(fn) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(N_CALLS):
            fn()
        samples.append((time.perf_counter() - start) / N_CALLS * 1e6)
    return statistics.median(samples)


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


def _kernels(fn) -> str:
    with _CountKernels() as mode:
        fn()
    return f"{len(mode.names)} ({', '.join(mode.names) or '-'})"


def main() -> None:
    torch.set_num_threads(1)
    spec = ModelSpec.from_mapping(
        dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
             ffn_hidden_size=14336, gated_linear_unit=True, activation_func="silu", vocab_size=128256)
    )
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 256, (64,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    packed_tokens = torch.zeros(1, int(cu[-1]), dtype=torch.long)
    plain_tokens = torch.zeros(4, 4096, dtype=torch.long)

    tracker = FlopsTracker(spec)
    acc = torch.zeros(2, dtype=torch.int64)

    def reference_packed() -> None:
        acc[0].add_((cu[1:] - cu[:-1]).to(torch.int64).square().sum())

    def tracker_packed() -> None:
        tracker.record(tokens=packed_tokens, cu_seqlens=cu)

    def reference_plain() -> None:
        # Upstream prices a plain batch from the shape too, but adds it into the device tensor.
        acc[1].add_(plain_tokens.shape[0] * plain_tokens.shape[1] ** 2)

    def tracker_plain() -> None:
        tracker.record(tokens=plain_tokens)

    cases = [
        ("packed row, 64 sub-sequences", reference_packed, tracker_packed),
        ("plain batch [4, 4096]", reference_plain, tracker_plain),
    ]
    print(f"torch {torch.__version__}, 1 thread, median of {REPEATS} x {N_CALLS} calls")
    print("| case | reference (us/call) | record() (us/call) | ratio | reference kernels | record() kernels |")
    print("|---|---:|---:|---:|---|---|")
    for name, ref_fn, ours_fn in cases:
        ref, ours = _time_per_call(ref_fn), _time_per_call(ours_fn)
        print(f"| {name} | {ref:.1f} | {ours:.1f} | {ours / ref:.2f} | {_kernels(ref_fn)} | {_kernels(ours_fn)} |")
    tracker.end_step()


if __name__ == "__main__":
    main()
