"""The public entry point: predict a training step's time, throughput, utilization and memory.

``predict(model, cluster, layout, seq_len=..., global_batch=...)`` takes a :class:`scalebook.configs.ModelConfig`
(a registry entry or one built by hand), a :class:`scalebook.system.hardware.Cluster` and a
:class:`scalebook.system.layout.TrainingLayout`, and returns a :class:`Prediction`. Conventions:

- **model FLOPs** per token are :func:`scalebook.accounting.flops.flops_per_token` at ``seq_len``: 6 N plus
  attention over all positions, no recomputation (the MFU convention of Narayanan et al., PaLM and Llama 3);
  ``mfu`` divides model FLOP/s by the dense bf16 peak whatever dtype the matmuls use.
- **hardware FLOPs** add what recomputation reruns, in the same convention: the layers' forward for ``full``,
  the attention scores' forward for ``selective`` (Korthikanti et al.'s HFU).
- Every number is a prediction of the model in :mod:`scalebook.system`, with the parameters fitted on published
  runs (``FITTED``, :mod:`scalebook.calibration`).

Source: Chowdhery et al. 2022, Appendix B (MFU, HFU); Narayanan et al. 2021, Sec. 5.1; Korthikanti et al. 2022,
Sec. 6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scalebook.accounting.flops import _score_width, flops_per_token
from scalebook.accounting.pipeline import step_time as pipeline_step_time
from scalebook.configs import ModelConfig
from scalebook.system.compute import SystemParams
from scalebook.system.hardware import Cluster, p2p_time, ranks_per_domain
from scalebook.system.layout import TrainingLayout
from scalebook.system.memory import memory_by_kind
from scalebook.system.step import OPTIMIZER_BYTES_PER_PARAM, busiest_stage, dp_time, head_time, layer_time, stage_params

# Fitted by scalebook.system.fit.fit_params on scalebook.calibration.RUNS; tests/test_system.py refits and checks.
FITTED = SystemParams(matmul_efficiency=0.7639, attention_efficiency=0.2442, memory_efficiency=0.9977)


@dataclass(frozen=True)
class Prediction:
    """What one step costs. Times in seconds, memory in bytes, throughputs per second."""

    step_time: float
    tokens_per_second: float
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    memory: dict = field(hash=False)  # bytes on the busiest GPU by kind
    feasible: bool
    reasons: tuple[str, ...]
    breakdown: dict = field(hash=False)  # seconds per step: compute, tp, cp, ep, bubble, pp, dp, optimizer

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())


def _problems(cfg, cluster, lay, seq_len, global_batch) -> list[str]:
    found = lay.problems()
    if not isinstance(cfg, ModelConfig):
        found.append(f"model must be a ModelConfig, got {cfg!r}")
    if not isinstance(cluster, Cluster):
        found.append(f"cluster must be a scalebook.system.Cluster, got {cluster!r}")
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            found.append(f"{name} must be a positive integer (global_batch in sequences), got {value!r}")
    if found:
        return found
    if lay.gpus != cluster.gpus:
        found.append(f"tp pp dp cp = {lay.gpus} GPUs, the cluster has {cluster.gpus}")
    if cfg.n_heads % lay.tp or (cfg.n_kv_heads % lay.tp and cfg.latent_attention is None):
        found.append(f"tp ({lay.tp}) must divide the {cfg.n_heads} query and {cfg.n_kv_heads} key/value heads")
    if lay.pp * lay.virtual_stages > cfg.n_layers:
        found.append(f"pp x v ({lay.pp * lay.virtual_stages}) exceeds the {cfg.n_layers} layers")
    if seq_len % (lay.cp * lay.tp):
        found.append(f"seq_len ({seq_len}) must split into cp x tp ({lay.cp * lay.tp}) shards")
    if global_batch % (lay.dp * lay.micro_batch):
        found.append(f"global_batch ({global_batch}) must split into dp x micro_batch ({lay.dp * lay.micro_batch})")
    elif lay.pp > 1 and global_batch // (lay.dp * lay.micro_batch) < lay.pp:
        found.append(f"{global_batch // (lay.dp * lay.micro_batch)} micro-batches cannot fill {lay.pp} stages")
    if cfg.is_moe and cfg.n_experts % lay.ep:
        found.append(f"ep ({lay.ep}) must divide the {cfg.n_experts} experts")
    return found


def _pipeline(cfg, lay, seq_len, cluster, params, microbatches) -> tuple[float, dict, int]:
    """Seconds of the pipelined micro-batches on the busiest stage, their parts, and that stage's layers."""
    times = [layer_time(cfg, i, lay, seq_len, cluster, params) for i in sorted({0, cfg.n_layers - 1})]
    kinds = {i: t for i, t in zip(sorted({0, cfg.n_layers - 1}), times, strict=True)}
    per_layer = [
        kinds[0 if (i < cfg.n_dense_layers or not cfg.is_moe) else cfg.n_layers - 1] for i in range(cfg.n_layers)
    ]
    head = head_time(cfg, lay, seq_len, cluster, params)
    if cfg.n_mtp_layers:
        head *= 1 + cfg.n_mtp_layers
        head += cfg.n_mtp_layers * per_layer[-1].total
    chunks = lay.pp * lay.virtual_stages
    chunk_cost, most = busiest_stage([t.total for t in per_layer], head, chunks)
    stage = chunk_cost * lay.virtual_stages
    layers = min(cfg.n_layers, most * lay.virtual_stages)
    if lay.schedule == "dualpipe":
        pipe = (microbatches + lay.pp / 2 - 1) * stage
    elif lay.schedule == "gpipe":
        pipe = (microbatches + lay.pp - 1) * stage
    else:
        pipe = pipeline_step_time(lay.pp, microbatches, stage / 3, 2 * stage / 3, virtual_stages=lay.virtual_stages)
    # The stage's exposed TP, CP and EP time, in the proportions of its typical (last) layer.
    typical = per_layer[-1]
    parts = {k: microbatches * stage * getattr(typical, k) / typical.total for k in ("tp", "cp", "ep")}
    parts["compute"] = microbatches * stage - parts["tp"] - parts["cp"] - parts["ep"]
    parts["bubble"] = pipe - microbatches * stage
    return pipe, parts, layers


def predict(
    model: ModelConfig,
    cluster: Cluster,
    layout: TrainingLayout,
    *,
    seq_len: int,
    global_batch: int,
    params: SystemParams = FITTED,
) -> Prediction:
    """Predict one optimizer step of ``global_batch`` sequences of ``seq_len`` tokens (see the module docstring).

    Raises ValueError, listing every problem, for a layout that cannot run at all; a layout that runs but does
    not fit in memory is returned with ``feasible=False`` and the reason."""
    problems = _problems(model, cluster, layout, seq_len, global_batch)
    if problems:
        raise ValueError("cannot predict: " + "; ".join(problems))
    cfg, lay, gpu = model, layout, cluster.hardware
    microbatches = global_batch // (lay.dp * lay.micro_batch)
    pipe, parts, layers = _pipeline(cfg, lay, seq_len, cluster, params, microbatches)
    stage_mb = pipe / (microbatches + (lay.pp - 1) / lay.virtual_stages) if lay.pp > 1 else pipe / microbatches
    pp = 0.0
    if lay.pp > 1:
        message = lay.micro_batch * seq_len // lay.cp * cfg.d_model * 2 / (lay.tp if lay.sp else 1)
        same = ranks_per_domain(lay.pp, lay.tp * lay.cp * lay.dp, cluster) > 1
        hops = 2 * (lay.pp - 1) if lay.overlap_p2p or lay.schedule == "dualpipe" else 2 * (microbatches + lay.pp - 1)
        pp = hops * lay.virtual_stages * p2p_time(message, same_domain=same, cluster=cluster)
    sync = dp_time(cfg, lay, layers, microbatches, cluster)
    dp = max(0.0, sync - stage_mb) + sync / layers if lay.overlap_dp else sync
    dense, expert = stage_params(cfg, layers)
    local = dense / (lay.tp * (lay.dp * lay.cp if lay.zero_stage else 1))
    local += expert / (lay.tp * lay.ep * (max(1, lay.dp * lay.cp // lay.ep) if lay.zero_stage else 1))
    optimizer = local * OPTIMIZER_BYTES_PER_PARAM / (gpu.hbm_bandwidth * params.memory_efficiency)
    step = pipe + pp + dp + optimizer
    parts.update(pp=pp, dp=dp, optimizer=optimizer)
    tokens = global_batch * seq_len
    model_flops = flops_per_token(cfg, seq_len=seq_len) * tokens
    extra = 0.0
    if lay.recompute == "full":
        extra = (flops_per_token(cfg, seq_len=seq_len, recompute=True) - flops_per_token(cfg, seq_len=seq_len)) * tokens
    elif lay.recompute == "selective":
        extra = 2 * cfg.n_layers * seq_len * _score_width(cfg) * tokens
    peak = gpu.peak("bf16") * cluster.gpus
    memory = memory_by_kind(cfg, lay, seq_len=seq_len, layers=layers, microbatches=microbatches)
    total = sum(memory.values())
    reasons = () if total <= gpu.hbm_bytes else (f"memory {total / 1e9:.1f} GB > {gpu.hbm_bytes / 1e9:.0f} GB of HBM",)
    return Prediction(
        step,
        tokens / step,
        model_flops / step / cluster.gpus / 1e12,
        model_flops / step / peak,
        (model_flops + extra) / step / peak,
        memory,
        not reasons,
        reasons,
        parts,
    )
