"""Per-micro-batch sequence statistics of a decoder (or a VLM), priced once per step (torch).

Where a micro-batch goes: ``record()`` (in ``forward_step``) or ``observe()`` (where an adapter
sees the data iterator hand a batch over) takes it on the ranks that own it (``ownership``), checks
its tensors on the host (``batch_checks``), counts what their shapes tell, keeps host (CPU)
tensors by reference for the step's one vectorised pass (``host_stats``) and adds device tensors
into the device accumulator (``device_stats``): no host sync, no data-dependent shape, no tensor
operation for host tensors, no collective. ``end_step()`` (``step_tracker``) runs on every rank
after the forward-backward function: one ``all_reduce`` of a fixed-shape int64 vector
(``reduction``), then the FLOPs (``pricing``).

Ownership: a micro-batch is recorded by the first pipeline stage's first virtual chunk
(``model.pre_process``) on tensor- and context-parallel rank 0, so it is counted once per model
replica whatever the TP/PP/VPP/CP sizes; every other call is a no-op. The all-reduce sums the
replicas, so every rank, the last pipeline stage included, gets the global totals.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_flops.tracking.device_stats import SHAPE_SLOTS, DeviceStats
from megatron_flops.flops.dit_passes import dit_setup
from megatron_flops.tracking.dit_tracker import DiTFlopsTracker
from megatron_flops.tracking.host_stats import HostBatches
from megatron_flops.tracking.intake import BatchIntake
from megatron_flops.tracking.ownership import ChunkOwners
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.tracking.pricing import DecoderPricing
from megatron_flops.model.spec import ModelSpec, load_model_file
from megatron_flops.tracking.step_tracker import StepTracker
from megatron_flops.flops.vision import VisionSpec, hf_vision_sections, vision_spec_from_model_mapping


class FlopsTracker(StepTracker):
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

    _device: DeviceStats

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
        pricing = DecoderPricing(spec=spec, attention=attention, seq_length=seq_length, vision=vision, peft=peft,
                                 recompute=recompute, convention=convention)
        if context_parallel_size is not None and context_parallel_size <= 0:
            raise ValueError(f"context_parallel_size must be positive, got {context_parallel_size}")
        super().__init__(DeviceStats(window=spec.pair_window, vision=vision), pricing, shape_slots=SHAPE_SLOTS,
                         validate=validate, group=group)
        self.spec, self.attention, self.seq_length, self.vision = spec, attention, seq_length, vision
        self.peft, self.recompute, self.convention = peft, recompute, convention
        self.context_parallel_size = context_parallel_size
        self._owners = ChunkOwners(context_parallel_size)
        self._intake = BatchIntake(self._device, vision=vision, validate=validate, warn_once=self._warn_once)
        self._index = {name: i for i, name in enumerate(self._device.slots)}
        # This step's host micro-batches, recorded and observed (None: none yet; see observe()).
        self._explicit: HostBatches | None = None
        self._observed: HostBatches | None = None

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
        step = self._explicit
        if step is None:
            step = self._explicit = self._host_batches()
        try:
            is_owner, cp = self._owners.lookup(model, vp_stage, owner)
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
            self._intake.add(step, tokens.shape[0], tokens.shape[1] * (cp if cp_sliced else 1), cu_seqlens,
                             cu_seqlens_argmin, cu_seqlens_padded, cu_seqlens_padded_argmin, num_real_tokens,
                             seq_lengths, grid_thw, defer_device=False)
        except Exception as exc:
            if self.validate:
                raise
            step.failed = True
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
        step = self._observed
        if step is None:
            step = self._observed = self._host_batches()
        try:
            self._intake.add(step, num_rows, row_length, cu_seqlens, cu_seqlens_argmin, cu_seqlens_padded,
                             cu_seqlens_padded_argmin, num_real_tokens, seq_lengths, grid_thw, defer_device=True)
        except Exception as exc:
            if self.validate:
                raise
            step.failed = True
            self._warn_once("observing a micro-batch failed; every rank reports the static FLOPs for this step", exc)

    def observe_failed(self, exc: BaseException, *,
                       what: str = "a training batch is in a layout megatron-flops does not know") -> None:
        """A micro-batch could not be observed (a batch in an unknown layout, or one the model
        received otherwise): unless the step records explicitly, it falls back on every rank;
        logged once per ``what``."""
        if self._observed is None:
            self._observed = self._host_batches()
        self._observed.failed = True
        self._warn_once(f"{what}; every rank reports the stock FLOPs for such steps", exc)

    def owns(self, model: Any) -> bool:
        """Whether ``model`` (a model chunk) counts the micro-batches it is given."""
        return self._owners.lookup(model)[0]

    def discard_step(self) -> None:
        """Drop everything recorded or observed since the last ``end_step()``, without a
        collective (for a step that raised: its micro-batches are not counted anywhere)."""
        self._explicit = self._observed = None
        super().discard_step()

    @classmethod
    def from_model_file(cls, path: str | Path, **options: Any) -> FlopsTracker | DiTFlopsTracker:
        """A tracker for any model file ``megatron-flops estimate`` takes: a decoder (a VLM with a
        ``vision_config``; ``lora`` and ``recompute_*`` set up PEFT and recompute), or a DiT (a
        ``"dit"`` section: a :class:`~megatron_flops.tracking.dit_tracker.DiTFlopsTracker`). ``options``
        are the tracker's keyword arguments; they override the file."""
        return tracker_from_model_file(path, **options)

    # ---- per step ----------------------------------------------------------------------------

    def _settle(self) -> None:
        """Fold this step's host micro-batches into the host slots: the recorded ones if
        ``record()`` was called this step, else the observed ones. Never raises; on a failure
        the shape counts still arrive (the static number stays known) and the step falls back."""
        step = self._explicit if self._explicit is not None else self._observed
        self._explicit = self._observed = None
        if step is None:
            return
        failed = step.failed
        try:
            for batch in step.device_batches:
                self._intake.add(step, **batch, defer_device=False)
            totals = step.settle()
        except Exception as exc:
            failed = True
            totals = {name: step.counters[name] for name in SHAPE_SLOTS}
            self._warn_once("pricing the step's host micro-batches failed; every rank reports the static FLOPs "
                            "for this step", exc)
        for name, value in totals.items():
            self._host[self._index[name]] += value
        if failed:
            self._failed = True

    def _host_batches(self) -> HostBatches:
        return HostBatches(window=self.spec.pair_window, vision=self.vision)

    def _token_slots(self) -> int:
        return self._host[self._index["num_padded_tokens"]]


def tracker_from_model_file(path: str | Path, **options: Any) -> FlopsTracker | DiTFlopsTracker:
    """A :class:`FlopsTracker` or, for a DiT model file, a :class:`DiTFlopsTracker`; ``options``
    are the tracker's keyword arguments and override the file's setup."""
    spec, raw = load_model_file(path)
    source = Path(path).name
    if "dit" in raw:
        _check_options(DiTFlopsTracker, options, source, "a DiT")
        setup = dit_setup(raw, source=source)
        return DiTFlopsTracker(setup.spec, **{"peft": setup.peft, "recompute": setup.recompute, **options})
    _check_options(FlopsTracker, options, source, "a decoder")
    if spec is None:
        raise ValueError(f"{source}: holds no decoder to track (a vision tower alone is priced by the CLI)")
    defaults = {
        "peft": PeftSpec.from_lora_mapping(raw["lora"], source=source) if raw.get("lora") is not None else None,
        "recompute": RecomputeSpec.from_mapping(raw, source=source),
        "vision": vision_spec_from_model_mapping(raw) if hf_vision_sections(raw) is not None else None,
    }
    return FlopsTracker(spec, **{**defaults, **options})


def _check_options(cls: type, options: dict[str, Any], source: str, what: str) -> None:
    known = [name for name in inspect.signature(cls).parameters if name != "spec"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{source} describes {what}: option(s) {', '.join(unknown)} do not apply "
                         f"(options: {', '.join(known)})")
