"""What the model chunk receives, checked against what was read from its batch (no framework import).

megatron-core's stable interface is a model chunk's forward: Megatron-LM's ``forward_step``
calls ``model(tokens, position_ids, attention_mask, ..., packed_seq_params=...)``, Megatron-Bridge's
``gpt_step``/``vlm_step`` ``model(input_ids=..., ..., packed_seq_params=...)``. A forward pre-hook on
each chunk that owns its micro-batches sees those arguments while the adapter's forward step wrapper
is in the call, and compares their shapes (no values: no host sync, no tensor operation) with the
shapes the batch reader found in the same micro-batch:

- the sub-sequence count: the model's ``PackedSeqParams`` (``cu_seqlens_q`` entries minus one)
  delimit at most as many sub-sequences as the reader's bound allows: its offset entries minus one
  per row of offsets (sentinel padding and megatron-core's merge of row-local offsets only shrink
  the count), or, with no offsets read, one per row (Qwen3-VL's step runs unpacked rows as THD
  with one sub-sequence per row);
- packed offsets read but no ``PackedSeqParams`` received: the model ran whole rows (unless the
  offsets delimit at most one sub-sequence per row);
- the token slots: the model's token tensor holds the rows the reader priced, as this
  context-parallel rank's slice of them (times the CP size) or whole (a step that passes whole
  rows and lets the model slice them, as Qwen3-VL's does).

On disagreement the micro-batch's step falls back on every rank (``FlopsTracker.observe_failed``:
the failure travels in the step's reduction) and the reason is logged once. A model call that
does not show its inputs (no token tensor among the first argument or ``input_ids``) is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_flops.tracking.ownership import chunk_ownership
from megatron_flops.reporting.session import Session
from megatron_flops.tracking.tracker import FlopsTracker

# The reader's offset fields, real and padded (FlopsTracker.observe arguments).
OFFSET_FIELDS = ("cu_seqlens", "cu_seqlens_padded")


@dataclass(frozen=True, slots=True)
class Shapes:
    """One micro-batch as shapes: whole-row token slots (before context-parallel slicing; a model
    call's are also ``whole_slots`` when its tokens are whole rows), its rows, whether it runs
    packed, and a bound on its sub-sequences (None: not known from shapes)."""

    token_slots: int
    packed: bool
    num_subsequences: int | None = None
    num_rows: int | None = None
    whole_slots: int | None = None
    qkv_format: str | None = None


def batch_shapes(fields: dict[str, Any]) -> Shapes:
    """The shapes of a micro-batch as the batch reader gave it (``FlopsTracker.observe`` fields)."""
    rows = fields["num_rows"]
    bounds = [_offset_bound(fields[name]) for name in OFFSET_FIELDS if fields.get(name) is not None]
    known = [bound for bound in bounds if bound is not None]
    bound = max(known) if known else (None if bounds else rows)
    return Shapes(token_slots=rows * fields["row_length"], packed=bool(bounds), num_subsequences=bound,
                  num_rows=rows)


def model_shapes(args: tuple, kwargs: dict[str, Any], cp_size: int) -> Shapes | None:
    """The shapes of a model chunk's call, or None when its token tensor is not among its arguments."""
    tokens = kwargs.get("input_ids")
    if tokens is None and args:
        tokens = args[0]
    if not isinstance(tokens, torch.Tensor):
        return None
    params = kwargs.get("packed_seq_params")
    offsets = getattr(params, "cu_seqlens_q", None)
    packed = isinstance(offsets, torch.Tensor)
    return Shapes(token_slots=tokens.numel() * cp_size, whole_slots=tokens.numel(), packed=packed,
                  num_subsequences=_offset_bound(offsets) if packed else None,
                  qkv_format=getattr(params, "qkv_format", None) if params is not None else None)


def disagreement(batch: Shapes, model: Shapes) -> str | None:
    """Why the model's inputs contradict what was read from the batch, or None."""
    if (model.packed and model.num_subsequences is not None and batch.num_subsequences is not None
            and model.num_subsequences > batch.num_subsequences):
        if not batch.packed:
            return (f"the model chunk received packed sequences (PackedSeqParams, qkv_format "
                    f"{model.qkv_format!r}, {model.num_subsequences} sub-sequences) but the batch carried no "
                    f"offsets that megatron-flops reads ({batch.num_rows} whole rows)")
        return (f"the model chunk received {model.num_subsequences} packed sub-sequences, more than the "
                f"{batch.num_subsequences} the batch's offsets can hold")
    if (batch.packed and not model.packed and batch.num_rows is not None
            and (batch.num_subsequences is None or batch.num_subsequences > batch.num_rows)):
        return ("the batch carried packed-sequence offsets but the model chunk received no PackedSeqParams "
                "(it ran whole rows)")
    if batch.token_slots not in (model.token_slots, model.whole_slots):
        return (f"the model chunk received {model.token_slots} token slots (context-parallel slices "
                f"included) but megatron-flops priced {batch.token_slots}")
    return None


def _offset_bound(offsets: Any) -> int | None:
    """Sub-sequences an offsets tensor can delimit: its entries less one per row (None: not a tensor)."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() not in (1, 2):
        return None
    rows = 1 if offsets.dim() == 1 else offsets.shape[0]
    return max(offsets.numel() - rows, 0)


class ModelInputCheck:
    """The forward pre-hooks and the expectation they check (one per adapter).

    ``arm(model, session)`` before an observed forward step (hooks the chunk once), ``expect(fields)``
    when its data iterator hands a batch over, ``disarm()`` after it. Each model call checks and
    consumes the latest expectation; calls outside an armed forward step (evaluation, other chunks)
    return at once.
    """

    def __init__(self) -> None:
        self._session: Session | None = None
        self._expected: Shapes | None = None
        self._cp_size = 1
        # id(chunk) -> (the chunk, kept so that its id is not reused; its hook handle; its CP size)
        self._chunks: dict[int, tuple[Any, Any, int]] = {}
        self.num_checked = 0

    def arm(self, model: Any, session: Session) -> None:
        """Check ``model``'s calls until ``disarm()``; the first time, hook it (never raises)."""
        self._session, self._expected = session, None
        hooked = self._chunks.get(id(model))
        if hooked is None:
            hooked = self._chunks[id(model)] = self._hook(model, session)
        self._cp_size = hooked[2]

    def expect(self, fields: dict[str, Any]) -> None:
        """The batch reader's fields of the micro-batch that the next model call should receive."""
        if self._session is not None:
            self._expected = batch_shapes(fields)

    def disarm(self) -> None:
        self._session, self._expected = None, None

    def _hook(self, model: Any, session: Session) -> tuple[Any, Any, int]:
        tracker = session.tracker
        try:
            cp_size = getattr(tracker, "context_parallel_size", None) or chunk_ownership(model)[1]
            handle = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        except Exception as exc:  # not an nn.Module, or its groups are unreadable: calls go unchecked
            session.warn_once("the model chunk cannot be hooked; what it receives is not cross-checked", exc)
            return model, None, 1
        return model, handle, cp_size

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        session, expected = self._session, self._expected
        if session is None or expected is None:
            return
        self._expected = None
        try:
            got = model_shapes(args, kwargs, self._cp_size)
            reason = None if got is None else disagreement(expected, got)
        except Exception as exc:
            session.warn_once("cross-checking the model's inputs failed", exc)
            return
        if got is not None:
            self.num_checked += 1
        if reason is not None and isinstance(session.tracker, FlopsTracker):
            session.tracker.observe_failed(ValueError(reason), what="the model's inputs contradict the batch read")
