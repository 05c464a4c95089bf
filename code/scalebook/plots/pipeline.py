"""Pipeline parallelism (Chapter 13): a schedule's timeline per rank, and the bubble against the number of
micro-batches.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from scalebook.plots.style import figure_and_axes


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
    fig, ax = figure_and_axes(ax)
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
    fig, ax = figure_and_axes(ax)
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
