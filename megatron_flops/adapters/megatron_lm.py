"""Megatron-LM adapter: corrected TFLOP/s/GPU, tokens/s/GPU and MFU in ``training_log``.

``install()`` replaces three attributes of ``megatron.training.training``, where ``train()``
and ``training_log()`` look them up as module globals:

- ``train_step``: opens and closes the session's step (see ``_hooks`` for why this hook);
- ``num_floating_point_operations``: unchanged result, also kept as the step's static number;
- ``training_log``: unchanged, except that its log line gains the corrected fields after the
  stock ``throughput per GPU (TFLOP/s/GPU)`` and each log interval writes
  ``IntervalReport.scalars()`` to Megatron's TensorBoard and W&B writers.

Nothing is patched on import. The session is built at the first train step from Megatron's
global ``args`` (``ModelSpec.from_megatron_args``), unless one was installed already.
Checked against Megatron-LM core_v0.8.0 (baf94af), core_v0.12.0 (d580efc), core_v0.14.0
(23e00ed), core_v0.16.1 (55ac708), core_v0.18.2 (571370c), core_v0.19.0 (5be9626) and main
d98e8a6 (2026-08-22): the three names, ``print_rank_last``, ``get_args`` and the writer getters
are globals of that module in all of them.
"""

from __future__ import annotations

import argparse
import inspect
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
from megatron_flops.formulas import ATTENTION_CONVENTIONS
from megatron_flops.passes import RecomputeSpec
from megatron_flops.session import Session
from megatron_flops.spec import ModelSpec

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
        self.configure(None, peak_tflops=None, attention=None, namespace={})

    def configure(self, args: Any, *, peak_tflops: float | None, attention: str | None, namespace: dict) -> None:
        self.args = args
        self.peak_tflops = peak_tflops
        self.attention = attention
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
            recompute=RecomputeSpec.from_mapping(vars(args), source="Megatron-LM args"),
        )

    def log_iteration(self, bound: inspect.BoundArguments) -> int:
        return bound.arguments["iteration"]

    def writers(self, bound: inspect.BoundArguments, namespace: Any) -> tuple[Any, Any]:
        return namespace["get_tensorboard_writer"](), namespace["get_wandb_writer"]()


_ADAPTER = _MegatronLM()


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--flops-accounting``, ``--flops-peak-tflops`` and ``--flops-attention`` (Megatron's
    ``extra_args_provider`` convention: returns the parser)."""
    group = parser.add_argument_group(title="megatron-flops")
    group.add_argument("--flops-accounting", choices=("static", "corrected"), default="static",
                       help="corrected: add exact TFLOP/s/GPU, tokens/s/GPU and MFU to the training log")
    group.add_argument("--flops-peak-tflops", type=float, default=None,
                       help="one GPU's dense peak TFLOP/s for MFU (default: looked up from the device name)")
    group.add_argument("--flops-attention", choices=ATTENTION_CONVENTIONS, default="causal",
                       help="core-attention convention: causal halves the full product, as Megatron does")
    return parser


def install(args: Any = None, *, peak_tflops: float | None = None, attention: str | None = None) -> bool:
    """Patch ``megatron.training.training``; returns whether the hooks are in place.

    ``args``: Megatron's args (default: ``get_args()`` at the first train step); its
    ``flops_peak_tflops``/``flops_attention`` apply unless given here. A second call updates
    the options without wrapping again. A missing symbol (a renamed upstream function) logs one
    warning and returns False, patching nothing.
    """
    check_options(peak_tflops=peak_tflops, attention=attention)
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
        _ADAPTER.configure(args, peak_tflops=peak_tflops, attention=attention, namespace=namespace)
    return patch(module, _WRAPPERS, _ADAPTER, missing=missing, distribution="megatron-core")


def maybe_install_from_args(args: Any) -> bool:
    """``install(args)`` when ``args.flops_accounting == "corrected"``; False (nothing patched)
    when it is ``"static"`` or absent."""
    return is_corrected(getattr(args, "flops_accounting", None), "flops_accounting") and install(args)
