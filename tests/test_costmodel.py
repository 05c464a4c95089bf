"""The alpha-beta fit recovers known latencies and bandwidths; published links give hand-checked predictions."""

import random

import pytest
import torch.distributed as dist

from scalebook.comm import launch
from scalebook.comm.costmodel import AlphaBeta, fit_alpha_beta, link_latency, link_model, time_all_reduce

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
