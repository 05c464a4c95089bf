"""Memory (Chapters 1, 5, 7, 11): stacked bars of what a device holds against its capacity, totals that
span decades, and ZeRO's bytes per parameter against the data-parallel degree.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from scalebook.plots.style import figure_and_axes


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
    fig, ax = figure_and_axes(ax)
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
        ax.text(
            capacity / unit,
            1.01,
            capacity_label,
            transform=ax.get_xaxis_transform(),
            va="bottom",
            ha="center",
            fontsize=9,
        )
    ax.set_xlabel(unit_label)
    ax.set_title(title, pad=18 if capacity is not None else 6)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(components), frameon=False, fontsize=9)
    ax.invert_yaxis()
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
            100 * bars[label].get(component, 0.0) / (total * unit) for label, total in zip(labels, totals, strict=True)
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

    fig, ax = figure_and_axes(ax)
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
