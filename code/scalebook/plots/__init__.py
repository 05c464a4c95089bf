"""The book's figures, one module per topic. Each function draws on a fresh figure (or a given axis) and
returns the figure; every public function is re-exported here, so ``plots.step_timeline(...)`` works.

    style          the book's matplotlib style (``STYLE``, :func:`use_style`) and the shared figure helper
    training       loss curves, held-out loss of several runs; measured against predicted scaling on log axes
    language       vocabulary-size trade-off; next-token distributions under sampling settings
    embeddings     similarity heatmaps; labelled 2-D maps
    hardware       GPU generations by year: 16-bit FLOP/s, HBM capacity and bandwidth, NVLink
    attention      attention maps; softmax saturation against head width
    memory         what a device holds against its capacity; ZeRO's bytes per parameter
    context        ring attention's work and time per rank, naive against skipping and overlapping
    network        the interconnect hierarchy of two nodes (NVLink, PCIe, RDMA, GPUDirect); algbw and busbw by size
    communication  collectives before and after; one data-parallel step's timeline; load against ranks
    diagnosis      each rank's step split into compute and waiting; each rank's timeline from a profiler trace
    parallel       tensor-parallel times, the share async TP leaves exposed, measured against formula bars, expert load
    pipeline       pipeline schedules' timelines; the bubble against micro-batches
    sharding       one fully sharded step's all-gathers, waits and computations per unit, with and without prefetch
    stack          the layers of a launched job, SLURM to the links, and what each decides

All of them, and every figure a chapter draws itself, use one style: ``scalebook.mplstyle``.
:func:`scalebook.notebook.setup` applies it; call :func:`use_style` to get it in your own scripts.

Source: matplotlib documentation, "Customizing Matplotlib with style sheets and rcParams".
"""

from scalebook.plots.attention import attention_map, attention_map_grid, softmax_saturation
from scalebook.plots.communication import collective_before_after, step_timeline, traffic_vs_ranks
from scalebook.plots.context import ring_attention_work
from scalebook.plots.diagnosis import rank_time_split, trace_timeline
from scalebook.plots.embeddings import labelled_scatter, similarity_heatmap
from scalebook.plots.hardware import hardware_growth, hardware_numbers
from scalebook.plots.language import cumulative_mass, next_token_bars, vocab_tradeoff
from scalebook.plots.memory import memory_bars, memory_total_and_share, zero_memory_vs_dp
from scalebook.plots.network import bandwidth_sweep, interconnect_hierarchy
from scalebook.plots.parallel import (
    expert_load_imbalance,
    exposed_communication,
    measured_vs_formula_bars,
    tensor_parallel_times,
)
from scalebook.plots.pipeline import bubble_vs_microbatches, pipeline_gantt
from scalebook.plots.sharding import prefetch_timeline
from scalebook.plots.stack import launch_stack
from scalebook.plots.style import STYLE, figure_and_axes, use_style
from scalebook.plots.training import loglog_scaling, loss_curve, scaling_curve, validation_curves

__all__ = [
    "STYLE",
    "attention_map",
    "attention_map_grid",
    "bandwidth_sweep",
    "bubble_vs_microbatches",
    "collective_before_after",
    "cumulative_mass",
    "expert_load_imbalance",
    "exposed_communication",
    "figure_and_axes",
    "hardware_growth",
    "hardware_numbers",
    "interconnect_hierarchy",
    "labelled_scatter",
    "launch_stack",
    "loglog_scaling",
    "loss_curve",
    "measured_vs_formula_bars",
    "memory_bars",
    "memory_total_and_share",
    "next_token_bars",
    "pipeline_gantt",
    "prefetch_timeline",
    "rank_time_split",
    "ring_attention_work",
    "scaling_curve",
    "similarity_heatmap",
    "softmax_saturation",
    "step_timeline",
    "tensor_parallel_times",
    "trace_timeline",
    "traffic_vs_ranks",
    "use_style",
    "validation_curves",
    "vocab_tradeoff",
    "zero_memory_vs_dp",
]
