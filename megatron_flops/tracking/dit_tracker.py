"""Per-micro-batch clip statistics of a video DiT, priced once per step (torch).

``record(video_seqlens=..., text_seqlens=..., image_seqlens=...)`` runs once per micro-batch: no
host sync, no collective. Host lengths (ints, lists, CPU tensors) are summed on the host; device
tensors are summed on their device into one preallocated int64 accumulator, and a non-positive
device length is counted there rather than checked (a check would sync). ``end_step()`` runs on
every rank once per step: the one fixed-shape all-reduce (:class:`~megatron_flops.tracking.reduction.StepReducer`),
then :func:`~megatron_flops.flops.dit_passes.price_dit` on the totals: the DiT's FLOPs depend on the
clips only through the additive :class:`~megatron_flops.flops.dit.DiTStats`.

Ownership: every rank records the clips it trains on (data parallel, FSDP, HSDP); ranks that share
a replica's clips (tensor- or context-parallel peers) pass ``owner=False`` on all but one of them,
so each clip is counted once.

Static number: every sample priced at its micro-batch's longest clip (or ``seq_length`` video
tokens) with the full ``text_len`` (and ``image_len``) context, every weight trained, nothing
recomputed: what a fixed-shape formula reports. A step that cannot be priced exactly (a failed
record on any rank, a non-positive length, see :mod:`~megatron_flops.tracking.reduction`) reports the
static number on every rank with ``ok=False``: from the sample count with ``seq_length``, else the
latest exact step's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_flops.tracking.batch_checks import INT_DTYPES, on_host
from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec, DiTStats
from megatron_flops.flops.dit_passes import price_dit
from megatron_flops.flops.passes import MODEL_FLOPS_CONVENTIONS, PeftSpec, RecomputeSpec
from megatron_flops.tracking.result import StepResult
from megatron_flops.tracking.step_tracker import DeviceAccumulator, StepTracker

# Slots of the accumulator and of the reduced vector. The nine from num_video_tokens through
# num_bad_lengths are written by one add per device micro-batch, in this order.
SLOTS = (
    "num_microbatches",
    "num_samples",
    "num_video_tokens",
    "sum_video_seqlen_squared",
    "num_text_tokens",
    "sum_text_pairs",
    "num_image_tokens",
    "sum_image_pairs",
    "static_video_tokens",  # sum over micro-batches of samples x longest clip
    "static_video_seqlen_squared",  # ... x longest clip^2
    "num_bad_lengths",
)
# Known from host-side shapes alone: they travel even when a rank's payload fails.
SHAPE_SLOTS = ("num_microbatches", "num_samples")
_I = {name: i for i, name in enumerate(SLOTS)}
_SUMS = slice(_I["num_video_tokens"], _I["num_bad_lengths"] + 1)
_STAT_SLOTS = tuple(DiTStats.__dataclass_fields__)

Lengths = int | tuple[int, ...] | torch.Tensor


class DiTFlopsTracker(StepTracker):
    """Accumulates the clip lengths of every micro-batch of a DiT and prices each step.

    Args:
        spec: the DiT.
        peft, recompute, convention: frozen base / LoRA (:class:`~megatron_flops.flops.dit.DiTPeftSpec`),
            per-block checkpointing (:func:`~megatron_flops.flops.dit_passes.dit_recompute`) and the
            model-FLOPs convention (see :mod:`megatron_flops.flops.dit_passes`).
        seq_length: video tokens per sample of the static number (default: each micro-batch's
            longest clip).
        validate: check every input (this syncs the host with the device: for debugging).
        group: the process group of the per-step all-reduce (default: the world).
    """

    def __init__(
        self,
        spec: DiTSpec,
        *,
        peft: PeftSpec | None = None,
        recompute: RecomputeSpec | None = None,
        convention: str = "needed",
        seq_length: int | None = None,
        validate: bool = False,
        group: Any = None,
    ) -> None:
        if not isinstance(spec, DiTSpec):
            raise ValueError(f"DiTFlopsTracker needs a DiTSpec, got {type(spec).__name__}")
        self.peft = None if peft is None else DiTPeftSpec.of(peft)
        pricing = DiTPricing(spec=spec, peft=self.peft, recompute=recompute, convention=convention,
                             seq_length=seq_length)
        super().__init__(DeviceAccumulator(SLOTS), pricing, shape_slots=SHAPE_SLOTS, validate=validate, group=group)
        self.spec = spec
        self.recompute = recompute
        self.convention = convention
        self.seq_length = seq_length

    # ---- per micro-batch ------------------------------------------------------------------

    def record(
        self,
        *,
        video_seqlens: Any = None,
        text_seqlens: Any = None,
        image_seqlens: Any = None,
        num_samples: int | None = None,
        owner: bool = True,
        **decoder_args: Any,
    ) -> None:
        """Add one micro-batch's clips. Call it once per micro-batch.

        Each of ``video_seqlens`` (video tokens after patchifying), ``text_seqlens`` (default
        ``text_len``) and ``image_seqlens`` (image-to-video; default ``image_len``) is an ``[n]``
        int tensor on any device, a list of ints, or one int for every sample; ``num_samples``
        gives ``n`` when every length is an int (default 1). ``owner=False``: another rank records
        these clips (see the module docstring).
        """
        try:
            if decoder_args:
                raise ValueError(f"a DiT tracker records video_seqlens, text_seqlens and image_seqlens; "
                                 f"{', '.join(sorted(decoder_args))} are decoder arguments")
            if owner:
                self._record(video_seqlens, text_seqlens, image_seqlens, num_samples)
        except Exception as exc:
            if self.validate:
                raise
            self._failed = True
            self._warn_once("record() failed; every rank reports the static FLOPs for this step", exc)

    def _record(self, video: Any, text: Any, image: Any, num_samples: int | None) -> None:
        if video is None:
            raise ValueError("record() needs video_seqlens")
        if image is not None and self.spec.image_dim is None:
            raise ValueError("image_seqlens given for a text-to-video DiT (no image_dim)")
        named = [("video_seqlens", video), ("text_seqlens", self.spec.text_len if text is None else text)]
        if self.spec.image_dim is not None:
            named.append(("image_seqlens", self.spec.image_len if image is None else image))
        values = [self._lengths(value, name) for name, value in named]
        n = self._num_samples(named, values, num_samples)
        self._host[_I["num_microbatches"]] += 1
        self._host[_I["num_samples"]] += n  # counted before the values are: the fallback prices them
        for (name, _), value in zip(named, values):
            if not isinstance(value, torch.Tensor):
                _check_positive((value,) if isinstance(value, int) else value, name)
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
        if device is None:
            self._add_host(n, values)
        else:
            self._add_device(n, values, device)

    def _lengths(self, value: Any, name: str) -> Lengths:
        """An int or a tuple of ints (host values), or a 1-D int64 device tensor."""
        if isinstance(value, torch.Tensor):
            if value.dtype not in INT_DTYPES:
                raise ValueError(f"{name} must hold integers, got {value.dtype}")
            if not on_host(value):
                if self.validate:
                    _check_positive(value.tolist(), name)
                return value.reshape(-1).to(torch.int64)
            value = value.reshape(-1).tolist()  # a host tensor: reading it costs no sync
        if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
            raise ValueError(f"{name} must be an int tensor, a list of ints or an int, got {type(value).__name__}")
        for v in (value,) if isinstance(value, int) else value:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must hold integers, got {v!r}")
        return value if isinstance(value, int) else tuple(value)

    @staticmethod
    def _num_samples(named: list[tuple[str, Any]], values: list[Lengths], num_samples: int | None) -> int:
        """The micro-batch's sample count, from the shapes: lengths of every argument agree."""
        sizes = [(name, len(v)) for (name, _), v in zip(named, values) if not isinstance(v, int)]
        if num_samples is not None:
            if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
                raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
            sizes.insert(0, ("num_samples", num_samples))
        for name, size in sizes[1:]:
            if size != sizes[0][1]:
                raise ValueError(f"{sizes[0][0]} has {sizes[0][1]} samples but {name} has {size}")
        n = sizes[0][1] if sizes else 1
        if n == 0:
            raise ValueError("record() got no samples (empty lengths)")
        return n

    def _add_host(self, n: int, values: list[Lengths]) -> None:
        columns: list[tuple[int, ...]] = []
        for v in values:
            assert not isinstance(v, torch.Tensor), "device lengths take _add_device"
            columns.append(v if isinstance(v, tuple) else (v,) * n)
        video, text = columns[0], columns[1]
        image = columns[2] if len(columns) == 3 else (0,) * n
        longest = max(video)
        sums = (
            sum(video), sum(s * s for s in video), sum(text), sum(s * c for s, c in zip(video, text)),
            sum(image), sum(s * m for s, m in zip(video, image)), n * longest, n * longest * longest, 0,
        )
        for i, value in zip(range(_SUMS.start, _SUMS.stop), sums):
            self._host[i] += value

    def _add_device(self, n: int, values: list[Lengths], device: torch.device) -> None:
        acc = self._device.on(device)
        columns = [self._on_device(v, n, device) for v in values]
        lengths = torch.stack(columns)  # [2 or 3, n]
        video, text = columns[0], columns[1]
        image = columns[2] if len(columns) == 3 else torch.zeros_like(video)
        terms = torch.stack((video, video * video, text, video * text, image, video * image)).sum(1)
        longest = video.max()
        static = torch.stack((n * longest, n * longest * longest))
        bad = (lengths <= 0).sum().reshape(1)
        acc[_SUMS].add_(torch.cat((terms, static, bad)))

    @staticmethod
    def _on_device(value: Lengths, n: int, device: torch.device) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, int):
            return torch.full((n,), value, dtype=torch.int64, device=device)
        host = torch.tensor(value, dtype=torch.int64)
        # From pinned memory the copy is asynchronous (from pageable memory it would sync).
        return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)

    def _token_slots(self) -> int:
        # NB: the host-known token counts bound the statistics of host lengths; a wrapped device
        # value shows as a negative statistic after the reduction.
        host = self._host
        return max(host[_I["num_video_tokens"]], host[_I["num_text_tokens"]], host[_I["static_video_tokens"]])


@dataclass(frozen=True, kw_only=True)
class DiTPricing:
    """How a DiT's step is priced (see ``DiTFlopsTracker``'s arguments). Raises ``ValueError``
    for an unknown convention, a bad ``seq_length`` or an impossible setup."""

    spec: DiTSpec
    peft: DiTPeftSpec | None = None
    recompute: RecomputeSpec | None = None
    convention: str = "needed"
    seq_length: int | None = None

    def __post_init__(self) -> None:
        if self.convention not in MODEL_FLOPS_CONVENTIONS:
            raise ValueError(f"convention must be one of {MODEL_FLOPS_CONVENTIONS}, got {self.convention!r}")
        if self.seq_length is not None and (isinstance(self.seq_length, bool) or not isinstance(self.seq_length, int)
                                            or self.seq_length <= 0):
            raise ValueError(f"seq_length must be a positive integer, got {self.seq_length!r}")
        # Price an empty step once now: an impossible PEFT/recompute setup fails at set-up.
        price_dit(self.spec, DiTStats(), peft=self.peft, recompute=self.recompute, convention=self.convention)

    def problem(self, totals: Mapping[str, int]) -> str | None:
        """Non-positive clip lengths (counted on the device), or None."""
        bad = totals["num_bad_lengths"]
        return f"{bad} non-positive clip lengths" if bad else None

    def exact(self, t: Mapping[str, int]) -> StepResult:
        """Model and executed FLOPs of the step's clips."""
        stats = DiTStats(**{k: t[k] for k in _STAT_SLOTS})
        priced = price_dit(self.spec, stats, peft=self.peft, recompute=self.recompute, convention=self.convention)
        static = self._static(stats.num_samples, t["static_video_tokens"], t["static_video_seqlen_squared"])
        return StepResult(
            flops=priced.model.total,
            executed_flops=priced.executed.total,
            num_tokens=stats.num_video_tokens,
            num_padded_tokens=stats.num_video_tokens,
            num_sequences=stats.num_samples,
            sum_seqlen_squared=stats.sum_video_seqlen_squared,
            num_microbatches=t["num_microbatches"],
            components=dict(priced.model.components),
            static_flops=static,
        )

    def static(self, shapes: Mapping[str, int]) -> int | None:
        """With ``seq_length``, the static number of the step's samples (without it, the longest
        clips it needs are no shape count: None)."""
        return None if self.seq_length is None else self._static(shapes["num_samples"])

    def fallback(self, shapes: Mapping[str, int] | None, static: int | None, problem: str | None) -> StepResult:
        """The static number, with the step's sample and micro-batch counts."""
        shapes = shapes or dict.fromkeys(SHAPE_SLOTS, 0)
        return StepResult(flops=static or 0, executed_flops=static or 0, num_tokens=0, num_padded_tokens=0,
                          num_sequences=shapes["num_samples"], sum_seqlen_squared=0,
                          num_microbatches=shapes["num_microbatches"], static_flops=static, ok=False,
                          fallback_reason=problem)

    def _static(self, num_samples: int, longest_tokens: int = 0, longest_squares: int = 0) -> int:
        """``seq_length`` video tokens per sample when set, else each micro-batch's longest clip."""
        if self.seq_length is not None:
            longest_tokens, longest_squares = num_samples * self.seq_length, num_samples * self.seq_length**2
        stats = DiTStats.full_context(self.spec, num_samples=num_samples, num_video_tokens=longest_tokens,
                                      sum_video_seqlen_squared=longest_squares)
        return price_dit(self.spec, stats, convention=self.convention).model.total


def _check_positive(values: Any, name: str) -> None:
    for v in values:
        if v < 1:
            raise ValueError(f"{name} must be positive, got {v}")
