"""Embeddings (Chapter 3): similarity matrices and 2-D maps of labelled points whose labels do not collide.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from scalebook.plots.style import figure_and_axes


def similarity_heatmap(
    matrix,
    labels: Sequence[str],
    *,
    col_labels: Sequence[str] | None = None,
    title: str = "",
    vmin: float = -1.0,
    vmax: float = 1.0,
    annotate: bool = True,
    ax=None,
):
    """A matrix of similarities (rows x columns) as a diverging heatmap, each cell printed to 2 decimals."""
    fig, ax = figure_and_axes(ax)
    values = [[float(v) for v in row] for row in matrix]
    col_labels = labels if col_labels is None else col_labels
    image = ax.imshow(values, cmap="RdBu_r", vmin=vmin, vmax=vmax)
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=45, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(len(labels)), labels)
    ax.grid(False)
    if annotate:
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                # White text on the saturated ends of the colour map, black in the pale middle.
                strong = abs(v - (vmin + vmax) / 2) > 0.35 * (vmax - vmin)
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if strong else "black")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, shrink=0.8)
    return fig


def labelled_scatter(
    points,
    labels: Sequence[str],
    groups: Sequence[str],
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    ax=None,
):
    """2-D points coloured by group, each with a text label placed where it overlaps no other label."""
    fig, ax = figure_and_axes(ax)
    xy = [(float(p[0]), float(p[1])) for p in points]
    colors = plt.get_cmap("tab10").colors
    for k, group in enumerate(dict.fromkeys(groups)):
        members = [i for i, g in enumerate(groups) if g == group]
        ax.scatter(
            [xy[i][0] for i in members], [xy[i][1] for i in members], color=colors[k % 10], label=group, s=25, zorder=3
        )
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="best")
    _place_labels(ax, xy, labels)
    return fig


def _place_labels(ax, xy, labels, fontsize: int = 7):
    """Greedy label placement: try offsets around each point, nearest first, and keep the first whose
    text box overlaps no earlier label (or, in a crowd, the one that overlaps least)."""
    offsets = [(dx, dy) for dy in (3, -9, 10, -16, 17, -23, 24, -30) for dx in (4, -4)]
    fig = ax.figure
    fig.canvas.draw()  # settles the autoscaled limits, so data points map to their final pixels
    renderer = fig.canvas.get_renderer()
    placed = []

    def overlap_area(box):
        return sum(
            max(0.0, min(box.x1, o.x1) - max(box.x0, o.x0)) * max(0.0, min(box.y1, o.y1) - max(box.y0, o.y0))
            for o in placed
        )

    for (x, y), text in zip(xy, labels, strict=True):
        candidates = []
        for dx, dy in offsets:
            annotation = ax.annotate(
                text,
                (x, y),
                xytext=(dx, dy),
                textcoords="offset points",
                fontsize=fontsize,
                ha="left" if dx > 0 else "right",
            )
            box = annotation.get_window_extent(renderer).expanded(1.02, 1.1)
            annotation.remove()
            candidates.append((overlap_area(box), (dx, dy), box))
            if candidates[-1][0] == 0.0:
                break
        _, (dx, dy), box = min(candidates, key=lambda c: c[0])
        # A label pushed away from its point gets a faint leader line back to it.
        far = abs(dy) > 9
        leader = dict(arrowstyle="-", color="0.6", linewidth=0.5, shrinkA=0, shrinkB=2) if far else None
        ax.annotate(
            text,
            (x, y),
            xytext=(dx, dy),
            textcoords="offset points",
            fontsize=fontsize,
            ha="left" if dx > 0 else "right",
            arrowprops=leader,
        )
        placed.append(box)
