"""Exact GEMM FLOPs of one training pass of a megatron-core decoder (stdlib only: ints in, ints out).

Counted: every matrix multiply that megatron-core runs for the decoder (projections, core
attention, MLP, MoE router/experts, logits, MTP), as ``torch.utils.flop_counter`` counts them.
Not counted: norms, softmax, activations, RoPE, embedding lookups, the loss, optimizer steps,
communication. The deliberate exceptions, each under its own key: Mamba's scan (Megatron-LM's
estimate), and Gated DeltaNet's short convolution (exact MACs) and recurrence (a named
convention, :func:`gdn_core_flops`; docs/attention-variants.md).

Conventions (each named, each selectable):

- ``attention="causal"`` (default, Megatron-compatible): the core-attention term is half of
  the full query x key product; ``"full"``: every query/key pair inside each sub-sequence, what
  a varlen (THD) or unfused kernel executes.
- Sliding-window layers count only the band ``|q - k| <= window``: what a window-aware kernel
  (FlashAttention's ``window_size``) executes. NB: unfused (eager) attention computes the full
  ``s^2`` scores and masks the outside of the band, so it executes more than this count.
- ``include_padding=False`` (model FLOPs): real tokens and real sub-sequence lengths;
  ``True`` (executed FLOPs): padded tokens and padded sub-sequence lengths.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_flops.model.inputs import show
from megatron_flops.model.spec import ModelSpec

# One training step runs every GEMM three times:
#   forward           Y  = X @ W        1
#   input gradient    dX = dY @ W^T     1
#   weight gradient   dW = X^T @ dY     1
#                                      ---
#                                       3 x the forward GEMM
# Core attention has no weights, but both operands (Q and K, P and V) are activations that need
# gradients: again two backward GEMMs of the forward's size, so the same 3.
TRAIN_PASSES = 3
# One multiply-accumulate is two floating-point operations: (m x k) @ (k x n) = 2*m*k*n FLOPs.
FLOPS_PER_MAC = 2

ATTENTION_CONVENTIONS = ("causal", "full")


def gemm(m: int, k: int, n: int) -> int:
    """FLOPs of one (m x k) @ (k x n) matrix multiply."""
    return FLOPS_PER_MAC * m * k * n


def attention_gemm(num_heads: int, head_dim: int, pairs: int) -> int:
    """FLOPs of one core-attention GEMM over ``pairs`` query/key pairs, all heads: per head the
    scores ``[s, d] @ [d, s]`` (or the context ``[s, s] @ [s, d]``) is one ``d``-long MAC per pair."""
    return FLOPS_PER_MAC * num_heads * head_dim * pairs


def apply_attention_convention(full_flops: int, attention: str) -> int:
    """Core-attention FLOPs under a convention, from the full (unmasked) count.

    NB: ``causal`` halves the full product (Megatron-LM's convention), which keeps half the
    diagonal; an exact causal count would be ``s(s+1)/2`` pairs. Halving is exact in integers
    because every full count carries the factor FLOPS_PER_MAC = 2.
    """
    if attention == "full":
        return full_flops
    if attention == "causal":
        assert full_flops % 2 == 0, "full attention FLOPs always carry the multiply-add factor 2"
        return full_flops // 2
    raise ValueError(f"unknown attention convention {attention!r}; use one of {ATTENTION_CONVENTIONS}")


def band_pairs(seqlen: int, window: int | None) -> int:
    """Query/key pairs of one sequence with ``|q - k| <= window`` (``None``: all ``s^2`` pairs).

    With ``m = min(window, s - 1)``: ``s`` diagonal pairs plus ``2 * sum_{d=1..m} (s - d)`` =
    ``s * (2m + 1) - m * (m + 1)``; at ``m = s - 1`` this is ``s^2``.
    """
    if window is None or window >= seqlen - 1:
        return seqlen * seqlen
    return seqlen * (2 * window + 1) - window * (window + 1)


# ---- the data side: rows of sequences and their additive statistics --------------------------


@dataclass(frozen=True, kw_only=True)
class Row:
    """One micro-batch row: an unpacked sequence, or a packed row of sub-sequences.

    ``padded_seqlens`` are the lengths the attention kernel runs over (THD padding, or an
    unpacked sequence padded to the batch length); ``num_padded_tokens`` is every token slot
    the linear layers run over (padded sub-sequences plus any tail padding).
    """

    seqlens: tuple[int, ...]
    padded_seqlens: tuple[int, ...]
    num_padded_tokens: int


ROW_KEYS = ("seqlens", "padded_seqlens", "pad_to")
# Rows given to the CLI and parse_rows: a global batch of packed rows is well below this.
MAX_SEQUENCES = 1 << 18


def parse_rows(rows: Any) -> tuple[Row, ...]:
    """Validate ``rows``: a list whose elements are an int (one unpacked sequence), a list of ints
    (a packed row) or ``{"seqlens": ..., "padded_seqlens": ..., "pad_to": N}``. Errors name the row
    as ``rows[i]`` (0-based).

    NB: ``pad_to`` pads a row's token slots, which every linear layer runs over. An unpacked
    sequence (``seqlens`` an int) padded to ``pad_to`` is one row of a padded batch: attention runs
    over the whole ``pad_to`` square under a padding mask. A packed row (``seqlens`` a list) keeps
    each sub-sequence's attention at its ``padded_seqlens``: a THD (varlen) kernel attends only
    within ``cu_seqlens_padded``, so the tail past the last sub-sequence is not attended. When a
    packer folds the tail into the last sub-sequence, say so with ``padded_seqlens``.
    """
    if isinstance(rows, Mapping):
        hint = " (one row: wrap it in a list, [{...}])" if set(rows) & set(ROW_KEYS) else ""
        raise ValueError(f"expected a list of rows, got a mapping{hint}")
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"expected a list of rows, got {show(rows)}")
    if not rows:
        raise ValueError("the list of rows is empty")
    parsed = []
    num_sequences = 0
    for i, r in enumerate(rows):
        row = _parse_row(f"rows[{i}]", r)
        num_sequences += len(row.seqlens)
        if num_sequences > MAX_SEQUENCES:
            raise ValueError(f"more than {MAX_SEQUENCES:,} sequences; price a sample of the step instead")
        parsed.append(row)
    return tuple(parsed)


def _lengths(where: str, key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise ValueError(f"{where}: {key} must be an integer or a list of integers, got {show(value)}")
    if not isinstance(value, int) and len(value) > MAX_SEQUENCES:
        raise ValueError(f"{where}: {key} has more than {MAX_SEQUENCES:,} entries")
    values = (value,) if isinstance(value, int) else tuple(value)
    if not values:
        raise ValueError(f"{where}: {key} is empty")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: {key} must hold integers, got {show(v)}")
        if v <= 0:
            raise ValueError(f"{where}: {key} must be positive, got {v}")
    return values


def _parse_row(where: str, row: Any) -> Row:
    seqlens: tuple[int, ...]
    if type(row) is int and row > 0:  # the common case, fast
        seqlens = (row,)
        return Row(seqlens=seqlens, padded_seqlens=seqlens, num_padded_tokens=row)
    if not isinstance(row, Mapping):
        seqlens = _lengths(where, "length", row)
        return Row(seqlens=seqlens, padded_seqlens=seqlens, num_padded_tokens=sum(seqlens))
    unknown = [k for k in row if k not in ROW_KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), ROW_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(ROW_KEYS)})"
        raise ValueError(f"{where}: unknown key {show(unknown[0])}{hint}")
    if "seqlens" not in row:
        raise ValueError(f"{where}: a row mapping needs 'seqlens'")
    unpacked = isinstance(row["seqlens"], int) and not isinstance(row["seqlens"], bool)
    seqlens = _lengths(where, "seqlens", row["seqlens"])
    padded = seqlens
    if row.get("padded_seqlens") is not None:
        padded = _lengths(where, "padded_seqlens", row["padded_seqlens"])
        if len(padded) != len(seqlens) or any(p < s for p, s in zip(padded, seqlens)):
            raise ValueError(f"{where}: padded_seqlens must pair with seqlens and be >= them")
    total = sum(padded)
    if row.get("pad_to") is not None:
        pad_to = row["pad_to"]
        if isinstance(pad_to, bool) or not isinstance(pad_to, int):
            raise ValueError(f"{where}: pad_to must be an integer, got {show(pad_to)}")
        if pad_to < total:
            raise ValueError(f"{where}: pad_to={pad_to} is shorter than the row ({total} tokens)")
        if unpacked:
            if row.get("padded_seqlens") is not None:
                raise ValueError(f"{where}: give an unpacked sequence pad_to or padded_seqlens, not both")
            padded = (pad_to,)
        total = pad_to
    return Row(seqlens=seqlens, padded_seqlens=padded, num_padded_tokens=total)


@dataclass(frozen=True, kw_only=True)
class SeqStats:
    """Additive statistics of a set of rows: all that the FLOPs formulas read from data.

    ``*_pairs`` are attention pair counts: ``sum s_i^2`` (full attention) and the window band
    ``sum band_pairs(s_i, window)`` (sliding-window layers), real and padded.
    """

    num_sequences: int = 0
    num_tokens: int = 0
    num_padded_tokens: int = 0
    sum_seqlen_squared: int = 0
    sum_padded_seqlen_squared: int = 0
    window_pairs: int = 0
    padded_window_pairs: int = 0
    num_rows: int = 0

    def __add__(self, other: SeqStats) -> SeqStats:
        return SeqStats(**{k: getattr(self, k) + getattr(other, k) for k in _STAT_FIELDS})

    @classmethod
    def from_rows(cls, rows: Iterable[Row], *, window: int | None = None) -> SeqStats:
        """Statistics of parsed rows; ``window`` is the model's sliding window (or None)."""
        acc: dict[str, int] = dict.fromkeys(_STAT_FIELDS, 0)
        num_rows = num_sequences = tokens = padded_tokens = squares = padded_squares = band = padded_band = 0
        for row in rows:
            real, padded = row.seqlens, row.padded_seqlens
            num_rows += 1
            num_sequences += len(real)
            tokens += sum(real)
            padded_tokens += row.num_padded_tokens
            real_squares = sum(map(operator.mul, real, real))
            squares += real_squares
            pad_squares = real_squares if padded is real else sum(map(operator.mul, padded, padded))
            padded_squares += pad_squares
            if window is not None:
                band += sum(band_pairs(s, window) for s in real)
                padded_band += sum(band_pairs(s, window) for s in padded)
        if window is None:  # band_pairs without a window is s^2
            band, padded_band = squares, padded_squares
        acc.update(num_rows=num_rows, num_sequences=num_sequences, num_tokens=tokens, num_padded_tokens=padded_tokens,
                   sum_seqlen_squared=squares, sum_padded_seqlen_squared=padded_squares, window_pairs=band,
                   padded_window_pairs=padded_band)
        return cls(**acc)

    @classmethod
    def full_length(cls, num_sequences: int, seq_length: int, *, window: int | None = None) -> SeqStats:
        """The stock assumption: ``num_sequences`` unpacked rows of exactly ``seq_length``."""
        rows = [Row(seqlens=(seq_length,), padded_seqlens=(seq_length,), num_padded_tokens=seq_length)]
        one = cls.from_rows(rows, window=window)
        return cls(**{k: getattr(one, k) * num_sequences for k in _STAT_FIELDS})


_STAT_FIELDS = tuple(SeqStats.__dataclass_fields__)


# ---- the model side: FLOPs of each component -------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FlopsBreakdown:
    """FLOPs per component (``attn/qkv``, ``attn/core``, ``mlp``, ``moe/routed``, ``logits``, ...);
    the total is their sum."""

    components: Mapping[str, int] = field(default_factory=dict)
    attention: str = "causal"
    include_padding: bool = False

    @property
    def total(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True, kw_only=True)
class Gemm:
    """One forward GEMM (or one group of same-role GEMMs, e.g. every routed expert's fc1) of one layer.

    ``name`` is the megatron-core module that runs it (``linear_qkv``, ``experts.linear_fc1``,
    ``output_layer``, ...; core attention is ``core_attention.scores`` and
    ``core_attention.context``). ``shape`` is ``(rows, in_features, out_features)`` of a linear
    layer, ``None`` for a GEMM of two activations (core attention) or Mamba's scan. A model's
    identical layers share one list (the decoder's :class:`LayerRun`, the DiT's block).
    ``forward_passes``/``backward_passes``: how often training runs a GEMM of ``flops`` forward and
    backward: 1 + 2 (TRAIN_PASSES) for every GEMM of a trained model, except DSA's indexer, whose
    inputs megatron-core detaches.
    """

    key: str
    name: str
    flops: int
    shape: tuple[int, int, int] | None = None
    forward_passes: int = 1
    backward_passes: int = TRAIN_PASSES - 1

    @property
    def has_weight(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True, kw_only=True)
class LayerRun:
    """``count`` consecutive layers that each run the forward GEMMs ``gemms``.

    ``first`` is the 0-based index of the first layer: decoder layers are ``0 .. num_layers - 1``,
    MTP depth ``d`` is ``num_layers + d``; ``None`` for the output layer (once for the decoder,
    once per MTP depth). Repeated layers are one run, so pricing never loops over layers.
    """

    first: int | None
    count: int
    gemms: tuple[Gemm, ...]


def forward_runs(
    spec: ModelSpec, stats: SeqStats, *, attention: str = "causal", include_padding: bool = False
) -> tuple[LayerRun, ...]:
    """The forward GEMMs over ``stats`` in execution order, repeated layers as one run: the
    decoder's runs, the output layer, the MTP depths and their output layers. See the module
    docstring for conventions."""
    apply_attention_convention(0, attention)  # validates the name
    tokens = stats.num_padded_tokens if include_padding else stats.num_tokens
    full_pairs = stats.sum_padded_seqlen_squared if include_padding else stats.sum_seqlen_squared
    band = stats.padded_window_pairs if include_padding else stats.window_pairs
    layer = _LayerGemms(spec, tokens, full_pairs, band, attention)
    runs = [LayerRun(first=first, count=count, gemms=layer(kind, "")) for kind, count, first in _firsts(spec.layer_runs)]
    # Output layer: [T, h] @ [h, V_padded].
    logits = _Gemms()
    _linear(logits, "logits", "output_layer", tokens, spec.hidden_size, spec.padded_vocab_size)
    runs.append(LayerRun(first=None, count=1, gemms=tuple(logits)))
    if spec.mtp_num_layers:
        depth = _Gemms()
        # MTP eh_proj: concat(embedding, hidden) [T, 2h] @ [2h, h].
        # NB: the enorm/hnorm/final norms that Megatron-LM prices (3h per token) run no GEMM.
        _linear(depth, "mtp/eh_proj", "eh_proj", tokens, 2 * spec.hidden_size, spec.hidden_size)
        for kind, count in spec.mtp_layer_runs:
            depth.extend(layer(kind, "mtp/") * count)
        runs.append(LayerRun(first=spec.num_layers, count=spec.mtp_num_layers, gemms=tuple(depth)))
        # The shared output layer runs again on every MTP depth.
        mtp_logits = _Gemms()
        _linear(mtp_logits, "mtp/logits", "output_layer", tokens, spec.hidden_size, spec.padded_vocab_size)
        runs.append(LayerRun(first=None, count=spec.mtp_num_layers, gemms=tuple(mtp_logits)))
    return tuple(runs)


def _firsts(layer_runs: Sequence[tuple[tuple[str, str], int]]) -> Iterable[tuple[tuple[str, str], int, int]]:
    first = 0
    for kind, count in layer_runs:
        yield kind, count, first
        first += count


class _LayerGemms:
    """The forward GEMMs of one layer kind ``(mixer, ffn)``, each kind built once."""

    def __init__(self, spec: ModelSpec, tokens: int, full_pairs: int, band: int, attention: str) -> None:
        self.spec, self.tokens, self.full_pairs, self.band, self.attention = spec, tokens, full_pairs, band, attention
        self.cache: dict[tuple[str, str, str], tuple[Gemm, ...]] = {}

    def __call__(self, kind: tuple[str, str], prefix: str) -> tuple[Gemm, ...]:
        if (prefix, *kind) not in self.cache:
            self.cache[(prefix, *kind)] = self._build(kind, prefix)
        return self.cache[(prefix, *kind)]

    def _build(self, kind: tuple[str, str], prefix: str) -> tuple[Gemm, ...]:
        spec, tokens = self.spec, self.tokens
        mixer, ffn = kind
        out = _Gemms()
        if mixer in ("attention", "window"):
            pairs = self.band if mixer == "window" else self.full_pairs
            _attention(out, spec, tokens, pairs, self.attention, prefix)
        elif mixer == "mamba":
            _mamba(out, spec, tokens, prefix)
        elif mixer == "gdn":
            _gdn(out, spec, tokens, prefix)
        elif mixer == "kda":
            _kda(out, spec, tokens, prefix)
        elif mixer in ("dsa", "dsa_shared"):
            _dsa(out, spec, tokens, (self.full_pairs, self.band), self.attention, prefix, indexer=mixer == "dsa")
        if ffn == "mlp":
            _mlp(out, spec, tokens, prefix)
        elif ffn == "moe":
            _moe(out, spec, tokens, prefix)
        return tuple(out)


def forward_flops(
    spec: ModelSpec, stats: SeqStats, *, attention: str = "causal", include_padding: bool = False
) -> dict[str, int]:
    """Forward-pass FLOPs per component over ``stats``: :func:`forward_runs` summed by key."""
    return _summed(spec, stats, attention, include_padding, lambda g: g.forward_passes)


def _summed(spec: ModelSpec, stats: SeqStats, attention: str, include_padding: bool,
            passes: Callable[[Gemm], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for run in forward_runs(spec, stats, attention=attention, include_padding=include_padding):
        for g in run.gemms:
            out[g.key] = out.get(g.key, 0) + run.count * g.flops * passes(g)
    return out


def training_flops(
    spec: ModelSpec, stats: SeqStats, *, attention: str = "causal", include_padding: bool = False
) -> FlopsBreakdown:
    """Forward + backward FLOPs per component: TRAIN_PASSES x the forward GEMMs (each GEMM's
    ``forward_passes + backward_passes``)."""
    return FlopsBreakdown(
        components=_summed(spec, stats, attention, include_padding, lambda g: g.forward_passes + g.backward_passes),
        attention=attention,
        include_padding=include_padding,
    )


def estimate(
    spec: ModelSpec, rows: Sequence[Row], *, attention: str = "causal", include_padding: bool = False
) -> FlopsBreakdown:
    """Training FLOPs of one pass over parsed ``rows``."""
    stats = SeqStats.from_rows(rows, window=spec.pair_window)
    return training_flops(spec, stats, attention=attention, include_padding=include_padding)


class _Gemms(list[Gemm]):
    """The forward GEMMs of one layer, in execution order."""

    def __call__(self, key: str, name: str, flops: int, shape: tuple[int, int, int] | None = None,
                 passes: tuple[int, int] = (1, TRAIN_PASSES - 1)) -> None:
        assert shape is None or flops == gemm(*shape)
        self.append(Gemm(key=key, name=name, flops=flops, shape=shape, forward_passes=passes[0],
                         backward_passes=passes[1]))


def _linear(add: _Gemms, key: str, name: str, rows: int, d_in: int, d_out: int,
            passes: tuple[int, int] = (1, TRAIN_PASSES - 1)) -> None:
    add(key, name, gemm(rows, d_in, d_out), (rows, d_in, d_out), passes)


def _attention(add: _Gemms, spec: ModelSpec, tokens: int, pairs: int, attention: str, prefix: str) -> None:
    h, nq = spec.hidden_size, spec.num_attention_heads
    key = f"{prefix}attn/qkv"
    if spec.mla is None:
        d, ng = spec.kv_channels, spec.num_query_groups
        gate = nq * d if spec.attention_output_gate else 0
        # linear_qkv: [T, h] @ [h, (nq + 2*ng)*d (+ nq*d output gate)].
        _linear(add, key, "linear_qkv", tokens, h, (nq + 2 * ng) * d + gate)
        qk_dim, v_dim = d, d
    else:
        _mla_projections(add, spec, tokens, key)
        qk_dim, v_dim = spec.mla.qk_head_dim + spec.mla.qk_pos_emb_head_dim, spec.mla.v_head_dim
    # Per head: scores [s, qk] @ [qk, s] and context [s, s] @ [s, v], summed over sequences as
    # pair counts: FLOPS_PER_MAC * nq * qk * pairs and FLOPS_PER_MAC * nq * v * pairs.
    for name, dim in (("core_attention.scores", qk_dim), ("core_attention.context", v_dim)):
        add(f"{prefix}attn/core", name, apply_attention_convention(attention_gemm(nq, dim, pairs), attention))
    # linear_proj: [T, nq*v] @ [nq*v, h].
    _linear(add, f"{prefix}attn/out", "linear_proj", tokens, nq * v_dim, h)


def _mla_projections(add: _Gemms, spec: ModelSpec, tokens: int, key: str) -> None:
    mla = spec.mla
    assert mla is not None
    h, nq = spec.hidden_size, spec.num_attention_heads
    qk_dim = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    if mla.q_lora_rank is None:
        # linear_q_proj: [T, h] @ [h, nq*(qk + rope)].
        _linear(add, key, "linear_q_proj", tokens, h, nq * qk_dim)
    else:
        # linear_q_down_proj [T, h] @ [h, q_lora]; linear_q_up_proj [T, q_lora] @ [q_lora, nq*(qk + rope)].
        # NB: the q/kv layernorms that Megatron-LM prices (+1 per rank) run no GEMM.
        _linear(add, key, "linear_q_down_proj", tokens, h, mla.q_lora_rank)
        _linear(add, key, "linear_q_up_proj", tokens, mla.q_lora_rank, nq * qk_dim)
    # linear_kv_down_proj [T, h] @ [h, kv_lora + rope]; linear_kv_up_proj [T, kv_lora] @ [kv_lora, nq*(qk + v)].
    _linear(add, key, "linear_kv_down_proj", tokens, h, mla.kv_lora_rank + mla.qk_pos_emb_head_dim)
    _linear(add, key, "linear_kv_up_proj", tokens, mla.kv_lora_rank, nq * (mla.qk_head_dim + mla.v_head_dim))


def _kda(add: _Gemms, spec: ModelSpec, tokens: int, prefix: str) -> None:
    """Kimi Delta Attention as transformers' Kimi Linear runs it: GDN with a per-channel decay."""
    k = spec.kda
    assert k is not None
    h, d, dim = spec.hidden_size, k.head_dim, k.num_heads * k.head_dim
    # q_proj, k_proj, v_proj: [T, h] @ [h, H*d] each; b_proj (beta): [T, h] @ [h, H].
    for name in ("q_proj", "k_proj", "v_proj"):
        _linear(add, f"{prefix}kda/in_proj", name, tokens, h, dim)
    _linear(add, f"{prefix}kda/in_proj", "b_proj", tokens, h, k.num_heads)
    # Low-rank forget gate and output gate: [T, h] @ [h, d] then [T, d] @ [d, H*d], each.
    for a, b in (("forget_gate.f_a_proj", "forget_gate.f_b_proj"), ("g_a_proj", "g_b_proj")):
        _linear(add, f"{prefix}kda/gates", a, tokens, h, d)
        _linear(add, f"{prefix}kda/gates", b, tokens, d, dim)
    # Depthwise causal convolution over the 3*H*d channels of q, k, v (see _gdn).
    add(f"{prefix}kda/conv", "conv1d", FLOPS_PER_MAC * tokens * 3 * dim * k.conv_kernel_dim)
    # NB: the delta rule's convention of gdn/core, with a [d, d] state per head.
    add(f"{prefix}kda/core", "delta_rule", gdn_core_flops(tokens, k.num_heads, d, d))
    # o_proj: [T, H*d] @ [H*d, h] after the gated RMSNorm.
    _linear(add, f"{prefix}kda/out_proj", "o_proj", tokens, dim, h)


def _dsa(add: _Gemms, spec: ModelSpec, tokens: int, pairs: tuple[int, int], attention: str, prefix: str, *,
         indexer: bool) -> None:
    """DeepSeek sparse attention as megatron-core 0.19 runs it (absorbed MLA + lightning indexer);
    ``indexer=False``: a layer that reuses an earlier layer's top-k (and its loss)."""
    mla, dsa = spec.mla, spec.dsa
    assert mla is not None and dsa is not None
    full_pairs, band = pairs
    h, nq = spec.hidden_size, spec.num_attention_heads
    # NB: absorbed MLA runs the kv up-projection as two einsums (q_nope @ W_UK, context @ W_UV) of the
    # same MACs as linear_kv_up_proj over every token: priced under that name.
    _mla_projections(add, spec, tokens, f"{prefix}attn/qkv")
    # Sparse core over the latent: scores [s, kv_lora + rope] @ [., topk keys], context over kv_lora;
    # ``band`` counts min(i, topk) keys per query as a causal band of topk - 1 (the attention convention).
    # NB: megatron-core's unfused path computes every score and masks; a sparse kernel runs these pairs.
    for name, dim in (("core_attention.scores", mla.kv_lora_rank + mla.qk_pos_emb_head_dim),
                      ("core_attention.context", mla.kv_lora_rank)):
        add(f"{prefix}dsa/core", name, apply_attention_convention(attention_gemm(nq, dim, band), attention))
    _linear(add, f"{prefix}attn/out", "linear_proj", tokens, nq * mla.v_head_dim, h)
    if indexer:
        _dsa_indexer(add, spec, tokens, pairs, attention, prefix)


def _dsa_indexer(add: _Gemms, spec: ModelSpec, tokens: int, pairs: tuple[int, int], attention: str, prefix: str) -> None:
    mla, dsa = spec.mla, spec.dsa
    assert mla is not None and dsa is not None
    h, nq = spec.hidden_size, spec.num_attention_heads
    full_pairs, band = pairs
    # Indexer: linear_wq_b [T, q_lora (h without q_lora)] @ [., nh*d]; linear_wk [T, h] @ [h, d];
    # linear_weights_proj [T, h] @ [h, nh].
    # NB: megatron-core detaches the indexer's inputs: forward, plus the weight gradient only when the
    # indexer loss trains it (dsa_indexer_loss_coeff > 0); top-k is under no_grad otherwise.
    trained = (1, 1 if dsa.trains_indexer else 0)
    key = f"{prefix}dsa/indexer"
    _linear(add, key, "indexer.linear_wq_b", tokens, mla.q_lora_rank or h, dsa.num_heads * dsa.head_dim, trained)
    _linear(add, key, "indexer.linear_wk", tokens, h, dsa.head_dim, trained)
    _linear(add, key, "indexer.linear_weights_proj", tokens, h, dsa.num_heads, trained)
    # Index scores over every causal pair: nh q.k dot products of d and the weighted sum over heads,
    # nh * (d + 1) MACs per pair; forward only, unless the loss trains it: then its backward (2 GEMMs)
    # over the pairs the KL loss touches (every pair, or the selected ones with the sparse loss).
    # NB: ReLU, the Hadamard rotation, top-k selection and the softmax/KL run no GEMM.
    loss_pairs = band if dsa.sparse_loss else full_pairs
    per_pair = dsa.num_heads * (dsa.head_dim + 1)
    add(f"{prefix}dsa/indexer_scores", "indexer.scores",
        apply_attention_convention(attention_gemm(1, per_pair, full_pairs), attention), None, (1, 0))
    if dsa.trains_indexer:
        add(f"{prefix}dsa/indexer_scores", "indexer.scores_grad",
            apply_attention_convention(attention_gemm(1, per_pair, loss_pairs), attention), None, (0, 2))
        # The loss's target: main-model scores from detached q and k, [s, kv_lora + rope] per head, forward only.
        add(f"{prefix}dsa/indexer_loss", "indexer_loss.scores", apply_attention_convention(
            attention_gemm(nq, mla.kv_lora_rank + mla.qk_pos_emb_head_dim, loss_pairs), attention), None, (1, 0))


def _mlp(add: _Gemms, spec: ModelSpec, tokens: int, prefix: str) -> None:
    _ffn(add, f"{prefix}mlp", "", spec, tokens, spec.hidden_size, spec.ffn_hidden_size)


def _ffn(add: _Gemms, key: str, module: str, spec: ModelSpec, tokens: int, d_in: int, ffn: int) -> None:
    # linear_fc1: [T, d] @ [d, ffn (x2 gated)]; linear_fc2: [T, ffn] @ [ffn, d].
    _linear(add, key, f"{module}linear_fc1", tokens, d_in, ffn * (2 if spec.gated_linear_unit else 1))
    _linear(add, key, f"{module}linear_fc2", tokens, ffn, d_in)


def _moe(add: _Gemms, spec: ModelSpec, tokens: int, prefix: str) -> None:
    moe = spec.moe
    assert moe is not None
    h = spec.hidden_size
    # Router: [T, h] @ [h, E].
    # NB: Megatron-LM's and Megatron-Bridge's formulas omit this GEMM.
    _linear(add, f"{prefix}moe/router", "router", tokens, h, moe.num_experts)
    d_in = h
    if moe.latent_size is not None:
        # fc1_latent_proj [T, h] @ [h, latent] before dispatch; fc2_latent_proj after combine.
        _linear(add, f"{prefix}moe/latent", "fc1_latent_proj", tokens, h, moe.latent_size)
        d_in = moe.latent_size
    # Routed experts: each token runs top-k expert MLPs.
    # NB: dropless routing; a capacity factor that drops tokens lowers the executed count.
    _ffn(add, f"{prefix}moe/routed", "experts.", spec, tokens * moe.router_topk, d_in, moe.ffn_hidden_size)
    if moe.latent_size is not None:
        _linear(add, f"{prefix}moe/latent", "fc2_latent_proj", tokens, moe.latent_size, h)
    if moe.shared_expert_ffn_hidden_size:
        _ffn(add, f"{prefix}moe/shared", "shared_experts.", spec, tokens, h, moe.shared_expert_ffn_hidden_size)
        if moe.shared_expert_gate:
            # Shared-expert gate: [T, h] @ [h, 1].
            _linear(add, f"{prefix}moe/shared", "shared_experts.gate_weight", tokens, h, 1)


def _mamba(add: _Gemms, spec: ModelSpec, tokens: int, prefix: str) -> None:
    m = spec.mamba
    assert m is not None
    h = spec.hidden_size
    d_inner = 2 * h
    # in_proj: [T, h] @ [h, 2*d_inner + 2*groups*state + heads] (z, x, B, C, dt).
    _linear(add, f"{prefix}mamba/in_proj", "in_proj", tokens, h, 2 * d_inner + 2 * m.num_groups * m.state_dim + m.num_heads)
    # NB: not a GEMM; Megatron-LM's estimate of the SSD scan, 7 FLOPs per (token, channel, state).
    add(f"{prefix}mamba/scan", "scan", 7 * tokens * d_inner * m.state_dim)
    # out_proj: [T, d_inner] @ [d_inner, h].
    _linear(add, f"{prefix}mamba/out_proj", "out_proj", tokens, d_inner, h)


# The Gated DeltaNet core's convention: MACs per (token, value head) per key x value state entry.
GDN_CORE_MACS_PER_STATE_ENTRY = 4


def gdn_core_flops(tokens: int, num_value_heads: int, key_head_dim: int, value_head_dim: int) -> int:
    """Forward FLOPs of the gated delta rule under this project's convention (``gdn/core``).

    NB: a convention, not a measurement (the recurrence has no agreed count). Per token and value
    head, 4 MACs per entry of the ``[d_k, d_v]`` state: Megatron-LM's and Megatron-Bridge's "KK^T,
    VK^T, S(a(I-bKK^T)), SQ", with ``d_k * d_v`` where they write ``d_v ** 2`` (equal when
    ``d_k == d_v``, as in every released GDN model). Token-linear: chunking and the triangular
    solve of a chunked kernel are not counted. docs/attention-variants.md compares it with what
    the chunked torch kernel executes.
    """
    return FLOPS_PER_MAC * GDN_CORE_MACS_PER_STATE_ENTRY * tokens * num_value_heads * key_head_dim * value_head_dim


def _gdn(add: _Gemms, spec: ModelSpec, tokens: int, prefix: str) -> None:
    g = spec.gdn
    assert g is not None
    h = spec.hidden_size
    qk_dim, v_dim = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
    # in_proj: [T, h] @ [h, 2*qk + 2*v + 2*nv] (q, k, v, the output gate z, beta, alpha); HF splits it
    # into in_proj_qkvz and in_proj_ba, the same FLOPs.
    _linear(add, f"{prefix}gdn/in_proj", "in_proj", tokens, h, 2 * qk_dim + 2 * v_dim + 2 * g.num_value_heads)
    # conv1d: a depthwise causal convolution of width K over the 2*qk + v channels of q, k, v:
    # K MACs per (token, channel).
    # NB: not a GEMM. torch's F.conv1d with padding K - 1 (HF's fallback, megatron's deterministic mode)
    # also computes K - 1 discarded outputs per sequence; FlopCounterMode's wgrad formula ignores groups.
    add(f"{prefix}gdn/conv", "conv1d", FLOPS_PER_MAC * tokens * (2 * qk_dim + v_dim) * g.conv_kernel_dim)
    add(f"{prefix}gdn/core", "gated_delta_rule", gdn_core_flops(tokens, g.num_value_heads, g.key_head_dim,
                                                                 g.value_head_dim))
    # out_proj: [T, v] @ [v, h] after the gated RMSNorm (elementwise).
    _linear(add, f"{prefix}gdn/out_proj", "out_proj", tokens, v_dim, h)
