"""Megatron-Bridge adapter: corrected TFLOP/s/GPU, tokens/s/GPU and MFU in ``training_log``.

``install()`` replaces two attributes of ``megatron.bridge.training.train``, where ``train()``
looks them up as module globals (``training_log`` is imported there by name from
``megatron.bridge.training.utils.train_utils``):

- ``train_step``: opens and closes the session's step (see ``_hooks`` for why this hook);
- ``training_log``: unchanged, except that its log line gains the corrected fields after the
  stock ``throughput per GPU (TFLOP/s/GPU)`` and each log interval writes
  ``IntervalReport.scalars()`` to ``global_state.tensorboard_logger`` / ``wandb_logger``
  (MLflow and Comet are not written).

The step's static number is the step's increase of ``train_state.floating_point_operations_so_far``:
what ``train()`` adds after each step (``flop_utils.num_floating_point_operations`` plus, for
VLMs, ``vit_flops_from_patch_stats``) and what its log line divides. Reading the total instead of
patching ``flop_utils`` keeps the number right across releases that call those functions
differently (v0.4.0 prices one sample once; main adds the vision term separately).

Enable it with ``install(cfg)``, or ``maybe_install_from_config(cfg)`` and
``cfg.logger.flops_accounting = "corrected"`` (read with ``getattr``: absent means off). The
session is built at the first train step from ``global_state.cfg`` unless one was installed.
Checked against Megatron-Bridge v0.2.0 (7af9601), v0.4.0 (0fbfe7d), v0.5.0 (fcbb603), v0.6.0
(51885cf) and main 067f987 (2026-08-22).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch.distributed as dist

from megatron_flops.adapters._hooks import PRINTER, Adapter, wrap_train_step, wrap_training_log
from megatron_flops.adapters._setup import check_options, import_target, is_corrected, new_session, patch
from megatron_flops.passes import RecomputeSpec
from megatron_flops.session import Session
from megatron_flops.spec import ModelSpec
from megatron_flops.vision import VisionSpec

logger = logging.getLogger("megatron_flops")

MODULE = "megatron.bridge.training.train"
_WRAPPERS = {"train_step": wrap_train_step, "training_log": wrap_training_log}


class _MegatronBridge(Adapter):
    name = "Megatron-Bridge"

    def __init__(self) -> None:
        self.configure(None, peak_tflops=None, attention=None)

    def configure(self, cfg: Any, *, peak_tflops: float | None, attention: str | None) -> None:
        self.cfg = cfg
        self.peak_tflops = peak_tflops
        self.attention = attention
        self.failed = False
        self._flops_before_step: float | None = None

    def new_session(self, bound: inspect.BoundArguments) -> Session:
        cfg = self.cfg if self.cfg is not None else bound.arguments["global_state"].cfg
        model = cfg.model
        options = getattr(cfg, "logger", None)
        # Megatron-Bridge pads the vocabulary only when should_pad_vocab is set.
        pad = bool(getattr(model, "should_pad_vocab", False))
        pattern = getattr(model, "hybrid_layer_pattern", None) or getattr(model, "hybrid_override_pattern", None)
        spec = ModelSpec.from_transformer_config(
            model,
            vocab_size=model.vocab_size,
            make_vocab_size_divisible_by=getattr(model, "make_vocab_size_divisible_by", 128) if pad else 1,
            tensor_model_parallel_size=None if pad else 1,
            share_embeddings_and_output_weights=getattr(model, "share_embeddings_and_output_weights", True),
            hybrid_override_pattern=pattern,
        )
        return new_session(
            spec,
            seq_length=getattr(model, "seq_length", None),
            context_parallel_size=getattr(model, "context_parallel_size", None),
            attention=self.attention or getattr(options, "flops_attention", None) or "causal",
            peak_tflops=getattr(options, "flops_peak_tflops", None) if self.peak_tflops is None else self.peak_tflops,
            fp8=bool(getattr(model, "fp8", None)),
            world_size=dist.get_world_size() if dist.is_available() and dist.is_initialized() else None,
            recompute=RecomputeSpec.from_mapping(vars(model), source="Megatron-Bridge model config"),
            vision=_vision_spec(model),
        )

    def on_step_begin(self, bound: inspect.BoundArguments, session: Session) -> None:
        self._flops_before_step = _flops_so_far(bound)

    def on_log(self, bound: inspect.BoundArguments, session: Session) -> None:
        before, self._flops_before_step = self._flops_before_step, None
        if before is not None:
            session.set_static_flops(_flops_so_far(bound) - before)

    def log_iteration(self, bound: inspect.BoundArguments) -> int:
        return bound.arguments["global_state"].train_state.step

    def writers(self, bound: inspect.BoundArguments, namespace: Any) -> tuple[Any, Any]:
        state = bound.arguments["global_state"]
        return state.tensorboard_logger, state.wandb_logger


def _vision_spec(model: Any) -> VisionSpec | None:
    """The vision tower of a Qwen-VL provider (its Hugging Face ``vision_config``), else None."""
    config = getattr(model, "vision_config", None)
    if config is None:
        return None
    mapping = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    model_type = mapping.get("model_type") or getattr(config, "model_type", None)
    return VisionSpec.from_hf_vision_config(str(model_type), mapping)


def _flops_so_far(bound: inspect.BoundArguments) -> float:
    return bound.arguments["global_state"].train_state.floating_point_operations_so_far


_ADAPTER = _MegatronBridge()


def install(cfg: Any = None, *, peak_tflops: float | None = None, attention: str | None = None) -> bool:
    """Patch ``megatron.bridge.training.train``; returns whether the hooks are in place.

    ``cfg``: the ``ConfigContainer`` (default: ``global_state.cfg`` at the first train step);
    its ``logger.flops_peak_tflops``/``logger.flops_attention`` apply unless given here. A second
    call updates the options without wrapping again. A missing symbol (a renamed upstream
    function) logs one warning and returns False, patching nothing.
    """
    check_options(peak_tflops=peak_tflops, attention=attention)
    module = import_target(MODULE, _ADAPTER.name)
    if module is None:
        return False
    missing = [name for name in _WRAPPERS if not callable(getattr(module, name, None))]
    missing += [f"{name}(global_state)" for name in _WRAPPERS if name not in missing
                and "global_state" not in inspect.signature(getattr(module, name)).parameters]
    if "training_log" not in missing and PRINTER not in inspect.unwrap(module.training_log).__globals__:
        missing.append(f"training_log's {PRINTER}")
    if not missing:
        _ADAPTER.configure(cfg, peak_tflops=peak_tflops, attention=attention)
    return patch(module, _WRAPPERS, _ADAPTER, missing=missing, distribution="megatron-bridge")


def maybe_install_from_config(cfg: Any) -> bool:
    """``install(cfg)`` when ``cfg.logger.flops_accounting == "corrected"``; False (nothing
    patched) when it is ``"static"`` or absent."""
    mode = getattr(getattr(cfg, "logger", None), "flops_accounting", None)
    return is_corrected(mode, "cfg.logger.flops_accounting") and install(cfg)
