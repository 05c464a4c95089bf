"""The layers of a distributed training job (Chapter 15): from the scheduler down to the wires, each layer with
what it decides and what it hands to the layer below.

Source: SLURM documentation (sbatch, srun, environment variables); PyTorch documentation, "torchrun (Elastic
Launch)" and "Distributed communication package"; Accelerate documentation, "Launching your Accelerate
scripts"; the layered figure of SLURM, torchrun, the Trainer and NCCL in Torres' lecture notes (2025, ch. 13).
"""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt

#: One row per layer, top to bottom: the alternatives at that layer (one box each), what the layer decides,
#: and what it hands down (environment variables or calls).
LAUNCH_STACK = (
    (("SLURM\nsbatch, srun",), "which nodes and GPUs, for how long; starts the job script and one task per "
     "node; signals the job before its time limit",
     "SLURM_JOB_NODELIST, SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, CUDA_VISIBLE_DEVICES"),
    (("torchrun", "accelerate launch\n(config file; torchrun inside)"), "how many processes per node, the "
     "rendezvous address and port, restarts after a failure (accelerate launch: read from its config file)",
     "RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (+ ACCELERATE_*)"),
    (("python -m\nscalebook.train", "HF Trainer\n(accelerate inside)"), "each rank's device and data, how the model "
     "is wrapped (DDP, FSDP, TP, PP), precision, the loop, checkpoints", "tensors to reduce, gather, send"),
    (("torch.distributed",), "process groups, which collective on which ranks, the backend",
     "collective calls on buffers"),
    (("NCCL (GPUs)", "gloo (CPUs)"), "the algorithm (ring, tree), channels and protocol, which link each "
     "message takes", "bytes on the links"),
    (("NVLink, NVSwitch;\nInfiniBand, RoCE", "shared memory;\nTCP"), "bandwidth and latency: the β and α "
     "of every message (Chapter 9)", ""),
)  # fmt: skip


def launch_stack(layers=LAUNCH_STACK, *, title: str = "", ax=None):
    """The launch stack as boxes, top to bottom: each layer's alternatives (boxes side by side), what it
    decides, and (beside the arrow to the next layer) what it hands down. ``layers`` as ``LAUNCH_STACK``."""
    from matplotlib.patches import FancyBboxPatch

    if ax is None:
        fig, ax = plt.subplots(figsize=(8.6, 1.0 * len(layers) + 0.5))
    fig = ax.figure
    colors = plt.get_cmap("tab10").colors
    box_w, row_h, box_h = 3.8, 1.0, 0.66  # the left column holds the boxes; rows are 1 unit tall
    n = len(layers)
    for i, (names, decides, hands_down) in enumerate(layers):
        y = n - 1 - i  # the first layer on top
        width = (box_w - 0.1 * (len(names) - 1)) / len(names)
        for j, name in enumerate(names):
            x = j * (width + 0.1)
            ax.add_patch(FancyBboxPatch((x, y + (row_h - box_h) / 2), width, box_h, boxstyle="round,pad=0.02",
                                        facecolor=(*colors[i % 10], 0.22), edgecolor=colors[i % 10]))  # fmt: skip
            ax.text(x + width / 2, y + row_h / 2, name, ha="center", va="center", fontsize=8.5, linespacing=1.15)
        ax.text(box_w + 0.25, y + row_h / 2 + 0.04, "\n".join(textwrap.wrap(decides, 56)), ha="left", va="center",
                fontsize=8, linespacing=1.2)  # fmt: skip
        if i < n - 1:  # the arrow to the next layer, labelled with what crosses it
            ax.annotate("", xy=(0.25, y + (row_h - box_h) / 2 - 0.36), xytext=(0.25, y + (row_h - box_h) / 2 - 0.02),
                        arrowprops={"arrowstyle": "->", "color": "0.35"})  # fmt: skip
            ax.text(0.4, y, "\n".join(textwrap.wrap(hands_down, 118)), ha="left", va="center", fontsize=6.8,
                    family="monospace", color="0.3", linespacing=1.15)  # fmt: skip
    ax.text(box_w + 0.25, n + 0.05, "what it decides", ha="left", va="bottom", fontsize=8.5, style="italic")
    ax.text(0.0, n + 0.05, "layer (alternatives side by side)", ha="left", va="bottom", fontsize=8.5, style="italic")
    ax.set_xlim(-0.05, 8.9)
    ax.set_ylim(-0.1, n + 0.35)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left")
    return fig
