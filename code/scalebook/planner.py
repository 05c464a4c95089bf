"""Search for a parallel layout: enumerate (tp, pp, cp, dp, v, micro-batch, recomputation, ZeRO), reject, rank.

For a model, a sequence length, a global batch in tokens and a cluster, every factorization
``gpus = tp * pp * cp * dp`` with ``tp pp cp`` powers of two (``tp`` within an NVLink domain: a node of an HGX
board, 72 GPUs of a GB200 NVL72 rack; ``pp`` at most the layers) is combined with the expert-parallel degrees of a
mixture of experts (``ep``, with its all-to-all priced by :func:`scalebook.system.hardware.all_to_all_time`), the
virtual stages, micro-batch sizes, recomputation policies and ZeRO stages given. Each candidate goes through
the system model (:func:`scalebook.system.predict.predict`, parameters fitted on published runs:
:mod:`scalebook.calibration`), which **predicts** its step time, utilization and memory: nothing here is an
assumed utilization. A candidate is **rejected**, with its reason, when it cannot run at all (``predict``'s
ValueError: heads not divisible by ``tp``, fewer micro-batches than stages, a batch that does not split into
``dp`` replicas of whole micro-batches, ...) or when its busiest GPU's memory (states, activations, logits,
buffers, runtime, fragmentation: :mod:`scalebook.system.memory`) exceeds the GPU's HBM. The others are ranked
by predicted step time.

What every candidate shares (``base``): the settings of :class:`scalebook.system.layout.TrainingLayout`, with
pipeline sends overlapped (Megatron-LM's ``--overlap-p2p-communication``, Llama 3's asynchronous p2p), the
data-parallel sync overlapped with the backward, fused attention and sequence parallelism (DeepSeek-V3's
DualPipe, FP8 and node-limited routing are set there). The cluster's nodes have one network port per GPU
(:class:`Cluster`; ``NVL72`` is 32 GB200 NVL72 racks), NCCL's ring latencies and rail-aligned rings
(:mod:`scalebook.system.hardware`).

``predict`` here is :func:`scalebook.system.predict.predict`. ``plan`` once took an ``mfu`` (the share of peak the
matmuls reach, an input); the system model predicts it, so ``plan`` refuses that argument.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 3 (takeaways on combining TP, PP, DP); Grattafiori et al. 2024, "The Llama 3 Herd of
Models", Sec. 3.3.2 (TP 8, PP 16, DP 128 on 16,384 H100 for 8K sequences); Tazi et al. 2025, "The
Ultra-Scale Playbook", "Finding the best training configuration".
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace

from scalebook import configs
from scalebook.accounting import comm
from scalebook.configs import ModelConfig
from scalebook.system import hardware as system_hardware
from scalebook.system.layout import TrainingLayout
from scalebook.system.predict import FITTED, predict  # noqa: F401 - predict is the entry point planner.predict
from scalebook.system.search import rank_layouts

RECOMPUTE = ("selective", "full")
BASE = TrainingLayout(tp=1, pp=1, dp=1, overlap_p2p=True)


@dataclass(frozen=True)
class Cluster:
    """GPUs of one type in nodes of ``gpus_per_node``; every GPU has one network port of ``inter_node_link`` (a key
    of ``scalebook.configs.LINKS``). ``nvlink_domain`` GPUs reach each other over NVLink (``None``: one node, as
    on an HGX board; 72 for a GB200 NVL72 rack of 18 trays of 4): tensor parallelism stays inside it."""

    gpu: str = "h100-sxm"
    gpus_per_node: int = 8
    nodes: int = 2048
    inter_node_link: str = "infiniband-ndr"
    nvlink_domain: int | None = None

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def system(self) -> system_hardware.Cluster:
        """The same cluster for :mod:`scalebook.system`: one NIC per GPU at the link's bandwidth."""
        link = configs.get_link(self.inter_node_link)
        return system_hardware.Cluster(self.gpu, self.gpus, gpus_per_node=self.gpus_per_node,
                                       nics_per_node=self.gpus_per_node, nic_bandwidth=link.bandwidth,
                                       nvlink_domain=self.nvlink_domain,
                                       name=f"{self.nodes} x {self.gpus_per_node} {self.gpu}")  # fmt: skip


# 32 GB200 NVL72 racks (18 trays of 4 Blackwell GPUs, 72 in one NVLink domain), 2,304 GPUs. Each GPU is rated here
# as the HGX B200's datasheet rates it (2.25 PFLOPS dense BF16, 180 GB, NVLink 1.8 TB/s); the NVL72 sheet gives
# 2.5 PFLOPS and 186 GB, so the planner's compute times on it are about 10 % long.
NVL72 = Cluster(gpu="b200", gpus_per_node=4, nodes=18 * 32, nvlink_domain=72)


@dataclass(frozen=True)
class Estimate:
    """A feasible layout's predicted memory per GPU, step time, the parts of the step, and MFU."""

    layout: TrainingLayout
    memory: float  # bytes on the busiest GPU
    step_time: float  # seconds
    parts: dict = field(hash=False)  # seconds by cause: compute, bubble, tp, cp, ep, pp, dp, optimizer
    mfu: float  # model FLOPs (MFU convention) over peak bf16, predicted


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


def _check_inputs(cfg, seq_len, global_batch_tokens, cluster, options) -> None:
    problems = []
    if not isinstance(cfg, ModelConfig):
        problems.append(f"model must be a ModelConfig or a name from configs.list_models(), got {cfg!r}")
    for name, value in (("seq_len", seq_len), ("global_batch_tokens", global_batch_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if not problems and global_batch_tokens % seq_len:
        problems.append(f"global_batch_tokens ({global_batch_tokens}) must be a multiple of seq_len ({seq_len})")
    if not isinstance(cluster, Cluster):
        problems.append(f"cluster must be a planner.Cluster, got {cluster!r}")
    else:
        if cluster.gpu not in configs.HARDWARE:
            problems.append(f"unknown GPU {cluster.gpu!r}; choose one of {configs.list_hardware()}")
        elif "bf16" not in configs.get_hardware(cluster.gpu).peak_flops:
            bf16 = [name for name in configs.list_hardware() if "bf16" in configs.get_hardware(name).peak_flops]
            problems.append(f"the step model predicts bf16 training and {cluster.gpu} has no bf16 arithmetic; "
                            f"choose a GPU that has: {', '.join(bf16)}")  # fmt: skip
        if cluster.inter_node_link not in configs.LINKS:
            problems.append(f"unknown link {cluster.inter_node_link!r}; choose one of {configs.list_links()}")
        value = cluster.gpus_per_node
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            problems.append(f"cluster.gpus_per_node must be a power of two >= 1, got {value!r}")
        if isinstance(cluster.nodes, bool) or not isinstance(cluster.nodes, int) or cluster.nodes < 1:
            problems.append(f"cluster.nodes must be a positive integer, got {cluster.nodes!r}")
        elif (domain := cluster.nvlink_domain) is not None and (
            isinstance(domain, bool) or not isinstance(domain, int) or domain < 1
            or domain % cluster.gpus_per_node or cluster.gpus % domain
        ):  # fmt: skip
            problems.append(f"cluster.nvlink_domain must be whole nodes of {cluster.gpus_per_node} GPUs that divide "
                            f"the cluster's {cluster.gpus}, or None, got {domain!r}")  # fmt: skip
    for name, values, allowed in options:
        if not values or any(v not in allowed for v in values):
            problems.append(f"{name} must be a non-empty tuple of {allowed}, got {values!r}")
    if problems:
        raise ValueError("cannot plan: " + "; ".join(problems))


def _reason(text: str) -> str:
    """A rejection reason without the numbers of one candidate, so that candidates group by rule."""
    text = re.sub(r" \([^)]*\)", "", text)
    text = re.sub(r"^the interleaved schedule .*", "interleaved micro-batches not a multiple of pp", text)
    return re.sub(r"^\d+ micro-batches cannot fill \d+ stages$", "fewer micro-batches than pipeline stages", text)


def plan(
    model: str | ModelConfig,
    *,
    seq_len: int,
    global_batch_tokens: int,
    cluster: Cluster,
    micro_batches: tuple[int, ...] = (1, 2),
    zero_stages: tuple[int, ...] = (1, 3),
    virtual_stages: tuple[int, ...] = (1, 2, 4),
    recomputes: tuple[str, ...] = RECOMPUTE,
    expert_parallel: tuple[int, ...] | None = None,
    base: TrainingLayout = BASE,
    **unknown,
) -> Plan:
    """Enumerate, predict, reject and rank layouts (see the module docstring). ``base`` holds the settings every
    candidate shares; its degrees, micro-batch, recomputation, ZeRO stage and virtual stages are replaced.
    ``expert_parallel``: the ``ep`` degrees tried for a mixture of experts (``None``: every power of two that
    divides the experts and the data-parallel ranks; a dense model runs ``ep = 1``)."""
    if "mfu" in unknown:
        raise TypeError("plan() takes no mfu: the system model predicts utilization (scalebook.system); "
                        "remove the mfu argument")  # fmt: skip
    if unknown:
        raise TypeError(f"plan() got unexpected keyword arguments {sorted(unknown)}")
    cfg = configs.get_model(model) if isinstance(model, str) else model
    _check_inputs(cfg, seq_len, global_batch_tokens, cluster,
                  (("micro_batches", micro_batches, range(1, 1025)), ("zero_stages", zero_stages, (0, 1, 2, 3)),
                   ("virtual_stages", virtual_stages, range(1, 129)),
                   ("recomputes", recomputes, ("none", "selective", "full")),
                   ("expert_parallel", (1,) if expert_parallel is None else expert_parallel, range(1, 4097))),
                  )  # fmt: skip
    system = cluster.system()
    rejected: Counter = Counter()
    ranked = []
    for zero in zero_stages:
        ranking = rank_layouts(cfg, system, seq_len=seq_len, global_batch=global_batch_tokens // seq_len,
                               base=replace(base, zero_stage=zero), virtual_stages=virtual_stages,
                               micro_batches=micro_batches, recomputes=recomputes,
                               expert_parallel=expert_parallel)  # fmt: skip
        for reason, count in ranking.rejected.items():
            rejected[_reason(reason)] += count
        ranked += [Estimate(lay, p.memory_total, p.step_time, dict(p.breakdown), p.mfu) for lay, p in ranking.ranked]
    # Ties to a nanosecond and a byte are broken by the label, so that CPython and Pyodide (whose libm may
    # differ in the last bit) rank alike.
    ranked.sort(key=lambda e: (round(e.step_time, 9), round(e.memory), e.layout.label()))
    return Plan(ranked, rejected)


def data_parallel_time(params: float, n: int, zero_stage: int, microbatches: int, *, alpha: float,
                       bandwidth: float) -> float:  # fmt: skip
    """Seconds of data-parallel communication per step for ``params`` 16-bit weights and gradients per GPU
    over ``n`` ranks, in the alpha-beta model: ZeRO-0 one all-reduce; ZeRO-1 a reduce-scatter and an all-gather;
    ZeRO-2 a reduce-scatter per micro-batch and one all-gather; ZeRO-3 per micro-batch two all-gathers and a
    reduce-scatter (a stage that holds only its shards at every moment). A what-if formula of Chapter 14; the
    planner's predictions use :func:`scalebook.system.step.dp_time`."""
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


LAYOUT_HEADERS = ["#", "layout", "GB / GPU", "step (s)", "predicted MFU", "largest overhead"]
