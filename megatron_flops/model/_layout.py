"""Decoder layer layouts as runs ``((value, count), ...)`` of consecutive layers (stdlib only), so
that a layout costs the same for 4 layers or a million: megatron-core's per-layer frequencies and
0/1 lists, and Megatron-LM's pattern strings read without ``eval``."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from megatron_flops.model.inputs import MAX_NESTING, Fields, show

# A real model changes layer kind a few dozen times; far more is a malformed layout.
MAX_LAYER_RUNS = 10_000

Runs = tuple[tuple[Any, int], ...]


class FlagRuns(tuple):  # type: ignore[type-arg]
    """A per-layer 0/1 layout already given as runs ``((flag, count), ...)`` (HF readers)."""


def merged(pairs: Iterable[tuple[Any, int]], what: str) -> Runs:
    out: list[list[Any]] = []
    for value, count in pairs:
        if count <= 0:
            continue
        if out and out[-1][0] == value:
            out[-1][1] += count
        else:
            out.append([value, count])
            if len(out) > MAX_LAYER_RUNS:
                raise ValueError(f"{what} changes layer kind more than {MAX_LAYER_RUNS:,} times")
    return tuple((v, c) for v, c in out)


def repeat(unit: Runs, times: int, what: str) -> Runs:
    """``unit`` concatenated ``times`` times, never expanded past the run limit."""
    unit = merged(unit, what)
    if not unit or times == 0:
        return ()
    if len(unit) == 1:
        return ((unit[0][0], unit[0][1] * times),)
    if len(unit) * times > 2 * MAX_LAYER_RUNS:
        raise ValueError(f"{what} changes layer kind more than {MAX_LAYER_RUNS:,} times")
    return merged(unit * times, what)


def cycle(unit: Runs, total: int, what: str) -> Runs:
    """``unit`` repeated to cover exactly ``total`` layers (the last copy cut short)."""
    period = sum(c for _, c in unit)
    full, rest = divmod(total, period)
    tail: list[tuple[Any, int]] = []
    for value, count in unit:
        if rest <= 0:
            break
        tail.append((value, min(count, rest)))
        rest -= count
    return merged(repeat(unit, full, what) + tuple(tail), what)


def zip_runs(a: Runs, b: Runs) -> Runs:
    """Runs of ``(a_i, b_i)`` pairs of two layouts of one length."""
    out: list[tuple[Any, int]] = []
    i = j = 0
    left_a, left_b = (a[0][1] if a else 0), (b[0][1] if b else 0)
    while i < len(a) and j < len(b):
        n = min(left_a, left_b)
        out.append(((a[i][0], b[j][0]), n))
        left_a -= n
        left_b -= n
        if not left_a:
            i += 1
            left_a = a[i][1] if i < len(a) else 0
        if not left_b:
            j += 1
            left_b = b[j][1] if j < len(b) else 0
    return merged(out, "the layer layout")


def length(runs: Runs) -> int:
    return sum(c for _, c in runs)


class Pattern:
    """Megatron-LM's layer-pattern strings, e.g. ``"([0]*3+[1]*58)"`` or ``"([1]*3+[0]*2)*2"``,
    evaluated as runs without ``eval``: sums of lists, parenthesised groups and integer repeats."""

    def __init__(self, text: str, what: str) -> None:
        self.text, self.what = "".join(text.split()), what
        self.pos = 0

    def runs(self) -> Runs:
        runs = self._sum(0)
        if self.pos != len(self.text):
            self._fail()
        return runs

    def _fail(self) -> None:
        raise ValueError(f"{self.what} {show(self.text)} is not a sum of [0/1, ...]*n terms")

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _take(self, char: str) -> None:
        if self._peek() != char:
            self._fail()
        self.pos += 1

    def _number(self) -> int:
        start = self.pos
        while self._peek().isdigit():
            self.pos += 1
        if start == self.pos or self.pos - start > 18:
            self._fail()
        return int(self.text[start:self.pos])

    def _sum(self, depth: int) -> Runs:
        runs = self._term(depth)
        while self._peek() == "+":
            self.pos += 1
            runs = merged(runs + self._term(depth), self.what)
        return runs

    def _term(self, depth: int) -> Runs:
        times = 1
        while self._peek().isdigit():
            times *= self._number()
            self._take("*")
        runs = self._factor(depth)
        while self._peek() == "*":
            self.pos += 1
            times *= self._number()
        return repeat(runs, times, self.what)

    def _factor(self, depth: int) -> Runs:
        if depth > MAX_NESTING:
            self._fail()
        if self._peek() == "(":
            self.pos += 1
            runs = self._sum(depth + 1)
            self._take(")")
            return runs
        self._take("[")
        values = [self._number()]
        while self._peek() == ",":
            self.pos += 1
            values.append(self._number())
        self._take("]")
        if any(v not in (0, 1) for v in values):
            raise ValueError(f"{self.what} entries must be 0 or 1, got {show(self.text)}")
        return merged(((bool(v), 1) for v in values), self.what)


def layer_flags(f: Fields, key: str, value: Any, num_layers: int, *, every: bool) -> Runs:
    """An int frequency or a 0/1 list of length ``num_layers``, as megatron-core reads them, as
    runs of booleans.

    ``every=True``: layer i (0-based) is set when ``i % freq == 0`` (``moe_layer_freq``);
    ``every=False``: set unless ``(i + 1) % freq == 0`` (``window_attn_skip_freq``). Megatron-LM's
    command-line form, a string such as ``"([0]*3+[1]*58)"`` (or ``"2"``), is read without ``eval``.
    """
    name = repr(f.name(key))
    if isinstance(value, FlagRuns):
        runs = tuple(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.isdigit() and len(text) <= 18:
            return layer_flags(f, key, int(text), num_layers, every=every)
        runs = Pattern(text, f"{f.source}: {name} string").runs()
    elif isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise f.error(f"{name} must be an integer or a list of 0/1, got {show(value)}")
    elif isinstance(value, int):
        if value < 1:
            raise f.error(f"{name} must be >= 1, got {value}")
        unit = ((True, 1), (False, value - 1)) if every else ((True, value - 1), (False, 1))
        return cycle(unit, num_layers, f"{f.source}: {name}")
    else:
        if any(isinstance(v, bool) or v not in (0, 1) for v in value):
            raise f.error(f"{name} entries must be 0 or 1, got {show(list(value))}")
        runs = merged(((bool(v), len(list(group))) for v, group in itertools.groupby(value)), f"{f.source}: {name}")
    if length(runs) != num_layers:
        raise f.error(f"{name} has {length(runs)} entries but the model has {num_layers} layers")
    return runs


def cleared(runs: Runs, indices: list[int], what: str) -> Runs:
    """``runs`` with the layers at sorted ``indices`` set to False."""
    pieces: list[tuple[Any, int]] = []
    start = 0
    k = 0
    for value, count in runs:
        end = start + count
        pos = start
        while k < len(indices) and indices[k] < end:
            pieces += [(value, indices[k] - pos), (False, 1)]
            pos = indices[k] + 1
            k += 1
        pieces.append((value, end - pos))
        start = end
    return merged(pieces, what)
