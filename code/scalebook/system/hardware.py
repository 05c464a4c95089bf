"""Hardware and topology: a cluster built by hand, and the time of a collective on it.

A cluster is ``gpus`` accelerators of one type (:func:`scalebook.configs.get_hardware`), ``gpus_per_node`` to a
node, ``nvlink_domain`` GPUs to one NVLink domain (8 for an HGX/DGX board, 72 for a GB200 NVL72 rack), and
``nics_per_node`` network ports of ``nic_bandwidth`` bytes/s each way. What the model assumes:

- **Links are full duplex.** Every bandwidth is per direction; a ring step sends and receives at once.
- **Rings are rail-aligned.** NCCL drives one ring channel per NIC, so a ring whose ``g`` ranks share a domain
  leaves the domain once per channel and uses the ``g`` ranks' NICs together: its bus bandwidth is
  ``min(B_NVLink, g * nics_per_gpu * B_NIC)`` (nccl issue #812's 192 GB/s on DGX A100 is ``8 x 25 GB/s``
  times the network efficiency below). A group with one rank per node runs at one NIC's rate.
- **Hierarchy is in the latency, not a second pass.** NCCL's own tuning model charges a ring collective a base
  latency plus, per step, the NVLink hop latency, except for the ``2 (nodes - 1)`` steps (all-reduce;
  ``nodes - 1`` for reduce-scatter and all-gather) that cross the network, which pay the network latency:
  one network hop per node, not per rank.
- **Achievable bandwidth** is the datasheet rate times an efficiency read off vendor-reported nccl-tests bus
  bandwidths (``scalebook.configs.REPORTED_BUSBW``): the mean busbw/line-rate ratio of the NVLink ring
  reports, and of the InfiniBand ring report. Derived, not fitted.
- **All-to-all** (expert parallelism) moves ``(n - 1)/n`` of each rank's message; the part bound for other
  domains goes through the rank's NICs, the rest over NVLink, at the same time. With node-limited routing
  (DeepSeek-V3 sends a token to at most 4 nodes and forwards within a node over NVLink) a token crosses the
  network at most ``node_limit`` times.
- Not modelled: in-network reduction (NVLink SHARP, InfiniBand SHARP), the tree algorithm, congestion between
  jobs, and the ``latencyInter`` a particular NIC adds to NCCL's network latency.

Source: NVIDIA NCCL ``src/graph/tuning.cc`` as of the 2.23-2.27 releases (the ones with the PAT algorithm and
Blackwell entries): ``baseLat`` Ring/Simple 8.4 us, ``hwLat`` Ring/Simple NVLink 3.4 us and NET 14.0 us, and the
ring latency ``baseLat + (nsteps - nInterSteps) intraLat + nInterSteps interLat`` (older releases charged NET
Ring/Simple 9.6 us and no per-step network split); NVIDIA/nccl issue #812 and NVIDIA/nccl-tests issues #149
and #212 (reported bus bandwidths); DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 3.2.2
(node-limited routing, at most 4 nodes per token).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scalebook import configs
from scalebook.accounting.comm import bytes_sent_per_rank, ring_steps

NCCL_VERSION = "2.23-2.27 (src/graph/tuning.cc)"
NCCL_BASE_LATENCY = 8.4e-6  # baseLat[Ring][Simple], seconds per collective
NCCL_NVLINK_LATENCY = 3.4e-6  # hwLat[NVLINK][Ring][Simple], seconds per ring step inside a domain
NCCL_NETWORK_LATENCY = 14.0e-6  # hwLat[NET][Ring][Simple], seconds per ring step across the network


def _ring_efficiency(kind: str) -> float:
    """Mean busbw / line rate of the vendor-reported ring measurements whose link is ``kind``."""
    ratios = [
        r.busbw / r.bound for r in configs.REPORTED_BUSBW.values() if r.algorithm == "ring" and r.link.startswith(kind)
    ]
    return statistics.fmean(ratios)


NVLINK_EFFICIENCY = _ring_efficiency("nvlink")  # 230/300 and 370/450: 0.79
NETWORK_EFFICIENCY = _ring_efficiency("infiniband")  # 192/(8 x 25): 0.96


@dataclass(frozen=True)
class Cluster:
    """A cluster built by hand. Bandwidths are bytes/s per direction; ``nvlink_bandwidth=None`` takes the
    GPU's datasheet NVLink (``configs.Hardware.intra_node_bandwidth``), ``nvlink_domain=None`` the node."""

    gpu: str
    gpus: int
    gpus_per_node: int = 8
    nics_per_node: int = 8
    nic_bandwidth: float = 400e9 / 8
    nvlink_bandwidth: float | None = None
    nvlink_domain: int | None = None
    name: str = "user-defined"

    def __post_init__(self):
        problems = []
        if self.gpu not in configs.HARDWARE:
            problems.append(f"unknown GPU {self.gpu!r}; choose one of {configs.list_hardware()}")
        for attr in ("gpus", "gpus_per_node", "nics_per_node"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{attr} must be a positive integer, got {value!r}")
        if not problems and self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            problems.append(f"gpus ({self.gpus}) must fill whole nodes of {self.gpus_per_node}")
        if not self.nic_bandwidth > 0 or (self.nvlink_bandwidth is not None and not self.nvlink_bandwidth > 0):
            problems.append("bandwidths must be positive")
        if self.nvlink_domain is not None and (not isinstance(self.nvlink_domain, int) or self.nvlink_domain < 1):
            problems.append(f"nvlink_domain must be a positive integer or None, got {self.nvlink_domain!r}")
        if problems:
            raise ValueError(f"invalid Cluster {self.name!r}: " + "; ".join(problems))

    @property
    def hardware(self) -> configs.Hardware:
        return configs.get_hardware(self.gpu)

    @property
    def domain(self) -> int:
        """GPUs that reach each other over NVLink."""
        return self.nvlink_domain or self.gpus_per_node

    @property
    def nvlink(self) -> float:
        """Achievable NVLink bandwidth per GPU, per direction: datasheet x ``NVLINK_EFFICIENCY``."""
        raw = self.nvlink_bandwidth or self.hardware.intra_node_bandwidth
        return raw * NVLINK_EFFICIENCY

    @property
    def network_per_gpu(self) -> float:
        """Achievable network bandwidth per GPU, per direction: its share of the node's NICs."""
        return self.nics_per_node * self.nic_bandwidth / self.gpus_per_node * NETWORK_EFFICIENCY


def ranks_per_domain(size: int, inner: int, cluster: Cluster) -> int:
    """How many ranks of a group of ``size`` share one NVLink domain, when the ranks of the dimensions placed
    inside it (``inner``: the product of their degrees, Megatron's order tp, cp, ep, dp, pp) sit between them."""
    if inner >= cluster.domain:
        return 1
    return max(1, min(size, cluster.domain // inner))


def collective_time(op: str, message_bytes: float, n: int, *, per_domain: int, cluster: Cluster) -> float:
    """Seconds for a ring ``op`` (``all_reduce``, ``reduce_scatter``, ``all_gather``) of an ``M``-byte message
    over ``n`` ranks, ``per_domain`` of which share each NVLink domain (see the module docstring)."""
    if n <= 1:
        return 0.0
    g = min(per_domain, n)
    domains = math.ceil(n / g)
    if domains == 1:
        bandwidth = cluster.nvlink
    else:
        bandwidth = min(cluster.nvlink, g * cluster.network_per_gpu)
    steps, network_steps = ring_steps(op, n, g)
    latency = NCCL_BASE_LATENCY + (steps - network_steps) * NCCL_NVLINK_LATENCY
    latency += network_steps * NCCL_NETWORK_LATENCY
    return latency + bytes_sent_per_rank(op, message_bytes, n) / bandwidth


def all_to_all_time(
    message_bytes: float,
    n: int,
    *,
    per_domain: int,
    cluster: Cluster,
    node_limit: int | None = None,
    fanout: int | None = None,
) -> float:
    """Seconds for an all-to-all in which each rank sends ``message_bytes`` spread evenly over ``n`` ranks.

    The share bound for other domains crosses the network at the rank's NIC rate while the rest moves over
    NVLink. ``fanout`` copies of each token (top-k) with ``node_limit`` (at most that many domains per token,
    the copies for one domain sent once and forwarded over NVLink) cap the network share at
    ``node_limit / fanout`` of the message."""
    if n <= 1:
        return 0.0
    g = min(per_domain, n)
    remote = (n - g) / n
    if node_limit is not None and fanout:
        remote = min(remote, node_limit / fanout)
    local = (g - 1) / n
    network = message_bytes * remote / cluster.network_per_gpu
    nvlink = message_bytes * local / cluster.nvlink
    latency = NCCL_BASE_LATENCY + (NCCL_NETWORK_LATENCY if remote else NCCL_NVLINK_LATENCY)
    return latency + max(network, nvlink)


def p2p_time(message_bytes: float, *, same_domain: bool, cluster: Cluster) -> float:
    """Seconds to send one pipeline message to the next stage (one hop: NVLink inside a domain, else the NIC)."""
    if same_domain:
        return NCCL_NVLINK_LATENCY + message_bytes / cluster.nvlink
    return NCCL_NETWORK_LATENCY + message_bytes / cluster.network_per_gpu
