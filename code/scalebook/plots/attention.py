"""Attention (Chapter 4): one head's weights, a grid of heads, and how the softmax saturates with width.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from scalebook.plots.style import figure_and_axes


def attention_map(
    weights, query_tokens: Sequence[str], key_tokens: Sequence[str] | None = None, *, title: str = "", ax=None
):
    """One head's attention weights (queries x keys) as a heatmap from 0 to 1, tokens on both axes."""
    fig, ax = figure_and_axes(ax)
    key_tokens = query_tokens if key_tokens is None else key_tokens
    ax.imshow([[float(v) for v in row] for row in weights], cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize=8)
    ax.set_yticks(range(len(query_tokens)), query_tokens, fontsize=8)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.grid(False)
    ax.set_title(title, fontsize=10)
    return fig


def attention_map_grid(maps: dict[str, object], tokens: Sequence[str], *, ncols: int = 2, title: str = ""):
    """Several heads' maps for one sentence, ``maps[panel title] = (T, T) weights``, in a grid."""
    nrows = -(-len(maps) // ncols)
    size = 0.22 * len(tokens) + 1.6
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * size, nrows * size), squeeze=False)
    for ax, (panel, weights) in zip(axes.flat[: len(maps)], maps.items(), strict=True):
        attention_map(weights, tokens, title=panel, ax=ax)
    for ax in axes.flat[len(maps) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def softmax_saturation(d_ks: Sequence[int], stats: dict[str, Sequence], *, title: str = ""):
    """Four panels against the head width d_k (log scale): the largest attention weight, the entropy of the
    weights, the gradient norm with respect to the scores, and the gradient norm that reaches a query (mean
    over the queries, solid, and median, dotted, on a log scale). ``stats[label]`` is a list of
    :class:`scalebook.attention.SoftmaxStats` (one per d_k)."""
    fig, grid = plt.subplots(2, 2, figsize=(10.0, 6.2))
    axes = grid.ravel()
    panels = [("max_weight", "largest weight in a row"), ("entropy", "entropy of a row (nats)"),
              ("score_grad_norm", "||dL/dS||, S the scores")]  # fmt: skip
    for ax, (field, label) in zip(axes, panels, strict=False):
        for series, values in stats.items():
            ax.plot(d_ks, [getattr(v, field) for v in values], marker="o", markersize=4, label=series)
        ax.set_title(label, fontsize=10)
        ax.set_ylim(0, None)
    ax = axes[3]
    for color, values in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], stats.values(), strict=False):
        ax.plot(d_ks, [v.query_grad_norm for v in values], marker="o", markersize=4, color=color)
        ax.plot(d_ks, [v.query_grad_median for v in values], linestyle=":", marker=".", color=color)
    ax.set_yscale("log")
    ax.set_title("||dL/dq||: mean (solid), median (dotted)", fontsize=10)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("head width $d_h$")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
