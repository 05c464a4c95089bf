"""The network (Chapter 9): the interconnect hierarchy of a GPU cluster drawn as two nodes, and a benchmark's
algorithm and bus bandwidth against the message size.

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`; NVIDIA DGX H100 user guide
(what connects to what in a node: NVSwitch, PCIe switches, one NIC per GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from scalebook.configs import Link

_NVLINK, _PCIE, _NET, _RDMA, _HOST = "tab:green", "tab:blue", "tab:purple", "tab:red", "0.45"


def _box(ax, x, y, w, h, text, color, *, fontsize=7.5, fill=0.15):
    face = tuple(1 - fill + fill * c for c in to_rgb(color))  # a light, opaque tint: wires pass behind
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", linewidth=1,
                                edgecolor=color, facecolor=face, zorder=2))  # fmt: skip
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, zorder=4)


def _wire(ax, a, b, color, *, width=1.2, style="-"):
    ax.plot([a[0], b[0]], [a[1], b[1]], color=color, linewidth=width, linestyle=style, zorder=0)


def _node(ax, x0: float, name: str, gpus: int) -> dict:
    """One node at ``x0``: NVSwitch on top, GPUs, a PCIe switch per two GPUs with their NICs below, and the
    CPU with host memory at the end of the PCIe row; returns the centres the cross-node paths need."""
    width = 1.2 * gpus + 2.0
    ax.add_patch(FancyBboxPatch((x0, 0.9), width, 4.9, boxstyle="round,pad=0.05,rounding_size=0.15",
                                edgecolor="0.6", facecolor="none", linewidth=1, linestyle="--"))  # fmt: skip
    ax.text(x0 + 0.1, 5.75, name, fontsize=8, va="top", color="0.35")
    _box(ax, x0 + 0.2, 4.85, 1.2 * gpus - 0.2, 0.45, "NVSwitch", _NVLINK)
    gpu = [(x0 + 0.2 + 1.2 * i + 0.5, 3.9) for i in range(gpus)]
    nic = [(x, 1.45) for x, _ in gpu]
    cpu = (x0 + width - 1.0, 2.65)
    switches = []
    for j in range(0, gpus, 2):  # one PCIe switch per two GPUs and their NICs
        cx = (gpu[j][0] + gpu[min(j + 1, gpus - 1)][0]) / 2
        switches.append((cx, 2.65))
        for k in (j, j + 1):
            if k < gpus:
                _wire(ax, (gpu[k][0], 3.6), (cx, 2.9), _PCIE)
                _wire(ax, (cx, 2.4), (nic[k][0], 1.7), _PCIE)
    _wire(ax, switches[0], cpu, _PCIE, width=1.0)  # the PCIe switches hang off the CPU's root ports
    for cx, cy in switches:
        _box(ax, cx - 0.55, cy - 0.25, 1.1, 0.5, "PCIe switch", _PCIE, fontsize=7)
    for i, (x, y) in enumerate(gpu):
        _wire(ax, (x, y + 0.3), (x, 4.85), _NVLINK, width=2.5)
        _box(ax, x - 0.45, y - 0.3, 0.9, 0.6, f"GPU {i}\nHBM", "tab:orange")
        _box(ax, x - 0.45, 1.2, 0.9, 0.5, "NIC", _NET)
    _box(ax, cpu[0] - 0.75, cpu[1] - 0.45, 1.5, 0.9, "CPU\nhost memory", _HOST, fill=0.08)
    return {"gpu": gpu, "nic": nic, "switch": switches, "cpu": cpu}


def _arrow(ax, a, b, color, *, rad=0.0, style="-", width=2.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=9, color=color, linewidth=width,
                                 linestyle=style, connectionstyle=f"arc3,rad={rad}", zorder=3))  # fmt: skip


def interconnect_hierarchy(nvlink: Link, pcie: Link, network: Link, *, gpus: int = 4, title: str = ""):
    """Two nodes of ``gpus`` GPUs (a DGX-like node has 8): NVLink to the NVSwitch inside a node, PCIe from each
    GPU to a switch shared with its NIC and the CPU, one network port per GPU into the cluster's switch, and
    two ways for GPU 0 of one node to send to GPU 0 of the other: GPUDirect RDMA (the NIC reads GPU memory
    through the PCIe switch) and, dashed, a copy staged through host memory. The links' per-direction
    bandwidths label the levels."""
    fig, ax = plt.subplots(figsize=(9.0, 5.2))
    node_width = 1.2 * gpus + 2.0
    left = _node(ax, 0.0, "node 0", gpus)
    right = _node(ax, node_width + 0.6, "node 1", gpus)
    span = 2 * node_width + 0.6
    _box(ax, 0.2, -0.6, span - 0.4, 0.8, "", _NET)
    ax.text(span / 2, -0.38, "network switch (InfiniBand or RoCE); with SHARP the switch itself adds", ha="center",
            va="center", fontsize=7.5)  # fmt: skip
    for x, _ in left["nic"] + right["nic"]:
        _wire(ax, (x, 1.2), (x, 0.2), _NET)
    g0, s0, n0 = left["gpu"][0], left["switch"][0], left["nic"][0]
    g1, s1, n1 = right["gpu"][0], right["switch"][0], right["nic"][0]
    path = [(g0[0] - 0.15, 3.6), (s0[0] - 0.15, 2.65), (n0[0] - 0.15, 1.45), (n0[0] - 0.15, 0.0),
            (n1[0] - 0.15, 0.0), (n1[0] - 0.15, 1.45), (s1[0] - 0.15, 2.65), (g1[0] - 0.15, 3.6)]  # fmt: skip
    for a, b in zip(path, path[1:], strict=False):
        _arrow(ax, a, b, _RDMA)
    _arrow(ax, (g0[0] + 0.3, 3.6), (left["cpu"][0] - 0.5, 3.1), _HOST, rad=0.12, style="--", width=1.2)
    _arrow(ax, (left["cpu"][0] - 0.6, 2.2), (n0[0] + 0.3, 1.7), _HOST, rad=-0.12, style="--", width=1.2)
    gb = 1e9
    legend = [
        (_NVLINK, f"NVLink to the NVSwitch: {nvlink.bandwidth / gb:.0f} GB/s per direction per GPU ({nvlink.name})"),
        (_PCIE, f"PCIe: {pcie.bandwidth / gb:.0f} GB/s per direction ({pcie.name})"),
        (_NET, f"network port (RDMA): {network.bandwidth / gb:.0f} GB/s per direction ({network.name})"),
        (_RDMA, "GPUDirect RDMA: the NIC reads and writes GPU memory, no host copy"),
        (_HOST, "without it (dashed): the bytes are staged in host memory first"),
    ]
    for color, text in legend:
        ax.plot([], [], color=color, linewidth=2.5, label=text)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=7.5, frameon=False)
    ax.set_xlim(-0.3, span + 0.1)
    ax.set_ylim(-0.8, 6.0)
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def _size_label(m: int) -> str:
    return f"{m // 2**20} MiB" if m >= 2**20 else f"{m // 1024} KiB" if m >= 1024 else f"{m} B"


def bandwidth_sweep(
    sizes: Sequence[int],
    algbw: dict[str, Sequence[float]],
    busbw: dict[str, Sequence[float]],
    *,
    reference: dict[str, float] | None = None,
    unit: float = 1e9,
    title: str = "",
):
    """Algorithm bandwidth (left) and bus bandwidth (right) against the message size, one line per label
    (e.g. per number of ranks), in units of ``unit`` bytes per second (GB/s by default); ``reference`` draws
    horizontal dashed lines on the bus-bandwidth axes (e.g. a fitted link bandwidth)."""
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.6), sharey=True)
    for ax, series, name in ((axes[0], algbw, "algorithm bandwidth  M / T"), (axes[1], busbw, "bus bandwidth")):
        for label, values in series.items():
            ax.plot(sizes, [v / unit for v in values], marker="o", markersize=4, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(sizes), [_size_label(m) for m in sizes], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("message size M")
        ax.set_title(name, fontsize=10)
    for i, (label, value) in enumerate((reference or {}).items()):
        axes[1].axhline(value / unit, color=f"C{i + len(busbw)}", linestyle="--", linewidth=1, label=label)
    axes[0].set_ylabel("GB/s" if unit == 1e9 else f"units of {unit:g} B/s")
    axes[1].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
