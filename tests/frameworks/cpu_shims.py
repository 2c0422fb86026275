"""Test-only CPU shims for the real training loops: each one listed in ``tests/frameworks/SHIMS.md``.

Applied only by ``rank_main.py`` inside a rank process started by a test, before the training
script runs; never imported by the ``megatron_flops`` package. Each shim maps a CUDA call that
megatron-core, Megatron-LM or Megatron-Bridge make unconditionally onto the CPU; none changes
what is computed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """S1: ``device="cuda"`` arguments, ``Tensor.cuda()``, ``.to("cuda")`` and ``pin_memory()`` stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _noop_fn() -> Any:
    """A distinct no-op per patched name (torch._dynamo rejects one function under two names)."""
    return lambda *args, **kwargs: None


class _Stream:
    """S3: ``torch.cuda.Stream`` (megatron-core's DDP starts on a side stream): the CPU has one
    stream; waiting on it is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    wait_stream = wait_event = synchronize = _noop


def install_torch_cuda() -> None:
    """S1-S3: the ``torch.cuda`` surface the training loops touch, answered for one CPU "device"."""
    _CudaToCpu().__enter__()  # S1, for the life of the rank process
    cuda = torch.cuda
    cuda.device_count = lambda: 1  # S2: else Megatron skips model-parallel initialisation
    cuda.current_device = lambda: "cpu"  # S2: p2p buffers, scratch buffers, RoPE
    cuda.set_device = _noop_fn()
    cuda.synchronize = _noop_fn()  # S2: the schedules' batched p2p
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # S2: the rerun state machine's snapshot
    cuda.set_rng_state = _noop_fn()
    cuda.Stream = _Stream  # S3
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()


def install_nvrx_version() -> None:
    """S13 (megatron-core >= 0.19): ``nvidia_resiliency_ext.__version__`` (PyPI's releases, 0.4.1
    at most, lack it; megatron-core reads it at import), from the distribution's metadata; and
    while megatron-core imports, nvrx's async checkpointing module hidden, so megatron-core's probe
    of it (which asserts nvrx >= 0.6.0 once the module imports) finds it unavailable and keeps its
    own checkpoint path. Megatron-Bridge's ``pretrain`` imports nvrx unconditionally; no test
    saves a checkpoint."""
    import sys
    from importlib import metadata

    try:
        import nvidia_resiliency_ext as nvrx
    except ImportError:
        return
    if not hasattr(nvrx, "__version__"):
        nvrx.__version__ = metadata.version("nvidia-resiliency-ext")
    core = tuple(int(part) for part in metadata.version("megatron-core").split(".")[:2])
    hidden = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
    if core < (0, 19) or "megatron.core" in sys.modules or hidden in sys.modules:
        return
    sys.modules[hidden] = None  # type: ignore[assignment]  (import raises ImportError)
    try:
        import megatron.core  # noqa: F401
    finally:
        del sys.modules[hidden]


def install_megatron_core() -> None:
    """S4-S5 (S13 first): megatron-core's CUDA-only helpers (0.14.0 to 0.19.2)."""
    install_nvrx_version()
    import megatron.core.utils as mutils
    from megatron.core.tensor_parallel import random as tp_random

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tuple(tensor_shape), dtype=dtype)

    mutils.GlobalMemoryBuffer.get_tensor = get_tensor  # S4: scratch buffers on the CPU

    def tracker_add(self, name, seed):  # S5: the model-parallel RNG states are CPU generator states
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"RNG state {name} ({seed}) already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    tp_random.CudaRNGStatesTracker.add = tracker_add
    tp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    tp_random._set_cuda_rng_state = _noop


def install_pipeline_sends() -> None:
    """S10: pipeline sends hand gloo a copy. The schedules free a sent activation's storage right
    after ``isend`` returns (``deallocate_pipeline_outputs``); NCCL has read it by then on its
    stream, gloo may not have (intermittent NaN loss under PP2 x VPP2 otherwise)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    stock = c10d.isend

    def isend(tensor, *args: Any, **kwargs: Any):
        return stock(tensor.detach().clone(), *args, **kwargs)

    dist.isend = c10d.isend = isend  # both names: batched P2POp checks its op against c10d's


def install_megatron_lm() -> None:
    """S6-S7: Megatron-LM's start-up on a machine without CUDA (core_v0.14.0, core_v0.16.1 and
    core_v0.19.0; the last has no ``megatron.legacy``, and builds no fused kernels)."""
    import importlib.util

    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.arguments as arguments
    import megatron.training.training as training

    stock = training.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:  # S6: its own CPU switch
        return stock(*args, **{**kwargs, "allow_no_cuda": True})

    training.initialize_megatron = initialize_megatron
    # The argument checks read the GPU architecture when TP > 1: 9 (Hopper), whose
    # CUDA_DEVICE_MAX_CONNECTIONS=1 requirement procs.launch meets.
    arguments.get_device_arch_version = lambda: 9
    if importlib.util.find_spec("megatron.legacy") is not None:
        import megatron.legacy.fused_kernels as fused_kernels

        fused_kernels.load = _noop  # S7: no CUDA kernels to build;
    dataset_utils.compile_helpers = _noop  # the wheel ships the built dataset helpers (no Makefile)


def install_thd_attention() -> None:
    """S8: packed (THD) rows through megatron-core's local ``DotProductAttention``, which asserts
    ``packed_seq_params is None`` (Transformer Engine's attention handles THD on a GPU).

    Each sub-sequence of ``cu_seqlens`` (``cu_seqlens_q_padded`` when given, as Transformer
    Engine reads it) runs through the unchanged local attention as its own sequence of batch 1,
    with the caller's mask type (causal for GPT): what a THD kernel computes. Tokens past the
    last offset attend to nothing (zeros, as in Transformer Engine).
    """
    from megatron.core.transformer import dot_product_attention as dpa

    stock = dpa.DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return stock(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                         attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        offsets = cu.reshape(-1).tolist()
        parts = [
            stock(self, query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1), None,
                  attn_mask_type=attn_mask_type, attention_bias=attention_bias)
            for a, b in zip(offsets, offsets[1:]) if b > a
        ]
        tail = query.shape[0] - offsets[-1]
        if tail:
            parts.append(parts[0].new_zeros((tail, *parts[0].shape[1:])))
        return torch.cat(parts)  # [t, 1, heads x head dim]; the caller reshapes it

    dpa.DotProductAttention.forward = forward

    import megatron.core.utils as mutils

    if not hasattr(mutils, "get_thd_batch_on_this_cp_rank"):  # megatron-core 0.19: gone (get_batch_on_this_cp_rank)
        return
    stock_thd_batch = mutils.get_thd_batch_on_this_cp_rank

    def get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, *args, **kwargs):
        # S9: pretrain_gpt passes the collated offsets, [1, n + 1]; megatron-core's unfused THD RoPE
        # (the one that runs without Transformer Engine) indexes them as 1-D.
        flat = [None if cu is None else cu.reshape(-1) for cu in (cu_seqlens, cu_seqlens_padded)]
        return stock_thd_batch(batch, *flat, max_seqlen, *args, **kwargs)

    mutils.get_thd_batch_on_this_cp_rank = get_thd_batch_on_this_cp_rank


def import_megatron_bridge() -> None:
    """S11: import Megatron-Bridge with a stand-in ``transformer_engine`` present only while its two
    PEFT modules that import it without a fallback (``peft/lora.py``, ``peft/lora_layers.py``, both
    reached from ``training/config.py``) load. megatron-core is imported first, without it, so it
    keeps its own non-TE paths; LoRA is not used by these tests."""
    import sys
    import types

    import megatron.core.extensions.transformer_engine  # noqa: F401  (decides HAVE_TE=False)
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    try:  # megatron-core >= 0.19 ships megatron.training, which Megatron-Bridge 0.6 imports: without TE too
        import megatron.training.utils.common_utils  # noqa: F401
    except ImportError:
        pass

    class _Missing(torch.nn.Module):
        """A Transformer Engine class that the stand-in names but cannot provide."""

    def stub(name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__getattr__ = lambda attr: _stub_attr(name, attr)
        return module

    def _stub_attr(name: str, attr: str) -> Any:
        if attr.startswith("__"):  # no __path__: a submodule import fails as without TE (0.6.2's fallbacks)
            raise AttributeError(attr)
        return _Missing if attr[:1].isupper() else stub(f"{name}.{attr}")

    names = ("transformer_engine", "transformer_engine.pytorch")
    sys.modules.update({name: stub(name) for name in names})
    sys.modules["transformer_engine"].pytorch = sys.modules["transformer_engine.pytorch"]
    try:
        import megatron.bridge.training.config  # noqa: F401
    finally:
        for name in names:
            del sys.modules[name]


def install_megatron_bridge() -> None:
    """S12: Megatron-Bridge's start-up on a machine without CUDA (its own CPU switch, as S6)."""
    import megatron.bridge.training.initialize as initialize
    import megatron.bridge.training.setup as setup

    initialize.compile_helpers = _noop_fn()  # S7, where Megatron-Bridge imported it
    stock = setup.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        return stock(*args, **{**kwargs, "allow_no_cuda": True})

    setup.initialize_megatron = initialize_megatron
