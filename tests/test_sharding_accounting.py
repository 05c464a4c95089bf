"""The fully-sharded formulas of ``scalebook.accounting.sharding`` on cases worked by hand: bytes per node inside
and across nodes (full sharding and HSDP), the alpha-beta time per step, and the communication that prefetching
leaves exposed. The measured counterparts are in tests/test_hsdp.py (bytes) and tests/test_zero.py (timelines)."""

import pytest

from scalebook.accounting import alpha_beta_time
from scalebook.accounting.sharding import exposed_communication, zero3_bytes_per_node, zero3_comm_time


def test_bytes_per_node_of_full_sharding_and_hsdp_by_hand():
    # 100 parameters, 2 bytes each for P and G: 2P + G = 600 bytes per step. Two nodes of 4 (d = 8).
    # Full: each rank sends 7/8 of 600 = 525; 3 of a node's 4 ranks inside, 1 across.
    assert zero3_bytes_per_node(100, 2, 4) == {"intra_node": 3 * 525, "inter_node": 525}
    # HSDP: each rank sends 3/4 of 600 inside (1,800 per node), and all-reduces its 50-byte shard of G with its
    # replica: 2 (1/2) 50 = 50 bytes each, 200 per node.
    assert zero3_bytes_per_node(100, 2, 4, hybrid=True) == {"intra_node": 1800, "inter_node": 200}
    # One node: the ring closes inside it, and HSDP is full sharding.
    assert zero3_bytes_per_node(100, 1, 4) == zero3_bytes_per_node(100, 1, 4, hybrid=True) == {
        "intra_node": 1800, "inter_node": 0}  # fmt: skip


def test_across_nodes_hsdp_sends_two_thirds_of_full_shardings_bytes_on_many_nodes():
    # (2P + G) against 2 G with P = G: 3/2 as the number of nodes grows.
    full, hsdp = (zero3_bytes_per_node(7e9, 1024, 8, hybrid=h)["inter_node"] for h in (False, True))
    assert hsdp / full == pytest.approx(2 / 3, rel=2e-3)


def test_comm_time_is_alpha_beta_per_collective_on_the_right_links():
    links = dict(intra_alpha=1e-6, intra_bandwidth=400.0, inter_alpha=1e-5, inter_bandwidth=10.0)
    # 2 units of 50 parameters, 2 bytes each: 100-byte messages. Full sharding on 2 nodes of 4: rings over 8 at
    # min(400, 4 x 10) = 40 B/s, each rank sending 7/8 of 100 bytes; of a ring's 7 hops one crosses the network
    # (alpha 1e-5) and 6 stay in a node (1e-6): 1.6e-5 s of latency per collective, 3 collectives per unit.
    per_collective = 6 * 1e-6 + 1 * 1e-5 + 7 / 8 * 100 / 40.0
    assert zero3_comm_time(100, 2, 4, hybrid=False, units=2, **links) == pytest.approx(2 * 3 * per_collective)
    # HSDP: rings over the node's 4 at NVLink's alpha and bandwidth, then an all-reduce of the 25-byte shard
    # over the 2 nodes at one NIC's.
    inside = 2 * alpha_beta_time("all_gather", 100, 4, alpha=1e-6, bandwidth=400.0) + alpha_beta_time(
        "reduce_scatter", 100, 4, alpha=1e-6, bandwidth=400.0)  # fmt: skip
    across = alpha_beta_time("all_reduce", 25, 2, alpha=1e-5, bandwidth=10.0)
    assert zero3_comm_time(100, 2, 4, hybrid=True, units=2, **links) == pytest.approx(2 * (inside + across))


def test_a_full_sharding_ring_pays_the_network_latency_once_per_node_not_once_per_hop():
    """128 nodes of 8: the ring's 1,023 hops, 127 across the network. With a zero-byte message the time is the
    latency alone: 896 NVLink hops and 127 network hops per collective (issue 33: charging the network's alpha
    at every hop doubled Chapter 11's 1,024-GPU figure)."""
    links = dict(intra_alpha=3e-6, intra_bandwidth=1e12, inter_alpha=1e-5, inter_bandwidth=1e12)
    tiny = zero3_comm_time(1e-9, 128, 8, hybrid=False, units=1, **links)
    assert tiny == pytest.approx(3 * (896 * 3e-6 + 127 * 1e-5), rel=1e-6)


def test_without_prefetch_every_gather_is_exposed_and_with_it_only_what_outlasts_the_previous_compute():
    assert exposed_communication([1, 1, 1], [2, 2, 2], prefetch=False) == 3
    assert exposed_communication([1, 1, 1], [2, 2, 2], prefetch=True) == 1  # the first gather only
    # Gathers of 3 s behind computations of 2 s: the first, then 1 s at each of the others.
    assert exposed_communication([3, 3, 3], [2, 2, 2], prefetch=True) == 5


def test_reduce_scatters_queue_behind_the_gathers_and_the_last_one_is_exposed():
    # Gather 0 [0, 1], compute 0 [1, 3] while gather 1 runs [1, 2]; reduce-scatter 0 [3, 4], gather 2 queued
    # behind it [4, 5]; compute 1 [3, 5], reduce-scatter 1 [5, 6]; compute 2 [5, 7], reduce-scatter 2 [7, 8].
    assert exposed_communication([1, 1, 1], [2, 2, 2], prefetch=True, after=[1, 1, 1]) == 2


def test_bad_inputs_raise_one_clear_value_error():
    with pytest.raises(ValueError, match="one entry per unit"):
        exposed_communication([1, 1], [2], prefetch=True)
    with pytest.raises(ValueError, match="numbers >= 0"):
        exposed_communication([-1], [2], prefetch=True)
    with pytest.raises(ValueError, match="nodes must be an integer"):
        zero3_bytes_per_node(100, 0, 8)
    with pytest.raises(ValueError, match="hybrid must be one of"):
        zero3_bytes_per_node(100, 2, 8, hybrid="yes")


def test_ring_latency_charges_the_network_only_where_the_ring_leaves_a_node():
    from scalebook.accounting import ring_latency

    # 16 ranks on 2 nodes of 8: an all-reduce's 30 steps, 2 of them between the nodes; an all-gather's 15, 1.
    assert ring_latency("all_reduce", 16, per_node=8, intra_alpha=1.0, inter_alpha=10.0) == 28 + 2 * 10
    assert ring_latency("all_gather", 16, per_node=8, intra_alpha=1.0, inter_alpha=10.0) == 14 + 10
    assert ring_latency("all_reduce", 8, per_node=8, intra_alpha=1.0, inter_alpha=10.0) == 14  # one node
    with pytest.raises(ValueError, match="inter_alpha must be a number >= 0"):
        ring_latency("all_reduce", 16, per_node=8, intra_alpha=1.0, inter_alpha=-1.0)
