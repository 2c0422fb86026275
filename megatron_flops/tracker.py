"""Per-micro-batch sequence statistics, and the one per-step reduction (torch).

``record()`` runs in ``forward_step`` (``observe()`` where an adapter sees the data iterator hand a
batch over): no host sync, no data-dependent shape, no collective. What the tensor shapes tell
(rows, padded tokens, full-length rows) is counted on the host. Host (CPU) tensors are kept by
reference and priced at ``end_step()`` in one vectorised pass (``host_stats``): no tensor
operation per micro-batch. Device tensors are added into one preallocated int64 accumulator.
``end_step()`` runs on every rank after the forward-backward function: one ``all_reduce`` of a
fixed-shape int64 vector (``reduction``), then
the FLOPs.

Ownership (``ownership``): a micro-batch is recorded by the first pipeline stage's first virtual
chunk (``model.pre_process``) on tensor- and context-parallel rank 0, so it is counted once per
model replica whatever the TP/PP/VPP/CP sizes; every other call is a no-op. The all-reduce sums
the replicas, so every rank, the last pipeline stage included, gets the global totals.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_flops.formulas import ATTENTION_CONVENTIONS, SeqStats, training_flops
from megatron_flops.host_stats import HostBatches
from megatron_flops.ownership import chunk_ownership
from megatron_flops.passes import MODEL_FLOPS_CONVENTIONS, PeftSpec, RecomputeSpec, price
from megatron_flops.reduction import Reduction, StepReducer
from megatron_flops.result import StepResult
from megatron_flops.spec import ModelSpec
from megatron_flops.vision import VisionSpec, parse_grids, vision_training_flops
from megatron_flops.vision_torch import VISION_SLOTS, vision_stats_from_vector, vision_stats_tensor

if TYPE_CHECKING:
    from megatron_flops.dit_tracker import DiTFlopsTracker

logger = logging.getLogger("megatron_flops")

# Slots of the accumulator and of the reduced vector, in order. Adjacent pairs are written by
# one add: (sum s, sum s^2) for real and padded lengths, and (sum x, sum x^2) of the window
# excess x = max(s - window, 0), from which the band pairs follow (see _window_pairs).
SLOTS = (
    "num_microbatches",
    "num_rows",
    "num_sequences",
    "num_padded_tokens",
    "num_tokens",
    "sum_seqlen_squared",
    "sum_padded_seqlens",  # scratch: the device sum of padded lengths (tokens come from shapes)
    "sum_padded_seqlen_squared",
    "window_excess",
    "window_excess_squared",
    "padded_window_excess",
    "padded_window_excess_squared",
)
# The slots known from tensor shapes alone (host counts): they still travel when a rank fails, so
# the static number stays known.
SHAPE_SLOTS = ("num_microbatches", "num_rows", "num_sequences", "num_padded_tokens")
_I = {name: i for i, name in enumerate(SLOTS)}
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _window_pairs(sum_sq: int, excess: int, excess_sq: int) -> int:
    # band_pairs(s, w) = s^2 - x(x - 1) with x = max(s - w, 0): summed, sum s^2 - sum x^2 + sum x.
    return sum_sq - excess_sq + excess


class FlopsTracker:
    """Accumulates the real sequence statistics of every micro-batch and prices each step.

    Args:
        spec: the decoder model.
        attention: ``"causal"`` (Megatron-compatible) or ``"full"``; see ``formulas``.
        seq_length: the static sequence length the stock formula assumes (for the static
            number and the fallback); when None, the mean padded row length of the step.
        context_parallel_size: CP size when the model does not carry ``pg_collection.cp``.
            Unpacked rows hold ``1/cp`` of each sequence; packed ``cu_seqlens`` are global.
        validate: check every input (this syncs the host with the device: for debugging).
        group: the process group of the per-step all-reduce (default: the world).
        vision: the vision tower of a VLM; ``record(grid_thw=...)`` then prices it (executed
            FLOPs, full attention within each frame or window) into the same step.
        peft, recompute, convention: frozen weights / LoRA, activation recompute, and the
            model-FLOPs convention under PEFT (see ``passes``): they change executed FLOPs (HFU)
            and, for PEFT, model FLOPs (MFU).
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        attention: str = "causal",
        seq_length: int | None = None,
        context_parallel_size: int | None = None,
        validate: bool = False,
        group: Any = None,
        vision: VisionSpec | None = None,
        peft: PeftSpec | None = None,
        recompute: RecomputeSpec | None = None,
        convention: str = "needed",
    ) -> None:
        if attention not in ATTENTION_CONVENTIONS:
            raise ValueError(f"attention must be one of {ATTENTION_CONVENTIONS}, got {attention!r}")
        if seq_length is not None and seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if context_parallel_size is not None and context_parallel_size <= 0:
            raise ValueError(f"context_parallel_size must be positive, got {context_parallel_size}")
        if convention not in MODEL_FLOPS_CONVENTIONS:
            raise ValueError(f"convention must be one of {MODEL_FLOPS_CONVENTIONS}, got {convention!r}")
        # Price an empty step once now: an impossible PEFT/recompute setup fails at set-up.
        price(spec, SeqStats(), attention=attention, peft=peft, recompute=recompute, convention=convention)
        self.spec = spec
        self.peft = peft
        self.recompute = recompute
        self.convention = convention
        self.attention = attention
        self.seq_length = seq_length
        self.context_parallel_size = context_parallel_size
        self.validate = validate
        self.group = group
        self._window = spec.window_size
        self.vision = vision
        # The vector's layout is fixed per tracker (identical on every rank: same spec).
        self._slots = SLOTS + (tuple(f"vision/{name}" for name in VISION_SLOTS) if vision else ())
        self._acc: torch.Tensor | None = None
        self._exps = torch.tensor([1, 2], dtype=torch.int64)  # moved to the data's device on first use
        self._host = [0] * len(self._slots)
        self._failed = False
        self._reducer = StepReducer(self._slots, shape_slots=SHAPE_SLOTS, group=group)
        self._num_steps = 0
        self._last_static: int | None = None  # the static number of the latest step that had one
        self._index = {name: i for i, name in enumerate(self._slots)}
        # This step's host micro-batches, recorded and observed (see observe()).
        self._explicit = HostBatches(window=self._window, vision=vision)
        self._observed = HostBatches(window=self._window, vision=vision)
        self._num_explicit = 0
        self._owners: dict[int, tuple[bool, int]] = {}
        self._warned: set[str] = set()

    # ---- per micro-batch ------------------------------------------------------------------

    def record(
        self,
        *,
        model: Any = None,
        tokens: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_padded: torch.Tensor | None = None,
        cu_seqlens_argmin: torch.Tensor | int | None = None,
        cu_seqlens_padded_argmin: torch.Tensor | int | None = None,
        seq_lengths: torch.Tensor | None = None,
        grid_thw: torch.Tensor | Sequence[torch.Tensor] | None = None,
        num_real_tokens: int | None = None,
        vp_stage: int | None = None,
        owner: bool | None = None,
        cp_sliced: bool = True,
    ) -> None:
        """Add one micro-batch. Call it once per ``forward_step`` call, on every rank.

        ``tokens``: ``[b, s]`` input ids (``[1, T]`` for a packed row); with ``cp_sliced`` (the
        default) this context-parallel rank's slice, as ``forward_step`` holds it after
        ``get_batch``; ``cp_sliced=False`` for whole rows, as the data iterator yields them.
        ``packed_seq_params`` (megatron-core ``PackedSeqParams``) or ``cu_seqlens`` (real) and
        ``cu_seqlens_padded`` describe packed sub-sequences; a ``*_argmin`` marks where a
        sentinel-padded ``cu_seqlens`` ends (Megatron-Bridge); ``num_real_tokens``: the packed
        row's real tokens (offsets past it are padding). ``seq_lengths``: ``[b]`` real lengths of
        dynamically padded rows. ``grid_thw``: ``[n, 3]`` image/video grids of the micro-batch,
        or several such tensors (VLMs; needs ``vision``). ``owner`` overrides the ownership rule
        (see the module docstring).

        Host (CPU) tensors cost no tensor operation here: they are priced together at
        ``end_step()``. Device tensors are added into the device accumulator without a sync.
        """
        self._num_explicit += 1
        try:
            is_owner, cp = self._ownership(model, vp_stage, owner)
            if not is_owner:
                return
            if tokens is None:
                raise ValueError("record() needs tokens on the first pipeline stage")
            if tokens.dim() != 2:
                raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
            if packed_seq_params is not None:
                cu_seqlens = packed_seq_params.cu_seqlens_q if cu_seqlens is None else cu_seqlens
                if cu_seqlens_padded is None:
                    cu_seqlens_padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
            self._add(self._explicit, tokens.shape[0], tokens.shape[1] * (cp if cp_sliced else 1),
                      cu_seqlens, cu_seqlens_argmin, cu_seqlens_padded, cu_seqlens_padded_argmin,
                      num_real_tokens, seq_lengths, grid_thw, defer_device=False)
        except Exception as exc:
            if self.validate:
                raise
            self._explicit.failed = True
            self._warn_once("record() failed; every rank reports the static FLOPs for this step", exc)

    def observe(
        self,
        *,
        num_rows: int,
        row_length: int,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_argmin: torch.Tensor | int | None = None,
        cu_seqlens_padded: torch.Tensor | None = None,
        cu_seqlens_padded_argmin: torch.Tensor | int | None = None,
        num_real_tokens: int | None = None,
        seq_lengths: torch.Tensor | None = None,
        grid_thw: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Add one micro-batch as a data iterator handed it over: ``num_rows`` whole rows of
        ``row_length`` token slots (before any context-parallel slicing), the other arguments as
        in ``record()``. Call it only where ``owns(model)`` holds (the adapters do).

        Observed micro-batches are kept apart: a step with any ``record()`` call prices its
        recorded micro-batches only, so that a ``forward_step`` that records explicitly is not
        counted twice. Never raises (unless ``validate``); a failure makes the step fall back.
        """
        try:
            self._add(self._observed, num_rows, row_length, cu_seqlens, cu_seqlens_argmin, cu_seqlens_padded,
                      cu_seqlens_padded_argmin, num_real_tokens, seq_lengths, grid_thw, defer_device=True)
        except Exception as exc:
            if self.validate:
                raise
            self._observed.failed = True
            self._warn_once("observing a micro-batch failed; every rank reports the static FLOPs for this step", exc)

    def observe_failed(self, exc: BaseException) -> None:
        """A micro-batch could not be observed (a batch in an unknown layout): unless the step
        records explicitly, it falls back on every rank; logged once."""
        self._observed.failed = True
        self._warn_once("a training batch is in a layout megatron-flops does not know; every rank reports the "
                        "static FLOPs for such steps", exc)

    def owns(self, model: Any) -> bool:
        """Whether ``model`` (a model chunk) counts the micro-batches it is given."""
        return self._ownership(model, None, None)[0]

    def discard_step(self) -> None:
        """Drop everything recorded or observed since the last ``end_step()``, without a
        collective (for a step that raised: its micro-batches are not counted anywhere)."""
        self._clear_pending()
        self._failed = False
        self._reset()

    def _ownership(self, model: Any, vp_stage: int | None, owner: bool | None) -> tuple[bool, int]:
        """(whether this call records, the context-parallel size), cached per model chunk."""
        if owner is not None or model is None:
            is_owner = owner if owner is not None else vp_stage in (None, 0)
            return is_owner, self.context_parallel_size or 1
        cached = self._owners.get(id(model))
        if cached is None:
            is_owner, cp_size = chunk_ownership(model, vp_stage)
            cached = (is_owner, self.context_parallel_size or cp_size)
            self._owners[id(model)] = cached
        return cached

    def _add(self, step: HostBatches, rows: int, row_len: int, cu, argmin, cu_pad, pad_argmin, limit,
             seq_lengths, grids, *, defer_device: bool) -> None:
        """One micro-batch into ``step`` (host tensors and shape counters) and, for device
        tensors, the device accumulator (or ``step.device_batches`` with ``defer_device``)."""
        if grids is not None and not isinstance(grids, (list, tuple)):
            grids = (grids,)
        if defer_device and not (_on_host_or_none(cu) and _on_host_or_none(cu_pad) and _on_host_or_none(seq_lengths)
                                 and all(_on_host(g) for g in grids or ())):
            step.device_batches.append(dict(rows=rows, row_len=row_len, cu=cu, argmin=argmin, cu_pad=cu_pad,
                                            pad_argmin=pad_argmin, limit=limit, seq_lengths=seq_lengths,
                                            grids=grids))
            return
        counters = step.counters
        counters["num_microbatches"] += 1
        counters["num_rows"] += rows
        counters["num_padded_tokens"] += rows * row_len
        if grids:
            self._add_grids(step, grids)
        if cu is not None:
            self._add_packed(step, rows * row_len, cu, argmin, cu_pad, pad_argmin, limit)
            return
        counters["num_sequences"] += rows
        if seq_lengths is None:
            # Full-length unpacked rows: everything is known from the shape.
            step.add_full_rows(rows, row_len, real=True)
            return
        if seq_lengths.numel() != rows:
            raise ValueError(f"seq_lengths must hold one length per row ({rows}), got shape {tuple(seq_lengths.shape)}")
        self._check_lengths(seq_lengths, "seq_lengths", row_len)
        # NB: a dynamically padded row attends over its padded length.
        step.add_full_rows(rows, row_len, real=False)
        if _on_host(seq_lengths):
            step.lengths.append(seq_lengths)
        else:
            self._accumulator(seq_lengths.device)
            self._device_lengths(seq_lengths.reshape(-1), self._real, self._window_real)

    def _add_packed(self, step: HostBatches, num_slots: int, cu, argmin, cu_pad, pad_argmin, limit) -> None:
        """A packed row: lengths are the differences of cu_seqlens (global under CP)."""
        argmin = self._check_offsets(cu, argmin, "cu_seqlens", num_slots)
        if cu_pad is not None:
            pad_argmin = self._check_offsets(cu_pad, argmin if pad_argmin is None else pad_argmin,
                                             "cu_seqlens_padded", num_slots)
        if limit is not None:
            limit = _host_int(limit, "num_real_tokens")
        host, pad_host = _on_host(cu), cu_pad is None or _on_host(cu_pad)
        if host:
            step.offsets.append((cu, argmin, limit, True, cu_pad is None and limit is None))
            if cu_pad is None and limit is not None:
                step.offsets.append((cu, argmin, None, False, True))
        if cu_pad is not None and pad_host:
            step.offsets.append((cu_pad, pad_argmin, None, False, True))
        if not (host and pad_host):
            self._device_offsets(step, cu, argmin, cu_pad, pad_argmin, limit)

    def _device_offsets(self, step: HostBatches, cu, argmin, cu_pad, pad_argmin, limit) -> None:
        """The device path of a packed row: trim (host argmins), diff, (s, s^2) sums."""
        if limit is not None:
            raise ValueError("num_real_tokens needs host (CPU) cu_seqlens")
        on_device = not _on_host(cu)
        pad_on_device = cu_pad is not None and not _on_host(cu_pad)
        cu = self._trim(cu, argmin, "cu_seqlens")
        if on_device:
            step.counters["num_sequences"] += cu.shape[0] - 1
        self._accumulator(cu.device if on_device else cu_pad.device)
        if cu_pad is None:
            # No sub-sequence padding: the real lengths count for both (broadcast into [2, 2]).
            self._device_lengths(torch.diff(cu), self._both, self._window_both)
            return
        cu_pad = self._trim(cu_pad, pad_argmin, "cu_seqlens_padded")
        if on_device and pad_on_device and cu.shape == cu_pad.shape:
            self._device_lengths(torch.diff(torch.stack((cu, cu_pad))), self._both, self._window_both)
            return
        if on_device:
            self._device_lengths(torch.diff(cu), self._real, self._window_real)
        if pad_on_device:
            self._device_lengths(torch.diff(cu_pad), self._padded, self._window_padded)

    def _add_grids(self, step: HostBatches, grids: list[torch.Tensor]) -> None:
        if self.vision is None:
            message = "grid_thw needs FlopsTracker(..., vision=VisionSpec)"
            if self.validate:
                raise ValueError(message)
            # NB: the decoder stays exact; only the vision tower is left out, and said so once.
            self._warn_once("vision tower not counted", ValueError(message))
            return
        for grid in grids:
            if not isinstance(grid, torch.Tensor) or grid.dtype not in _INT_DTYPES or grid.shape[-1:] != (3,):
                raise ValueError(f"grid_thw must be an integer tensor of [t, h, w] rows, got {grid!r:.80}")
            if self.validate:
                parse_grids(grid.reshape(-1, 3).tolist(), spatial_merge_size=self.vision.spatial_merge_size)
            if _on_host(grid):
                step.grids.append(grid)
            else:
                self._accumulator(grid.device)
                self._vision_acc.add_(vision_stats_tensor(self.vision, grid.reshape(-1, 3)))

    def _check_offsets(self, cu: Any, argmin: Any, name: str, num_tokens: int) -> Any:
        """Host checks of a cu_seqlens (its dtype and shape; its values only when validating);
        returns its argmin: None, an int, or a one-element CPU tensor (read at ``end_step``)."""
        if not isinstance(cu, torch.Tensor) or cu.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be a tensor of integers, got {getattr(cu, 'dtype', type(cu).__name__)}")
        shape = cu.shape
        if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
            raise ValueError(f"{name} must be one-dimensional ([n], or [1, n]: one packed row), "
                             f"got shape {tuple(shape)}")
        if shape[-1] < 2:
            raise ValueError(f"{name} needs at least two entries, got shape {tuple(shape)}")
        if isinstance(argmin, torch.Tensor):
            if argmin.numel() != 1 or argmin.device.type != "cpu":
                argmin = _host_int(argmin, f"{name} argmin")  # raises: not a host value of one element
        elif argmin is not None:
            argmin = _host_int(argmin, f"{name} argmin")
        if self.validate:
            self._check_cu(self._trim(cu, argmin, name), name, num_tokens)
        return argmin

    def _trim(self, cu: torch.Tensor, argmin: torch.Tensor | int | None, name: str) -> torch.Tensor:
        cu = cu.reshape(-1)
        if argmin is None:
            return cu
        argmin = _host_int(argmin, f"{name} argmin")
        if argmin < 2:
            raise ValueError(f"{name} needs at least two entries before its end marker, got {argmin}")
        return cu[:argmin]

    def _check_cu(self, cu: torch.Tensor, name: str, num_tokens: int) -> None:
        """Validation mode only (it syncs the host with the device)."""
        values = cu.tolist()
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]}")
        if any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if values[-1] > num_tokens:
            raise ValueError(f"{name} ends at {values[-1]} but the micro-batch holds {num_tokens} tokens")

    def _check_lengths(self, lengths: torch.Tensor, name: str, row_len: int) -> None:
        if lengths.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must hold integers, got {lengths.dtype}")
        if self.validate:
            values = lengths.tolist()
            if any(v < 0 or v > row_len for v in values):
                raise ValueError(f"{name} must lie in [0, {row_len}], got {values}")

    def _device_lengths(self, lengths: torch.Tensor, target: torch.Tensor, window_target: torch.Tensor) -> None:
        """Add ``(sum s, sum s^2)`` of ``[n]`` or ``[k, n]`` lengths into the ``[2]``/``[k, 2]`` view
        ``target`` (and the window excess into ``window_target``)."""
        # [..., n, 1] ** [2] -> [..., n, 2] (int64), summed over n: (sum s, sum s^2).
        target.add_(torch.pow(lengths.unsqueeze(-1), self._exps).sum(-2))
        if self._window is not None:
            excess = (lengths - self._window).clamp_(min=0)
            window_target.add_(torch.pow(excess.unsqueeze(-1), self._exps).sum(-2))

    def _accumulator(self, device: torch.device) -> torch.Tensor:
        if self._acc is None:
            self._acc = torch.zeros(len(self._slots), dtype=torch.int64, device=device)
            self._exps = self._exps.to(device)
            # Views made once: [real, padded] x (sum s, sum s^2), and the same for the window excess.
            i, j = _I["num_tokens"], _I["window_excess"]
            self._both = self._acc[i : i + 4].view(2, 2)
            self._window_both = self._acc[j : j + 4].view(2, 2)
            self._real, self._padded = self._both[0], self._both[1]
            self._vision_acc = self._acc[len(SLOTS) :]
            self._window_real, self._window_padded = self._window_both[0], self._window_both[1]
        return self._acc

    def _settle(self) -> None:
        """Fold this step's host micro-batches into the host slots: the recorded ones if
        ``record()`` was called this step, else the observed ones. Never raises; on a failure
        the shape counts still arrive (the static number stays known) and the step falls back."""
        step = self._explicit if self._num_explicit else self._observed
        failed = step.failed
        try:
            for batch in step.device_batches:
                self._add(step, **batch, defer_device=False)
            totals = step.settle()
        except Exception as exc:
            failed = True
            totals = {name: step.counters[name] for name in SHAPE_SLOTS}
            self._warn_once("pricing the step's host micro-batches failed; every rank reports the static FLOPs "
                            "for this step", exc)
        for name, value in totals.items():
            self._host[self._index[name]] += value
        self._clear_pending()
        if failed:
            self._failed = True

    def _clear_pending(self) -> None:
        self._explicit = HostBatches(window=self._window, vision=self.vision)
        self._observed = HostBatches(window=self._window, vision=self.vision)
        self._num_explicit = 0

    # ---- per step ----------------------------------------------------------------------------

    def end_step(self, *, step: int | None = None) -> StepResult:
        """Reduce this step's statistics over all ranks and price them. Every rank must call it
        once per step: it runs the step's one all-reduce whatever failed on this rank.

        ``step``: the training iteration (the same on every rank, one more each step); with it the
        reduction detects a rank that skipped or repeated ``end_step()`` (every rank then falls
        back and the ranks resynchronise). Default: the number of ``end_step()`` calls, which
        cannot show such a rank. When the step cannot be priced exactly, every rank returns the
        static number with ``ok=False`` and logs the reason once.
        """
        self._settle()
        self._num_steps += 1
        failed, self._failed = self._failed, False
        reduction = self._reducer.reduce(self._acc, self._host, step=self._num_steps if step is None else step,
                                         failed=failed, token_slots=self._host[_I["num_padded_tokens"]])
        self._reset()
        if reduction.local_error is not None:
            self._warn_once("this rank could not build its statistics vector", reduction.local_error)
        return self._price(reduction, failed_here=failed)

    def _reset(self) -> None:
        self._host = [0] * len(self._slots)
        if self._acc is not None:
            try:
                self._acc.zero_()
            except Exception as exc:  # a fresh accumulator on the next record()
                self._acc = None
                self._warn_once("the accumulator could not be reset", exc)

    def _price(self, reduction: Reduction, *, failed_here: bool) -> StepResult:
        shapes, totals, problem = reduction.shapes, reduction.totals, reduction.problem
        static = None if shapes is None else self._static(shapes)
        if totals is not None:
            problem = _inconsistency(totals)
            if problem is None:
                try:
                    return self._exact(totals, static)
                except Exception as exc:  # the same totals on every rank: every rank falls back
                    problem = f"pricing failed ({type(exc).__name__}: {exc})"
        if not failed_here:  # a rank that failed to record has said why already
            self._warn_once("the step fell back to the static number", problem or "no totals")
        if not static:  # the step's shapes did not arrive or hold no row: the latest known
            static = self._last_static
        if static is None:
            self._warn_once("no static number is known for a failed step", "it reports 0 FLOPs with ok=False")
        return self._fallback(shapes, static, problem)

    def _static(self, shapes: Mapping[str, int]) -> int:
        """The stock number: every row one ``seq_length`` (or mean padded row length) sequence."""
        rows = shapes["num_rows"]
        static_len = self.seq_length or -(-shapes["num_padded_tokens"] // max(rows, 1))
        stats = SeqStats.full_length(rows, static_len, window=self._window) if static_len else SeqStats()
        static = training_flops(self.spec, stats, attention=self.attention).total
        if static:
            self._last_static = static
        return static

    def _fallback(self, shapes: Mapping[str, int] | None, static: int | None, problem: str | None) -> StepResult:
        shapes = shapes or dict.fromkeys(SHAPE_SLOTS, 0)
        return StepResult(
            flops=static or 0, executed_flops=static or 0, num_tokens=shapes["num_padded_tokens"],
            num_padded_tokens=shapes["num_padded_tokens"], num_sequences=shapes["num_sequences"],
            sum_seqlen_squared=0, num_microbatches=shapes["num_microbatches"], static_flops=static, ok=False,
            fallback_reason=problem,
        )

    def _exact(self, t: Mapping[str, int], static: int | None) -> StepResult:
        stats = SeqStats(
            num_rows=t["num_rows"],
            num_sequences=t["num_sequences"],
            num_tokens=t["num_tokens"],
            num_padded_tokens=t["num_padded_tokens"],
            sum_seqlen_squared=t["sum_seqlen_squared"],
            sum_padded_seqlen_squared=t["sum_padded_seqlen_squared"],
            window_pairs=_window_pairs(t["sum_seqlen_squared"], t["window_excess"], t["window_excess_squared"]),
            padded_window_pairs=_window_pairs(t["sum_padded_seqlen_squared"], t["padded_window_excess"],
                                              t["padded_window_excess_squared"]),
        )
        priced = price(self.spec, stats, attention=self.attention, peft=self.peft, recompute=self.recompute,
                       convention=self.convention)
        model, executed = priced.model, priced.executed
        components = dict(model.components)
        vision_flops = 0
        if self.vision is not None:
            vision_stats = vision_stats_from_vector([t[f"vision/{name}"] for name in VISION_SLOTS])
            # NB: the vision tower is priced as executed (full attention within each frame or
            # window, no padding): the same number in model and executed FLOPs.
            vision = vision_training_flops(self.vision, vision_stats)
            components.update(vision.components)
            vision_flops = vision.total
        return StepResult(
            flops=model.total + vision_flops,
            executed_flops=executed.total + vision_flops,
            num_tokens=stats.num_tokens,
            num_padded_tokens=stats.num_padded_tokens,
            num_sequences=stats.num_sequences,
            sum_seqlen_squared=stats.sum_seqlen_squared,
            num_microbatches=t["num_microbatches"],
            components=components,
            static_flops=static,
        )

    @classmethod
    def from_model_file(cls, path: str | Path, **options: Any) -> FlopsTracker | DiTFlopsTracker:
        """A tracker for any model file ``megatron-flops estimate`` takes: a decoder (a VLM with a
        ``vision_config``; ``lora`` and ``recompute_*`` set up PEFT and recompute), or a DiT (a
        ``"dit"`` section: a :class:`~megatron_flops.dit_tracker.DiTFlopsTracker`). ``options``
        are the tracker's keyword arguments; they override the file."""
        from megatron_flops.model_file import tracker_from_model_file

        return tracker_from_model_file(path, **options)

    def _warn_once(self, what: str, why: BaseException | str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            if isinstance(why, BaseException):
                why = f"{type(why).__name__}: {why}"
            logger.warning("megatron-flops: %s (%s) (logged once)", what, why)


def _inconsistency(t: Mapping[str, int]) -> str | None:
    """Why reduced totals cannot come from valid lengths (malformed values are counted as given,
    since seeing them would sync), or None."""
    if not t["num_tokens"] <= t["num_padded_tokens"]:
        return f"{t['num_tokens']} real tokens > {t['num_padded_tokens']} token slots"
    if t["sum_seqlen_squared"] < t["num_tokens"]:  # s^2 >= s for every integer s
        return f"sum of squared lengths {t['sum_seqlen_squared']} < {t['num_tokens']} tokens"
    if t["num_tokens"] ** 2 > t["num_sequences"] * t["sum_seqlen_squared"]:  # Cauchy-Schwarz
        return (f"{t['num_tokens']} tokens in {t['num_sequences']} sequences cannot have a sum of squared "
                f"lengths of {t['sum_seqlen_squared']}")
    return None


# Where a tensor counts as on the host (priced at end_step by HostBatches). Tests empty it to run
# the device path on CPU tensors.
HOST_DEVICE_TYPES = frozenset({"cpu"})


def _on_host(value: Any) -> bool:
    """Whether ``value`` is a host tensor (anything else takes the checked device path)."""
    return isinstance(value, torch.Tensor) and value.is_cpu and "cpu" in HOST_DEVICE_TYPES


def _on_host_or_none(value: Any) -> bool:
    return value is None or _on_host(value)


def _host_int(value: Any, name: str) -> int:
    """An int, or the one value of a host tensor or one-element list (never a device read)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            raise ValueError(f"{name} must be a host value (a CPU tensor of one element or an int) to read "
                             f"without a sync, got {tuple(value.shape)} on {value.device}")
        return int(value.reshape(()))
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value
