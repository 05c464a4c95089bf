"""The book's figures. Each function draws on a fresh figure (or a given axis) and returns the figure.

All of them, and every figure a chapter draws itself, use one style: ``scalebook.mplstyle`` next to this
file (sizes, fonts, an opaque white background that reads on light and dark pages, grid, colours).
:func:`scalebook.notebook.setup` applies it; call :func:`use_style` to get it in your own scripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt

STYLE = Path(__file__).resolve().parent.parent / "scalebook.mplstyle"


def use_style() -> None:
    """Apply the book's matplotlib style (``STYLE``) to every figure drawn from now on."""
    plt.style.use(STYLE)


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
        left = [a + b for a, b in zip(left, widths, strict=True)]
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
    ax_params.set_ylabel("embedding parameters (V x h)")
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
        ax.set_xlabel("head width $d_h$")
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


def pipeline_gantt(rows, *, title: str = "", time_label: str = "time", labels: bool = True, ax=None):
    """A pipeline timeline: a lane per rank, a box per forward (F) or backward (B; or I and W when the
    backward is split) of one micro-batch, numbered by micro-batch.

    ``rows[rank]`` is a list of ``(start, end, kind, micro-batch, chunk)``; a rank's later model chunks
    (interleaved schedules) are drawn in lighter shades of the same colour. Empty lane space is bubble;
    ``kind="recv"`` items (a measured rank waiting for a message) are drawn as thin grey lines in it.
    """
    import matplotlib.colors as mcolors
    from matplotlib.patches import Patch

    new_figure = ax is None
    fig, ax = _figure(ax)
    colors = {"F": "tab:blue", "B": "tab:green", "I": "tab:olive", "W": "tab:orange"}
    names = {
        "F": "forward",
        "B": "backward",
        "I": "backward (input)",
        "W": "backward (weights)",
        "recv": "waiting to receive",
    }
    span = max((end for row in rows for _, end, *_ in row), default=1.0)
    seen, n_chunks = [], 1 + max((item[4] for row in rows for item in row), default=0)
    for rank, row in enumerate(rows):
        for start, end, kind, microbatch, chunk in row:
            if kind not in seen:
                seen.append(kind)
            if kind == "recv":
                ax.broken_barh([(start, end - start)], (rank - 0.05, 0.1), facecolors="0.6")
                continue
            base = mcolors.to_rgb(colors[kind])
            shade = 0.55 * chunk / max(1, n_chunks - 1)  # mix with white: later chunks lighter
            color = tuple(c + (1 - c) * shade for c in base)
            ax.broken_barh(
                [(start, end - start)], (rank - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.6
            )
            if labels and end - start > 0.012 * span:
                ax.text(
                    (start + end) / 2,
                    rank,
                    str(microbatch),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if shade < 0.3 else "black",
                )
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    # Panels sharing the time axis (sharex=True) must all fit: keep the longest span drawn so far.
    ax._scalebook_span = span
    longest = max(getattr(a, "_scalebook_span", 0.0) for a in ax.get_shared_x_axes().get_siblings(ax))
    ax.set_xlim(0, longest * 1.01)
    ax.grid(axis="y", visible=False)
    ax.set_xlabel(time_label)
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=colors.get(k, "0.6"), label=names[k]) for k in seen]
    if n_chunks > 1:
        handles.append(
            Patch(color=tuple(c + (1 - c) * 0.55 for c in mcolors.to_rgb("tab:grey")), label="later chunk (lighter)")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if new_figure:
        fig.tight_layout()
    return fig


def bubble_vs_microbatches(
    formula: dict[str, tuple[Sequence[float], Sequence[float]]],
    measured: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str = "",
    ax=None,
):
    """Pipeline bubble fraction against the number of micro-batches: each schedule's formula as a line
    (``formula[name] = (Ms, fractions)``) and its measured values as markers in the same colour."""
    fig, ax = _figure(ax)
    colors = plt.get_cmap("tab10").colors
    markers = "osD^v"
    for i, name in enumerate(dict.fromkeys([*formula, *measured])):
        color = colors[i % len(colors)]
        if name in formula:
            ax.plot(*formula[name], color=color, linestyle="--", linewidth=1.2, label=f"{name}: formula")
        if name in measured:
            ax.plot(
                *measured[name],
                color=color,
                linestyle="none",
                marker=markers[i % len(markers)],
                markersize=6,
                label=f"{name}: measured",
            )
    ms = sorted({m for xs, _ in [*formula.values(), *measured.values()] for m in xs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches per step $m$")
    ax.set_ylabel("bubble: idle share of the step")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def collective_before_after(cases: dict, *, owner=None, title: str = "", cell: float = 0.3):
    """Each rank's buffer before (left) and after (right) a collective, one row of axes per collective.

    ``cases[name] = (before, after)``, each a list over ranks of the values a rank holds (``None``: the rank
    holds no such buffer, drawn as a dash). A cell per element shows its value; ``owner(value)`` names the
    rank a value came from and colours the cell like that rank's label; values it returns ``None`` for
    (sums of several ranks' values) are grey.
    """
    from matplotlib.patches import Rectangle

    colors = plt.get_cmap("tab10").colors
    n_ranks = max(len(buffers) for pair in cases.values() for buffers in pair)
    widths = [tuple(max(len(v or [None]) for v in buffers) for buffers in pair) for pair in cases.values()]
    gap, margin = 3.0, 3.2  # cells between the two sides; room for the rank labels
    span = max(before + gap + after for before, after in widths)
    fig, axes = plt.subplots(len(cases), 1, squeeze=False,
                             figsize=((span + margin) * cell, len(cases) * (n_ranks + 1.8) * cell + 0.4))  # fmt: skip
    for ax, (name, pair), (width_before, _) in zip(axes[:, 0], cases.items(), widths, strict=True):
        for x0, buffers in zip((0.0, width_before + gap), pair, strict=True):
            for rank, values in enumerate(buffers):
                y = n_ranks - 1 - rank
                if values is None:
                    ax.text(x0 + 0.5, y + 0.5, "-", ha="center", va="center", fontsize=8, color="0.4")
                    continue
                for j, value in enumerate(values):
                    who = owner(value) if owner else None
                    face = (*colors[who % 10], 0.4) if who is not None else (0.8, 0.8, 0.8, 1.0)
                    ax.add_patch(Rectangle((x0 + j, y), 1, 1, facecolor=face, edgecolor="white", linewidth=1))
                    ax.text(x0 + j + 0.5, y + 0.5, f"{value:g}", ha="center", va="center", fontsize=6.5)
        for rank in range(n_ranks):
            ax.text(-0.3, n_ranks - rank - 0.5, f"rank {rank}", ha="right", va="center", fontsize=7.5,
                    color=colors[rank % 10])  # fmt: skip
        ax.annotate("", xy=(width_before + gap - 0.5, n_ranks / 2), xytext=(width_before + 0.5, n_ranks / 2),
                    arrowprops={"arrowstyle": "->", "color": "0.3"})  # fmt: skip
        ax.set_title(name, loc="left", fontsize=9, x=0.0)
        ax.set_xlim(-margin, span)
        ax.set_ylim(-0.1, n_ranks + 0.1)
        ax.set_aspect("equal")
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def tensor_parallel_times(
    tps: Sequence[int],
    compute: Sequence[float],
    communication: dict[str, Sequence[float]],
    *,
    node_size: int | None = 8,
    title: str = "",
    ax=None,
):
    """Seconds per layer against the tensor-parallel degree, log-log: ``compute[i]`` at ``tps[i]`` and one
    communication curve per link (``communication[label]``); degrees beyond ``node_size`` are shaded."""
    from matplotlib.ticker import NullLocator

    fig, ax = _figure(ax)
    ax.plot(tps, [1e3 * c for c in compute], "o-", color="black", linewidth=2, label="compute")
    colors = ("tab:green", "tab:red", "tab:blue", "tab:purple")
    for (label, times), color in zip(communication.items(), colors, strict=False):
        ax.plot(tps, [1e3 * t for t in times], "s--", color=color, label=f"communication, {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(tps), [str(t) for t in tps])
    ax.xaxis.set_minor_locator(NullLocator())
    if node_size is not None and max(tps) > node_size:
        ax.axvspan(node_size * 1.15, max(tps) * 1.3, color="0.5", alpha=0.12, linewidth=0)
        ax.text(node_size * 1.25, 0.97, f"more than {node_size} GPUs:\nthe ring leaves the node",
                transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="0.3")  # fmt: skip
    ax.set_xlim(min(tps) / 1.3, max(tps) * 1.3)
    ax.set_xlabel("tensor-parallel degree t")
    ax.set_ylabel("ms per layer (forward + backward)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=3, frameon=False)
    fig.tight_layout()
    return fig


def measured_vs_formula_bars(
    labels: Sequence[str],
    measured: Sequence[float],
    formula: Sequence[float],
    *,
    unit: float = 2**20,
    unit_label: str = "MiB",
    title: str = "",
    ax=None,
):
    """Side-by-side bars of a measured quantity and its closed-form prediction, one pair per label."""
    fig, ax = _figure(ax)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [m / unit for m in measured], width=0.4, color="tab:blue", label="measured")
    ax.bar([i + 0.2 for i in x], [f / unit for f in formula], width=0.4, color="tab:orange", label="formula")
    ax.set_xticks(list(x), list(labels))
    ax.set_ylabel(unit_label)
    ax.set_title(title)
    ax.legend(fontsize=9)
    fig.tight_layout()
    return fig


def zero_memory_vs_dp(
    dp: Sequence[int],
    formula: dict[str, Sequence[float]],
    measured: dict[str, Sequence[tuple[int, float]]],
    *,
    n_params: float,
    mark_dp: int | None = None,
    title: str = "",
    ax=None,
):
    """Model-state bytes per parameter on one device against the data-parallel degree, one line per ZeRO stage.

    ``formula[label]`` holds bytes per parameter at each ``dp``; ``measured[label]`` holds (dp, bytes per
    parameter) points, drawn as markers in the line's colour. The right axis reads the same curves in GB
    for a model of ``n_params`` parameters; ``mark_dp`` draws a vertical guide and labels each line there.
    """
    from matplotlib.ticker import FuncFormatter

    fig, ax = _figure(ax)
    colors = plt.get_cmap("tab10").colors
    for i, (label, values) in enumerate(formula.items()):
        ax.plot(dp, values, color=colors[i], linewidth=1.8, label=f"{label} (formula)")
        points = measured.get(label, [])
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], linestyle="none", marker="o",
                    markersize=7, markerfacecolor="none", markeredgewidth=1.6, color=colors[i])  # fmt: skip
        if mark_dp is not None:
            value = values[list(dp).index(mark_dp)]
            gb = value * n_params / 1e9
            ax.annotate(f"{gb:.0f} GB" if gb >= 100 else f"{gb:.1f} GB", (mark_dp, value), xytext=(5, 3),
                        textcoords="offset points", fontsize=8, color=colors[i])  # fmt: skip
    if mark_dp is not None:
        ax.axvline(mark_dp, color="0.5", linestyle=":", linewidth=1)
    ax.plot([], [], linestyle="none", marker="o", markerfacecolor="none", color="0.3", label="measured (tiny GPT)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel degree $d$")
    ax.set_ylabel("bytes per parameter per device")
    right = ax.secondary_yaxis("right", functions=(lambda b: b * n_params / 1e9, lambda gb: gb * 1e9 / n_params))
    right.set_ylabel(f"GB per device for {n_params / 1e9:.3g}B parameters")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


def step_timeline(
    timelines: dict[str, Sequence[tuple[str, float, float]]],
    *,
    title: str = "",
    unit: float = 1e-3,
    unit_label: str = "ms",
):
    """One training step per setup as a Gantt chart: a compute lane (forward, backward, sync, optimizer)
    above a communication lane (each all-reduce from launch to completion), so that overlap shows as bars
    at the same time in both lanes. ``timelines[setup]`` is a list of ``(kind, start, end)`` in seconds;
    ``kind`` "all-reduce" goes to the communication lane. Each setup's clock starts at its first span."""
    from matplotlib.patches import Patch

    colors = {"forward": "tab:blue", "backward": "tab:orange", "sync": "0.65", "optimizer": "tab:green"}
    comm_colors = ("tab:red", "darkred")  # alternate, so that neighbouring all-reduces stay apart
    height = 0.42 * 2 * len(timelines) + 1.5
    fig, ax = plt.subplots(figsize=(9.0, height))
    ticks, labels = [], []
    for i, (setup, spans) in enumerate(timelines.items()):
        origin = min(start for _, start, _ in spans)
        compute_y, comm_y = 2 * i, 2 * i + 1
        ticks += [compute_y, comm_y]
        labels += [f"{setup}: compute", f"{setup}: all-reduce"]
        comm = sorted((s for s in spans if s[0] == "all-reduce"), key=lambda s: s[1])
        for k, (_, start, end) in enumerate(comm):
            ax.barh(comm_y, (end - start) / unit, left=(start - origin) / unit, height=0.7, color=comm_colors[k % 2])
        for kind, start, end in spans:
            if kind != "all-reduce":
                ax.barh(
                    compute_y,
                    (end - start) / unit,
                    left=(start - origin) / unit,
                    height=0.7,
                    color=colors.get(kind, "tab:purple"),
                )
        if i:
            ax.axhline(compute_y - 0.5, color="0.3", linewidth=0.8)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(len(ticks) - 0.5, -0.5)
    ax.set_xlabel(f"time since the step started ({unit_label})")
    ax.grid(axis="y", visible=False)
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=c, label="sync_gradients()" if k == "sync" else k) for k, c in colors.items()]
    handles.append(Patch(color=comm_colors[0], label="all-reduce (launch to completion)"))
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
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
    fig, ax = _figure(ax)
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


def expert_load_imbalance(histories: dict, *, smooth: int = 5, title: str = "", ax=None):
    """Max over mean expert load per training step, one line per balancing method (moving average of ``smooth``)."""
    import numpy as np

    fig, ax = _figure(ax)
    for name, values in histories.items():
        values = np.asarray(values, dtype=float)
        kernel = np.ones(smooth) / smooth
        smoothed = np.convolve(values, kernel, mode="valid")
        ax.plot(np.arange(smooth - 1, len(values)), smoothed, label=name)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("max load / mean load")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig
