"""Training curves and scaling: the loss per step (Chapter 1), held-out loss of several runs (Chapter 14),
measured against predicted scaling on log axes (Chapters 4, 9, 10).

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from scalebook.plots.style import figure_and_axes


def loss_curve(losses: Sequence[float], *, smooth: int = 10, title: str = "Training loss", ax=None):
    """Per-step loss (faint) with a moving average over ``smooth`` steps (bold)."""
    fig, ax = figure_and_axes(ax)
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="per step")
    if smooth > 1 and len(losses) >= smooth:
        avg = [sum(losses[i - smooth : i]) / smooth for i in range(smooth, len(losses) + 1)]
        ax.plot(range(smooth, len(losses) + 1), avg, color="tab:blue", linewidth=2, label=f"mean of {smooth}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.legend()
    return fig


def validation_curves(
    curves: dict[str, tuple[Sequence[int], Sequence[float]]],
    *,
    styles: dict[str, dict] | None = None,
    ylabel: str = "held-out next-token loss (nats/token)",
    title: str = "",
    ax=None,
):
    """Held-out loss against the optimizer step, one line with markers per run; ``curves`` maps a label to
    ``(steps, losses)``, ``styles`` a label to keyword arguments of ``ax.plot`` (``color``, ``linestyle``). The
    step-0 point (the untrained model) would set the top of the axis, so it is left out."""
    fig, ax = figure_and_axes(ax)
    for label, (steps, losses) in curves.items():
        points = [(s, v) for s, v in zip(steps, losses, strict=True) if s > 0]
        style = {"marker": "o", "markersize": 4, **(styles or {}).get(label, {})}
        ax.plot([s for s, _ in points], [v for _, v in points], label=label, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def loglog_scaling(
    x: Sequence[float],
    measured: dict[str, Sequence[float]],
    *,
    reference: dict[str, Sequence[float]] | None = None,
    xlabel: str = "",
    ylabel: str = "",
    title: str = "",
    ax=None,
):
    """Measured series (markers) and formula or fitted lines (dashed) against ``x``, both axes log."""
    fig, ax = figure_and_axes(ax)
    colors = plt.get_cmap("tab10").colors
    for i, (label, values) in enumerate(measured.items()):
        ax.plot(x, values, marker="o", linestyle="none", color=colors[i % 10], label=label)
    for i, (label, values) in enumerate((reference or {}).items()):
        ax.plot(x, values, linestyle="--", linewidth=1.2, color=colors[i % 10], label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(x), [f"{v:,}" for v in x])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def scaling_curve(
    measured: dict[str, tuple[Sequence[int], Sequence[float]]],
    *,
    predicted: dict[str, tuple[Sequence[int], Sequence[float]]] | None = None,
    kind: str = "strong",
    title: str = "",
    ax=None,
):
    """Scaling against the number of data-parallel ranks d (log2 axis): strong scaling plots the speed-up
    T(1)/T(d) at a fixed global batch (ideal: d), weak scaling the efficiency T(1)/T(d) at a fixed batch per rank
    (ideal: 1). ``measured`` series are drawn solid with markers, ``predicted`` ones dashed; each maps a
    label to ``(ranks, values)``."""
    if kind not in ("strong", "weak"):
        raise ValueError(f"kind must be 'strong' or 'weak', got {kind!r}")
    fig, ax = figure_and_axes(ax)
    series = {**measured, **(predicted or {})}
    ranks = sorted({n for xs, _ in series.values() for n in xs})
    ideal = ranks if kind == "strong" else [1.0] * len(ranks)
    ax.plot(ranks, ideal, color="0.5", linestyle=":", linewidth=1.2, label="ideal")
    for label, (xs, ys) in measured.items():
        ax.plot(xs, ys, marker="o", linewidth=1.5, label=label)
    for label, (xs, ys) in (predicted or {}).items():
        ax.plot(xs, ys, marker="s", markersize=4, linestyle="--", linewidth=1.2, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(n) for n in ranks])
    ax.minorticks_off()
    ax.set_xlabel("data-parallel ranks $d$")
    ax.set_ylabel("speed-up $T(1) / T(d)$" if kind == "strong" else "efficiency $T(1) / T(d)$")
    ax.set_ylim(0, None)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig
