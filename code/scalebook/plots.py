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


def similarity_heatmap(matrix, labels: Sequence[str], *, col_labels: Sequence[str] | None = None,
                       title: str = "", vmin: float = -1.0, vmax: float = 1.0, annotate: bool = True,
                       ax=None):
    """A matrix of similarities (rows x columns) as a diverging heatmap, each cell printed to 2 decimals."""
    fig, ax = _figure(ax)
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
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if strong else "black")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, shrink=0.8)
    return fig


def labelled_scatter(points, labels: Sequence[str], groups: Sequence[str], *, title: str = "",
                     xlabel: str = "", ylabel: str = "", ax=None):
    """2-D points coloured by group, each with a text label placed where it overlaps no other label."""
    fig, ax = _figure(ax)
    xy = [(float(p[0]), float(p[1])) for p in points]
    colors = plt.get_cmap("tab10").colors
    for k, group in enumerate(dict.fromkeys(groups)):
        members = [i for i, g in enumerate(groups) if g == group]
        ax.scatter([xy[i][0] for i in members], [xy[i][1] for i in members], color=colors[k % 10],
                   label=group, s=25, zorder=3)
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
            annotation = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                                     fontsize=fontsize, ha="left" if dx > 0 else "right")
            box = annotation.get_window_extent(renderer).expanded(1.02, 1.1)
            annotation.remove()
            candidates.append((overlap_area(box), (dx, dy), box))
            if candidates[-1][0] == 0.0:
                break
        _, (dx, dy), box = min(candidates, key=lambda c: c[0])
        # A label pushed away from its point gets a faint leader line back to it.
        far = abs(dy) > 9
        leader = dict(arrowstyle="-", color="0.6", linewidth=0.5, shrinkA=0, shrinkB=2) if far else None
        ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                    ha="left" if dx > 0 else "right", arrowprops=leader)
        placed.append(box)


def vocab_tradeoff(
    vocab_sizes: Sequence[int],
    tokens_per_byte: dict[str, Sequence[float]],
    embedding_params: dict[str, Sequence[float]],
    *,
    reference_params: dict[str, float] | None = None,
    title: str = "",
):
    """Two panels against vocabulary size (log scale): tokens per byte of text (left) and embedding-table
    parameters (right, log scale), each a dict of labelled series; ``reference_params`` adds dashed
    horizontal lines, named in the legend, to the right panel."""
    fig, (ax_tokens, ax_params) = plt.subplots(1, 2, figsize=(9.0, 3.6))
    for label, values in tokens_per_byte.items():
        ax_tokens.plot(vocab_sizes, values, marker="o", label=label)
    ax_tokens.set_ylabel("tokens per byte of text")
    ax_tokens.set_ylim(0, None)
    for label, values in embedding_params.items():
        ax_params.plot(vocab_sizes, values, marker="o", label=label)
    for label, value in (reference_params or {}).items():
        ax_params.axhline(value, color="gray", linestyle="--", linewidth=1, label=label)
    ax_params.set_yscale("log")
    ax_params.set_ylabel("embedding parameters (V x d)")
    for ax in (ax_tokens, ax_params):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(vocab_sizes), [f"{v:,}" for v in vocab_sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("vocabulary size V")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def memory_total_and_share(
    bars: dict[str, dict[str, float]],
    *,
    capacity: float,
    capacity_label: str = "",
    unit: float = 1e9,
    unit_label: str = "GB",
    title: str = "",
):
    """Two panels for sizes that span decades: each bar's total on a log axis against ``capacity``
    (left), and what it is made of, as shares of that total (right). ``bars[label][component] = bytes``.

    Stacked segments on a log axis would misstate the parts, so the parts get their own linear panel.
    """
    labels = list(bars)
    components = list(dict.fromkeys(c for parts in bars.values() for c in parts))
    colors = plt.get_cmap("tab10").colors
    height = 0.36 * len(labels) + 1.7
    fig, (ax_total, ax_share) = plt.subplots(
        1, 2, figsize=(9.0, height), sharey=True, gridspec_kw={"width_ratios": [1.25, 1]}
    )
    totals = [sum(bars[label].values()) / unit for label in labels]
    fits = [t * unit <= capacity for t in totals]
    ax_total.barh(labels, totals, color=["0.35" if ok else "0.75" for ok in fits])
    ax_total.set_xscale("log")
    ax_total.axvline(capacity / unit, color="black", linestyle="--", linewidth=1.2)
    ax_total.text(capacity / unit, 1.01, capacity_label, transform=ax_total.get_xaxis_transform(),
                  va="bottom", ha="center", fontsize=9)  # fmt: skip
    for y, (total, ok) in enumerate(zip(totals, fits, strict=True)):
        label = f"{total:,.0f}" if total >= 10 else f"{total:.2g}"
        ax_total.text(total * 1.15, y, label + ("" if ok else "  too big"), va="center", fontsize=8)
    ax_total.set_xlim(min(totals) / 2, max(totals) * 12)
    ax_total.set_xlabel(f"{unit_label} per GPU (log scale)")
    ax_total.set_title("total", fontsize=10, pad=16)
    ax_total.invert_yaxis()
    left = [0.0] * len(labels)
    for i, component in enumerate(components):
        shares = [
            100 * bars[label].get(component, 0.0) / (total * unit)
            for label, total in zip(labels, totals, strict=True)
        ]
        ax_share.barh(labels, shares, left=left, color=colors[i % len(colors)], label=component)
        left = [a + b for a, b in zip(left, shares, strict=True)]
    ax_share.set_xlim(0, 100)
    ax_share.set_xlabel("share of the total (%)")
    ax_share.set_title("made of", fontsize=10, pad=16)
    fig.legend(*ax_share.get_legend_handles_labels(), loc="lower center", ncol=len(components),
               frameon=False, fontsize=9)  # fmt: skip
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
    return fig


def attention_map(weights, query_tokens: Sequence[str], key_tokens: Sequence[str] | None = None, *,
                  title: str = "", ax=None):
    """One head's attention weights (queries x keys) as a heatmap from 0 to 1, tokens on both axes."""
    fig, ax = _figure(ax)
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
    for ax in axes.flat[len(maps):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def softmax_saturation(d_ks: Sequence[int], stats: dict[str, Sequence], *, title: str = ""):
    """Three panels against the head width d_k (log scale): the largest attention weight, the entropy of
    the weights and the gradient norm through the softmax. ``stats[label]`` is a list of objects with
    ``max_weight``, ``entropy`` and ``grad_norm`` (one per d_k)."""
    fig, axes = plt.subplots(1, 3, figsize=(10.0, 3.3))
    panels = [("max_weight", "largest weight in a row"), ("entropy", "entropy of a row (nats)"),
              ("grad_norm", "gradient norm through softmax")]  # fmt: skip
    for ax, (field, label) in zip(axes, panels, strict=True):
        for series, values in stats.items():
            ax.plot(d_ks, [getattr(v, field) for v in values], marker="o", markersize=4, label=series)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("head width $d_k$")
        ax.set_title(label, fontsize=10)
        ax.set_ylim(0, None)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def loglog_scaling(x: Sequence[float], measured: dict[str, Sequence[float]], *,
                   reference: dict[str, Sequence[float]] | None = None, xlabel: str = "", ylabel: str = "",
                   title: str = "", ax=None):
    """Measured series (markers) and formula or fitted lines (dashed) against ``x``, both axes log."""
    fig, ax = _figure(ax)
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


def next_token_bars(
    distributions: dict[str, Sequence[float]], token_labels: Sequence[str], *, title: str = "", ax=None
):
    """Grouped bars: the probability of a few candidate next tokens (``token_labels``) under each of
    several sampling settings (``distributions[setting][i]`` is the probability of token ``i``)."""
    fig, ax = _figure(ax)
    n_settings = len(distributions)
    width = 0.8 / n_settings
    positions = range(len(token_labels))
    for i, (label, probs) in enumerate(distributions.items()):
        ax.bar([x + (i - (n_settings - 1) / 2) * width for x in positions], probs, width=width, label=label)
    ax.set_xticks(list(positions), token_labels)
    ax.set_xlabel("candidate next token")
    ax.set_ylabel("probability")
    ax.set_title(title)
    ax.legend(fontsize=9)
    return fig


def cumulative_mass(
    distributions: dict[str, Sequence[float]],
    *,
    p_levels: Sequence[float] = (),
    max_rank: int | None = None,
    title: str = "",
    ax=None,
):
    """Probability mass of the r most probable tokens against r, one curve per distribution.

    A dotted line at each top-p level ``p``: where a curve first reaches it is the size of that
    distribution's nucleus.
    """
    fig, ax = _figure(ax)
    for label, probs in distributions.items():
        ranked = sorted(probs, reverse=True)[:max_rank]
        mass, running = [], 0.0
        for p in ranked:
            running += p
            mass.append(running)
        ax.step(range(1, len(mass) + 1), mass, where="post", label=label)
    for level in p_levels:
        ax.axhline(level, color="grey", linestyle=":", linewidth=1)
        ax.text(1.0, level, f"p = {level:g}", transform=ax.get_yaxis_transform(), ha="right", va="bottom",
                fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("number of most probable tokens kept")
    ax.set_ylabel("probability mass kept")
    ax.set_title(title)
    ax.legend(fontsize=9, loc="lower right")
    return fig
