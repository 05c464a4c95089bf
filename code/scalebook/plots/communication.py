"""Communication (Chapters 9, 10): each rank's buffer before and after a collective, one training step's
compute and all-reduce lanes as a timeline, and a per-rank load (bytes, seconds) against the number of ranks.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from scalebook.plots.style import figure_and_axes


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
    names = {"sync": "end of backward: waiting for the all-reduces"}
    handles = [Patch(color=c, label=names.get(k, k)) for k, c in colors.items()]
    handles.append(Patch(color=comm_colors[0], label="all-reduce (launch to completion)"))
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
    return fig


def traffic_vs_ranks(
    formulas: dict[str, tuple[Sequence[int], Sequence[float]]],
    measured: dict[str, tuple[Sequence[int], Sequence[float]]] | None = None,
    *,
    ylabel: str = "",
    title: str = "",
    logy: bool = False,
    ax=None,
):
    """What one rank carries (bytes, seconds) against the number of ranks: each ``formulas[label] = (ranks,
    values)`` as a line, and the ``measured`` values of the same label as markers in its colour (a measured
    label without a formula gets its own colour)."""
    fig, ax = figure_and_axes(ax)
    colors = plt.get_cmap("tab10").colors
    labels = list(dict.fromkeys([*formulas, *(measured or {})]))
    for i, label in enumerate(labels):
        color = colors[i % 10]
        if label in formulas:
            ax.plot(*formulas[label], color=color, linewidth=1.6, label=f"{label} (formula)")
        if measured and label in measured:
            ax.plot(*measured[label], marker="o", markersize=6, linestyle="none", color=color,
                    markeredgecolor="black", label=f"{label} (measured)")  # fmt: skip
    ax.set_xlabel("ranks d")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7.5)
    return fig
