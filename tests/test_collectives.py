"""The from-scratch all-reduces equal torch's gloo all-reduce, and send the bytes the ring formulas predict.

One launch of 8 ranks runs every case: groups of the first 2, 3, 4 and 8 ranks (so the ``group=`` path is
exercised too), tensor sizes divisible and not divisible by the group size.
"""

import math

import pytest
import torch
import torch.distributed as dist

from scalebook.comm import LaunchError, count_traffic, launch
from scalebook.comm.collectives import (
    ALL_REDUCES,
    binary_tree,
    double_binary_tree,
    double_tree_all_reduce,
    double_tree_schedule,
    ring_all_gather,
    ring_chunk_sizes,
    ring_reduce_scatter,
)
from scalebook.experiments.collectives import (
    all_reduce_with_a_failing_rank,
    compare_all_reduces,
    labelled_tensor,
    run_every_collective,
    seeded_inputs,
    time_small_all_reduces,
)

GROUP_SIZES = (2, 3, 4, 8)
U = 2.0**-24  # float32 unit roundoff


def sizes_for(k):
    # Divisible by 2k (equal ring chunks), a single element, fewer elements than ranks, and odd sizes.
    return sorted({2 * k * 64, 1, k - 1, 7, 1001})


def _inputs(k, numel, seed, integers):
    generator = torch.Generator().manual_seed(seed)
    if integers:
        return [torch.randint(-1000, 1000, (numel,), generator=generator).float() for _ in range(k)]
    return [torch.randn(numel, generator=generator) for _ in range(k)]


def check_every_all_reduce():
    """On each group, every algorithm on float and integer-valued inputs; returns comparison summaries."""
    rank = dist.get_rank()
    groups = {k: dist.new_group(list(range(k))) for k in GROUP_SIZES}
    report = {}
    for k, group in groups.items():
        if rank >= k:
            continue
        cases = [(numel, integers) for numel in sizes_for(k) for integers in (False, True)]
        if k == 3:
            cases.append((1_800_001, False))  # 7.2 MB: gloo cuts it into 9 segments, not 6
        for numel, integers in cases:
            xs = _inputs(k, numel, seed=1000 * k + numel, integers=integers)
            reference = xs[rank].clone()
            dist.all_reduce(reference, group=group)
            bound = 2 * (k - 1) * U * torch.stack(xs).abs().sum(0)  # two summation orders, each within (k-1) u sum|x|
            for name, all_reduce in ALL_REDUCES.items():
                t = xs[rank].clone().reshape(1, -1)  # a 2-D view: the result must keep the caller's shape
                with count_traffic() as traffic:
                    all_reduce(t, group=group)
                first = t.clone()
                dist.broadcast(first, src=0, group=group)  # group rank 0 is global rank 0
                report[(k, numel, integers, name)] = {
                    "shape": tuple(t.shape),
                    "bitwise": torch.equal(t[0], reference),
                    "within_bound": bool(((t[0] - reference).abs() <= bound).all()),
                    "same_on_every_rank": torch.equal(t, first),
                    "bytes_sent": traffic.bytes_sent(),
                    "messages": traffic.count("send", "isend"),
                }
        # The double tree pipelined in chunks of 10 floats (40 B): 51 chunks for each half of 1001 elements.
        for integers in (False, True):
            xs = _inputs(k, 1001, seed=7 * k, integers=integers)
            reference = xs[rank].clone()
            dist.all_reduce(reference, group=group)
            t = xs[rank].clone()
            with count_traffic() as traffic:
                double_tree_all_reduce(t, group=group, chunk_bytes=40)
            report[(k, "pipelined", integers)] = {
                "bitwise": torch.equal(t, reference),
                "within_bound": bool(((t - reference).abs() <= 2 * (k - 1) * U * torch.stack(xs).abs().sum(0)).all()),
                "messages": traffic.count("send", "isend"),
            }  # fmt: skip
        # The two phases alone, against gloo's reduce-scatter and all-gather (equal chunks: 2k * 64 elements).
        numel = 2 * k * 64
        xs = _inputs(k, numel, seed=k, integers=False)
        with count_traffic() as rs_traffic:
            mine = ring_reduce_scatter(xs[rank], group=group)
        expected = torch.empty(numel // k)
        dist.reduce_scatter_single(expected, xs[rank].clone(), group=group)
        with count_traffic() as ag_traffic:
            gathered = ring_all_gather(mine, numel, group=group)
        expected_gathered = torch.empty(numel)
        dist.all_gather_single(expected_gathered, mine, group=group)
        try:
            ring_all_gather(torch.ones(numel), numel, group=group)
            wrong_chunk = None
        except ValueError as error:
            wrong_chunk = str(error)
        report[(k, "phases")] = {
            "reduce_scatter_within_bound": bool(((mine - expected).abs() <= 2 * (k - 1) * U
                                                 * torch.stack(xs).abs().sum(0).chunk(k)[rank]).all()),
            "all_gather_bitwise": torch.equal(gathered, expected_gathered),
            "bytes": (rs_traffic.bytes_sent(), ag_traffic.bytes_sent()),
            "wrong_chunk": wrong_chunk,
        }  # fmt: skip
    # The chapter's workers, on all 8 ranks of the same launch.
    report["every_collective"] = run_every_collective(0.01)
    report["compare"] = compare_all_reduces(6, seed=3)["float"]
    report["timing"] = time_small_all_reduces((4, 64), rounds=2)
    try:
        time_small_all_reduces((4,), algorithms=("butterfly",))
    except ValueError as error:
        report["timing_error"] = str(error)
    return report


@pytest.fixture(scope="module")
def reports():
    return launch(check_every_all_reduce, 8, timeout=120)


def _cases(reports, **where):
    """(rank, (k, numel, integers, name), summary) for the all-reduce cases matching ``where``."""
    for rank, report in enumerate(reports):
        for key, value in report.items():
            if not (isinstance(key, tuple) and len(key) == 4):
                continue
            fields = dict(zip(("k", "numel", "integers", "name"), key, strict=True))
            if all(fields[f] == v for f, v in where.items()):
                yield rank, key, value


@pytest.mark.parametrize("k", GROUP_SIZES)
def test_ring_all_reduce_is_bitwise_equal_to_gloo_even_for_random_floats(reports, k):
    cases = list(_cases(reports, k=k, name="ring"))
    assert len(cases) == k * (2 * len(sizes_for(k)) + (k == 3))
    for rank, key, value in cases:
        assert value["bitwise"], (rank, key)


@pytest.mark.parametrize("k", GROUP_SIZES)
@pytest.mark.parametrize("name", ["tree", "double_tree", "naive"])
def test_tree_and_naive_are_exact_on_integers_and_within_rounding_on_floats(reports, k, name):
    # Integer-valued floats below 2^24 add exactly in any order. Random floats are summed in another
    # order than gloo's ring: each of the two results is within (k - 1) u sum|x| of the exact sum.
    for rank, key, value in _cases(reports, k=k, name=name):
        _, _, integers, _ = key
        assert value["bitwise"] if integers else value["within_bound"], (rank, key)


def test_every_algorithm_leaves_the_same_bits_and_shape_on_every_rank(reports):
    for rank, key, value in _cases(reports):
        assert value["same_on_every_rank"] and value["shape"] == (1, key[1]), (rank, key)


@pytest.mark.parametrize("k", GROUP_SIZES)
def test_ring_sends_2_n_minus_1_over_n_of_the_message_and_naive_n_minus_1_times_it(reports, k):
    numel = 2 * k * 64
    message = 4 * numel
    for _, _, value in _cases(reports, k=k, numel=numel, name="ring"):
        assert value["bytes_sent"] == 2 * (k - 1) * message // k  # exact: the chunks are equal
        assert value["messages"] == 2 * (k - 1)
    for _, _, value in _cases(reports, k=k, numel=numel, name="naive"):
        assert value["bytes_sent"] == (k - 1) * message
        assert value["messages"] == k - 1


@pytest.mark.parametrize(
    "k, whole_messages",
    [
        # Binomial tree: every rank but 0 sends once on the way up; on the way down rank r sends to
        # r + 2^j for each 2^j below its lowest set bit (rank 0: every 2^j) with r + 2^j < k.
        (2, [1, 1]),
        (3, [2, 1, 1]),
        (4, [2, 1, 2, 1]),
        (8, [3, 1, 2, 1, 3, 1, 2, 1]),
    ],
)
def test_tree_sends_whole_messages_along_the_binomial_tree(reports, k, whole_messages):
    numel = 2 * k * 64
    sent = {rank: value["bytes_sent"] for rank, _, value in _cases(reports, k=k, numel=numel, name="tree")}
    assert sent == {rank: 4 * numel * m for rank, m in enumerate(whole_messages)}
    assert sum(whole_messages) == 2 * (k - 1)  # the same total volume as the ring


@pytest.mark.parametrize(
    "k, halves_sent",
    [
        # Halves of the message each rank sends: one up to its parent and one down to each child, per tree.
        # k = 2: 0 -> 1 and 1 -> 0. k = 3: 0 -> 2 -> 1 and its shift 1 -> 0 -> 2. k = 4: 0 -> 2 -> {1, 3} and
        # its mirror 3 -> 1 -> {2, 0}. k = 8: 0 -> 4 -> {2, 6}, 2 -> {1, 3}, 6 -> {5, 7} and its mirror.
        (2, [2, 2]),
        (3, [3, 2, 3]),
        (4, [2, 4, 4, 2]),
        (8, [2, 4, 4, 4, 4, 4, 4, 2]),
    ],
)
def test_double_tree_sends_half_messages_along_both_trees(reports, k, halves_sent):
    numel = 2 * k * 64
    cases = list(_cases(reports, k=k, numel=numel, name="double_tree"))
    assert {rank: v["bytes_sent"] for rank, _, v in cases} == {r: 2 * numel * h for r, h in enumerate(halves_sent)}
    assert {rank: v["messages"] for rank, _, v in cases} == dict(enumerate(halves_sent))  # one chunk per half
    assert max(halves_sent) <= 4  # at most 2 M from any rank; on average the ring's 2 (k - 1)/k M:
    assert sum(halves_sent) == 4 * (k - 1)


@pytest.mark.parametrize("k", GROUP_SIZES)
def test_pipelined_double_tree_matches_gloo_chunk_by_chunk(reports, k):
    for rank in range(k):
        floats, integers = reports[rank][(k, "pipelined", False)], reports[rank][(k, "pipelined", True)]
        assert integers["bitwise"] and floats["within_bound"], (k, rank)
        # Every rank sends each chunk of each half at least once (up, or down from a root): 51 + 50 chunks.
        assert integers["messages"] >= 51 + 50


def test_binary_tree_is_nccls_drawing():
    # The tree drawn in NCCL's src/graph/trees.cc for 14 ranks: 0 - 8; 8 -> 4, 12; 4 -> 2, 6; 12 -> 10, 13; ...
    assert binary_tree(14) == [(-1, (8,)), (2, ()), (4, (1, 3)), (2, ()), (8, (2, 6)), (6, ()), (4, (5, 7)), (6, ()),
                               (0, (4, 12)), (10, ()), (12, (9, 11)), (10, ()), (8, (10, 13)), (12, ())]  # fmt: skip
    # And its mirror for 12 ranks, drawn there too: 11 - 3; 3 -> 7, 1; 7 -> 9, 5; 1 -> 2, 0; 5 -> 6, 4; 9 -> 10, 8.
    second = double_binary_tree(12)[1]
    assert second[11] == (-1, (3,)) and second[3] == (11, (7, 1)) and second[7] == (3, (9, 5))
    assert second[1] == (3, (2, 0)) and second[5] == (7, (6, 4)) and second[9] == (7, (10, 8))
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        binary_tree(0)


@pytest.mark.parametrize("n", range(1, 33))
def test_double_binary_tree_spans_every_rank_and_splits_the_work(n):
    for tree in double_binary_tree(n):
        roots = [r for r, (parent, _) in enumerate(tree) if parent < 0]
        assert len(roots) == 1
        reached, frontier = set(roots), list(roots)
        while frontier:
            rank = frontier.pop()
            for child in tree[rank][1]:
                assert tree[child][0] == rank and child not in reached  # a tree: one parent each, no cycles
                reached.add(child)
                frontier.append(child)
        assert reached == set(range(n)) and all(len(children) <= 2 for _, children in tree)
    interior = [{r for r, (_, children) in enumerate(tree) if children} for tree in double_binary_tree(n)]
    if n % 2 == 0:  # every rank a leaf in one tree and interior in the other
        assert interior[0] | interior[1] == set(range(n)) and not interior[0] & interior[1]
    elif n > 1:  # odd: the shift leaves rank 0 interior in both
        assert interior[0] & interior[1] == {0}


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 12, 16, 64])
@pytest.mark.parametrize("chunks", [1, 5])
def test_double_tree_takes_2_log2_n_rounds_plus_one_per_extra_chunk(n, chunks):
    # Rounds are what the latency term counts: 2 ceil(log2 n) for one chunk (the ring: 2 (n - 1)).
    numel = 2 * 7 * chunks  # two halves of 7 chunks... of 7 elements each
    schedules = [double_tree_schedule(n, rank, numel, 7) for rank in range(n)]
    rounds = 1 + max(max(schedule) for schedule in schedules)
    assert rounds == 2 * math.ceil(math.log2(n)) + chunks - 1
    # Every send has its receive in the same round, on the other side, in the same (tree, chunk) order.
    for rank, schedule in enumerate(schedules):
        for when, transfers in schedule.items():
            for peer in {m.peer for m in transfers}:
                sent = [(m.tree, m.chunk, m.start) for m in transfers if m.send and m.peer == peer]
                received = [(m.tree, m.chunk, m.start) for m in schedules[peer].get(when, [])
                            if not m.send and m.peer == rank]  # fmt: skip
                assert sent == received, (n, rank, peer, when)


def test_uneven_ring_bytes_match_a_hand_count_of_the_chunks(reports):
    # 7 floats over 4 ranks: gloo cuts 8 segments of ceil(7/8) = 1 element, 2 per chunk: chunks 2, 2, 2, 1.
    # Rank r sends every chunk but its own in the reduce-scatter and every chunk but r - 1's in the
    # all-gather: (14 - c_r - c_{r-1}) elements of 4 bytes.
    sent = {rank: v["bytes_sent"] for rank, _, v in _cases(reports, k=4, numel=7, name="ring", integers=True)}
    assert sent == {0: 4 * (14 - 2 - 1), 1: 4 * (14 - 2 - 2), 2: 4 * (14 - 2 - 2), 3: 4 * (14 - 1 - 2)}
    # 3 floats over 4 ranks: 8 segments of 1 element, chunks 2, 1, 0, 0; empty chunks are not sent.
    sent = {rank: v["bytes_sent"] for rank, _, v in _cases(reports, k=4, numel=3, name="ring", integers=True)}
    assert sent == {0: 4 * (6 - 2 - 0), 1: 4 * (6 - 1 - 2), 2: 4 * (6 - 0 - 1), 3: 4 * (6 - 0 - 0)}


@pytest.mark.parametrize("k", GROUP_SIZES)
def test_ring_phases_match_gloo_reduce_scatter_and_all_gather(reports, k):
    message = 4 * 2 * k * 64
    for rank in range(k):
        phases = reports[rank][(k, "phases")]
        assert phases["reduce_scatter_within_bound"] and phases["all_gather_bitwise"]
        assert phases["bytes"] == ((k - 1) * message // k, (k - 1) * message // k)
        assert "pass the chunk ring_reduce_scatter returned" in phases["wrong_chunk"]


@pytest.mark.parametrize(
    "numel, n, element_size, expected",
    [
        (8, 4, 4, [2, 2, 2, 2]),
        (12, 4, 4, [4, 4, 4, 0]),  # 8 segments of ceil(12/8) = 2 elements, 2 segments per chunk
        (10, 4, 4, [4, 4, 2, 0]),
        (7, 4, 4, [2, 2, 2, 1]),
        (0, 3, 4, [0, 0, 0]),
        # 7,200,004 bytes need ceil(7.2e6 / 2^20) = 7 segments, rounded up to 9 for 3 ranks; 200,001 each.
        (1_800_001, 3, 4, [600_003, 600_003, 599_995]),
        (1 << 20, 2, 2, [1 << 19, 1 << 19]),  # 2 MiB of 16-bit values: at least 2 segments per rank
    ],
)
def test_ring_chunk_sizes_follow_gloo_by_hand(numel, n, element_size, expected):
    assert ring_chunk_sizes(numel, n, element_size) == expected


def test_bad_chunk_arguments_raise():
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        ring_chunk_sizes(10, 0)
    with pytest.raises(ValueError, match="labels need"):
        labelled_tensor(0, 10)


def test_every_library_collective_runs_on_gloo_with_the_expected_before_and_after(reports):
    results = [report["every_collective"] for report in reports]
    n = len(results)
    x = [[10.0 * (r + 1) + j for j in range(n)] for r in range(n)]  # rank r holds 10 (r + 1) + j
    sums = [sum(column) for column in zip(*x, strict=True)]
    everything = [v for row in x for v in row]
    expected_after = {
        "broadcast": [x[0]] * n,
        "reduce": [sums] + [None] * (n - 1),
        "all_reduce": [sums] * n,
        "gather": [everything] + [None] * (n - 1),
        "all_gather": [everything] * n,
        "scatter": x,
        "reduce_scatter": [[s] for s in sums],
        "all_to_all": [[x[src][r] for src in range(n)] for r in range(n)],
        "send_recv": [x[0], x[0]] + x[2:],
    }
    for name, after in expected_after.items():
        assert [r["collectives"][name]["after"] for r in results] == after, name
    assert results[0]["collectives"]["scatter"]["before"] == everything
    assert [r["env"]["RANK"] for r in results] == [str(r) for r in range(n)]
    assert {r["env"]["WORLD_SIZE"] for r in results} == {str(n)} and {r["backend"] for r in results} == {"gloo"}
    last_arrival = max(r["barrier"]["arrived"] for r in results)
    assert all(r["barrier"]["left"] >= last_arrival for r in results)


def test_compare_all_reduces_rebuilds_inputs_and_counts_gloo_as_a_ring(reports):
    results = [report["compare"] for report in reports]
    inputs = seeded_inputs(6, 8, seed=3)
    assert all(torch.equal(r["input"], inputs[rank]) for rank, r in enumerate(results))
    assert all(torch.equal(r["output"]["ring"], r["output"]["gloo"]) for r in results)
    assert [r["bytes_sent"]["gloo"] for r in results] == [2 * 7 / 8 * 24] * 8  # assumed, not measured
    assert [r["messages"]["gloo"] for r in results] == [None] * 8


def test_small_message_timing_agrees_on_every_rank(reports):
    timings = [report["timing"] for report in reports]
    assert all(t["seconds"] == timings[0]["seconds"] for t in timings)  # the slowest rank's time, on every rank
    assert sorted(timings[0]["seconds"]) == ["double_tree", "ring"]
    assert all(len(best) == 2 and all(0 < s < 5 for s in best) for best in timings[0]["seconds"].values())
    assert len(timings[0]["load"]) == 2 and "need algorithms from" in reports[0]["timing_error"]


def test_a_failing_rank_fails_the_launch_with_its_message():
    with pytest.raises(LaunchError, match="rank 1 of 2 raised first") as info:
        launch(all_reduce_with_a_failing_rank, 2, 1, timeout=30)
    assert "RuntimeError: rank 1 cannot find its data shard (raised on purpose)" in str(info.value)
