"""Observing micro-batches where the training loop hands them over (no framework import).

The train-step wrapper passes the original train step ``observe_forward_step(forward_step_func)``
instead of the framework's forward step. Each call of it on a model chunk that owns its
micro-batches (``FlopsTracker.owns``: first pipeline stage, first virtual chunk, tensor- and
context-parallel rank 0) hands the forward step an ``ObservedIterator`` around its data
iterator, so every ``next()`` inside that forward step is observed with the call's chunk. Under
interleaved pipelining each chunk gets its own iterator from the list: only the first chunk's is
observed. Other calls get their arguments untouched, and the train step itself still gets the
framework's iterators (Megatron's rerun state machine checks their type). While an observed
forward step runs, what its model chunk receives is checked against what was read from its batch
(``_crosscheck``).

``BatchReader`` turns a batch, as Megatron-LM's and Megatron-Bridge's data loaders yield it, into
``FlopsTracker.observe`` arguments (the keys are listed on the class). It reads references and
shapes only: host tensors are priced at the end of the step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from megatron_flops.adapters._crosscheck import ModelInputCheck
from megatron_flops.reporting.session import Session

logger = logging.getLogger("megatron_flops")

GRID_KEYS = ("image_grid_thw", "video_grid_thw")
# The packed-sequence keys of each batch layout that BatchReader reads ("te": megatron-core's
# PackedSeqParams names, Megatron-Bridge >= 0.6; "legacy": Megatron-LM and Megatron-Bridge <= 0.5).
# The kv offsets and the maximum lengths are not read: the GPT decoders attend within the q
# segments (self-attention), and FLOPs need the lengths only.
_COMMON_KEYS = frozenset({"token_count"})
PACKED_LAYOUTS = {
    "te": _COMMON_KEYS | {"cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                          "max_seqlen_q", "max_seqlen_kv"},
    "legacy": _COMMON_KEYS | {"cu_seqlens", "cu_seqlens_argmin", "cu_seqlens_unpadded", "cu_seqlens_unpadded_argmin",
                              "cu_seqlens_padded", "cu_seqlens_padded_argmin", "max_seqlen"},
}
_PACKED_PREFIXES = ("cu_seqlens", "max_seqlen", "token_count")


class ObservedIterator:
    """``iterator``, whose batches are also observed by ``session`` (read with ``read``).

    A batch that Megatron's ``RerunDataIterator`` replays (a step re-run to check a result) is
    not observed again. Every other attribute is the wrapped iterator's.
    """

    __slots__ = ("_iterator", "_session", "_read", "_replays", "_check")

    def __init__(self, iterator: Iterator[Any], session: Session, read: Callable[[Any], dict[str, Any]],
                 check: ModelInputCheck | None = None) -> None:
        self._iterator: Any = iterator  # may be a RerunDataIterator, with its replaying flag
        self._session = session
        self._read = read
        self._replays = hasattr(iterator, "replaying")
        self._check = check

    def __iter__(self) -> ObservedIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        if not (self._replays and self._iterator.replaying):
            fields = self._session.observe(self._read, batch)
            if fields is not None and self._check is not None:
                self._check.expect(fields)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


def observe_forward_step(
    forward_step_func: Callable[..., Any], session: Session, read: Callable[[Any], dict[str, Any]],
    check: ModelInputCheck | None = None,
) -> Callable[..., Any]:
    """``forward_step_func(data_iterator, model, ...)`` whose data iterator is observed when
    ``model`` owns its micro-batches; with ``check``, what ``model`` receives is cross-checked."""

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if data_iterator is None or not hasattr(data_iterator, "__next__") or not session.observing(model):
            return forward_step_func(data_iterator, model, *args, **kwargs)
        if check is None:
            return forward_step_func(ObservedIterator(data_iterator, session, read), model, *args, **kwargs)
        check.arm(model, session)
        try:
            return forward_step_func(ObservedIterator(data_iterator, session, read, check), model, *args, **kwargs)
        finally:
            check.disarm()

    return forward_step


class BatchReader:
    """``FlopsTracker.observe`` arguments from a training batch (a mapping of tensors).

    Keys read:

    - ``tokens`` (else ``input_ids``): ``[b, s]``; its shape gives the rows and token slots.
    - Packed rows, in one of two layouts (``PACKED_LAYOUTS``):

      - megatron-core's ``PackedSeqParams`` names (Megatron-Bridge >= 0.6): ``cu_seqlens_q``,
        the real (logical) offsets, and ``cu_seqlens_q_padded``, the physical ones (absent:
        the real ones are what runs). Zero-length segments (repeated entries) mark boundaries
        and pad a row's offsets to a common length; they are no sequence.
      - the older names: the real offsets are ``cu_seqlens_unpadded`` (Megatron-Bridge <= 0.5,
        with ``cu_seqlens_unpadded_argmin``) or else ``cu_seqlens`` (with ``cu_seqlens_argmin``
        marking where the ``-1`` sentinels begin); the padded ones are ``cu_seqlens_padded``
        (Megatron-LM) or, next to ``cu_seqlens_unpadded``, ``cu_seqlens``.

      Megatron-Bridge's ``token_count`` (the packed row's real tokens: an int, a one-element
      list or tensor), when no padded offsets are given, makes a trailing padding segment zero
      real tokens.
    - Vision grids: ``image_grid_thw`` and ``video_grid_thw``, in the batch or in its
      ``visual_inputs`` (an object or a mapping), ``[n, 3]`` or ``[b, n, 3]``.

    A batch with no offsets counts full rows and says so once. A batch without a ``[b, s]``
    token tensor, or with a packed-sequence key outside its layout (``cu_seqlens*``,
    ``max_seqlen*``, ``token_count``: a layout this reader does not know), raises
    ``ValueError``: the step falls back, with that reason in the log.
    """

    def __init__(self) -> None:
        self._warned = False

    def __call__(self, batch: Any) -> dict[str, Any]:
        rows, length = self.tokens(batch).shape
        fields = self.offsets(batch)
        fields["num_rows"], fields["row_length"] = rows, length
        if "visual_inputs" in batch or "image_grid_thw" in batch or "video_grid_thw" in batch:
            grids = self.grids(batch)
            if grids:
                fields["grid_thw"] = grids
        return fields

    def tokens(self, batch: Any) -> torch.Tensor:
        """The batch's ``[b, s]`` token tensor."""
        if type(batch) is not dict and not isinstance(batch, Mapping):
            raise ValueError(f"a training batch is a {type(batch).__name__}, not a mapping with 'tokens'")
        tokens = batch.get("tokens")
        if tokens is None:
            tokens = batch.get("input_ids")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError("a training batch has no [batch, seq] 'tokens' or 'input_ids' tensor "
                             f"(keys: {', '.join(map(str, batch))})")
        return tokens

    def offsets(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The packed-row arguments (empty for unpacked rows, said once)."""
        layout = _packed_layout(batch)
        if layout == "te":
            return self._limited(batch, dict(cu_seqlens=batch["cu_seqlens_q"],
                                             cu_seqlens_padded=batch.get("cu_seqlens_q_padded")))
        cu, unpadded, padded = batch.get("cu_seqlens"), batch.get("cu_seqlens_unpadded"), batch.get("cu_seqlens_padded")
        if cu is None and unpadded is None:
            if not self._warned:
                self._warned = True
                logger.warning("megatron-flops: the training batches carry no packed-sequence offsets "
                               "(cu_seqlens): each row counts as one sequence of its full length (logged once)")
            return {}
        if unpadded is not None:
            if padded is None:
                padded, padded_argmin = cu, batch.get("cu_seqlens_argmin")
            else:
                padded_argmin = batch.get("cu_seqlens_padded_argmin")
            return dict(cu_seqlens=unpadded, cu_seqlens_argmin=batch.get("cu_seqlens_unpadded_argmin"),
                        cu_seqlens_padded=padded, cu_seqlens_padded_argmin=padded_argmin)
        return self._limited(batch, dict(cu_seqlens=cu, cu_seqlens_argmin=batch.get("cu_seqlens_argmin"),
                                         cu_seqlens_padded=padded,
                                         cu_seqlens_padded_argmin=batch.get("cu_seqlens_padded_argmin")))

    @staticmethod
    def _limited(batch: Mapping[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` with ``token_count`` as the real tokens when no padded offsets are given."""
        if fields.get("cu_seqlens_padded") is None and batch.get("token_count") is not None:
            fields["num_real_tokens"] = batch["token_count"]
        return fields

    def grids(self, batch: Mapping[str, Any]) -> list[torch.Tensor]:
        """The batch's image and video grids (none: an empty list)."""
        visual = batch.get("visual_inputs")
        found = []
        for key in GRID_KEYS:
            grid = batch.get(key)
            if grid is None and visual is not None:
                grid = visual.get(key) if isinstance(visual, Mapping) else getattr(visual, key, None)
            if grid is not None:
                found.append(grid)
        return found


def _packed_layout(batch: Mapping[str, Any]) -> str:
    """``"te"`` or ``"legacy"`` (``PACKED_LAYOUTS``); raises ``ValueError`` naming any
    packed-sequence key (not None) outside the batch's layout, or keys of both layouts."""
    present = {key for key, value in batch.items()
               if value is not None and isinstance(key, str) and key.startswith(_PACKED_PREFIXES)}
    layout = "te" if "cu_seqlens_q" in present else "legacy"
    unknown = present - PACKED_LAYOUTS[layout]
    if unknown:
        raise ValueError(f"the batch's packed-sequence keys {sorted(present)} are not a layout megatron-flops "
                         f"reads ({', '.join(sorted(unknown))} unknown next to the {layout} keys)")
    return layout
