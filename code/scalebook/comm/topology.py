"""The network between nodes: a two-level, rail-optimized fat tree, its bisection bandwidth, and what a leaf
switch's oversubscription does to a ring all-reduce across nodes.

A two-level fat tree (leaf-spine) connects every network port (NIC) to a *leaf* switch, and every leaf to
every *spine* switch. A leaf with ``d`` ports down to NICs and ``u`` up to the spine is *oversubscribed*
``d : u``; at ``1 : 1`` the fabric is non-blocking. In a *rail-optimized* cluster NIC ``i`` of every node is
cabled to the leaves of rail ``i``: rail ``i`` joins the ``i``-th NICs of all nodes, a rail of ``N`` nodes has
``ceil(N / d)`` leaves, and traffic between two NICs of the same rail stays in their leaf when they share it.

**Bisection bandwidth** is what crosses the worst cut of the endpoints into two equal halves, per direction:
``E B / 2`` for ``E`` NICs of ``B`` bytes/s in a non-blocking fabric, ``E B / (2 r)`` with leaves
oversubscribed ``r : 1`` (each half's traffic leaves through its leaves' uplinks). It is what an all-to-all
pattern needs; a ring needs much less.

**Rings are rail-aligned.** NCCL runs one ring (channel) per NIC, and the hop that leaves a node goes from NIC
``i`` to NIC ``i`` of the next node: on the same rail. With the nodes in order along their rail's leaves, a
channel leaves a leaf only after the leaf's last node, one flow per leaf, so its ``u`` uplinks are never the
bottleneck and the ring keeps the NIC's line rate at any oversubscription. A ring whose hop changes rail
(GPU ``i`` of one node to GPU ``j != i`` of the next) crosses the spine at every node: the ``d`` flows of a
leaf share its ``u`` uplinks, and each gets ``B u / d = B / r``.
:meth:`RailOptimizedFatTree.ring_hop_bandwidth` counts those flows instead of assuming the formula: it assumes
a fluid network, in which the spine spreads a leaf's flows evenly over its uplinks (real ECMP hashing can
collide, which only lowers the result), a cluster running one job, and links that are full duplex.

Source: NVIDIA Enterprise Reference Architecture, "HGX AI Factory (H100, H200, B200): Network Logical
Architecture" (a rail-optimized leaf-spine GPU compute fabric); NVIDIA NCCL ``src/graph`` (one ring channel per
NIC); Leiserson 1985, "Fat-trees: universal networks for hardware-efficient supercomputing".
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RailOptimizedFatTree:
    """``nodes`` nodes, each with ``rails`` NICs of ``nic_bandwidth`` bytes/s per direction, NIC ``i`` on rail
    ``i``; leaves of ``leaf_down_ports`` ports to NICs and ``leaf_down_ports / oversubscription`` to the spine,
    spine switches of ``spine_ports`` ports. Nodes fill a rail's leaves in order."""

    nodes: int
    rails: int
    nic_bandwidth: float
    leaf_down_ports: int = 32
    oversubscription: int = 1
    spine_ports: int = 64

    def __post_init__(self):
        for name in ("nodes", "rails", "leaf_down_ports", "oversubscription", "spine_ports"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.nic_bandwidth > 0:
            raise ValueError(f"nic_bandwidth must be > 0 bytes/s, got {self.nic_bandwidth!r}")
        if self.leaf_down_ports % self.oversubscription:
            raise ValueError(
                f"a leaf's {self.leaf_down_ports} down ports cannot be oversubscribed {self.oversubscription}:1 with "
                f"whole uplinks; pick leaf_down_ports divisible by the oversubscription"
            )

    @property
    def endpoints(self) -> int:
        """NICs in the cluster (one per GPU in an 8-GPU, 8-NIC node)."""
        return self.nodes * self.rails

    @property
    def leaf_up_ports(self) -> int:
        """Uplinks per leaf: its down ports over the oversubscription."""
        return self.leaf_down_ports // self.oversubscription

    @property
    def leaves_per_rail(self) -> int:
        """Leaf switches of one rail: ``ceil(nodes / leaf_down_ports)``."""
        return -(-self.nodes // self.leaf_down_ports)

    @property
    def leaves(self) -> int:
        """Leaf switches in all."""
        return self.rails * self.leaves_per_rail

    @property
    def spines(self) -> int:
        """Spine switches that the leaves' uplinks fill."""
        return -(-self.leaves * self.leaf_up_ports // self.spine_ports)

    @property
    def bisection_bandwidth(self) -> float:
        """Bytes/s across the worst cut into two equal halves, per direction: ``E B / (2 r)``."""
        return self.endpoints * self.nic_bandwidth / (2 * self.oversubscription)

    def _leaf(self, node: int, rail: int) -> tuple[int, int]:
        return rail, node // self.leaf_down_ports

    def ring_hop_bandwidth(self, *, rail_aligned: bool = True) -> float:
        """Bytes/s that each inter-node hop of a ring channel gets when every rail runs one channel at once.

        Rail ``c``'s channel goes from node ``k`` to node ``k + 1`` (the last back to the first), arriving on
        rail ``c`` if ``rail_aligned``, else on rail ``c + 1``. A hop between two leaves takes an uplink of
        the first and a downlink of the second; each leaf's uplinks are shared evenly by the flows leaving it
        (and its downlinks by those arriving), and the busiest leaf sets every hop's rate, since a ring moves
        at the pace of its slowest step.
        """
        if self.nodes == 1:
            return math.inf  # no hop leaves the node
        leaving: dict[tuple[int, int], int] = {}
        arriving: dict[tuple[int, int], int] = {}
        for rail in range(self.rails):
            for node in range(self.nodes):
                source = self._leaf(node, rail)
                target = self._leaf((node + 1) % self.nodes, rail if rail_aligned else (rail + 1) % self.rails)
                if source != target:
                    leaving[source] = leaving.get(source, 0) + 1
                    arriving[target] = arriving.get(target, 0) + 1
        busiest = max([*leaving.values(), *arriving.values()], default=0)
        return self.nic_bandwidth * min(1.0, self.leaf_up_ports / busiest) if busiest else self.nic_bandwidth

    def all_reduce_bus_bandwidth(self, *, rail_aligned: bool = True, nvlink_bandwidth: float = math.inf) -> float:
        """The bus bandwidth per GPU of a ring all-reduce over all GPUs, one GPU per NIC (nccl-tests' busbw).

        NCCL runs ``rails`` channels, each carrying ``1 / rails`` of the data through every GPU of a node over
        NVLink and out of the node through one NIC. A channel moves at its network hop's rate, so a GPU's
        share of the ring moves at ``rails`` times it, unless its NVLink (``nvlink_bandwidth`` per direction),
        which carries every channel, is slower: ``busbw = min(B_NVLink, rails x hop)``, as in
        :mod:`scalebook.system.hardware`."""
        return min(nvlink_bandwidth, self.rails * self.ring_hop_bandwidth(rail_aligned=rail_aligned))
