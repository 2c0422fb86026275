"""megatron-flops: true TFLOP/s/GPU, tokens/s and MFU for Megatron-style training loops.

The top-level names load lazily so that the pure layers (``spec``, ``formulas``) stay importable
without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelSpec": "megatron_flops.spec",
    "load_model_file": "megatron_flops.spec",
    "SeqStats": "megatron_flops.formulas",
    "FlopsBreakdown": "megatron_flops.formulas",
    "estimate": "megatron_flops.formulas",
    "parse_rows": "megatron_flops.formulas",
    "training_flops": "megatron_flops.formulas",
    "StepResult": "megatron_flops.result",
    "FlopsTracker": "megatron_flops.tracker",
    "DiTFlopsTracker": "megatron_flops.dit_tracker",
    "DiTSpec": "megatron_flops.dit",
    "ThroughputMeter": "megatron_flops.meter",
    "peak_flops_per_s": "megatron_flops.peaks",
    "record": "megatron_flops.session",
    "install_session": "megatron_flops.session",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_flops' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
