"""Megatron-Bridge 0.6.2's per-expert grouped LoRA adapter (``GroupedExpertLinearAdapter``) on
CPU: the bytes its forward saves for backward, beside its parameters, on ``grouped_mm``'s path.

Run by tests/test_memory_grouped_start.py with Megatron-Bridge 0.6.2's Python 3.12 venv (torch
2.13 runs ``grouped_mm`` on CPU in bf16); prints one JSON line. Its two CUDA-only gates are
opened (``_can_use_grouped_mm`` asks for a CUDA tensor and compute capability 8.0; the FP8 check
reads Transformer Engine, absent here): the adapter's own code runs as on a GPU. The base
``TEGroupedLinear`` it wraps is not run (Transformer Engine is CUDA-only)."""

from __future__ import annotations

import json
import os
import sys

import torch

from frameworks.cpu_shims import import_megatron_bridge, install_nvrx_version

E, N_E, H, FFN, R = 2, 16, 64, 48, 8  # 2 local experts, 16 tokens each (n = 32), gated fc1 [2 ffn]


def _saved(adapter: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages the adapter's forward saves, its parameters' aside."""
    params = {p.untyped_storage().data_ptr() for p in adapter.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        adapter(x, [N_E] * E).float().sum().backward()
    return sum(seen.values())


def main() -> None:
    install_nvrx_version()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    import_megatron_bridge()
    from megatron.bridge.peft.utils import GroupedExpertLinearAdapter

    parallel_state.initialize_model_parallel()
    out = {}
    for name, inp, width, parallel in (("linear_fc1", H, 2 * FFN, False), ("linear_fc2", FFN, H, True)):
        config = ModelParallelConfig(params_dtype=torch.bfloat16, bf16=True)
        adapter = GroupedExpertLinearAdapter(inp, width, R, num_local_experts=E, base_linear_name=name,
                                             activation="identity", input_is_parallel=parallel,
                                             model_parallel_config=config, params_dtype=torch.bfloat16)
        adapter._can_use_grouped_mm = lambda x: True  # (CUDA-only gates; see the module doc)
        adapter._is_te_fp8_enabled = lambda: False
        for grad in (False, True):
            x = torch.randn(E * N_E, inp, dtype=torch.bfloat16, requires_grad=grad)
            out[f"{name} {'input grad' if grad else 'frozen input'}"] = _saved(adapter, x)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
