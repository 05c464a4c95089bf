"""Fully sharded data parallelism on a cluster of nodes: where the bytes go, how long they take, what overlap hides.

A cluster has ``nodes`` nodes of ``s = gpus_per_node`` GPUs (``d = nodes x s`` data-parallel ranks), fast links
inside a node (NVLink) and a network across nodes. Per training step ZeRO-3 all-gathers the parameters twice
(P bytes each time, forward and backward) and reduce-scatters the gradients (G bytes); ``2 P + G`` per step.

**Bytes per node per step** (:func:`zero3_bytes_per_node`). Full sharding runs each collective as one ring
through all d ranks, node after node, so a node's s ranks each send (d-1)/d of every message, s - 1 of them to
a neighbour in the node and one to the next node (on a single node the ring closes inside it):

    full sharding   inside = (s - 1) (d-1)/d (2P + G)      across = (d-1)/d (2P + G)
    HSDP            inside = (s - 1) (2P + G)              across = 2 (r-1)/r G         (r = nodes)

HSDP (hybrid sharding) shards inside the node and replicates across nodes: gathers and the reduce-scatter stay
in the node, and each rank then all-reduces its G/s shard of the gradients with its r - 1 replicas.

**Time** (:func:`zero3_comm_time`), alpha-beta per collective (``accounting.comm.alpha_beta_time``), the model in
``units`` equal units (one collective of each kind per unit): HSDP's collectives in the node run at the
NVLink's alpha and bandwidth, its all-reduce at the network's, each GPU on its own NIC. A full-sharding ring
through ``r`` nodes has ``d - 1`` hops per pass, of which only ``r - 1`` cross the network: a chunk pays the
network's alpha at those and NVLink's at the others, as NCCL's tuning model counts a ring's latency
(``(steps - net steps) x intra + net steps x inter``). NCCL spreads the ring over one channel per NIC, so a
node moves ``s x`` the NIC bandwidth, capped by the NVLink every byte also crosses: ``min(B_nvlink, s B_nic)``.

**Overlap** (:func:`exposed_communication`): one stream computes the units in order, one communication stream
runs the collectives in the order they were issued; a unit computes once its all-gather is done. Without
prefetch, a unit's all-gather is issued when the previous unit has finished computing, so all of it is
exposed; with prefetch it is issued when the previous unit starts computing, and only what outlasts that
computation is exposed.

Source: Zhao et al. 2023, "PyTorch FSDP" (Sec. 3.2.2 hybrid sharding, 3.3 prefetching); Rajbhandari et al.
2020, "ZeRO", Sec. 7 (volume); Thakur, Rabenseifner and Gropp 2005 (alpha-beta); NVIDIA NCCL documentation
(rings over channels, one per NIC).
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real

from scalebook.accounting import _checks
from scalebook.accounting.comm import alpha_beta_time, ring_latency
from scalebook.accounting.params import params_of
from scalebook.configs import ModelConfig


def _layout_problems(model, nodes, gpus_per_node, grad_bytes, param_bytes) -> list[str]:
    return _checks.model_or_count(model) + _checks.positive_int(
        nodes=nodes, gpus_per_node=gpus_per_node, grad_bytes=grad_bytes, param_bytes=param_bytes
    )


def zero3_bytes_per_node(
    model: ModelConfig | float, nodes: int, gpus_per_node: int, *, hybrid: bool = False, grad_bytes: int = 2,
    param_bytes: int = 2,
) -> dict[str, float]:  # fmt: skip
    """Bytes one node's GPUs send per ZeRO-3 step, ``{"intra_node": ..., "inter_node": ...}``: full sharding over
    all ``nodes x gpus_per_node`` ranks, or HSDP (``hybrid=True``). See the module's docstring for the formulas."""
    _checks.require(_layout_problems(model, nodes, gpus_per_node, grad_bytes, param_bytes),
                    _checks.one_of("hybrid", hybrid, (False, True)))  # fmt: skip
    psi, s, r = params_of(model), gpus_per_node, nodes
    per_step, grads = psi * (2 * param_bytes + grad_bytes), psi * grad_bytes  # 2 P + G, and G
    if hybrid:
        return {"intra_node": (s - 1) * per_step, "inter_node": 2 * (r - 1) / r * grads}
    d, crossing = r * s, 1 if r > 1 else 0  # ranks of the node whose ring neighbour is on the next node
    return {"intra_node": (s - crossing) * (d - 1) / d * per_step, "inter_node": crossing * (d - 1) / d * per_step}


def zero3_comm_time(
    model: ModelConfig | float, nodes: int, gpus_per_node: int, *, hybrid: bool, units: int, intra_alpha: float,
    intra_bandwidth: float, inter_alpha: float, inter_bandwidth: float, grad_bytes: int = 2, param_bytes: int = 2,
) -> float:  # fmt: skip
    """Seconds of ZeRO-3 communication per step with nothing overlapped (alpha-beta, ring algorithms): per unit
    two all-gathers of its parameters and a reduce-scatter of its gradients (HSDP: in the node, then an
    all-reduce of the gradient shard across nodes). ``inter_bandwidth`` is one NIC's (each GPU has its own)."""
    _checks.require(
        _layout_problems(model, nodes, gpus_per_node, grad_bytes, param_bytes),
        _checks.one_of("hybrid", hybrid, (False, True)),
        _checks.positive_int(units=units),
        _checks.positive(intra_bandwidth=intra_bandwidth, inter_bandwidth=inter_bandwidth),
    )
    psi, s, r = params_of(model), gpus_per_node, nodes
    unit_params, unit_grads = psi * param_bytes / units, psi * grad_bytes / units
    if hybrid or r == 1:  # collectives inside the node
        inside = dict(alpha=intra_alpha, bandwidth=intra_bandwidth)
        per_unit = (2 * alpha_beta_time("all_gather", unit_params, s, **inside)
                    + alpha_beta_time("reduce_scatter", unit_grads, s, **inside))  # fmt: skip
        if hybrid and r > 1:
            per_unit += alpha_beta_time("all_reduce", unit_grads / s, r, alpha=inter_alpha, bandwidth=inter_bandwidth)
        return units * per_unit
    d, bandwidth = r * s, min(intra_bandwidth, s * inter_bandwidth)
    # An all-gather or reduce-scatter ring: d - 1 steps, r - 1 of them across the network, the rest on NVLink.
    latency = ring_latency("all_gather", d, per_node=s, intra_alpha=intra_alpha, inter_alpha=inter_alpha)
    return units * (2 * (latency + alpha_beta_time("all_gather", unit_params, d, alpha=0.0, bandwidth=bandwidth))
                    + latency + alpha_beta_time("reduce_scatter", unit_grads, d, alpha=0.0, bandwidth=bandwidth))


def exposed_communication(
    comm: Sequence[float], compute: Sequence[float], *, prefetch: bool, after: Sequence[float] | None = None
) -> float:
    """Seconds the computation waits for communication in one pass over the units (in execution order).

    ``comm[i]``: unit i's all-gather, which must finish before unit i computes (``compute[i]`` seconds);
    ``after[i]``: communication issued when unit i has computed (its reduce-scatter), which nothing waits for
    until the pass ends. One communication stream runs everything in issue order. Returns the pass's length
    minus its computation.
    """
    after = [0.0] * len(comm) if after is None else list(after)
    times = {"comm": list(comm), "compute": list(compute), "after": after}
    problems = [f"{name} must be numbers >= 0, got {values!r}" for name, values in times.items()
                if any(isinstance(t, bool) or not isinstance(t, Real) or t < 0 for t in values)]  # fmt: skip
    if len({len(values) for values in times.values()}) != 1 or not comm:
        problems.append("comm, compute (and after) need one entry per unit, at least one unit, as many of each")
    _checks.require(problems, _checks.one_of("prefetch", prefetch, (False, True)))
    comm_free = compute_free = 0.0  # when each stream is next free
    gathered = [0.0] * len(comm)

    def issue_gather(unit: int, at: float) -> None:
        nonlocal comm_free
        gathered[unit] = comm_free = max(at, comm_free) + comm[unit]

    issue_gather(0, 0.0)
    for unit, seconds in enumerate(compute):
        start = max(compute_free, gathered[unit])
        if prefetch and unit + 1 < len(comm):
            issue_gather(unit + 1, start)
        compute_free = start + seconds
        if after[unit]:  # the reduce-scatter goes into the queue behind what was issued before it
            comm_free = max(comm_free, compute_free) + after[unit]
        if not prefetch and unit + 1 < len(comm):
            issue_gather(unit + 1, compute_free)
    return max(compute_free, comm_free) - sum(compute)
