"""HSDP: the book's stage 3 on a 2-D group (shard inside a node, replicate across nodes) trains exactly like FSDP2
on a 2-D ``DeviceMesh`` and like one process, holds one node's stage-3 bytes, and sends inside and across the
nodes the bytes of the two-level formula (``scalebook.accounting.sharding``); full sharding's ring, replayed
from send/recv, sends one rank's bytes per node across.

One launch of 4 ranks (2 nodes of 2) runs everything; the tests below only compare.
"""

import pytest
import torch.distributed as dist

from scalebook import accounting
from scalebook.accounting.sharding import zero3_bytes_per_node
from scalebook.comm import launch
from scalebook.experiments import zero as zero_runs
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import fsdp

TINY = GPTConfig.named("tiny", n_layer=2)  # width 128: every dim 0 is a multiple of 4, nothing is padded
NODES, GPUS_PER_NODE = 2, 2
PSI = GPT(TINY).num_parameters()


def _bad_requests() -> dict[str, str]:
    """The ValueError of each bad HSDP request on this rank (every rank creates every group, in one order)."""
    rank = dist.get_rank()
    shard = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // GPUS_PER_NODE]
    replicate = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    requests = {
        "overlap": lambda: fsdp.fully_shard(GPT(TINY), process_group=shard, replicate_group=shard),
        "not a member": lambda: fsdp.fully_shard(
            GPT(TINY), process_group=shard, replicate_group=replicate[1 - rank % 2]
        ),  # fmt: skip
    }
    messages = {}
    for name, request in requests.items():
        try:
            request()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    return messages


def run() -> dict:
    out = zero_runs.hsdp_runs(zero_runs.Recipe(TINY), GPUS_PER_NODE)
    out["bad"] = _bad_requests()
    return out


@pytest.fixture(scope="module")
def hsdp():
    return launch(run, NODES * GPUS_PER_NODE, timeout=300)


def _node_sums(ranks, ops) -> list[float]:
    """Bytes sent by each node's ranks in the calls of ``ops`` (each rank's ``traffic``: {op: (calls, bytes)})."""
    return [sum(rank["traffic"].get(op, (0, 0))[1] for rank in ranks[node * GPUS_PER_NODE : (node + 1) * GPUS_PER_NODE]
                for op in ops) for node in range(NODES)]  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
def test_hsdp_equals_fsdp2_on_a_2d_mesh_bitwise(hsdp, dtype):
    # Both reduce-scatter in the node and divide by 2, then all-reduce across the nodes and divide by 2: the same
    # additions of two numbers each (exact in any order) and divisions by powers of two (exact).
    assert hsdp[0]["errors"][dtype][("HSDP", "FSDP2 HSDP")] == 0.0
    assert hsdp[0]["grad_errors"][dtype][("HSDP", "FSDP2 HSDP")] == 0.0


def test_hsdp_trains_like_one_process_on_the_global_batch(hsdp):
    # float64: reordered sums leave about 1e-15 per step; a replica left out of the average would move a weight by
    # about lr = 1e-3 in three AdamW steps and the gradient by 1 relative, far above these bounds.
    assert hsdp[0]["errors"]["fp64"][("HSDP", "single process")] < 1e-10
    assert hsdp[0]["grad_errors"]["fp64"][("HSDP", "single process")] < 1e-12


def test_hsdp_holds_the_stage3_bytes_of_one_nodes_shard_group(hsdp):
    formula = accounting.model_state_bytes(PSI, zero_stage=3, dp=GPUS_PER_NODE, precision="fp32")
    for rank in hsdp:
        assert (rank["held"].params, rank["held"].grads, rank["held"].optimizer) == (
            formula.params, formula.grads, formula.optimizer)  # fmt: skip


def test_hsdp_sends_inside_and_across_nodes_the_ring_bytes_of_its_messages(hsdp):
    # Measured: the calls and their message sizes. Modelled: the bytes, since a library collective's sends are
    # hidden and count_traffic charges each call the ring's (d - 1) / d M (all-gather, reduce-scatter) or
    # 2 (d - 1) / d M (all-reduce) over its group of d. Written out for one node of g = 2 ranks, fp32:
    #   inside: per rank two all-gathers of 4 Psi and one reduce-scatter of 4 Psi over g: 3 (g - 1) / g 4 Psi = 6 Psi;
    #   across: per rank the all-reduce of its 4 Psi / g gradient shard over the N = 2 nodes: 2 (N - 1) / N 2 Psi.
    g, n = GPUS_PER_NODE, NODES
    intra_per_rank = 3 * (g - 1) / g * 4 * PSI
    inter_per_rank = 2 * (n - 1) / n * 4 * PSI / g
    assert (intra_per_rank, inter_per_rank) == (6 * PSI, 2 * PSI)
    assert _node_sums(hsdp, ["all_gather_single", "reduce_scatter_single"]) == [g * intra_per_rank] * NODES
    assert _node_sums(hsdp, ["all_reduce"]) == [g * inter_per_rank] * NODES
    for rank in hsdp:
        assert rank["messages"] == {"all_gather_single": 2 * 4 * PSI, "reduce_scatter_single": 4 * PSI,
                                    "all_reduce": 4 * PSI // GPUS_PER_NODE}  # fmt: skip
        assert rank["traffic"] == rank["fsdp2_traffic"]
    # accounting's two-level formula says the same per node.
    formula = zero3_bytes_per_node(PSI, NODES, GPUS_PER_NODE, hybrid=True, grad_bytes=4, param_bytes=4)
    assert (formula["intra_node"], formula["inter_node"]) == (g * intra_per_rank, g * inter_per_rank)


def test_full_sharding_ring_sends_one_ranks_bytes_per_node_across_nodes(hsdp):
    # The step's collectives over all 4 ranks as rings from send/recv: rank r sends to r - 1, so ranks 0 and 2
    # send to the other node and ranks 1 and 3 inside their own.
    formula = zero3_bytes_per_node(PSI, NODES, GPUS_PER_NODE, grad_bytes=4, param_bytes=4)
    for node in range(NODES):
        ranks = hsdp[node * GPUS_PER_NODE : (node + 1) * GPUS_PER_NODE]
        assert sum(rank["ring"]["intra_node"] for rank in ranks) == formula["intra_node"]
        assert sum(rank["ring"]["inter_node"] for rank in ranks) == formula["inter_node"]


@pytest.mark.parametrize("request_, message", [("overlap", "shares ranks"), ("not a member", "not a member")])
def test_bad_hsdp_groups_raise_one_clear_value_error(hsdp, request_, message):
    for rank in hsdp:
        assert message in rank["bad"][request_]
