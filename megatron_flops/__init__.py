"""megatron-flops: true TFLOP/s/GPU, tokens/s and MFU for Megatron-style training loops.

The top-level names load lazily so that the pure layers (``spec``, ``formulas``) stay importable
without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelSpec": "megatron_flops.model.spec",
    "load_model_file": "megatron_flops.model.spec",
    "SeqStats": "megatron_flops.flops.formulas",
    "FlopsBreakdown": "megatron_flops.flops.formulas",
    "estimate": "megatron_flops.flops.formulas",
    "parse_rows": "megatron_flops.flops.formulas",
    "training_flops": "megatron_flops.flops.formulas",
    "StepResult": "megatron_flops.tracking.result",
    "FlopsTracker": "megatron_flops.tracking.tracker",
    "DiTFlopsTracker": "megatron_flops.tracking.dit_tracker",
    "DiTSpec": "megatron_flops.flops.dit",
    "ThroughputMeter": "megatron_flops.reporting.meter",
    "peak_flops_per_s": "megatron_flops.reporting.peaks",
    "record": "megatron_flops.reporting.session",
    "install_session": "megatron_flops.reporting.session",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_flops' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
