"""The per-step result that the tracker returns and the meter consumes (stdlib only)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """Global statistics and FLOPs of one training step, summed over every data-parallel rank.

    ``flops`` is model FLOPs (real tokens, the tracker's attention convention, no recompute):
    what MFU is computed from. ``executed_flops`` counts what the hardware runs (padding
    included, full score matrices, recompute): what HFU is computed from.
    """

    flops: int
    executed_flops: int
    num_tokens: int
    num_padded_tokens: int
    num_sequences: int
    sum_seqlen_squared: int
    num_microbatches: int
    components: Mapping[str, int] = field(default_factory=dict)
    static_flops: int | None = None
    ok: bool = True
    fallback_reason: str | None = None
