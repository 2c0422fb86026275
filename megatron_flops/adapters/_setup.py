"""Building a session from framework options, shared by the adapters (no framework import)."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import math
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from megatron_flops.adapters._hooks import Adapter, is_wrapped
from megatron_flops.flops.formulas import ATTENTION_CONVENTIONS
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.reporting.peaks import resolve_peak
from megatron_flops.reporting.session import Session, install_session
from megatron_flops.model.spec import ModelSpec
from megatron_flops.tracking.tracker import FlopsTracker
from megatron_flops.flops.vision import VisionSpec

logger = logging.getLogger("megatron_flops")


def check_options(*, peak_tflops: float | None, attention: str | None, trace: Any = None) -> None:
    """Reject bad adapter options up front (``ValueError`` naming the option)."""
    if trace is not None and not (isinstance(trace, (str, os.PathLike)) and os.fspath(trace)):
        raise ValueError(f"the trace must be a file path, got {trace!r}")
    if peak_tflops is not None and not (isinstance(peak_tflops, (int, float)) and math.isfinite(peak_tflops)
                                        and peak_tflops > 0):
        raise ValueError(f"peak_tflops must be a positive finite number, got {peak_tflops!r}")
    if attention is not None and attention not in ATTENTION_CONVENTIONS:
        raise ValueError(f"attention must be one of {ATTENTION_CONVENTIONS}, got {attention!r}")


def new_session(
    spec: ModelSpec,
    *,
    seq_length: int | None,
    context_parallel_size: int | None,
    attention: str,
    peak_tflops: float | None,
    fp8: bool,
    world_size: int | None,
    framework: str,
    recompute: RecomputeSpec | None = None,
    vision: VisionSpec | None = None,
    trace: str | os.PathLike[str] | None = None,
) -> Session:
    """Install a session for ``spec``. The MFU peak is ``peak_tflops`` if given, else this
    device's dense peak from the table. ``trace``: the per-step trace file (see ``trace``);
    ``framework`` names the adapter there, with its installed version.

    NB: with an fp8 recipe the peak is the fp8 one, since most GEMMs then run in fp8.
    """
    check_options(peak_tflops=peak_tflops, attention=attention, trace=trace)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    tracker = FlopsTracker(spec, attention=attention, seq_length=seq_length,
                           context_parallel_size=context_parallel_size, recompute=recompute,
                           vision=vision)
    distribution = {"megatron-lm": "megatron-core", "megatron-bridge": "megatron-bridge"}[framework]
    version = framework_version(distribution)
    return install_session(
        tracker,
        peak_flops_per_s=resolve_peak(device, "fp8" if fp8 else "bf16", peak_tflops),
        world_size=world_size,
        trace=trace,
        framework=framework,
        framework_version=None if version == "unknown" else version,
    )


# The releases the framework tests run (tests/test_frameworks_*.py), by the distribution whose
# version names them: Megatron-LM's training package has none, its megatron-core release does.
TESTED_RELEASES = {"megatron-core": ("0.14.0", "0.16.1", "0.19.0"), "megatron-bridge": ("0.3.1", "0.6.2")}
_warned_releases: set[str] = set()


def warn_untested_release(framework: str, distribution: str) -> None:
    """One warning per distribution when its installed release is not one the tests run (a local
    version label such as ``+cu12`` is ignored); the adapter still installs, with the same
    guarantees: what the model receives is cross-checked, a step that cannot be priced exactly
    falls back to the framework's own number, nothing interrupts training."""
    version = framework_version(distribution)
    tested = TESTED_RELEASES[distribution]
    if version.split("+")[0] in tested or distribution in _warned_releases:
        return
    _warned_releases.add(distribution)
    logger.warning(
        "megatron-flops: %s with %s is not a tested release (tested: %s %s); accounting is installed with "
        "the same guarantees: what each model chunk receives is cross-checked against the batch read, and a "
        "step that cannot be priced exactly reports the framework's own number, logged once",
        framework, f"{distribution} {version}" if version != "unknown" else f"{distribution} of an unknown version",
        distribution, ", ".join(tested),
    )


def framework_version(distribution: str) -> str:
    """The installed version of a distribution, for warnings; ``"unknown"`` if not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def import_target(module_name: str, framework: str) -> ModuleType | None:
    """The framework module to patch, or None (with one warning) when it does not import."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        logger.warning("megatron-flops: cannot import %s (%s); %s accounting is not installed",
                       module_name, exc, framework)
        return None


def patch(module: ModuleType, wrappers: dict[str, Callable[..., Any]], adapter: Adapter, *,
          missing: list[str], distribution: str) -> bool:
    """Replace each ``wrappers`` name in ``module`` by its wrapper (once), unless a required
    symbol is ``missing``: then warn once, naming it and the installed version, and patch nothing."""
    if missing:
        logger.warning(
            "megatron-flops: %s not found in %s (%s %s); %s accounting is not installed and training "
            "continues with the stock numbers",
            ", ".join(missing), module.__name__, distribution, framework_version(distribution), adapter.name,
        )
        return False
    warn_untested_release(adapter.name, distribution)
    for name, wrap in wrappers.items():
        fn = getattr(module, name)
        if not is_wrapped(fn):
            setattr(module, name, wrap(fn, adapter))
    return True


def is_corrected(mode: Any, option: str) -> bool:
    """Whether an accounting option (``static``, ``corrected``, or unset = static) asks for ours."""
    mode = mode or "static"
    if mode not in ("static", "corrected"):
        raise ValueError(f"{option} must be 'static' or 'corrected', got {mode!r}")
    return mode == "corrected"
