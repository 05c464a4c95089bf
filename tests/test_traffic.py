"""Communication volume: the closed forms of accounting.comm and the bytes count_traffic records, each against
a hand calculation written out in the test."""

import pytest
import torch
import torch.distributed as dist

from scalebook.accounting.comm import (
    alpha_beta_time,
    bytes_sent_per_rank,
    data_parallel_bytes_per_step,
    tensor_parallel_bytes_per_layer,
)
from scalebook.comm import count_traffic, launch

# --- closed forms -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, algorithm, expected",
    [
        ("all_reduce", "ring", 1800),  # 2 * 3/4 * 1200
        ("all_reduce", "tree", 1800),  # the tree's 2 (n-1) M bytes spread over n ranks
        ("all_reduce", "naive", 3600),  # 3 peers * 1200
        ("reduce_scatter", "ring", 900),  # 3/4 * 1200
        ("all_gather", "ring", 900),
        ("all_to_all", "ring", 900),  # keeps its own quarter, sends three
        ("broadcast", "ring", 900),
        ("reduce", "ring", 900),
    ],
)
def test_bytes_sent_per_rank_of_a_1200_byte_message_over_4_ranks(op, algorithm, expected):
    assert bytes_sent_per_rank(op, 1200, 4, algorithm=algorithm) == expected


def test_a_single_rank_sends_nothing():
    assert bytes_sent_per_rank("all_reduce", 1200, 1) == 0
    assert alpha_beta_time("all_reduce", 1200, 1, alpha=1e-5, bandwidth=1e9) == 0


@pytest.mark.parametrize(
    "op, n, algorithm, expected",
    [
        # 1 MB over 4 ranks, alpha 10 us, 1 GB/s: a ring step moves 250 kB in 10 us + 250 us.
        ("all_reduce", 4, "ring", 6 * 260e-6),
        ("reduce_scatter", 4, "ring", 3 * 260e-6),
        ("all_gather", 4, "ring", 3 * 260e-6),
        ("all_reduce", 4, "tree", 4 * 1010e-6),  # 2 * log2(4) rounds of the whole 1 MB (1000 us + 10 us)
        ("all_reduce", 3, "tree", 4 * 1010e-6),  # ceil(log2 3) = 2: as many rounds as for 4 ranks
        ("all_reduce", 4, "naive", 3 * 1010e-6),
    ],
)
def test_alpha_beta_time_of_one_megabyte(op, n, algorithm, expected):
    seconds = alpha_beta_time(op, 1e6, n, alpha=10e-6, bandwidth=1e9, algorithm=algorithm)
    assert seconds == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "zero_stage, expected",
    [
        (0, 3.5e9),  # all-reduce of 2 GB of 16-bit gradients over 8 ranks: 2 * 7/8 * 2e9
        (1, 3.5e9),  # reduce-scatter 7/8 * 2e9 + all-gather 7/8 * 2e9
        (2, 3.5e9),
        (3, 5.25e9),  # one reduce-scatter and two all-gathers, 3 * 1.75e9
    ],
)
def test_data_parallel_bytes_of_a_1b_model_over_8_ranks(zero_stage, expected):
    sent = data_parallel_bytes_per_step(1e9, 8, zero_stage=zero_stage, grad_bytes=2, param_bytes=2)
    assert sent == pytest.approx(expected, rel=1e-12)


def test_tensor_parallel_bytes_of_a_gpt3_layer():
    # s b h * 2 bytes = 2048 * 1 * 12288 * 2 = 50,331,648 over tp = 8.
    message = 2048 * 12288 * 2
    # Two all-reduces per pass, 2 * 7/8 of the message each.
    assert tensor_parallel_bytes_per_layer(2048, 1, 12288, 8, dtype_bytes=2) == {
        "forward": 3.5 * message, "backward": 3.5 * message}  # fmt: skip
    # SP: each all-reduce becomes an all-gather and a reduce-scatter, 7/8 + 7/8: the same bytes...
    kept = tensor_parallel_bytes_per_layer(2048, 1, 12288, 8, sp=True, dtype_bytes=2, regather_inputs=False)
    assert kept == {"forward": 3.5 * message, "backward": 3.5 * message}
    # ... plus, when the gathered inputs are not kept, two more all-gathers (7/8 each) in the backward.
    regathered = tensor_parallel_bytes_per_layer(2048, 1, 12288, 8, sp=True, dtype_bytes=2)
    assert regathered == {"forward": 3.5 * message, "backward": 5.25 * message}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: bytes_sent_per_rank("all_reduce", 10, 0), "n must be an integer >= 1"),
        (lambda: bytes_sent_per_rank("allreduce", 10, 2), "op must be one of"),
        (lambda: bytes_sent_per_rank("all_gather", 10, 2, algorithm="tree"), "only all_reduce has a 'tree'"),
        (lambda: bytes_sent_per_rank("all_reduce", -1, 2), "message_bytes must be a number >= 0"),
        (lambda: alpha_beta_time("all_reduce", 10, 2, alpha=-1.0, bandwidth=1e9), "alpha must be a latency"),
        (lambda: alpha_beta_time("all_reduce", 10, 2, alpha=0.0, bandwidth=0), "bandwidth must be a positive"),
    ],
)
def test_bad_arguments_raise_one_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- what count_traffic records on 4 real ranks ---------------------------------------------------------------


def _f32(*shape):
    return torch.ones(*shape, dtype=torch.float32)


def record_every_kind_of_call():
    """Each rank issues one of every recorded call; returns (op, message bytes, group size, sent, peer) rows."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    pair = dist.new_group([2, 3])
    with count_traffic() as outer, count_traffic() as traffic:
        if rank == 0:
            dist.send(_f32(10), dst=1)
        elif rank == 1:
            dist.recv(_f32(10), src=0)
        f64 = torch.ones(5, dtype=torch.float64)
        # Unbatched, so even ranks send first and odd ranks receive first: NCCL pairs that ring (nccl_rules).
        post = [lambda: dist.isend(f64, dst=right), lambda: dist.irecv(f64.clone(), src=left)]
        works = [issue() for issue in post[:: 1 if rank % 2 == 0 else -1]]
        for work in works:
            work.wait()
        dist.all_reduce(_f32(1000))
        dist.all_gather_single(_f32(4 * 256), _f32(256))
        dist.reduce_scatter_single(_f32(256), _f32(4 * 256))
        dist.all_gather([_f32(64) for _ in range(n)], _f32(64))
        dist.reduce_scatter(_f32(64), [_f32(64) for _ in range(n)])
        dist.all_to_all_single(_f32(400), _f32(400))
        # Rank r sends j + 1 rows of 2 floats to rank j, and receives r + 1 rows from every rank.
        dist.all_to_all_single(_f32(n * (rank + 1), 2), _f32(10, 2), output_split_sizes=[rank + 1] * n,
                               input_split_sizes=[1, 2, 3, 4])  # fmt: skip
        dist.all_to_all([_f32(3) for _ in range(n)], [_f32(3) for _ in range(n)])
        dist.gather(_f32(3), gather_list=[_f32(3) for _ in range(n)] if rank == 2 else None, dst=2)
        dist.scatter(_f32(3), scatter_list=[_f32(3) for _ in range(n)] if rank == 3 else None, src=3)
        dist.broadcast(_f32(100), src=0)
        dist.reduce(_f32(100), dst=0)
        dist.barrier()
        ops = [dist.P2POp(dist.isend, _f32(8), right), dist.P2POp(dist.irecv, _f32(8), left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if rank >= 2:  # global ranks 2 and 3 are group ranks 0 and 1 of ``pair``
            dist.gather(_f32(3), gather_list=[_f32(3), _f32(3)] if rank == 3 else None, dst=3, group=pair)
            dist.scatter(_f32(3), scatter_list=[_f32(3), _f32(3)] if rank == 3 else None, src=3, group=pair)
            peer = 5 - rank
            if rank == 2:
                dist.send(_f32(2), group_dst=1, group=pair)
            else:
                dist.recv(_f32(2), group_src=0, group=pair)
    dist.all_reduce(_f32(1))  # after the block: recorded by neither
    rows = [(c.op, c.message_bytes, c.group_size, c.bytes_sent, c.peer) for c in traffic.calls]
    return {"rows": rows, "outer_rows": len(outer.calls), "by_op": traffic.by_op(),
            "peer": peer if rank >= 2 else None}  # fmt: skip


@pytest.fixture(scope="module")
def recorded():
    return launch(record_every_kind_of_call, 4, timeout=60)


def _rows(recorded, rank, op):
    return [row[1:] for row in recorded[rank]["rows"] if row[0] == op]


def test_point_to_point_sends_count_exact_bytes_and_receives_none(recorded):
    assert _rows(recorded, 0, "send") == [(40, 4, 40.0, 1)]  # 10 float32
    assert _rows(recorded, 1, "recv") == [(40, 4, 0.0, 0)]
    for rank in range(4):
        assert _rows(recorded, rank, "isend")[0] == (40, 4, 40.0, (rank + 1) % 4)  # 5 float64
        assert _rows(recorded, rank, "irecv")[0] == (40, 4, 0.0, (rank - 1) % 4)


def test_library_collectives_count_the_ring_volume(recorded):
    for rank in range(4):
        assert _rows(recorded, rank, "all_reduce") == [(4000, 4, 6000.0, None)]  # 2 * 3/4 * 4000
        assert _rows(recorded, rank, "all_gather_single") == [(4096, 4, 3072.0, None)]  # 3/4 of the output
        assert _rows(recorded, rank, "reduce_scatter_single") == [(4096, 4, 3072.0, None)]  # 3/4 of the input
        assert _rows(recorded, rank, "all_gather") == [(1024, 4, 768.0, None)]  # 4 x 64 float32 gathered
        assert _rows(recorded, rank, "reduce_scatter") == [(1024, 4, 768.0, None)]
        assert _rows(recorded, rank, "broadcast") == [(400, 4, 300.0, None)]
        assert _rows(recorded, rank, "reduce") == [(400, 4, 300.0, None)]
        assert _rows(recorded, rank, "barrier") == [(0, 4, 0.0, None)]


def test_all_to_all_counts_what_leaves_the_rank(recorded):
    for rank in range(4):
        even, uneven = _rows(recorded, rank, "all_to_all_single")
        assert even == (1600, 4, 1200.0, None)  # keeps its own 400 of 1600 bytes
        # 10 rows of 8 bytes; keeps the rank + 1 rows addressed to itself.
        assert uneven == (80, 4, float(80 - 8 * (rank + 1)), None)
        assert _rows(recorded, rank, "all_to_all") == [(48, 4, 36.0, None)]  # 3 of its 4 tensors of 12 bytes


def test_gather_and_scatter_count_the_root_correctly(recorded):
    for rank in range(4):
        gather, scatter = _rows(recorded, rank, "gather")[0], _rows(recorded, rank, "scatter")[0]
        assert gather == (48, 4, 0.0 if rank == 2 else 12.0, 2)  # everyone but the root sends 12 bytes
        assert scatter == (48, 4, 36.0 if rank == 3 else 0.0, 3)  # the root sends 3 pieces of 12 bytes


def test_subgroup_roots_and_peers_are_global_ranks(recorded):
    # In the group [2, 3], dst=3 and src=3 are global ranks: rank 3 is the root, rank 2 the only sender.
    assert _rows(recorded, 2, "gather")[1] == (24, 2, 12.0, 3)
    assert _rows(recorded, 3, "gather")[1] == (24, 2, 0.0, 3)
    assert _rows(recorded, 2, "scatter")[1] == (24, 2, 0.0, 3)
    assert _rows(recorded, 3, "scatter")[1] == (24, 2, 12.0, 3)
    assert _rows(recorded, 2, "send")[-1] == (8, 2, 8.0, 3)  # group_dst=1 of [2, 3] is global rank 3
    assert _rows(recorded, 3, "recv")[-1] == (8, 2, 0.0, 2)


def test_batched_point_to_point_is_counted_once_per_operation(recorded):
    for rank in range(4):
        assert _rows(recorded, rank, "isend")[1] == (32, 4, 32.0, (rank + 1) % 4)
        assert _rows(recorded, rank, "irecv")[1] == (32, 4, 0.0, (rank - 1) % 4)


def test_totals_nested_blocks_and_nothing_recorded_after_the_block(recorded):
    rank0 = recorded[0]
    assert rank0["outer_rows"] == len(rank0["rows"])  # both nested blocks saw every call
    assert rank0["by_op"]["isend"] == (2, 72.0)  # 40 + 32 bytes
    assert rank0["by_op"]["all_reduce"] == (1, 6000.0)  # not the one after the block
    assert list(rank0["by_op"])[:3] == ["send", "isend", "irecv"]  # order of first appearance


def test_the_last_block_to_end_restores_the_torch_distributed_functions():
    original = dist.all_reduce
    with count_traffic(), count_traffic():
        assert dist.all_reduce is not original and dist.batch_isend_irecv.__module__ == "scalebook.comm.intercept"
    assert dist.all_reduce is original


def test_the_wrappers_install_on_a_torch_without_the_2_13_names(monkeypatch):
    # torch 2.11 (seen on GPU machines) has no all_gather_single / reduce_scatter_single: nothing to wrap there.
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name)
        monkeypatch.delattr(dist.distributed_c10d, name)
    original = dist.all_reduce
    with count_traffic():
        assert dist.all_reduce is not original and not hasattr(dist, "all_gather_single")
    assert dist.all_reduce is original
