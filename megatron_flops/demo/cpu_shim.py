"""CPU shim: what megatron-core 0.16 and 0.19 need to train a dense GPT (local layer spec) on a CPU.

Used by the demo only, and only inside :func:`cpu_shim`, which restores every patched attribute
on exit; importing this module patches nothing. The tracker and the adapters never use it.

Inside the context:

- ``torch.cuda.current_device()`` returns ``"cpu"``: DDP's grad buffers, the attention scratch
  buffer (``GlobalMemoryBuffer``), RoPE's ``inv_freq``, the pipeline's p2p buffers and its shape
  exchange (``variable_seq_lengths``) allocate on it.
- ``torch.cuda.synchronize()`` is a no-op: the pipeline calls it after every batched p2p
  exchange (PP > 1 only).
- ``CudaRNGStatesTracker.fork()`` is a null context: the attention dropout forks the CUDA RNG
  state, which a CPU build does not have (dropout is 0 in the demo anyway).
- a ``TorchFunctionMode`` maps a ``device="cuda"`` argument to the CPU: every schedule creates
  its token count with ``torch.zeros(..., device="cuda")``.
- ``torch.cuda.current_stream()`` returns a stand-in for the CPU's one stream, whose waits are
  no-ops: megatron-core 0.19's DDP grad sync waits on the current stream for CUDA-graph events.

Each of the five was checked by removing it and watching the demo fail (the last on
megatron-core 0.19 only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class _CudaDeviceToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _cpu_device() -> str:
    return "cpu"


def _no_sync(*args: Any, **kwargs: Any) -> None:
    return None


def _no_fork(self: Any, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class _CpuStream:
    """The CPU's one stream: work is done in order, so waiting on an event or stream is a no-op."""

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _cpu_stream(*args: Any, **kwargs: Any) -> _CpuStream:
    return _CpuStream()


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Run megatron-core on the CPU inside the block; every patch is undone on exit."""
    from megatron.core.tensor_parallel import random as tp_random

    patches = (
        (torch.cuda, "current_device", _cpu_device),
        (torch.cuda, "synchronize", _no_sync),
        (torch.cuda, "current_stream", _cpu_stream),
        (tp_random.CudaRNGStatesTracker, "fork", _no_fork),
    )
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        with _CudaDeviceToCpu():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
