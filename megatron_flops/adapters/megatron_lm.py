"""Megatron-LM adapter: corrected TFLOP/s/GPU, tokens/s/GPU and MFU in ``training_log``.

``install()`` replaces three attributes of ``megatron.training.training``, where ``train()``
and ``training_log()`` look them up as module globals:

- ``train_step``: opens and closes the session's step (see ``_hooks`` for why this hook), and
  observes the micro-batches that ``forward_step`` pulls from its data iterator (``_observe``):
  the stock ``pretrain_gpt.py`` needs no edit;
- ``num_floating_point_operations``: unchanged result, also kept as the step's framework number
  (packed-aware from core_v0.19.0; the static number is the tracker's own full-row formula);
- ``training_log``: unchanged, except that its log line gains the corrected fields after the
  stock ``throughput per GPU (TFLOP/s/GPU)`` and each log interval writes
  ``IntervalReport.scalars()`` to Megatron's TensorBoard and W&B writers.

Nothing is patched on import. The session is built at the first train step from Megatron's
global ``args`` (``ModelSpec.from_megatron_args``), unless one was installed already.
Run in tests: core_v0.19.0, core_v0.16.1 and core_v0.14.0 (``pretrain_gpt.py``, unmodified).
Read, not run: core_v0.8.0 (baf94af), core_v0.12.0 (d580efc), core_v0.18.2 (571370c) and main
d98e8a6 (2026-08-22): the three names, ``print_rank_last``, ``get_args`` and the writer getters
are globals of that module in all of them.
"""

from __future__ import annotations

import argparse
import inspect
import os
import logging
from typing import Any

from megatron_flops.adapters._hooks import (
    PRINTER,
    Adapter,
    wrap_static_flops,
    wrap_train_step,
    wrap_training_log,
)
from megatron_flops.adapters._setup import check_options, import_target, is_corrected, new_session, patch
from megatron_flops.flops.formulas import ATTENTION_CONVENTIONS
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.reporting.session import Session
from megatron_flops.model.spec import ModelSpec

logger = logging.getLogger("megatron_flops")

MODULE = "megatron.training.training"
_WRAPPERS = {
    "train_step": wrap_train_step,
    "num_floating_point_operations": wrap_static_flops,
    "training_log": wrap_training_log,
}
_LOG_GLOBALS = (PRINTER, "get_args", "get_tensorboard_writer", "get_wandb_writer")


class _MegatronLM(Adapter):
    name = "Megatron-LM"

    def __init__(self) -> None:
        self.configure(None, peak_tflops=None, attention=None, trace=None, namespace={})

    def configure(self, args: Any, *, peak_tflops: float | None, attention: str | None, trace: Any,
                  namespace: dict) -> None:
        self.args = args
        self.peak_tflops = peak_tflops
        self.attention = attention
        self.trace = trace
        self.namespace = namespace
        self.failed = False

    def new_session(self, bound: inspect.BoundArguments) -> Session:
        args = self.args if self.args is not None else self.namespace["get_args"]()
        return new_session(
            ModelSpec.from_megatron_args(args),
            seq_length=getattr(args, "seq_length", None),
            context_parallel_size=getattr(args, "context_parallel_size", None),
            attention=self.attention or getattr(args, "flops_attention", None) or "causal",
            peak_tflops=getattr(args, "flops_peak_tflops", None) if self.peak_tflops is None else self.peak_tflops,
            fp8=bool(getattr(args, "fp8", None)),
            world_size=getattr(args, "world_size", None),
            framework="megatron-lm",
            recompute=RecomputeSpec.from_mapping(vars(args), source="Megatron-LM args"),
            trace=self.trace if self.trace is not None else getattr(args, "flops_trace", None),
        )

    def log_iteration(self, bound: inspect.BoundArguments) -> int:
        return bound.arguments["iteration"]

    def writers(self, bound: inspect.BoundArguments, namespace: Any) -> tuple[Any, Any]:
        return namespace["get_tensorboard_writer"](), namespace["get_wandb_writer"]()


_ADAPTER = _MegatronLM()


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--flops-accounting``, ``--flops-peak-tflops``, ``--flops-attention`` and
    ``--flops-trace`` (Megatron's ``extra_args_provider`` convention: returns the parser)."""
    group = parser.add_argument_group(title="megatron-flops")
    group.add_argument("--flops-accounting", choices=("static", "corrected"), default="static",
                       help="corrected: add exact TFLOP/s/GPU, tokens/s/GPU and MFU to the training log")
    group.add_argument("--flops-peak-tflops", type=float, default=None,
                       help="one GPU's dense peak TFLOP/s for MFU (default: looked up from the device name)")
    group.add_argument("--flops-attention", choices=ATTENTION_CONVENTIONS, default="causal",
                       help="core-attention convention: causal halves the full product, as Megatron does")
    group.add_argument("--flops-trace", default=None, metavar="FILE",
                       help="append one JSON line per iteration to FILE (written by the last rank; "
                            "{rank} in the name: one file per rank)")
    return parser


def install(args: Any = None, *, peak_tflops: float | None = None, attention: str | None = None,
            trace: str | os.PathLike[str] | None = None) -> bool:
    """Patch ``megatron.training.training``; returns whether the hooks are in place.

    ``args``: Megatron's args (default: ``get_args()`` at the first train step); its
    ``flops_peak_tflops``/``flops_attention``/``flops_trace`` apply unless given here. A second
    call updates the options without wrapping again. A missing symbol (a renamed upstream
    function) logs one warning and returns False, patching nothing.
    """
    check_options(peak_tflops=peak_tflops, attention=attention, trace=trace)
    module = import_target(MODULE, _ADAPTER.name)
    if module is None:
        return False
    missing = [name for name in _WRAPPERS if not callable(getattr(module, name, None))]
    namespace: dict = {}
    if not missing:
        namespace = inspect.unwrap(module.training_log).__globals__
        missing += [name for name in _LOG_GLOBALS if name not in namespace]
        if "iteration" not in inspect.signature(module.training_log).parameters:
            missing.append("training_log(iteration)")
    if not missing:
        _ADAPTER.configure(args, peak_tflops=peak_tflops, attention=attention, trace=trace, namespace=namespace)
    return patch(module, _WRAPPERS, _ADAPTER, missing=missing, distribution="megatron-core")


def maybe_install_from_args(args: Any) -> bool:
    """``install(args)`` when ``args.flops_accounting == "corrected"``; False (nothing patched)
    when it is ``"static"`` or absent."""
    return is_corrected(getattr(args, "flops_accounting", None), "flops_accounting") and install(args)
