"""Figures for ``compare --plot`` and ``sweep --plot`` (matplotlib, an optional extra: ``[plot]``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_flops.reporting.runs import RunStats


def require_matplotlib(flag: str) -> None:
    """``ValueError`` naming the extra to install when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{flag} needs matplotlib: pip install 'megatron-flops[plot]' (or pip install matplotlib)")


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    return Figure(figsize=(width, height), layout="constrained")


def plot_runs(runs: Sequence[RunStats], path: str) -> None:
    """One panel per run, sharing the y axis: corrected (solid) and static (dashed) TFLOP/s/GPU per
    iteration, warm-up steps in grey, steps that fell back as crosses, the steady-state median
    as a dotted line. Each restart (trace segment) is its own line piece."""
    figure = _figure(9.0, 1.0 + 2.2 * len(runs))
    axes = figure.subplots(len(runs), 1, sharey=True, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs):
        for segment in sorted({s.segment for s in run.steps}):
            steps = [s for s in run.steps if s.segment == segment]
            x = [s.iteration for s in steps]
            corrected = [s.rates["tflops_per_gpu"] for s in steps]
            static = [s.rates["static_tflops_per_gpu"] for s in steps]
            first = segment == 1
            ax.plot(x, corrected, color="C0", lw=1.5, label="corrected" if first else None)
            if any(v is not None for v in static):
                ax.plot(x, [float("nan") if v is None else v for v in static], color="C1", ls="--", lw=1.2,
                        label="static (stock formula)" if first else None)
            warm = [s for s in steps if s.warmup]
            if warm:
                ax.scatter([s.iteration for s in warm], [s.rates["tflops_per_gpu"] for s in warm], color="0.6",
                           s=14, zorder=3, label="warm-up (left out)" if first else None)
            failed = [s for s in steps if not s.ok]
            if failed:
                ax.scatter([s.iteration for s in failed], [s.rates["tflops_per_gpu"] for s in failed], color="C3",
                           marker="x", s=30, zorder=3, label="fell back (left out)" if first else None)
        median, static_median = run.median("tflops_per_gpu"), run.median("static_tflops_per_gpu")
        assert median is not None
        ax.axhline(median, color="C0", ls=":", lw=1.0, label="steady-state median (corrected)")
        title = f"{run.name}: {run.num_steps} steps used, corrected median {median:.4g} TFLOP/s/GPU"
        if static_median is not None:
            title += f" (static {static_median:.4g})"
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylabel("TFLOP/s/GPU")
        ax.grid(alpha=0.3)
    top = max(v for run in runs for s in run.steps
              for v in (s.rates["tflops_per_gpu"], s.rates["static_tflops_per_gpu"]) if v is not None)
    axes[0].set_ylim(0, 1.05 * top)  # shared by every panel
    handles: dict[str, Any] = {}
    for ax in axes:  # one legend for the figure, every kind of mark once
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    figure.legend(handles.values(), handles.keys(), fontsize=7, loc="outside upper center", ncols=len(handles))
    axes[-1].set_xlabel("iteration")
    figure.savefig(path, dpi=110)


@dataclass(frozen=True, kw_only=True)
class SweepBar:
    """One configuration of a sweep as ``sweep --plot`` draws it."""

    label: str
    value: float | None
    static: float | None
    status: str
    chosen: bool


def plot_sweep(bars: Sequence[SweepBar], path: str, *, metric: str, threshold: float | None) -> None:
    """Horizontal bars of every configuration's median ``metric`` (corrected, with the stock
    formula's number beside it when known), the recommended one highlighted, the tolerance
    threshold as a dashed line; configurations without a number are labelled with their status."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    figure = _figure(9.0, 1.4 + 0.45 * len(bars))
    ax = figure.subplots()
    with_static = any(b.static is not None for b in bars)
    height = 0.38 if with_static else 0.6
    rows = list(range(len(bars)))[::-1]  # first configuration on top
    for y, bar in zip(rows, bars):
        if bar.value is None:
            ax.text(0, y, f" {bar.status}", va="center", fontsize=8, color="C3")
            continue
        y_corrected = y + height / 2 if with_static else y
        ax.barh(y_corrected, bar.value, height, color="C2" if bar.chosen else "C0")
        ax.text(bar.value, y_corrected, f" {bar.value:.4g}" + ("  recommended" if bar.chosen else ""),
                va="center", fontsize=8)
        if bar.static is not None:
            ax.barh(y - height / 2, bar.static, height, color="C1", alpha=0.55)
            ax.text(bar.static, y - height / 2, f" {bar.static:.4g}", va="center", fontsize=7, color="0.35")
    handles: list[Any] = [Patch(color="C0", label="corrected median"), Patch(color="C2", label="recommended")]
    if with_static:
        handles.append(Patch(color="C1", alpha=0.55, label="static (stock formula) median"))
    if threshold is not None:
        ax.axvline(threshold, color="0.3", ls="--", lw=1.0)
        handles.append(Line2D([], [], color="0.3", ls="--", lw=1.0, label="tolerance below the fastest"))
    ax.set_yticks(rows, [b.label for b in bars], fontsize=8)
    ax.set_xlabel(metric)
    ax.set_xlim(left=0)
    ax.margins(x=0.2)
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    figure.legend(handles=handles, fontsize=7, loc="outside upper center", ncols=len(handles))
    figure.savefig(path, dpi=110)
