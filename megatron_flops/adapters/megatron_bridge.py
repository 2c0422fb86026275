"""Megatron-Bridge adapter: corrected TFLOP/s/GPU, tokens/s/GPU and MFU in ``training_log``.

``install()`` replaces two attributes of ``megatron.bridge.training.train``, where ``train()``
looks them up as module globals (``training_log`` is imported there by name from
``megatron.bridge.training.utils.train_utils``):

- ``train_step``: opens and closes the session's step (see ``_hooks`` for why this hook), and
  observes the micro-batches the forward step pulls from its data iterator (``_observe``; for
  0.3.1-0.5's ``vlm_step``, ``VlmStepReader``; for ``qwen3_vl_step``, ``Qwen3VLStepReader``):
  the stock forward steps need no edit;
- ``training_log``: unchanged, except that its log line gains the corrected fields after the
  stock ``throughput per GPU (TFLOP/s/GPU)`` and each log interval writes
  ``IntervalReport.scalars()`` to ``global_state.tensorboard_logger`` / ``wandb_logger``
  (MLflow and Comet are not written).

The step's framework number is the step's increase of ``train_state.floating_point_operations_so_far``:
what ``train()`` adds after each step (``flop_utils.num_floating_point_operations`` plus, for
VLMs, ``vit_flops_from_patch_stats``) and what its log line divides. Reading the total instead of
patching ``flop_utils`` keeps the number right across releases that call those functions
differently (v0.4.0 prices one sample once; main adds the vision term separately).

Enable it with ``install(cfg)``, or ``maybe_install_from_config(cfg)`` and
``cfg.logger.flops_accounting = "corrected"`` (read with ``getattr``: absent means off). The
session is built at the first train step from ``global_state.cfg`` unless one was installed.
Run in tests: 0.6.2 and 0.3.1 (PyPI). Read, not run: v0.2.0 (7af9601), v0.4.0 (0fbfe7d), v0.5.0 (fcbb603),
v0.6.0 (51885cf) and main 067f987 (2026-08-22).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_flops.adapters._hooks import PRINTER, Adapter, wrap_train_step, wrap_training_log
from megatron_flops.adapters._observe import BatchReader
from megatron_flops.adapters._setup import (
    check_options,
    import_target,
    is_corrected,
    new_session,
    patch,
)
from megatron_flops.flops.passes import RecomputeSpec
from megatron_flops.reporting.session import Session
from megatron_flops.model.spec import ModelSpec
from megatron_flops.flops.vision import VisionSpec

logger = logging.getLogger("megatron_flops")

MODULE = "megatron.bridge.training.train"
VLM_STEP_MODULE = "megatron.bridge.training.vlm_step"
QWEN3_VL_STEP_MODULE = "megatron.bridge.models.qwen_vl.qwen3_vl_step"
_WRAPPERS = {"train_step": wrap_train_step, "training_log": wrap_training_log}


class _MegatronBridge(Adapter):
    name = "Megatron-Bridge"

    def __init__(self) -> None:
        self.configure(None, peak_tflops=None, attention=None, trace=None)

    def configure(self, cfg: Any, *, peak_tflops: float | None, attention: str | None, trace: Any) -> None:
        self.cfg = cfg
        self.peak_tflops = peak_tflops
        self.attention = attention
        self.trace = trace
        self.failed = False
        self._flops_before_step: float | None = None
        self._vlm_reader: VlmStepReader | Qwen3VLStepReader | None = None

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
            framework="megatron-bridge",
            recompute=RecomputeSpec.from_mapping(vars(model), source="Megatron-Bridge model config"),
            vision=_vision_spec(model),
            trace=self.trace if self.trace is not None else getattr(options, "flops_trace", None),
        )

    def reader(self, bound: inspect.BoundArguments, forward_step_func: Callable[..., Any]) -> Callable[[Any], dict]:
        """Batches as the forward step reshapes them: ``qwen3_vl_step`` (``Qwen3VLStepReader``),
        ``vlm_step`` of 0.3.1 to 0.5.x (``VlmStepReader``); else (``gpt_step``, 0.6's ``vlm_step``,
        which runs the rows as the collate function delivers them) the batch as it is."""
        module = _step_module(forward_step_func)
        make: type[VlmStepReader] | type[Qwen3VLStepReader]
        if module == QWEN3_VL_STEP_MODULE:
            make = Qwen3VLStepReader
        elif module == VLM_STEP_MODULE and _reshapes_rows(module):
            make = VlmStepReader
        else:
            return super().reader(bound, forward_step_func)
        cfg = bound.arguments["global_state"].cfg
        reader = self._vlm_reader
        if not isinstance(reader, make) or reader.cfg is not cfg:
            reader = self._vlm_reader = make(cfg)
        return reader

    def on_step_begin(self, bound: inspect.BoundArguments, session: Session) -> None:
        self._flops_before_step = _flops_so_far(bound)

    def on_log(self, bound: inspect.BoundArguments, session: Session) -> None:
        before, self._flops_before_step = self._flops_before_step, None
        if before is not None:
            session.set_framework_flops(_flops_so_far(bound) - before)

    def log_iteration(self, bound: inspect.BoundArguments) -> int:
        return bound.arguments["global_state"].train_state.step

    def writers(self, bound: inspect.BoundArguments, namespace: Any) -> tuple[Any, Any]:
        state = bound.arguments["global_state"]
        return state.tensorboard_logger, state.wandb_logger


class VlmStepReader(BatchReader):
    """Batches as ``megatron.bridge.training.vlm_step.forward_step`` (0.3.1 to 0.5.x) reshapes them
    for the model, which the data iterator's batch does not show.

    Without in-batch packing, rows are padded or cut to ``seq_length`` under pipeline
    parallelism, else padded to the next multiple of 128 (at most ``seq_length``); each counts as
    one sequence of that length. With ``cfg.dataset.pack_sequences_in_batch``, a row's real length
    runs to its last non-zero token id (vlm_step's padding rule), rows with none are dropped,
    each is padded to a multiple of ``2 x CP`` under context parallelism, and the model runs
    them as one packed row. The dataset's own ``cu_seqlens`` are ignored, as vlm_step does.
    """

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        model = cfg.model
        self.seq_length = model.seq_length
        self.pipelined = (getattr(model, "pipeline_model_parallel_size", 1) or 1) > 1
        self.packing = bool(getattr(getattr(cfg, "dataset", None), "pack_sequences_in_batch", False))
        cp = getattr(model, "context_parallel_size", 1) or 1
        self.multiple = 2 * cp if cp > 1 else 1

    def __call__(self, batch: Any) -> dict[str, Any]:
        tokens = self.tokens(batch)
        fields: dict[str, Any] = self.packed(tokens) if self.packing else {
            "num_rows": tokens.shape[0], "row_length": self.row_length(tokens.shape[1])}
        grids = self.grids(batch)
        if grids:
            fields["grid_thw"] = grids
        return fields

    def row_length(self, length: int) -> int:
        """The length vlm_step pads or cuts an unpacked row of ``length`` to."""
        cap = self.seq_length
        target = cap if self.pipelined else min(cap, -(-length // 128) * 128)
        return target if length < target else min(length, cap)

    def packed(self, tokens: torch.Tensor) -> dict[str, Any]:
        """The packed row vlm_step builds (host tensor operations: vlm_step itself reads each row)."""
        positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)
        ends = ((tokens != 0) * positions).amax(dim=1).cpu()
        real = ends[ends > 0]
        padded = -(-real // self.multiple) * self.multiple
        if real.numel() == 0:
            return {"num_rows": 0, "row_length": 0}
        zero = torch.zeros(1, dtype=real.dtype)
        cu_padded = torch.cat((zero, padded.cumsum(0)))
        return {"num_rows": 1, "row_length": int(cu_padded[-1]), "cu_seqlens": torch.cat((zero, real.cumsum(0))),
                "cu_seqlens_padded": cu_padded}


class Qwen3VLStepReader(BatchReader):
    """Batches as ``megatron.bridge.models.qwen_vl.qwen3_vl_step.forward_step`` (0.6) runs them:
    each row padded to a multiple of ``lcm(d, 16)`` (``d`` = TP, or 2 x TP x CP under context
    parallelism), or padded or cut to ``seq_length`` under pipeline or expert parallelism; every
    row is one sequence of that length (its packed offsets are whole rows; the collate-time
    packing keys are refused by qwen3_vl_step itself)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        model = cfg.model
        self.seq_length = model.seq_length
        self.fixed = any((getattr(model, name, 1) or 1) > 1
                         for name in ("pipeline_model_parallel_size", "expert_model_parallel_size"))
        tp = getattr(model, "tensor_model_parallel_size", 1) or 1
        cp = getattr(model, "context_parallel_size", 1) or 1
        self.multiple = math.lcm(2 * tp * cp if cp > 1 else tp, 16)

    def __call__(self, batch: Any) -> dict[str, Any]:
        rows, length = self.tokens(batch).shape
        target = self.seq_length if self.fixed else -(-length // self.multiple) * self.multiple
        fields: dict[str, Any] = {"num_rows": rows, "row_length": target}
        grids = self.grids(batch)
        if grids:
            fields["grid_thw"] = grids
        return fields


def _step_module(forward_step_func: Any) -> str | None:
    """The module of the forward step (through partials)."""
    while isinstance(forward_step_func, functools.partial):
        forward_step_func = forward_step_func.func
    return getattr(forward_step_func, "__module__", None)


def _reshapes_rows(module_name: str) -> bool:
    """Whether this release's ``vlm_step`` pads rows (to 128 or ``seq_length``) and packs them
    itself (0.3.1 to 0.5.x: it defines ``pack_batch_sequences``); from 0.6 it runs the rows as
    delivered, packed at collate time (``cu_seqlens_q*`` keys)."""
    module = sys.modules.get(module_name)
    return module is None or callable(getattr(module, "pack_batch_sequences", None))


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


def install(cfg: Any = None, *, peak_tflops: float | None = None, attention: str | None = None,
            trace: str | os.PathLike[str] | None = None) -> bool:
    """Patch ``megatron.bridge.training.train``; returns whether the hooks are in place.

    ``cfg``: the ``ConfigContainer`` (default: ``global_state.cfg`` at the first train step);
    its ``logger.flops_peak_tflops``/``logger.flops_attention``/``logger.flops_trace`` apply
    unless given here. A second call updates the options without wrapping again. A missing
    symbol (a renamed upstream function) logs one warning and returns False, patching nothing.
    """
    check_options(peak_tflops=peak_tflops, attention=attention, trace=trace)
    module = import_target(MODULE, _ADAPTER.name)
    if module is None:
        return False
    missing = [name for name in _WRAPPERS if not callable(getattr(module, name, None))]
    missing += [f"{name}(global_state)" for name in _WRAPPERS if name not in missing
                and "global_state" not in inspect.signature(getattr(module, name)).parameters]
    if "training_log" not in missing and PRINTER not in inspect.unwrap(module.training_log).__globals__:
        missing.append(f"training_log's {PRINTER}")
    if not missing:
        _ADAPTER.configure(cfg, peak_tflops=peak_tflops, attention=attention, trace=trace)
    return patch(module, _WRAPPERS, _ADAPTER, missing=missing, distribution="megatron-bridge")


def maybe_install_from_config(cfg: Any) -> bool:
    """``install(cfg)`` when ``cfg.logger.flops_accounting == "corrected"``; False (nothing
    patched) when it is ``"static"`` or absent."""
    mode = getattr(getattr(cfg, "logger", None), "flops_accounting", None)
    return is_corrected(mode, "cfg.logger.flops_accounting") and install(cfg)
