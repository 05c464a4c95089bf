"""The alpha-beta fit recovers known latencies and bandwidths; published links give hand-checked predictions; the
double binary tree's model and the rail-optimized fat tree of a 1,024-GPU cluster are checked by hand."""

import random

import pytest
import torch.distributed as dist

from scalebook.comm import launch
from scalebook.comm.costmodel import (
    AlphaBeta,
    double_tree_max_send_share,
    double_tree_time,
    fit_alpha_beta,
    link_latency,
    link_model,
    time_all_reduce,
)
from scalebook.comm.topology import RailOptimizedFatTree

SIZES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB


def ring_seconds(n, message, alpha, beta):
    # Written out here rather than taken from accounting: 2 (n-1) steps of alpha + (M / n) beta.
    return 2 * (n - 1) * (alpha + message / n * beta)


def test_fit_recovers_alpha_and_beta_from_exact_ring_times():
    alpha, beta = 150e-6, 1 / 1.5e9
    points = [(n, m, ring_seconds(n, m, alpha, beta)) for n in (2, 4) for m in SIZES]
    fit = fit_alpha_beta(points)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.bandwidth == pytest.approx(1.5e9, rel=1e-9)
    assert fit.beta == pytest.approx(beta, rel=1e-9)


def test_fit_tolerates_ten_percent_noise():
    rng = random.Random(0)
    alpha, beta = 50e-6, 1 / 3e9
    points = [(n, m, ring_seconds(n, m, alpha, beta) * rng.uniform(0.9, 1.1)) for n in (2, 3, 4) for m in SIZES]
    fit = fit_alpha_beta(points)
    assert fit.alpha == pytest.approx(alpha, rel=0.15)
    assert fit.bandwidth == pytest.approx(3e9, rel=0.15)


def test_a_latency_that_would_fit_negative_is_clamped_to_zero():
    # Pure bandwidth, with the smallest messages measured a little fast: unconstrained, alpha < 0.
    beta = 1 / 2e9
    points = [(2, m, ring_seconds(2, m, 0.0, beta) * (0.5 if m < 5000 else 1.0)) for m in SIZES]
    fit = fit_alpha_beta(points)
    assert fit.alpha == 0.0
    # With alpha = 0 the relative residuals are c x_i - 1, x_i = 1 for six sizes and 2 for the two halved
    # ones; least squares gives c = sum x / sum x^2 = 10 / 14, so the bandwidth is 2e9 * 14 / 10.
    assert fit.bandwidth == pytest.approx(2.8e9, rel=1e-9)


@pytest.mark.parametrize(
    "points, message",
    [
        ([(2, 1024, 1e-4)], "at least two"),
        ([(1, 1024, 1e-4), (2, 2048, 2e-4)], "n >= 2 ranks"),
        ([(2, 1024, 0.0), (2, 2048, 2e-4)], "seconds > 0"),
    ],
)
def test_bad_measurements_raise(points, message):
    with pytest.raises(ValueError, match=message):
        fit_alpha_beta(points)


@pytest.mark.parametrize(
    "link, latency",
    [("nvlink-3", 3.4e-6), ("nvlink-4", 3.4e-6), ("pcie-4-x16", 5.7e-6), ("infiniband-hdr", 14.0e-6),
     ("roce-400gbe", 14.0e-6)],
)  # fmt: skip
def test_link_latency_is_nccls_ring_step_latency(link, latency):
    assert link_latency(link) == latency


def test_links_without_a_published_latency_raise():
    with pytest.raises(ValueError, match="no published per-step latency"):
        link_latency("infinity-fabric-mi300x")


def test_gpt3_gradient_all_reduce_by_hand():
    # 350 GB over 1024 ranks on NDR InfiniBand (400 Gb/s = 50 GB/s per direction), 14.0 us per step (NCCL's
    # hwLat[NET][Ring][Simple] in 2.23-2.27): 2 * 1023 * (14.0e-6 + 350e9 / (1024 * 50e9)) = 14.014972125 s.
    ndr = link_model("infiniband-ndr")
    assert ndr.bandwidth == 50e9
    assert ndr.time("all_reduce", 350e9, 1024) == pytest.approx(14.014972125, rel=1e-12)
    # 8 ranks on H100 NVLink (900 GB/s both directions, 450 per direction), 3.4 us per step.
    assert link_model("nvlink-4").time("all_reduce", 350e9, 8) == pytest.approx(1.3611587111111, rel=1e-12)
    assert AlphaBeta(alpha=0.0, bandwidth=1e9).time("all_reduce", 1e9, 2) == pytest.approx(1.0)


def time_every_algorithm():
    times = {name: time_all_reduce([1024, 65536], (2,), repeats=3, algorithm=name)
             for name in ("library", "ring", "tree", "naive")}  # fmt: skip
    try:
        time_all_reduce([1024], (2,), algorithm="butterfly")
    except ValueError as error:
        times["error"] = str(error)
    dist.barrier()
    return times


def test_time_all_reduce_measures_each_algorithm_on_real_ranks():
    results = launch(time_every_algorithm, 2, timeout=60)
    for name in ("library", "ring", "tree", "naive"):
        assert results[0][name] == results[1][name]  # the slowest rank's time, agreed by both
        assert list(results[0][name]) == [2]
        assert len(results[0][name][2]) == 2 and all(0 < t < 5 for t in results[0][name][2])
    assert "algorithm must be 'library' or one of" in results[0]["error"]


def test_double_tree_time_by_hand():
    # 1,024 ranks on NDR (14.0 us per hop, 50 GB/s): 2 log2 1024 = 20 latencies, and the busiest rank sends 2 M.
    ndr = link_model("infiniband-ndr")
    assert ndr.time("all_reduce", 350e9, 1024, algorithm="double_tree") == pytest.approx(20 * 14.0e-6 + 14.0, rel=1e-12)
    # A 1 KB all-reduce: the ring pays 2 * 1023 latencies (28.6 ms), the double tree 20 (0.28 ms).
    assert ndr.time("all_reduce", 1e3, 1024) / ndr.time("all_reduce", 1e3, 1024, algorithm="double_tree") > 100
    # Two ranks: each sends its half up one tree and the other half down the other, M in all, like the ring.
    assert double_tree_time(1e9, 2, alpha=0.0, bandwidth=1e9) == pytest.approx(1.0)
    assert [double_tree_max_send_share(n) for n in (1, 2, 3, 4, 8, 1024)] == [0, 1, 1.5, 2, 2, 2]
    with pytest.raises(ValueError, match="all-reduce algorithm here"):
        ndr.time("all_gather", 1e6, 8, algorithm="double_tree")


def test_rail_optimized_fat_tree_of_1024_h100s_by_hand():
    # 128 nodes x 8 NICs of 400 Gb/s; leaves of 32 ports down, spines of 64 ports.
    fabric = RailOptimizedFatTree(nodes=128, rails=8, nic_bandwidth=50e9)
    assert (fabric.endpoints, fabric.leaves_per_rail, fabric.leaves, fabric.leaf_up_ports) == (1024, 4, 32, 32)
    assert fabric.spines == 32 * 32 // 64 == 16
    assert fabric.bisection_bandwidth == 1024 * 50e9 / 2 == 25.6e12
    oversubscribed = RailOptimizedFatTree(nodes=128, rails=8, nic_bandwidth=50e9, oversubscription=2)
    assert (oversubscribed.leaf_up_ports, oversubscribed.spines, oversubscribed.bisection_bandwidth) == (16, 8, 12.8e12)


@pytest.mark.parametrize("oversubscription", [1, 2, 4])
def test_rail_aligned_rings_keep_line_rate_and_rail_crossing_rings_lose_the_oversubscription(oversubscription):
    fabric = RailOptimizedFatTree(nodes=128, rails=8, nic_bandwidth=50e9, oversubscription=oversubscription)
    # Aligned: one flow leaves each leaf (after its 32nd node), far below its 32 / r uplinks.
    assert fabric.ring_hop_bandwidth(rail_aligned=True) == 50e9
    # Crossing rails: all 32 nodes of a leaf send through the spine, on 32 / r uplinks: 50 GB/s / r each.
    assert fabric.ring_hop_bandwidth(rail_aligned=False) == 50e9 / oversubscription
    # Bus bandwidth per GPU: 8 channels, one per NIC, capped by NVLink 4's 450 GB/s per direction.
    assert fabric.all_reduce_bus_bandwidth(nvlink_bandwidth=450e9) == 400e9
    assert fabric.all_reduce_bus_bandwidth(rail_aligned=False, nvlink_bandwidth=450e9) == 400e9 / oversubscription


def test_small_fabrics_and_bad_layouts():
    # 32 nodes fill one leaf per rail: an aligned ring never leaves it; a crossing one uses all 16 uplinks at 2:1.
    one_leaf = RailOptimizedFatTree(nodes=32, rails=8, nic_bandwidth=50e9, oversubscription=2)
    assert one_leaf.ring_hop_bandwidth() == 50e9 and one_leaf.ring_hop_bandwidth(rail_aligned=False) == 25e9
    with pytest.raises(ValueError, match="divisible by the oversubscription"):
        RailOptimizedFatTree(nodes=8, rails=8, nic_bandwidth=50e9, oversubscription=3)
    with pytest.raises(ValueError, match="nodes must be a positive integer"):
        RailOptimizedFatTree(nodes=0, rails=8, nic_bandwidth=50e9)
