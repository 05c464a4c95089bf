"""Fully sharded data parallelism (Chapter 11): one step's all-gathers, waits and computations per unit, with and
without prefetching.

Source: matplotlib documentation (``broken_barh``); the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "all-gather": "0.45", "wait": "tab:red",
          "reduce": "tab:purple"}  # fmt: skip
LEGEND = {"forward": "forward computation", "backward": "backward computation",
          "all-gather": "all-gather in flight (issue to wait)", "wait": "waiting for an all-gather (exposed)",
          "reduce": "reduce-scatter"}  # fmt: skip


def prefetch_timeline(steps: dict[str, dict], unit_labels: Sequence[str], *, title: str = "", unit: float = 1e-3,
                      unit_label: str = "ms"):  # fmt: skip
    """One panel per run, one row per unit (``unit_labels``, the root first) and a bottom row of the waits.

    ``steps[label]`` is one timed step, ``{"length": seconds, "events": [TimelineEvent, ...]}`` with times from
    the step's start (``scalebook.experiments.zero.train(..., timeline=True)``). A unit's row shows its
    computations (forward, backward; the root's, which span the blocks', pale), its reduce-scatters, the
    time the computation waited for its all-gather (red) and, as a thin grey bar above, the all-gather from
    its issue to the end of that wait. All panels share the time axis."""
    from matplotlib.patches import Patch

    rows = len(unit_labels)
    fig, axes = plt.subplots(len(steps), 1, figsize=(9.0, 0.9 + 0.42 * (rows + 1) * len(steps)), sharex=True,
                             squeeze=False)  # fmt: skip
    for ax, (label, step) in zip(axes[:, 0], steps.items(), strict=True):
        waited = 0.0
        for event in step["events"]:
            y, span = rows - event.unit, (event.start / unit, (event.end - event.start) / unit)
            if event.kind == "all-gather":
                ax.broken_barh([span], (y + 0.22, 0.14), color=COLORS["all-gather"])
                continue
            kind = event.phase if event.kind == "compute" else event.kind
            pale = event.kind == "compute" and event.unit == 0
            ax.broken_barh([span], (y - 0.3, 0.48), color=COLORS[kind], alpha=0.3 if pale else 0.9)
            if event.kind == "wait":
                waited += event.end - event.start
                ax.broken_barh([span], (-0.3, 0.6), color=COLORS["wait"])
        ax.set_yticks(range(rows + 1), ["waits"] + list(reversed(unit_labels)), fontsize=8)
        ax.set_ylim(-0.6, rows + 0.6)
        ax.grid(axis="y", visible=False)
        ax.set_title(f"{label}: step {step['length'] / unit:.0f} {unit_label}, of which waiting for all-gathers "
                     f"{waited / unit:.1f} {unit_label}", fontsize=9)  # fmt: skip
    axes[-1, 0].set_xlabel(f"time since the step started ({unit_label})")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.legend(handles=[Patch(color=COLORS[k], label=text) for k, text in LEGEND.items()], loc="lower center",
               ncol=3, frameon=False, fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig
