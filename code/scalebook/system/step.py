"""One training step: per-layer times, the pipeline, the exposed communication, and what it adds up to.

For the busiest pipeline stage, one micro-batch costs its layers' forward and backward
(:mod:`scalebook.system.compute`) plus the communication the layout leaves exposed:

- **TP**: two collectives of the layer's ``s b h`` activations forward and two backward (reduce-scatter +
  all-gather under sequence parallelism, two more all-gathers backward to re-gather the sharded inputs), two
  more forward under full recomputation; exposed, or with ``async_tp`` only what exceeds the matmuls. With
  ``overlap_tp_backward`` (Megatron-LM's default since its sequence-parallel release) the column-parallel
  layers' backward collectives (the input-gradient reduce-scatter, or all-reduce without SP, and under SP the
  re-gather of the saved input shard) run under those layers' weight- and input-gradient GEMMs; only what
  exceeds the layer's forward matmul time stays exposed.
- **CP**: Llama 3's all-gather of K and V forward and reduce-scatter of their gradients backward (exposed), or
  a ring whose ``cp - 1`` block transfers hide under the attention kernel.
- **EP**: a dispatch and a combine all-to-all of the ``k`` routed copies of each token, forward and backward;
  DualPipe overlaps them with another micro-batch's compute, leaving only what exceeds it.

The pipeline runs ``M = B / (dp b)`` micro-batches: ``(M + (p - 1) / v) t`` for 1F1B and interleaving
(:func:`scalebook.accounting.pipeline.step_time`), ``M t`` for GPipe plus ``(p - 1) t``, and
``(M + p/2 - 1) t`` for DualPipe (its bubble is ``(p/2 - 1)`` overlapped forward-backward chunks). Pipeline
sends cross the network unless stage neighbours share a domain; without ``overlap_p2p`` every micro-batch
waits for its sends. Data-parallel sync (:func:`dp_time`) overlaps one micro-batch's forward and backward when
``overlap_dp`` is set, except for its last layer's bucket. The optimizer step reads and writes 30 bytes per
local parameter (fp32 master, m, v, fp32 gradient; bf16 copy) at HBM bandwidth.

Layers go to stages by a contiguous split that minimizes the busiest stage (Llama 3 gives its first and last
stage one layer fewer, for the embedding and the head); the head (and DeepSeek-V3's multi-token-prediction
module) sits on the last stage.

Source: Narayanan et al. 2021, Sec. 2.2 and 3.2 (schedules, bubble, communication); Korthikanti et al. 2022,
Sec. 4.2 (sequence parallelism's collectives); Grattafiori et al. 2024, Sec. 3.3.2 (stage balancing,
all-gather context parallelism); DeepSeek-AI 2024, Sec. 3.2 (DualPipe, all-to-all overlap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalebook.accounting.params import layer_weights
from scalebook.configs import ModelConfig
from scalebook.system import compute
from scalebook.system.compute import Matmul, SystemParams
from scalebook.system.hardware import (
    Cluster,
    all_to_all_time,
    collective_time,
    ranks_per_domain,
)
from scalebook.system.layout import TrainingLayout

OPTIMIZER_BYTES_PER_PARAM = 30  # Adam: master, m, v read and written (24), fp32 gradient read (4), bf16 write (2)


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one layer for one micro-batch on one GPU: compute and the exposed TP, CP, EP shares."""

    forward: float
    backward: float
    tp: float
    cp: float
    ep: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.tp + self.cp + self.ep


def _attention_time(
    cfg: ModelConfig, lay: TrainingLayout, n: int, s: int, cluster: Cluster, params: SystemParams
) -> tuple[float, float]:
    """Forward and backward seconds of the attention core (scores and their use) for ``n`` local tokens."""
    gpu = cluster.hardware
    hbm = gpu.hbm_bandwidth * params.memory_efficiency
    if lay.attention == "fused":
        forward = compute.attention_flops(cfg, n, s, tp=lay.tp, causal=True) / (
            gpu.peak("bf16") * params.attention_efficiency
        )
        return forward, compute.FLASH_BACKWARD_RATIO * forward
    heads, mb = cfg.n_heads // lay.tp, lay.micro_batch
    d_qk = d_v = cfg.d_head
    if cfg.latent_attention is not None:
        d_qk, d_v = cfg.latent_attention.qk_head_dim, cfg.latent_attention.v_head_dim
    q = n // mb
    bmm = compute.matmul_time(Matmul("scores", q, d_qk, s, mb * heads), gpu, "bf16", params) + compute.matmul_time(
        Matmul("P V", q, s, d_v, mb * heads), gpu, "bf16", params
    )
    softmax = mb * heads * q * s * 2 * compute.EXPLICIT_SCORE_PASSES / hbm
    return bmm + softmax, 2 * (bmm + softmax)


def layer_time(
    cfg: ModelConfig, layer: int, lay: TrainingLayout, s: int, cluster: Cluster, params: SystemParams
) -> LayerTime:
    """One layer, one micro-batch, one GPU (see the module docstring)."""
    gpu, n = cluster.hardware, lay.micro_batch * s // lay.cp
    hbm = gpu.hbm_bandwidth * params.memory_efficiency
    matmuls = sum(
        compute.matmul_time(mm, gpu, lay.matmul_dtype, params)
        for mm in compute.layer_matmuls(cfg, layer, n, tp=lay.tp, ep=lay.ep)
    )
    attn_f, attn_b = _attention_time(cfg, lay, n, s, cluster, params)
    elementwise = compute.elementwise_bytes(cfg, layer, n, tp=lay.tp, sp=lay.sp) / hbm
    forward = (matmuls + attn_f + elementwise) / lay.compute_share
    backward = (2 * matmuls + attn_b + 2 * elementwise) / lay.compute_share
    if lay.recompute == "full":
        backward += forward
    elif lay.recompute == "selective":
        again = compute.rematerialized_bytes(cfg, layer, n, tp=lay.tp, sp=lay.sp) / hbm
        backward += (again + (attn_f if lay.attention == "explicit" else 0.0)) / lay.compute_share
    message = n * cfg.d_model * 2
    tp = 0.0
    if lay.tp > 1:
        inside = ranks_per_domain(lay.tp, 1, cluster)
        pair = collective_time("reduce_scatter", message, lay.tp, per_domain=inside, cluster=cluster) + collective_time(
            "all_gather", message, lay.tp, per_domain=inside, cluster=cluster
        )
        count = 4 + (1 if lay.sp else 0) + (2 if lay.recompute == "full" else 0)  # pairs: fwd 2, bwd 2 (+2 AG)
        tp = count * pair
        if lay.async_tp:
            tp = max(0.0, tp - 3 * matmuls)
        elif lay.overlap_tp_backward:
            # The column-parallel layers' backward collectives (their dgrad reduce-scatter, and under SP the
            # re-gather of their input) run under their wgrad and dgrad GEMMs, about the layer's forward matmuls.
            hidden = (1 + (1 if lay.sp else 0)) * pair
            tp = (count - 1 - (1 if lay.sp else 0)) * pair + max(0.0, hidden - matmuls)
    cp = 0.0
    if lay.cp > 1:
        kv_width = (
            2 * cfg.d_kv
            if cfg.latent_attention is None
            else (cfg.latent_attention.kv_lora_rank + cfg.latent_attention.qk_rope_head_dim)
        )
        kv = lay.micro_batch * s * kv_width * 2 / lay.tp
        inside = ranks_per_domain(lay.cp, lay.tp, cluster)
        if lay.cp_mode == "all_gather":
            cp = 2 * collective_time("all_gather", kv, lay.cp, per_domain=inside, cluster=cluster)
        else:
            ring = 3 * collective_time("all_gather", kv, lay.cp, per_domain=inside, cluster=cluster)
            cp = max(0.0, ring - attn_f - attn_b)
    ep = 0.0
    if cfg.is_moe and layer >= cfg.n_dense_layers and lay.ep > 1:
        copies = n * cfg.experts_per_token * cfg.d_model
        inside = ranks_per_domain(lay.ep, lay.tp * lay.cp, cluster)
        one_way = [
            all_to_all_time(
                copies * b,
                lay.ep,
                per_domain=inside,
                cluster=cluster,
                node_limit=lay.node_limit,
                fanout=cfg.experts_per_token,
            )
            for b in (lay.dispatch_bytes, 2)
        ]
        ep = 2 * sum(one_way)
        if lay.schedule == "dualpipe":
            ep = max(0.0, ep - forward - backward)
    return LayerTime(forward, backward, tp, cp, ep)


def head_time(cfg: ModelConfig, lay: TrainingLayout, s: int, cluster: Cluster, params: SystemParams) -> float:
    """Forward and backward seconds of the LM head and the cross-entropy for one micro-batch on one GPU."""
    gpu, n = cluster.hardware, lay.micro_batch * s // lay.cp
    logits = compute.Matmul("LM head", n, cfg.d_model, cfg.vocab_size // lay.tp)
    matmul = 3 * compute.matmul_time(logits, gpu, lay.matmul_dtype, params)
    loss = n * cfg.vocab_size / lay.tp * compute.LOGIT_BYTES / (gpu.hbm_bandwidth * params.memory_efficiency)
    return (matmul + loss) / lay.compute_share


def busiest_stage(costs: list[float], head: float, chunks: int) -> tuple[float, int]:
    """Smallest achievable cost of the busiest of ``chunks`` contiguous pieces of ``costs`` with ``head`` added
    to the last piece, and the most layers a piece holds. Binary search on the capacity, greedy packing."""
    items = costs[:-1] + [costs[-1] + head]
    if chunks == 1:  # one piece holds everything
        return math.fsum(items), len(items)
    # A piece is full within rounding: sum() and a running total may differ in the last bit (Python 3.12's sum()
    # compensates, 3.11's does not, and the calculators run Pyodide's 3.13), which must not spill a layer over.
    slack = 1 + 1e-9

    def pieces(capacity: float) -> int:
        count, load = 1, 0.0
        for c in items:
            if load + c > capacity * slack and load:
                count, load = count + 1, 0.0
            load += c
        return count

    def most_layers(capacity: float) -> int:
        most = run = 0
        load = 0.0
        for c in items:
            if load + c > capacity * slack and run:
                load, run = 0.0, 0
            load, run = load + c, run + 1
            most = run if run > most else most
        return most

    lo, hi = max(items), math.fsum(items)
    while hi - lo > 1e-6 * hi:  # about 20 halvings
        mid = (lo + hi) / 2
        if pieces(mid) <= chunks:
            hi = mid
        else:
            lo = mid
    return hi, most_layers(hi)


def stage_params(cfg: ModelConfig, layers: int) -> tuple[float, float]:
    """(dense, routed-expert) weights of ``layers`` typical layers: the last layer's kind, plus the head's share."""
    swiglu = 3 if cfg.mlp == "swiglu" else 2
    expert = cfg.n_experts * swiglu * cfg.d_model * cfg.expert_d_ff if cfg.is_moe else 0
    dense = layer_weights(cfg, cfg.n_layers - 1) - expert
    return layers * dense + cfg.vocab_size * cfg.d_model, layers * expert


def dp_time(cfg: ModelConfig, lay: TrainingLayout, layers: int, microbatches: int, cluster: Cluster) -> float:
    """Seconds of data-parallel sync per step for the busiest stage (gradients of ``layers`` layers).

    ZeRO-0 all-reduces the gradients; ZeRO-1/2 reduce-scatter them and all-gather the bf16 parameters; ZeRO-3
    gathers the parameters twice and reduce-scatters the gradients per micro-batch. Routed experts sync over
    the ``dp cp / ep`` replicas of each expert."""
    dense, expert = stage_params(cfg, layers)
    total = 0.0
    for weights, n, inner in (
        (dense / lay.tp, lay.dp * lay.cp, lay.tp),
        (expert / (lay.tp * lay.ep), lay.dp * lay.cp // lay.ep, lay.tp * lay.cp * lay.ep),
    ):
        if not weights or n == 1:
            continue
        inside = ranks_per_domain(n, inner, cluster)

        def op(name: str, bytes_per: int, w=weights, n=n, inside=inside) -> float:
            return collective_time(name, w * bytes_per, n, per_domain=inside, cluster=cluster)

        if lay.zero_stage == 0:
            total += op("all_reduce", lay.grad_reduce_bytes)
        elif lay.zero_stage in (1, 2):
            total += op("reduce_scatter", lay.grad_reduce_bytes) + op("all_gather", 2)
        else:
            total += microbatches * (2 * op("all_gather", 2) + op("reduce_scatter", lay.grad_reduce_bytes))
    return total
