"""One model of a training step at cluster scale: hardware and topology, compute, overlap, memory.

Pure Python (no torch), so the live calculators can run it in the browser as they run ``accounting``:

    hardware   Cluster (built by hand: GPU, GPUs per node and per NVLink domain, NICs and their bandwidth),
               collective_time, all_to_all_time, p2p_time (NCCL's ring latencies, rail-aligned rings)
    compute    SystemParams (the fitted parameters), Matmul, matmul_time, layer_matmuls, attention_flops
    layout     TrainingLayout (tp pp dp cp ep, ZeRO, virtual stages, micro-batch, recomputation, SP, overlaps)
    step       layer_time, head_time, dp_time: per-layer times and the exposed communication
    memory     memory_by_kind: states, activations, logits, temporary buffers, runtime, fragmentation
    predict    predict -> Prediction (also ``scalebook.planner.predict``), FITTED
    fit        fit_params, calibration_table, nelder_mead: the parameters fitted on
               ``scalebook.calibration.RUNS``, with leave-one-out errors
    search     rank_layouts -> Ranking: every layout of a cluster, predicted and sorted by step time

Source: the modules' own sources; the fit's runs are listed in :mod:`scalebook.calibration`.
"""

from scalebook.system.compute import SystemParams
from scalebook.system.hardware import Cluster
from scalebook.system.layout import TrainingLayout
from scalebook.system.predict import FITTED, Prediction, predict

__all__ = ["FITTED", "Cluster", "Prediction", "SystemParams", "TrainingLayout", "predict"]
