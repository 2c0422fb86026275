"""A decoder step's reduced totals priced into a :class:`StepResult`, and its static number.

The totals are the tracker's slots summed over every rank (``device_stats.SLOTS``, then the
vision slots): the :class:`~megatron_flops.flops.formulas.SeqStats` of the step, priced by
:func:`~megatron_flops.flops.passes.price` (model and executed FLOPs under PEFT and recompute), plus the
vision tower. The static number is what the stock formula reports: every row one ``seq_length``
sequence (or one of the step's mean padded row length).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass, field, replace

from megatron_flops.flops.formulas import ATTENTION_CONVENTIONS, SeqStats, training_flops
from megatron_flops.flops.passes import MODEL_FLOPS_CONVENTIONS, PeftSpec, RecomputeSpec, price
from megatron_flops.tracking.result import StepResult
from megatron_flops.model.spec import ModelSpec
from megatron_flops.flops.vision import VisionSpec, vision_training_flops
from megatron_flops.tracking.vision_torch import VISION_SLOTS, vision_stats_from_vector


@dataclass(frozen=True, kw_only=True)
class DecoderPricing:
    """How a decoder's (and a VLM's vision tower's) step is priced; see ``FlopsTracker``'s
    arguments. Raises ``ValueError`` for an unknown convention or an impossible setup."""

    spec: ModelSpec
    attention: str = "causal"
    seq_length: int | None = None
    vision: VisionSpec | None = None
    peft: PeftSpec | None = None
    recompute: RecomputeSpec | None = None
    convention: str = "needed"
    # Steps priced before, by their totals, and static numbers by (rows, length): pricing depends
    # on them only, and repeated shapes (unpacked rows, the static number) repeat them exactly.
    _priced: dict[tuple[tuple[str, int], ...], StepResult] = field(default_factory=dict, init=False, repr=False,
                                                                   compare=False)
    _statics: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CONVENTIONS:
            raise ValueError(f"attention must be one of {ATTENTION_CONVENTIONS}, got {self.attention!r}")
        if self.seq_length is not None and self.seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {self.seq_length}")
        if self.convention not in MODEL_FLOPS_CONVENTIONS:
            raise ValueError(f"convention must be one of {MODEL_FLOPS_CONVENTIONS}, got {self.convention!r}")
        # Price an empty step once now: an impossible PEFT/recompute setup fails at set-up.
        price(self.spec, SeqStats(), attention=self.attention, peft=self.peft, recompute=self.recompute,
              convention=self.convention)

    def problem(self, t: Mapping[str, int]) -> str | None:
        """Why reduced totals cannot come from valid lengths (malformed values are counted as
        given, since seeing them would sync), or None."""
        if not t["num_tokens"] <= t["num_padded_tokens"]:
            return f"{t['num_tokens']} real tokens > {t['num_padded_tokens']} token slots"
        if t["sum_seqlen_squared"] < t["num_tokens"]:  # s^2 >= s for every integer s
            return f"sum of squared lengths {t['sum_seqlen_squared']} < {t['num_tokens']} tokens"
        if t["num_tokens"] ** 2 > t["num_sequences"] * t["sum_seqlen_squared"]:  # Cauchy-Schwarz
            return (f"{t['num_tokens']} tokens in {t['num_sequences']} sequences cannot have a sum of squared "
                    f"lengths of {t['sum_seqlen_squared']}")
        return None

    def exact(self, t: Mapping[str, int]) -> StepResult:
        """Model and executed FLOPs of the totals (decoder, then the vision tower); totals priced
        before are looked up (a fresh copy of their result)."""
        key = tuple(t.items())
        result = self._priced.get(key)
        if result is None:
            result = _remember(self._priced, key, self._exact(t))
        return replace(result, components=dict(result.components))

    def _exact(self, t: Mapping[str, int]) -> StepResult:
        """The totals priced (``exact()`` without the memo)."""
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
            static_flops=self.static(t),
        )

    def static(self, shapes: Mapping[str, int]) -> int:
        """The stock number: every row one ``seq_length`` (or mean padded row length) sequence."""
        rows = shapes["num_rows"]
        static_len = self.seq_length or -(-shapes["num_padded_tokens"] // max(rows, 1))
        static = self._statics.get((rows, static_len))
        if static is None:
            window = self.spec.pair_window
            stats = SeqStats.full_length(rows, static_len, window=window) if static_len else SeqStats()
            static = _remember(self._statics, (rows, static_len),
                               training_flops(self.spec, stats, attention=self.attention).total)
        return static

    def fallback(self, shapes: Mapping[str, int] | None, static: int | None, problem: str | None) -> StepResult:
        """The static number, with the step's shape counts (token slots as tokens)."""
        shapes = shapes or dict.fromkeys(("num_microbatches", "num_sequences", "num_padded_tokens"), 0)
        return StepResult(
            flops=static or 0, executed_flops=static or 0, num_tokens=shapes["num_padded_tokens"],
            num_padded_tokens=shapes["num_padded_tokens"], num_sequences=shapes["num_sequences"],
            sum_seqlen_squared=0, num_microbatches=shapes["num_microbatches"], static_flops=static, ok=False,
            fallback_reason=problem,
        )


_MEMO_SIZE = 256  # entries kept per memo (a run repeats few distinct shapes)


def _remember(memo: dict[Any, Any], key: Any, value: Any) -> Any:
    """``value``, stored in ``memo`` under ``key`` (a full memo is emptied first)."""
    if len(memo) >= _MEMO_SIZE:
        memo.clear()
    memo[key] = value
    return value


def _window_pairs(sum_sq: int, excess: int, excess_sq: int) -> int:
    # band_pairs(s, w) = s^2 - x(x - 1) with x = max(s - w, 0): summed, sum s^2 - sum x^2 + sum x.
    return sum_sq - excess_sq + excess
