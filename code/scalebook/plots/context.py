"""Context parallelism (Chapter 14): what each rank of a ring-attention variant computes, and how its time
splits into computing and waiting.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def ring_attention_work(
    flops: Mapping[str, Sequence[float]],
    seconds: Mapping[str, Sequence[Mapping[str, float]]],
    *,
    flops_title: str = "",
    seconds_title: str = "",
):
    """Two panels, one group of bars per variant (the keys, in order) and one bar per rank: left, the matmul
    FLOPs each rank ran (``flops[variant][rank]``); right, each rank's milliseconds of one forward and
    backward pass, computing (solid) and waiting for blocks (hatched) (``seconds[variant][rank]`` with keys
    ``"forward"``, ``"backward"`` and ``"wait"``)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")
    for ax, data in ((left, flops), (right, seconds)):
        labels = list(data)
        ranks = max(len(v) for v in data.values())
        width = 0.8 / ranks
        for r in range(ranks):
            xs = [i - 0.4 + width * (r + 0.5) for i in range(len(labels))]
            if data is flops:
                ax.bar(xs, [data[v][r] / 1e6 for v in labels], width, color=colors[r % len(colors)],
                       label=f"rank {r}")  # fmt: skip
                continue
            compute = [1e3 * (data[v][r]["forward"] + data[v][r]["backward"]) for v in labels]
            wait = [1e3 * data[v][r]["wait"] for v in labels]
            ax.bar(xs, compute, width, color=colors[r % len(colors)], label=f"rank {r} computing")
            ax.bar(xs, wait, width, bottom=compute, color="white", edgecolor=colors[r % len(colors)],
                   hatch="///", label=f"rank {r} waiting")  # fmt: skip
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    left.set_ylabel("matmul MFLOP per rank (forward + backward)")
    left.set_title(flops_title)
    right.set_ylabel("ms per forward + backward pass")
    right.set_title(seconds_title)
    fig.tight_layout()
    return fig
