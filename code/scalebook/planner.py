"""Search for a parallel layout: enumerate (tp, pp, dp, cp, v, micro-batch, recompute, ZeRO), reject, rank.

For a model, a sequence length, a global batch in tokens and a cluster, every factorization
``gpus = tp * pp * cp * dp`` is combined with a micro-batch size, a recomputation policy, a ZeRO stage
and a number of virtual pipeline stages v. A layout is **rejected**, with the rule it breaks, if

- tp exceeds the GPUs of a node (its four all-reduces per layer need NVLink), or does not divide the
  query and key/value heads; pp * v exceeds the layers; the sequence does not split into 2 cp chunks
  of whole sequence-parallel shards (2 cp tp);
- the batch does not split into dp replicas of whole micro-batches, or gives fewer micro-batches than
  pipeline stages (M >= pp; a multiple of pp for the interleaved schedule);
- the busiest GPU's memory exceeds ``memory_fraction`` of its HBM: model states
  (:func:`scalebook.accounting.memory.model_state_bytes` for the largest stage, ceil(L / pp) layers)
  plus activations (:func:`scalebook.accounting.memory.activation_bytes` per layer, times the layers of
  a stage, times the micro-batches the first rank holds in flight,
  :func:`scalebook.accounting.pipeline.peak_in_flight`). Attention is assumed to be FlashAttention, so
  the s^2 scores are never stored ("selective" in Korthikanti et al.'s terms). A layout that does not
  fit with selective recomputation is retried with the fewest whole layers of each stage recomputed in
  full that make it fit (Megatron-LM's ``--recompute-num-layers``), its label then reading
  ``selective+k full``.

Every surviving layout gets a step-time estimate:

    stage time per micro-batch = compute / (tp cp) at ``mfu`` of peak + TP all-reduces + CP ring transfers
    step = (M + (pp - 1) / v) * stage time + PP transfers + data-parallel sync not hidden by the last backward

with compute from :func:`scalebook.accounting.flops.flops_per_token` (8/6 of it under full recompute),
TP and DP collectives in the alpha-beta model (:func:`scalebook.accounting.comm.alpha_beta_time`; TP on
the node's link, everything else on the per-GPU network link) and the pipeline bubble of
:func:`scalebook.accounting.pipeline.bubble_fraction`. Nothing overlaps except the data-parallel
gradient sync, which runs under the backward pass of the last micro-batch.

Data-parallel traffic per step, over the dp cp ranks that hold the same weights, with M micro-batches per
step (gradient accumulation, or the micro-batches of a pipeline). A ZeRO stage is taken to hold, at every
moment, only what its memory formula counts, so:

    ZeRO-0: one all-reduce of the gradients        ZeRO-1: one reduce-scatter + one all-gather
    ZeRO-2: M reduce-scatters (each micro-batch's gradients, so that only the shard is kept) + one all-gather
    ZeRO-3: M x (all-gather for the forward, all-gather for the backward, reduce-scatter)

ZeRO-2/3 combine with pipeline parallelism (DeepSpeed refuses the combination; torchtitan's FSDP2 x TP x
PP is its standard recipe), at this per-micro-batch price. A stage that instead keeps its parameters and
gradients gathered from the first micro-batch to the last (what ``torch.distributed.pipelining`` does
with FSDP2) has ZeRO-1's peak memory and traffic, which the search already holds as ZeRO-1.

``predict`` here is :func:`scalebook.system.predict.predict`, the system model that predicts a given layout's
step time, utilization and memory with parameters fitted on published runs; ``plan`` keeps its ``mfu`` input.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 3 (takeaways on combining TP, PP, DP); Grattafiori et al. 2024, "The Llama 3 Herd of
Models", Sec. 3.3.2 (TP 8, PP 16, DP 128 on 16,384 H100 for 8K sequences); Tazi et al. 2025, "The
Ultra-Scale Playbook", "Finding the best training configuration".
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from scalebook import configs
from scalebook.accounting import comm
from scalebook.accounting import pipeline as pipeline_math
from scalebook.accounting.flops import flops_per_token
from scalebook.accounting.memory import activation_bytes, model_state_bytes
from scalebook.accounting.params import param_count
from scalebook.configs import ModelConfig
from scalebook.system.predict import predict  # noqa: F401 - the system model's entry point, planner.predict

RECOMPUTE = ("selective", "full")


@dataclass(frozen=True)
class Cluster:
    """GPUs of one type in nodes of ``gpus_per_node``; ``inter_node_link`` is each GPU's network port."""

    gpu: str = "h100-sxm"
    gpus_per_node: int = 8
    nodes: int = 2048
    inter_node_link: str = "infiniband-ndr"
    alpha: float = 5e-6  # seconds of latency per message

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Layout:
    """One candidate: degrees, micro-batch, recomputation, ZeRO stage, virtual stages."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    micro_batch: int
    recompute: str
    zero_stage: int
    virtual_stages: int
    full_recompute_layers: int = 0  # with recompute="selective": layers per stage recomputed in full

    def label(self) -> str:
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        policy = self.recompute + (f"+{self.full_recompute_layers} full" if self.full_recompute_layers else "")
        return (f"TP{self.tp} PP{self.pp}{v} DP{self.dp} CP{self.cp} mb{self.micro_batch} "
                f"{policy} ZeRO-{self.zero_stage}")  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """A feasible layout's memory per GPU and step time, with the parts of the step."""

    layout: Layout
    memory: int  # bytes on the busiest GPU
    step_time: float  # seconds
    parts: dict = field(hash=False)  # seconds by cause: compute, bubble, tp, cp, pp, dp
    mfu: float  # model FLOPs (6 N D with attention, no recompute) over peak, for the whole step


@dataclass
class Plan:
    """The ranked feasible layouts and why the others were rejected."""

    ranked: list[Estimate]
    rejected: Counter  # reason -> number of layouts

    def rank_of(self, **degrees) -> int:
        """Position (0-based) of the best layout with these degrees, e.g. ``rank_of(tp=8, pp=16, dp=128)``."""
        for i, estimate in enumerate(self.ranked):
            if all(getattr(estimate.layout, k) == v for k, v in degrees.items()):
                return i
        raise ValueError(f"no feasible layout has {degrees}")


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)]


def _check_inputs(cfg, seq_len, global_batch_tokens, cluster, mfu, memory_fraction) -> None:
    problems = []
    if not isinstance(cfg, ModelConfig):
        problems.append(f"model must be a ModelConfig or a name from configs.list_models(), got {cfg!r}")
    for name, value in (("seq_len", seq_len), ("global_batch_tokens", global_batch_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if not problems and global_batch_tokens % seq_len:
        problems.append(f"global_batch_tokens ({global_batch_tokens}) must be a multiple of seq_len ({seq_len})")
    if cluster.gpu not in configs.HARDWARE:
        problems.append(f"unknown GPU {cluster.gpu!r}; choose one of {configs.list_hardware()}")
    if cluster.inter_node_link not in configs.LINKS:
        problems.append(f"unknown link {cluster.inter_node_link!r}; choose one of {configs.list_links()}")
    for name in ("gpus_per_node", "nodes"):
        value = getattr(cluster, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            problems.append(f"cluster.{name} must be a power of two >= 1, got {value!r}")
    if not 0 < mfu <= 1:
        problems.append(f"mfu must be in (0, 1], got {mfu!r}")
    if not 0 < memory_fraction <= 1:
        problems.append(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    if problems:
        raise ValueError("cannot plan: " + "; ".join(problems))


def plan(
    model: str | ModelConfig,
    *,
    seq_len: int,
    global_batch_tokens: int,
    cluster: Cluster,
    mfu: float = 0.5,
    memory_fraction: float = 0.9,
    micro_batches: tuple[int, ...] = (1, 2, 4),
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    virtual_stages: tuple[int, ...] = (1, 2, 4),
) -> Plan:
    """Enumerate, reject and rank layouts (see the module docstring). ``mfu`` is the share of peak bf16
    FLOP/s the matmuls reach; ``memory_fraction`` of HBM is usable (the rest: buffers, fragmentation)."""
    cfg = configs.get_model(model) if isinstance(model, str) else model
    _check_inputs(cfg, seq_len, global_batch_tokens, cluster, mfu, memory_fraction)
    gpu = configs.get_hardware(cluster.gpu)
    peak = gpu.peak("bf16")
    nvlink, network = gpu.intra_node_bandwidth, configs.get_link(cluster.inter_node_link).bandwidth
    n_params, L = param_count(cfg), cfg.n_layers
    sequences = global_batch_tokens // seq_len
    budget = memory_fraction * gpu.hbm_bytes
    rejected: Counter = Counter()
    estimates = []
    N = cluster.gpus
    degrees = _powers_of_two(N)
    for tp in degrees:
        for pp in [p for p in range(1, L + 1) if N % p == 0]:
            for cp in degrees:
                if N % (tp * pp * cp):
                    continue
                dp = N // (tp * pp * cp)
                for mb in micro_batches:
                    for recompute in RECOMPUTE:
                        for zero in zero_stages:
                            for v in virtual_stages:
                                layout = Layout(tp, pp, dp, cp, 1, mb, recompute, zero, v)
                                reason = _rule_broken(cfg, layout, cluster, seq_len, sequences)
                                if reason is None:
                                    estimate = _estimate(cfg, layout, seq_len, sequences, cluster, peak, mfu,
                                                         nvlink, network, n_params)  # fmt: skip
                                    if estimate.memory > budget and recompute == "selective":
                                        # Megatron's --recompute-num-layers: recompute the fewest whole
                                        # layers of each stage in full that bring the stage under budget.
                                        for k in range(1, -(-L // pp)):
                                            partial = _estimate(cfg, replace(layout, full_recompute_layers=k),
                                                                seq_len, sequences, cluster, peak, mfu, nvlink,
                                                                network, n_params)  # fmt: skip
                                            if partial.memory <= budget:
                                                estimate = partial
                                                break
                                    if estimate.memory > budget:
                                        reason = f"memory > {memory_fraction:.0%} of {gpu.hbm_bytes / 1e9:.0f} GB"
                                if reason is None:
                                    estimates.append(estimate)
                                else:
                                    rejected[reason] += 1
    estimates.sort(key=lambda e: (e.step_time, e.memory))
    return Plan(estimates, rejected)


def _rule_broken(cfg: ModelConfig, lay: Layout, cluster: Cluster, seq_len: int, sequences: int) -> str | None:
    if lay.tp > cluster.gpus_per_node:
        return "TP beyond a node"
    if cfg.n_heads % lay.tp or cfg.n_kv_heads % lay.tp:
        return "heads not divisible by TP"
    if lay.pp * lay.virtual_stages > cfg.n_layers:
        return "more pipeline stages than layers"
    if lay.pp == 1 and lay.virtual_stages > 1:
        return "virtual stages without a pipeline"
    if seq_len % (2 * lay.cp * lay.tp):
        return "sequence not divisible into 2 CP x TP chunks"
    if sequences % (lay.dp * lay.micro_batch):
        return "batch not divisible into DP x micro-batch"
    microbatches = sequences // (lay.dp * lay.micro_batch)
    if lay.pp > 1 and microbatches < lay.pp:
        return "fewer micro-batches than stages"
    if lay.virtual_stages > 1 and microbatches % lay.pp:
        return "interleaving needs micro-batches in multiples of PP"
    return None


def _estimate(cfg, lay: Layout, seq_len, sequences, cluster, peak, mfu, nvlink, network, n_params) -> Estimate:
    L, h, alpha = cfg.n_layers, cfg.d_model, cluster.alpha
    M = sequences // (lay.dp * lay.micro_batch)
    stage_layers = -(-L // lay.pp)  # the largest stage
    # Memory: states of the largest stage; activations of its layers for the micro-batches in flight.
    states = model_state_bytes(n_params * stage_layers * lay.pp / L, zero_stage=lay.zero_stage,
                               dp=lay.dp * lay.cp, tp=lay.tp, pp=lay.pp).total  # fmt: skip

    def per_layer(recompute: str) -> float:
        return activation_bytes(cfg, seq_len=seq_len // lay.cp, micro_batch=lay.micro_batch, tp=lay.tp,
                                sp=lay.tp > 1, recompute=recompute, dropout=False) / L  # fmt: skip

    # The share of each stage's layers recomputed in full: all of them, none, or k (partial recomputation).
    full_share = 1.0 if lay.recompute == "full" else lay.full_recompute_layers / stage_layers
    layer_bytes = full_share * per_layer("full") + (1 - full_share) * per_layer(lay.recompute)
    schedule = "interleaved" if lay.virtual_stages > 1 else "1f1b"
    in_flight = (
        pipeline_math.peak_in_flight(schedule, lay.pp, M, 0, virtual_stages=lay.virtual_stages) if lay.pp > 1 else 1
    )
    activations = layer_bytes * stage_layers / lay.virtual_stages * in_flight
    memory = int(states + activations)

    # Time of one micro-batch through one stage on one GPU; a fully recomputed layer runs its forward twice.
    tokens_mb = lay.micro_batch * seq_len
    per_token = (1 - full_share) * flops_per_token(cfg, seq_len=seq_len) + full_share * flops_per_token(
        cfg, seq_len=seq_len, recompute=True
    )
    compute = per_token * tokens_mb * stage_layers / L
    compute /= lay.tp * lay.cp * peak * mfu
    message = tokens_mb // lay.cp * h * 2  # bf16 activations of the micro-batch on this CP rank
    tp_per_layer = (4 + 2 * full_share) * comm.alpha_beta_time(
        "all_reduce", message, lay.tp, alpha=alpha, bandwidth=nvlink
    )
    tp_time = tp_per_layer * stage_layers
    kv_block = tokens_mb // lay.cp * cfg.d_kv * 2 * 2  # K and V of this rank's tokens
    cp_link = nvlink if lay.tp * lay.cp <= cluster.gpus_per_node else network
    cp_time = 3 * (lay.cp - 1) * (alpha + kv_block / cp_link) * stage_layers  # forward once, backward twice
    stage_time = compute + tp_time + cp_time
    pipeline_time = (M + (lay.pp - 1) / lay.virtual_stages) * stage_time
    pp_time = 0.0
    if lay.pp > 1:
        pp_message = message // lay.tp  # sequence-parallel activations: each TP rank sends its share
        pp_time = 2 * (lay.pp - 1) * (alpha + pp_message / network)  # fill and drain are exposed
    grads_per_gpu = n_params * stage_layers / L
    dp_time = data_parallel_time(grads_per_gpu / lay.tp, lay.dp * lay.cp, lay.zero_stage, M, alpha=alpha,
                                 bandwidth=network)  # fmt: skip
    dp_exposed = max(0.0, dp_time - stage_time * 2 / 3)  # hidden under the last micro-batch's backward
    step = pipeline_time + pp_time + dp_exposed
    parts = {
        "compute": M * compute,
        "bubble": (lay.pp - 1) / lay.virtual_stages * stage_time,
        "tp": M * tp_time,
        "cp": M * cp_time,
        "pp": pp_time,
        "dp": dp_exposed,
    }
    model_flops = flops_per_token(cfg, seq_len=seq_len) * sequences * seq_len
    achieved = model_flops / (step * cluster.gpus * peak)
    return Estimate(lay, memory, step, parts, achieved)


def data_parallel_time(params: float, n: int, zero_stage: int, microbatches: int, *, alpha: float,
                       bandwidth: float) -> float:  # fmt: skip
    """Seconds of data-parallel communication per step for ``params`` 16-bit weights and gradients per GPU
    over ``n`` ranks, in the alpha-beta model (see the module docstring for what each stage sends)."""
    if n == 1:
        return 0.0
    message = 2 * params  # bytes of bf16 gradients, or of bf16 weights

    def collective(op: str) -> float:
        return comm.alpha_beta_time(op, message, n, alpha=alpha, bandwidth=bandwidth)

    if zero_stage == 0:
        return collective("all_reduce")
    if zero_stage == 1:
        return collective("reduce_scatter") + collective("all_gather")
    if zero_stage == 2:
        return microbatches * collective("reduce_scatter") + collective("all_gather")
    return microbatches * (2 * collective("all_gather") + collective("reduce_scatter"))


def layout_table(estimates: list[Estimate]) -> list[list[str]]:
    """Rows for :func:`scalebook.notebook.markdown_table`: layout, memory, step time, MFU, largest overhead."""
    rows = []
    for i, e in enumerate(estimates, 1):
        overhead = max((k for k in e.parts if k != "compute"), key=lambda k: e.parts[k])
        rows.append([i, e.layout.label(), f"{e.memory / 1e9:.1f}", f"{e.step_time:.2f}", f"{e.mfu:.0%}",
                     f"{overhead} {e.parts[overhead]:.2f} s"])  # fmt: skip
    return rows


LAYOUT_HEADERS = ["#", "layout", "GB / GPU", "step (s)", "MFU", "largest overhead"]
