"""Per-micro-batch clip statistics of a video DiT, priced once per step (torch).

``record(video_seqlens=..., text_seqlens=..., image_seqlens=...)`` runs once per micro-batch: no
host sync, no collective. Host lengths (ints, lists, CPU tensors) are summed on the host; device
tensors are summed on their device into one preallocated int64 accumulator, and a non-positive
device length is counted there rather than checked (a check would sync). ``end_step()`` runs on
every rank once per step: the one fixed-shape all-reduce (:class:`~megatron_flops.reduction.StepReducer`),
then :func:`~megatron_flops.dit_passes.price_dit` on the totals: the DiT's FLOPs depend on the
clips only through the additive :class:`~megatron_flops.dit.DiTStats`.

Ownership: every rank records the clips it trains on (data parallel, FSDP, HSDP); ranks that share
a replica's clips (tensor- or context-parallel peers) pass ``owner=False`` on all but one of them,
so each clip is counted once.

Static number: every sample priced at its micro-batch's longest clip (or ``seq_length`` video
tokens) with the full ``text_len`` (and ``image_len``) context, every weight trained, nothing
recomputed: what a fixed-shape formula reports. A step that cannot be priced exactly (a failed
record on any rank, a non-positive length, see :mod:`~megatron_flops.reduction`) reports the
static number on every rank with ``ok=False``: from the sample count with ``seq_length``, else the
latest exact step's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from megatron_flops.dit import DiTPeftSpec, DiTSpec, DiTStats
from megatron_flops.dit_passes import price_dit
from megatron_flops.passes import MODEL_FLOPS_CONVENTIONS, PeftSpec, RecomputeSpec
from megatron_flops.reduction import Reduction, StepReducer
from megatron_flops.result import StepResult

logger = logging.getLogger("megatron_flops")

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
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
# Tensors on these devices are read on the host (no device to sync with).
_HOST_DEVICE_TYPES = frozenset({"cpu"})
_STAT_SLOTS = tuple(DiTStats.__dataclass_fields__)

Lengths = int | tuple[int, ...] | torch.Tensor


class DiTFlopsTracker:
    """Accumulates the clip lengths of every micro-batch of a DiT and prices each step.

    Args:
        spec: the DiT.
        peft, recompute, convention: frozen base / LoRA (:class:`~megatron_flops.dit.DiTPeftSpec`),
            per-block checkpointing (:func:`~megatron_flops.dit_passes.dit_recompute`) and the
            model-FLOPs convention (see :mod:`megatron_flops.dit_passes`).
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
        if convention not in MODEL_FLOPS_CONVENTIONS:
            raise ValueError(f"convention must be one of {MODEL_FLOPS_CONVENTIONS}, got {convention!r}")
        if seq_length is not None and (isinstance(seq_length, bool) or not isinstance(seq_length, int)
                                       or seq_length <= 0):
            raise ValueError(f"seq_length must be a positive integer, got {seq_length!r}")
        self.peft = None if peft is None else DiTPeftSpec.of(peft)
        # Price an empty step once now: an impossible PEFT/recompute setup fails at set-up.
        price_dit(spec, DiTStats(), peft=self.peft, recompute=recompute, convention=convention)
        self.spec = spec
        self.recompute = recompute
        self.convention = convention
        self.seq_length = seq_length
        self.validate = validate
        self.group = group
        self._acc: torch.Tensor | None = None
        self._host = [0] * len(SLOTS)
        self._failed = False
        self._num_steps = 0
        self._last_static: int | None = None
        self._reducer = StepReducer(SLOTS, shape_slots=SHAPE_SLOTS, group=group)
        self._warned: set[str] = set()

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
            if value.dtype not in _INT_DTYPES:
                raise ValueError(f"{name} must hold integers, got {value.dtype}")
            if value.device.type not in _HOST_DEVICE_TYPES:
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
        if self._acc is None:
            self._acc = torch.zeros(len(SLOTS), dtype=torch.int64, device=device)
        columns = [self._on_device(v, n, device) for v in values]
        lengths = torch.stack(columns)  # [2 or 3, n]
        video, text = columns[0], columns[1]
        image = columns[2] if len(columns) == 3 else torch.zeros_like(video)
        terms = torch.stack((video, video * video, text, video * text, image, video * image)).sum(1)
        longest = video.max()
        static = torch.stack((n * longest, n * longest * longest))
        bad = (lengths <= 0).sum().reshape(1)
        self._acc[_SUMS].add_(torch.cat((terms, static, bad)))

    @staticmethod
    def _on_device(value: Lengths, n: int, device: torch.device) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, int):
            return torch.full((n,), value, dtype=torch.int64, device=device)
        host = torch.tensor(value, dtype=torch.int64)
        # From pinned memory the copy is asynchronous (from pageable memory it would sync).
        return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)

    # ---- per step ----------------------------------------------------------------------------

    def end_step(self, *, step: int | None = None) -> StepResult:
        """Reduce this step's statistics over all ranks and price them. Every rank must call it
        once per step: it runs the step's one all-reduce whatever failed on this rank.

        ``step``: the training iteration (see ``FlopsTracker.end_step``; default: the number of
        ``end_step()`` calls). When the step cannot be priced exactly, every rank returns the
        static number with ``ok=False`` and logs the reason once.
        """
        self._num_steps += 1
        failed, self._failed = self._failed, False
        # NB: the host-known token counts bound the statistics of host lengths; a wrapped device
        # value shows as a negative statistic after the reduction.
        host = self._host
        token_slots = max(host[_I["num_video_tokens"]], host[_I["num_text_tokens"]], host[_I["static_video_tokens"]])
        reduction = self._reducer.reduce(self._acc, host, step=self._num_steps if step is None else step,
                                         failed=failed, token_slots=token_slots)
        self._reset()
        if reduction.local_error is not None:
            self._warn_once("this rank could not build its statistics vector", reduction.local_error)
        return self._price(reduction, failed_here=failed)

    def discard_step(self) -> None:
        """Drop everything recorded since the last ``end_step()``, without a collective (for a
        step that raised; see ``Session.abort_step``)."""
        self._failed = False
        self._reset()

    def _reset(self) -> None:
        self._host = [0] * len(SLOTS)
        if self._acc is not None:
            try:
                self._acc.zero_()
            except Exception as exc:  # a fresh accumulator on the next record()
                self._acc = None
                self._warn_once("the accumulator could not be reset", exc)

    def _price(self, reduction: Reduction, *, failed_here: bool) -> StepResult:
        shapes, totals, problem = reduction.shapes, reduction.totals, reduction.problem
        if totals is not None:
            problem = f"{totals['num_bad_lengths']} non-positive clip lengths" if totals["num_bad_lengths"] else None
            if problem is None:
                try:
                    return self._exact(totals)
                except Exception as exc:  # the same totals on every rank: every rank falls back
                    problem = f"pricing failed ({type(exc).__name__}: {exc})"
        if not failed_here:  # a rank that failed to record has said why already
            self._warn_once("the step fell back to the static number", problem or "no totals")
        static = self._static(shapes["num_samples"]) if shapes is not None and self.seq_length else None
        static = static or self._last_static
        if static is None:
            self._warn_once("no static number is known for a failed step", "it reports 0 FLOPs with ok=False")
        shapes = shapes or dict.fromkeys(SHAPE_SLOTS, 0)
        return StepResult(flops=static or 0, executed_flops=static or 0, num_tokens=0, num_padded_tokens=0,
                          num_sequences=shapes["num_samples"], sum_seqlen_squared=0,
                          num_microbatches=shapes["num_microbatches"], static_flops=static, ok=False,
                          fallback_reason=problem)

    def _exact(self, t: Mapping[str, int]) -> StepResult:
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

    def _static(self, num_samples: int, longest_tokens: int = 0, longest_squares: int = 0) -> int:
        """``seq_length`` video tokens per sample when set, else each micro-batch's longest clip."""
        if self.seq_length is not None:
            longest_tokens, longest_squares = num_samples * self.seq_length, num_samples * self.seq_length**2
        stats = DiTStats.full_context(self.spec, num_samples=num_samples, num_video_tokens=longest_tokens,
                                      sum_video_seqlen_squared=longest_squares)
        static = price_dit(self.spec, stats, convention=self.convention).model.total
        if static:
            self._last_static = static
        return static

    def _warn_once(self, what: str, why: BaseException | str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            if isinstance(why, BaseException):
                why = f"{type(why).__name__}: {why}"
            logger.warning("megatron-flops: %s (%s) (logged once)", what, why)


def _check_positive(values: Any, name: str) -> None:
    for v in values:
        if v < 1:
            raise ValueError(f"{name} must be positive, got {v}")
