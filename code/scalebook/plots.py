"""The book's figures. Each function draws on a fresh figure (or a given axis) and returns the figure."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt


def loss_curve(losses: Sequence[float], *, smooth: int = 10, title: str = "Training loss", ax=None):
    """Per-step loss (faint) with a moving average over ``smooth`` steps (bold)."""
    fig, ax = _figure(ax)
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


def memory_bars(
    bars: dict[str, dict[str, float]],
    *,
    capacity: float | None = None,
    capacity_label: str = "",
    unit: float = 1e9,
    unit_label: str = "GB",
    title: str = "",
    ax=None,
):
    """Horizontal stacked bars: ``bars[label][component] = bytes``; an optional vertical capacity line."""
    fig, ax = _figure(ax)
    components = list(dict.fromkeys(c for parts in bars.values() for c in parts))
    colors = plt.get_cmap("tab10").colors
    labels = list(bars)
    left = [0.0] * len(labels)
    for i, component in enumerate(components):
        widths = [bars[label].get(component, 0.0) / unit for label in labels]
        ax.barh(labels, widths, left=left, color=colors[i % len(colors)], label=component)
        left = [a + b for a, b in zip(left, widths)]
    if capacity is not None:
        ax.axvline(capacity / unit, color="black", linestyle="--", linewidth=1.2)
        # x in data units, y in axes units: the label sits just above the plot, clear of the bars.
        ax.text(capacity / unit, 1.01, capacity_label, transform=ax.get_xaxis_transform(),
                va="bottom", ha="center", fontsize=9)
    ax.set_xlabel(unit_label)
    ax.set_title(title, pad=18 if capacity is not None else 6)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(components), frameon=False, fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    return fig


def _figure(ax):
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots()
    return fig, ax
