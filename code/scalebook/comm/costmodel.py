"""The alpha-beta cost model of a collective: fit it to all-reduce times measured here, then apply it to
published interconnects.

A message of ``m`` bytes over one link takes ``alpha + m beta``: a fixed latency ``alpha`` (seconds) and
``beta = 1 / B`` seconds per byte for a link of bandwidth ``B``. A ring all-reduce over ``n`` ranks is
``2 (n - 1)`` such steps of ``M / n`` bytes (:func:`scalebook.accounting.comm.alpha_beta_time`):

    T(M, n) = 2 (n - 1) alpha + 2 (n - 1) / n * M * beta

``T`` is linear in ``alpha`` and ``beta``, so measured ``(n, M, T)`` triples determine both by least
squares. The fitted ``1 / beta`` is what NCCL's benchmarks call the *bus bandwidth*: the rate at which a
rank's link moves data when the algorithm's ``2 (n - 1) / n`` factor is accounted for.

For real hardware the bandwidth comes from the link's datasheet (``scalebook.configs.get_link``, per
direction) and the latency per step from NCCL's own performance model, which charges each ring step a
hardware latency of 3.4 us over NVLink, 5.7 us over PCIe and 14.0 us over the network (``hwLat``, its
``Simple`` protocol, used for large messages, in the releases ``scalebook.system.hardware.NCCL_VERSION``
names; releases before them charged 9.6 us over the network). The same constants drive the system model of
a training step (:mod:`scalebook.system.hardware`), which also adds NCCL's base latency per collective and
charges the network's latency only at the ring steps that leave a node; the alpha-beta model here, one link
kind per ring, leaves both out.

NCCL's double binary tree (:func:`double_tree_time`) trades the ring's ``2 (n - 1)`` latencies for
``2 log2 n``, at up to twice the ring's bytes on the busiest rank: NCCL's own tuning model charges its tree the
same, a bandwidth half the bus bandwidth (``ratio = .5`` against the ring's ``n / (2 (n - 1))``).

Source: Hockney 1994, "The communication challenge for MPP: Intel Paragon and Meiko CS-2" (alpha-beta);
Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations in MPICH";
NVIDIA NCCL ``src/graph/tuning.cc`` (``hwLat``, ring/Simple; the tree's bandwidth ratio and its latency
``2 log2(nodes)`` network hops) and nccl-tests ``doc/PERFORMANCE.md`` (bus bandwidth).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from scalebook.accounting.comm import alpha_beta_time
from scalebook.comm.collectives import ALL_REDUCES, double_binary_tree, library_all_reduce
from scalebook.configs import get_link
from scalebook.system.hardware import NCCL_NETWORK_LATENCY, NCCL_NVLINK_LATENCY

# Seconds per ring step, NCCL's hwLat[...][Ring][Simple] (the system model's constants, one version of NCCL);
# network covers InfiniBand and RoCE.
NCCL_STEP_LATENCY = {"nvlink": NCCL_NVLINK_LATENCY, "pcie": 5.7e-6, "network": NCCL_NETWORK_LATENCY}
_LINK_KIND = {"nvlink": "nvlink", "pcie": "pcie", "infiniband": "network", "roce": "network"}


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted or assumed link: ``alpha`` seconds per message, ``bandwidth`` bytes per second."""

    alpha: float
    bandwidth: float

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth

    def time(self, op: str, message_bytes: float, n: int, *, algorithm: str = "ring") -> float:
        """Predicted seconds for ``op`` on an ``M``-byte message over ``n`` ranks (``algorithm="double_tree"``:
        :func:`double_tree_time`, all-reduce only)."""
        if algorithm == "double_tree":
            if op != "all_reduce":
                raise ValueError(f"the double binary tree is an all-reduce algorithm here, not {op!r}")
            return double_tree_time(message_bytes, n, alpha=self.alpha, bandwidth=self.bandwidth)
        return alpha_beta_time(op, message_bytes, n, alpha=self.alpha, bandwidth=self.bandwidth,
                               algorithm=algorithm)  # fmt: skip


def double_tree_max_send_share(n: int) -> float:
    """The most any rank sends in a double-binary-tree all-reduce, as a multiple of its message ``M``.

    In each tree a rank sends its half (``M / 2``) once up to its parent and once down to each child; a rank
    that is interior, with two children, in one tree and a leaf in the other sends ``3 M / 2 + M / 2 = 2 M``
    (every rank, for ``n`` a power of two from 4 on). The mean over ranks is the ring's ``2 (n - 1) / n M``.
    """
    trees = double_binary_tree(n)
    return max(sum((tree[r][0] >= 0) + len(tree[r][1]) for tree in trees) for r in range(n)) / 2


def double_tree_time(message_bytes: float, n: int, *, alpha: float, bandwidth: float) -> float:
    """Seconds for a pipelined double-binary-tree all-reduce of ``M`` bytes over ``n`` ranks:

        T = 2 ceil(log2 n) alpha + S M beta,   S = double_tree_max_send_share(n)  (2 for n >= 4, powers of two)

    against the ring's ``2 (n - 1) alpha + 2 (n - 1) / n M beta``. Assumed: one rank per NIC and full-duplex
    links (as for the ring); the message is cut into many chunks that follow each other up and down the trees,
    so a chunk's latency is paid once per level on the way up and once on the way down (``alpha`` is a delay,
    not a time the link is busy) and the fill and drain of the pipeline add little; the busiest rank's sends
    set the bandwidth term; additions are free. For one chunk (small messages) the from-scratch
    :func:`scalebook.comm.collectives.double_tree_all_reduce` runs ``2 log2 n`` rounds, the latency term.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a number of ranks >= 1, got {n!r}")
    if message_bytes < 0 or alpha < 0 or bandwidth <= 0:
        raise ValueError(f"need message_bytes >= 0, alpha >= 0 and bandwidth > 0; got {message_bytes}, {alpha}, "
                         f"{bandwidth}")  # fmt: skip
    if n == 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + double_tree_max_send_share(n) * message_bytes / bandwidth


def _coefficients(op: str, message_bytes: float, n: int, algorithm: str) -> tuple[float, float]:
    # T = a alpha + b beta; the formula is linear, so unit inputs read off a and b.
    a = alpha_beta_time(op, 0, n, alpha=1.0, bandwidth=1.0, algorithm=algorithm)
    b = alpha_beta_time(op, message_bytes, n, alpha=0.0, bandwidth=1.0, algorithm=algorithm)
    return a, b


def fit_alpha_beta(
    measurements: Sequence[tuple[int, float, float]], *, op: str = "all_reduce", algorithm: str = "ring"
) -> AlphaBeta:
    """Least-squares ``alpha`` and ``beta`` from ``(n, message_bytes, seconds)`` measurements.

    Residuals are relative (divided by the measured time), so a 1 KB message that takes 100 us counts as
    much as a 16 MB one that takes 50 ms. Both parameters are kept >= 0: if the unconstrained fit makes
    one negative, it is set to 0 and the other refitted alone.
    """
    rows = list(measurements)
    if len(rows) < 2:
        raise ValueError(f"need at least two (n, message_bytes, seconds) measurements, got {len(rows)}")
    for n, message_bytes, seconds in rows:
        if not (isinstance(n, int) and n >= 2 and message_bytes >= 0 and seconds > 0):
            raise ValueError(f"each measurement needs n >= 2 ranks, bytes >= 0 and seconds > 0; got "
                             f"{(n, message_bytes, seconds)}")  # fmt: skip
    design = np.array([[c / t for c in _coefficients(op, m, n, algorithm)] for n, m, t in rows])
    target = np.ones(len(rows))
    alpha, beta = np.linalg.lstsq(design, target, rcond=None)[0]
    if alpha < 0 or beta <= 0:
        keep = 1 if alpha < 0 else 0  # the parameter that stays
        column = design[:, keep]
        value = float(column @ target / (column @ column))
        alpha, beta = (0.0, value) if keep == 1 else (value, 0.0)
    if beta <= 0:
        raise ValueError("the times do not grow with the message size, so no bandwidth can be fitted; "
                         "measure larger messages")  # fmt: skip
    return AlphaBeta(alpha=float(alpha), bandwidth=float(1.0 / beta))


def link_latency(link: str) -> float:
    """NCCL's per-step latency (seconds) for the kind of ``link`` (an entry of ``configs.list_links()``)."""
    name = get_link(link).name
    for prefix, kind in _LINK_KIND.items():
        if name.startswith(prefix):
            return NCCL_STEP_LATENCY[kind]
    raise ValueError(f"no published per-step latency for {name!r}; use an NVLink, PCIe, InfiniBand or RoCE link")


def link_model(link: str) -> AlphaBeta:
    """The alpha-beta model of a published link: NCCL's step latency and the datasheet bandwidth."""
    return AlphaBeta(alpha=link_latency(link), bandwidth=get_link(link).bandwidth)


def time_all_reduce(
    message_bytes: Sequence[int],
    group_sizes: Sequence[int] = (2, 4),
    *,
    repeats: int = 5,
    warmup: int = 1,
    algorithm: str = "library",
) -> dict[int, list[float]]:
    """Worker: seconds per all-reduce of each message size, on the first ``k`` ranks for each ``k``.

    ``algorithm`` is ``"library"`` (``dist.all_reduce``) or one of the from-scratch ``"ring"``, ``"tree"``,
    ``"naive"`` of :mod:`scalebook.comm.collectives`. Each measurement starts after a barrier and is the
    slowest rank's time, since the collective is done only when every rank is; the result per size is the
    median over ``repeats`` (after ``warmup`` untimed calls). Messages are float32 tensors of
    ``message_bytes / 4`` elements. Every rank returns ``{k: [median seconds per size]}`` for the groups it
    belongs to.
    """
    if algorithm != "library" and algorithm not in ALL_REDUCES:
        raise ValueError(f"algorithm must be 'library' or one of {sorted(ALL_REDUCES)}, got {algorithm!r}")
    all_reduce = ALL_REDUCES.get(algorithm, library_all_reduce)
    world = dist.get_world_size()
    if any(k < 2 or k > world for k in group_sizes):
        raise ValueError(f"group sizes must be between 2 and the world size {world}, got {list(group_sizes)}")
    if any(m < 4 or m % 4 for m in message_bytes):
        raise ValueError(f"message sizes must be positive multiples of 4 bytes (float32), got {list(message_bytes)}")
    groups = {k: dist.new_group(list(range(k))) for k in group_sizes}  # every rank must create every group
    rank = dist.get_rank()
    medians: dict[int, list[float]] = {}
    for k, group in groups.items():
        if rank >= k:
            continue
        medians[k] = []
        for size in message_bytes:
            buffer = torch.ones(size // 4)
            for _ in range(warmup):
                all_reduce(buffer, group=group)
            elapsed = torch.empty(repeats, dtype=torch.float64)
            for i in range(repeats):
                dist.barrier(group=group)
                start = time.perf_counter()
                all_reduce(buffer, group=group)
                elapsed[i] = time.perf_counter() - start
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            medians[k].append(statistics.median(elapsed.tolist()))
    dist.barrier()
    return medians
