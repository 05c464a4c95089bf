"""Diagnosing a distributed step (Chapter 16): each rank's step split into compute and waiting, and each
rank's timeline as a profiler trace recorded it.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

Intervals = Sequence[tuple[float, float]]


def rank_time_split(
    splits: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    marked: Mapping[str, int | None] | None = None,
    unit: float = 1e-3,
    unit_label: str = "ms",
):
    """One panel per run: each rank's step as a bar of compute followed by waiting in the collective.

    ``splits[run] = (compute, wait)``, seconds per rank (medians over steps, say); ``marked[run]`` names a
    rank to flag (the straggler found) or None.
    """
    height = 0.5 * max(len(compute) for compute, _ in splits.values()) + 1.8
    fig, axes = plt.subplots(1, len(splits), figsize=(4.6 * len(splits), height), sharex=True, squeeze=False)
    for ax, (run, (compute, wait)) in zip(axes[0], splits.items(), strict=True):
        ranks = range(len(compute))
        ax.barh(ranks, [c / unit for c in compute], color="tab:blue", label="compute (forward, backward)")
        ax.barh(ranks, [w / unit for w in wait], left=[c / unit for c in compute], color="tab:red",
                label="waiting in the all-reduce")  # fmt: skip
        flagged = (marked or {}).get(run)
        ax.set_yticks(list(ranks), [f"rank {r}" + (" (straggler)" if r == flagged else "") for r in ranks])
        ax.set_ylim(len(compute) - 0.5, -0.5)
        ax.set_xlabel(f"median time per step ({unit_label})")
        ax.set_title(run, fontsize=10)
        ax.grid(axis="y", visible=False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def trace_timeline(
    lanes: Mapping[str, Mapping[int, Mapping[str, Intervals]]],
    *,
    unit: float = 1e-3,
    unit_label: str = "ms",
):
    """One panel per profiled step, two lanes per rank: compute (forward and other operators, backward on
    top) and communication, as the rank's trace recorded them.

    ``lanes[setup][rank][kind]`` are the intervals in seconds of ``kind`` "compute", "backward" and
    "communication" (:meth:`scalebook.experiments.profiling.RankTrace.intervals`). Each panel's clock
    starts at its earliest event on any rank (the ranks of one machine share the trace clock).
    """
    from matplotlib.patches import Patch

    colors = {"compute": "tab:blue", "backward": "tab:orange", "communication": "tab:red"}
    n_rows = sum(2 * len(ranks) for ranks in lanes.values())
    fig, axes = plt.subplots(len(lanes), 1, figsize=(9.0, 0.42 * n_rows + 1.2 * len(lanes) + 0.6), squeeze=False)
    for ax, (setup, ranks) in zip(axes[:, 0], lanes.items(), strict=True):
        origin = min(start for kinds in ranks.values() for spans in kinds.values() for start, _ in spans)
        ticks, labels = [], []
        for row, (rank, kinds) in enumerate(sorted(ranks.items())):
            compute_y, comm_y = 2 * row, 2 * row + 1
            for kind, y in (("compute", compute_y), ("backward", compute_y), ("communication", comm_y)):
                spans = kinds.get(kind, [])
                ax.broken_barh([((s - origin) / unit, (e - s) / unit) for s, e in spans], (y - 0.35, 0.7),
                               color=colors[kind])  # fmt: skip
            ticks += [compute_y, comm_y]
            labels += [f"rank {rank}: compute", f"rank {rank}: communication"]
            if row:
                ax.axhline(compute_y - 0.5, color="0.3", linewidth=0.8)
        ax.set_yticks(ticks, labels, fontsize=8)
        ax.set_ylim(len(ticks) - 0.5, -0.5)
        ax.set_title(setup, fontsize=10)
        ax.grid(axis="y", visible=False)
        ax.set_xlabel(f"time since the step's first event ({unit_label})")
    handles = [Patch(color=c, label={"compute": "forward and other operators"}.get(k, k)) for k, c in colors.items()]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    return fig
