"""Tensor and expert parallelism (Chapters 12, 14): time per layer against the tensor-parallel degree, the
communication async tensor parallelism leaves exposed, measured bytes against their formula, and expert load
over training.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

from scalebook.plots.style import figure_and_axes


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

    fig, ax = figure_and_axes(ax)
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


def exposed_communication(
    xs: Sequence[float],
    compute: Sequence[float],
    communication: Sequence[float],
    exposed: Sequence[float],
    *,
    xlabel: str,
    title: str = "",
    ax=None,
):
    """The share of a layer's time spent waiting for communication against ``xs`` (log base 2): with the
    collectives back to back, ``communication / (compute + communication)``, and with async tensor
    parallelism, ``exposed / (compute + exposed)``; ``compute``, ``communication`` and ``exposed`` in seconds."""
    from matplotlib.ticker import NullLocator, PercentFormatter

    fig, ax = figure_and_axes(ax)
    serial = [m / (c + m) for c, m in zip(compute, communication, strict=True)]
    overlapped = [e / (c + e) for c, e in zip(compute, exposed, strict=True)]
    ax.plot(xs, serial, "s--", color="tab:red", label="collectives back to back")
    ax.plot(xs, overlapped, "^-", color="tab:green", label="async TP: what stays exposed")
    ax.fill_between(xs, overlapped, serial, color="tab:green", alpha=0.12, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylim(0, max(serial) * 1.1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of the layer's time waiting")
    ax.set_title(title)
    ax.legend(fontsize=8)
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
    fig, ax = figure_and_axes(ax)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [m / unit for m in measured], width=0.4, color="tab:blue", label="measured")
    ax.bar([i + 0.2 for i in x], [f / unit for f in formula], width=0.4, color="tab:orange", label="formula")
    ax.set_xticks(list(x), list(labels))
    ax.set_ylabel(unit_label)
    ax.set_title(title)
    ax.legend(fontsize=9)
    fig.tight_layout()
    return fig


def expert_load_imbalance(histories: dict, *, smooth: int = 5, title: str = "", ax=None):
    """Max over mean expert load per training step, one line per balancing method (moving average of ``smooth``)."""
    import numpy as np

    fig, ax = figure_and_axes(ax)
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
