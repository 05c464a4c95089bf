"""Bus bandwidth as nccl-tests defines it: the formulas against nccl-tests' own numbers, the benchmark's rows on
two ranks, and the vendor-reported bus bandwidths in configs against their sources and bounds."""

import pytest

from scalebook import configs
from scalebook.accounting import comm
from scalebook.comm import launch
from scalebook.experiments import busbw as bench

# nccl-tests doc/PERFORMANCE.md, "Summary": the correction from algbw to busbw per collective.
PERFORMANCE_MD_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1,
    "reduce": lambda n: 1,
    "all_to_all": lambda n: (n - 1) / n,
}


@pytest.mark.parametrize("op", sorted(PERFORMANCE_MD_FACTORS))
@pytest.mark.parametrize("n", [2, 4, 8, 1024])
def test_busbw_factors_are_performance_md_s(op, n):
    assert comm.busbw_factor(op, n) == pytest.approx(PERFORMANCE_MD_FACTORS[op](n), rel=1e-15)


def test_all_reduce_on_8_ranks_reports_1_75_times_its_algbw():
    # 2 (8-1)/8 = 1.75, the factor every 8-GPU all_reduce_perf line applies
    assert comm.busbw("all_reduce", 1e9, 0.01, 8) == pytest.approx(175e9, rel=1e-12)


@pytest.mark.parametrize(
    "op, n, size, microseconds, algbw_gbs, busbw_gbs",
    [
        # all_reduce_perf -t 4 (4 ranks), NCCL 2.18.5: gist.github.com/kwen2501/89c28b6d12045b45ccf7e33816af2713
        ("all_reduce", 4, 4218900, 1011.4, 4.17, 6.26),
        # sendrecv_perf -g 8 on 8 A100s: github.com/li-plus/playground, cuda/nccl.md
        ("send_recv", 8, 134217728, 1211.2, 110.81, 110.81),
    ],
)
def test_bandwidths_reproduce_lines_printed_by_nccl_tests(op, n, size, microseconds, algbw_gbs, busbw_gbs):
    # nccl-tests prints GB/s (1e9 bytes) to two decimals, so the printed value is ours rounded.
    seconds = microseconds * 1e-6
    assert round(comm.algbw(size, seconds) / 1e9, 2) == algbw_gbs
    assert round(comm.busbw(op, size, seconds, n) / 1e9, 2) == busbw_gbs


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "broadcast"])
def test_seconds_at_busbw_inverts_busbw(op):
    seconds = comm.seconds_at_busbw(op, 350e9, 1024, 192e9)
    assert comm.busbw(op, 350e9, seconds, 1024) == pytest.approx(192e9, rel=1e-12)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: comm.busbw_factor("allreduce", 8), "op must be one of"),
        (lambda: comm.busbw_factor("all_reduce", 0), "n must be an integer >= 1"),
        (lambda: comm.algbw(1e9, 0.0), "seconds must be a positive number"),
        (lambda: comm.busbw("all_reduce", -1, 1.0, 2), "message_bytes must be a number >= 0"),
        (lambda: comm.seconds_at_busbw("all_reduce", 1e9, 8, 0), "bus_bandwidth must be a positive number"),
    ],
)
def test_bad_bandwidth_arguments_raise_one_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(op="allreduce"), "op must be one of"),
        (dict(group_sizes=(1,)), "group sizes must be integers >= 2"),
        (dict(message_bytes=[1000], op="all_gather", group_sizes=(4,)), "multiples of 16 bytes"),
        (dict(warmup=0), "warmup and iters must be integers >= 1"),
    ],
)
def test_the_benchmark_rejects_bad_arguments_before_any_collective(kwargs, message):
    # No process group exists here: the error must come before the benchmark touches torch.distributed.
    arguments = dict(message_bytes=[1024], group_sizes=(2,)) | kwargs
    with pytest.raises(ValueError, match=message):
        bench.benchmark(arguments.pop("message_bytes"), **arguments)


@pytest.fixture(scope="module")
def two_ranks():
    return launch(bench.benchmark, 2, [1024, 65536], (2,), iters=3)


def test_the_benchmark_returns_one_checked_row_per_size_on_every_rank(two_ranks):
    for rows in two_ranks:
        assert [(r.op, r.ranks, r.message_bytes) for r in rows] == [("all_reduce", 2, 1024), ("all_reduce", 2, 65536)]
        assert all(r.wrong == 0 and r.seconds > 0 for r in rows)
    assert [r.seconds for r in two_ranks[0]] == [r.seconds for r in two_ranks[1]]  # the slowest rank's, shared


def test_the_benchmark_s_bandwidths_are_nccl_tests_of_its_time(two_ranks):
    for r in two_ranks[0]:
        assert r.algbw == pytest.approx(r.message_bytes / r.seconds, rel=1e-12)
        assert r.busbw == pytest.approx(r.algbw, rel=1e-12)  # 2 (2-1)/2 = 1


def test_the_ring_puts_the_busbw_factor_of_the_message_on_the_wire(two_ranks):
    # Counted at the sends of the from-scratch ring: 2 (n-1)/n M per rank, M itself on 2 ranks.
    assert [[r.wire_bytes for r in rows] for rows in two_ranks] == [[1024, 65536], [1024, 65536]]


@pytest.mark.parametrize("name", configs.list_reported_busbw())
def test_every_reported_busbw_names_its_nvidia_thread_and_a_known_link(name):
    reported = configs.get_reported_busbw(name)
    assert reported.source.startswith(("NVIDIA/nccl issue #", "NVIDIA/nccl-tests issue #"))
    assert f"{reported.busbw / 1e9:.0f} GB/s" in reported.source  # the number is the thread's
    assert reported.link in configs.list_links() and reported.links >= 1
    assert comm.busbw_factor(reported.op, reported.gpus or 2) > 0  # an operation nccl-tests defines


def test_rings_stay_below_their_links_and_only_nvlink_sharp_exceeds_its():
    # A point-to-point ring cannot move more than its links carry; with the switch adding, busbw is not the
    # bandwidth on the wire (nccl-tests issue #212), and can pass it.
    over = {name for name in configs.list_reported_busbw()
            if configs.get_reported_busbw(name).busbw > configs.get_reported_busbw(name).bound}  # fmt: skip
    assert over == {"h100-nvlink-nvls"}


def test_reported_nvls_busbw_is_its_algbw_times_the_all_reduce_factor():
    # 275 GB/s x 2 (8-1)/8 = 481 GB/s: nccl-tests applies the ring's factor whatever algorithm ran.
    nvls = configs.get_reported_busbw("h100-nvlink-nvls")
    assert nvls.algbw * comm.busbw_factor("all_reduce", nvls.gpus) == pytest.approx(nvls.busbw, rel=0.01)
