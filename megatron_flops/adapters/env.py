"""Enable the adapters from environment variables, with an explicit ``install_from_env()``.

- ``MEGATRON_FLOPS``: ``corrected`` installs; ``static`` or unset does nothing.
- ``MEGATRON_FLOPS_PEAK_TFLOPS``: one GPU's dense peak for MFU (default: the device table).
- ``MEGATRON_FLOPS_ATTENTION``: ``causal`` (default) or ``full``.
- ``MEGATRON_FLOPS_FRAMEWORK``: ``megatron-lm``, ``megatron-bridge`` or ``auto`` (default:
  every one of the two that is installed).
- ``MEGATRON_FLOPS_TRACE``: a file the per-step trace is appended to (``megatron_flops.reporting.trace``;
  written by the last rank, or by every rank when the name holds ``{rank}``).

Without editing the training script: ``python -m megatron_flops.launch script.py ARGS`` (see
``megatron_flops.launch``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping

from megatron_flops.adapters import megatron_bridge, megatron_lm
from megatron_flops.flops.formulas import ATTENTION_CONVENTIONS
from megatron_flops.reporting.trace import TRACE_ENV

logger = logging.getLogger("megatron_flops")

ACCOUNTING = "MEGATRON_FLOPS"
PEAK_TFLOPS = "MEGATRON_FLOPS_PEAK_TFLOPS"
ATTENTION = "MEGATRON_FLOPS_ATTENTION"
FRAMEWORK = "MEGATRON_FLOPS_FRAMEWORK"
TRACE = TRACE_ENV

# Framework name -> (the package whose presence selects it under "auto", its install()).
_FRAMEWORKS: dict[str, tuple[str, Callable[..., bool]]] = {
    "megatron-lm": ("megatron.training", megatron_lm.install),
    "megatron-bridge": ("megatron.bridge", megatron_bridge.install),
}


def install_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Install the adapters that the environment asks for; True if at least one is in place.

    Bad values raise ``ValueError`` naming the variable (before anything is patched).
    """
    env = os.environ if environ is None else environ
    mode = env.get(ACCOUNTING, "").strip() or "static"
    if mode not in ("static", "corrected"):
        raise ValueError(f"{ACCOUNTING} must be 'static' or 'corrected', got {mode!r}")
    peak_text = env.get(PEAK_TFLOPS, "").strip()
    try:
        peak = float(peak_text) if peak_text else None
    except ValueError:
        raise ValueError(f"{PEAK_TFLOPS} must be a number of TFLOP/s, got {peak_text!r}") from None
    attention = env.get(ATTENTION, "").strip() or None
    framework = env.get(FRAMEWORK, "").strip() or "auto"
    trace = env.get(TRACE, "").strip() or None
    if framework != "auto" and framework not in _FRAMEWORKS:
        raise ValueError(f"{FRAMEWORK} must be 'auto' or one of {tuple(_FRAMEWORKS)}, got {framework!r}")
    if peak is not None and not (math.isfinite(peak) and peak > 0):
        raise ValueError(f"{PEAK_TFLOPS} must be a positive number of TFLOP/s, got {peak_text!r}")
    if attention is not None and attention not in ATTENTION_CONVENTIONS:
        raise ValueError(f"{ATTENTION} must be one of {ATTENTION_CONVENTIONS}, got {attention!r}")
    if mode == "static":
        return False
    names = list(_FRAMEWORKS) if framework == "auto" else [framework]
    if framework == "auto":
        names = [name for name in names if _importable(_FRAMEWORKS[name][0])]
        if not names:
            logger.warning("megatron-flops: %s=corrected but neither Megatron-LM nor Megatron-Bridge is "
                           "installed; nothing patched", ACCOUNTING)
            return False
    installed = [_FRAMEWORKS[name][1](peak_tflops=peak, attention=attention, trace=trace) for name in names]
    return any(installed)


def _importable(package: str) -> bool:
    if package in sys.modules:
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
