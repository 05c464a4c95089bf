"""Accelerators over time (Chapter 1): how compute, memory and links grew, from ``scalebook.configs``.

Each GPU contributes four numbers: its dense 16-bit peak FLOP/s (bf16 where the chip has it, else fp16),
its HBM capacity and bandwidth, and the per-direction bandwidth of its link to the other GPUs of its node.
Plotted as growth over the first GPU given, on a log axis, they show compute outrunning the rest.

Source: the NVIDIA and AMD datasheets that :mod:`scalebook.configs` cites per entry.
"""

from __future__ import annotations

from collections.abc import Sequence

from scalebook.configs import Hardware
from scalebook.plots.style import figure_and_axes


def hardware_numbers(gpu: Hardware) -> dict[str, float]:
    """The four numbers the figure compares, in SI units: FLOP/s, bytes, bytes/s, bytes/s."""
    if gpu.year is None:
        raise ValueError(f"{gpu.name} has no year in scalebook.configs; it cannot be placed on a timeline")
    return {
        "16-bit peak FLOP/s": gpu.peak("bf16") if "bf16" in gpu.peak_flops else gpu.peak("fp16"),
        "HBM capacity": gpu.hbm_bytes,
        "HBM bandwidth": gpu.hbm_bandwidth,
        "GPU-to-GPU link (NVLink)": gpu.intra_node_bandwidth,
    }


def hardware_growth(gpus: Sequence[Hardware], *, title: str = "", ax=None):
    """Each of :func:`hardware_numbers` divided by its value on ``gpus[0]``, against the year, log scale."""
    if len(gpus) < 2:
        raise ValueError(f"need at least two GPUs to show growth, got {len(gpus)}")
    fig, ax = figure_and_axes(ax)
    rows = [hardware_numbers(gpu) for gpu in gpus]
    years = [gpu.year for gpu in gpus]
    markers = ("o", "s", "^", "D")
    for marker, what in zip(markers, rows[0], strict=True):
        ax.plot(years, [row[what] / rows[0][what] for row in rows], marker=marker, label=what)
    for gpu, row in zip(gpus, rows, strict=True):
        ax.annotate(gpu.name, (gpu.year, row["16-bit peak FLOP/s"] / rows[0]["16-bit peak FLOP/s"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=7)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("year")
    ax.set_ylabel(f"growth over {gpus[0].name} (x)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
