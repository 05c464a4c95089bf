"""NCCL's rules on gloo: the checker fails exchanges that gloo completes but NCCL could not pair, match or progress,
and passes the patterns NCCL runs (a batch_isend_irecv ring, collectives issued alike everywhere)."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from scalebook.comm import LaunchError, launch, processes
from scalebook.comm.nccl_rules import ENV_VAR, Call, Transfer, check

# --- the pure checker, on hand-written call lists -------------------------------------------------------------


def send(peer, numel=4, op="send"):
    return Call(op, transfers=(Transfer(True, peer, numel, "float32"),))


def recv(peer, numel=4, op="recv"):
    return Call(op, transfers=(Transfer(False, peer, numel, "float32"),))


def batch(*calls):
    return Call("batch_isend_irecv", transfers=tuple(t for c in calls for t in c.transfers))


def all_reduce(numel, group=(0, 1), dtype="float32"):
    return Call("all_reduce", group, numel, dtype)


def test_matching_collectives_and_ordered_messages_pass():
    logs = [
        [all_reduce(8), send(1), recv(1), all_reduce(2)],
        [all_reduce(8), recv(0), send(0), all_reduce(2)],
    ]
    assert check(logs) == []


def test_collectives_in_a_different_order_fail_naming_both_calls():
    # Rank 1 issues the two all-reduces in swapped order: NCCL would reduce 8 elements with 2.
    problems = check([[all_reduce(8), all_reduce(2)], [all_reduce(2), all_reduce(8)]])
    assert len(problems) == 1
    assert "collective #0 on ranks [0, 1] differs" in problems[0]
    assert "rank 0's call #0 is all_reduce of 8 float32" in problems[0]
    assert "rank 1's call #0 is all_reduce of 2 float32" in problems[0]


def test_a_different_dtype_or_root_fails():
    assert "differs" in check([[all_reduce(4)], [all_reduce(4, dtype="bfloat16")]])[0]
    bcast = [Call("broadcast", (0, 1), 4, "float32", root=r) for r in (0, 1)]
    assert "root 1" in check([[bcast[0]], [bcast[1]]])[0]


def test_a_collective_one_rank_never_issues_fails():
    problems = check([[all_reduce(4), Call("barrier", (0, 1))], [all_reduce(4)]])
    assert "collective #1 on ranks [0, 1]" in problems[0] and "ranks [1] issued only 1" in problems[0]


def test_collectives_on_disjoint_groups_are_checked_per_group():
    # Ranks 0, 1 and ranks 2, 3 reduce different sizes: two groups, each consistent.
    logs = [[all_reduce(4, (0, 1))], [all_reduce(4, (0, 1))], [all_reduce(9, (2, 3))], [all_reduce(9, (2, 3))]]
    assert check(logs) == []


def test_all_to_all_splits_must_agree_between_sender_and_receiver():
    def a2a(sends, recvs):
        return Call("all_to_all_single", (0, 1), sum(sends), "float32", splits=(sends, recvs))

    assert check([[a2a((1, 3), (1, 2))], [a2a((2, 5), (3, 5))]]) == []  # uneven but consistent
    problems = check([[a2a((1, 3), (1, 2))], [a2a((2, 5), (4, 5))]])
    assert "rank 0's call #0" in problems[0] and "sends 3 elements to rank 1" in problems[0]


def test_messages_pair_in_issue_order_whatever_the_tags():
    # Rank 0 sends 4 then 6 elements; rank 1 posts the 6-element receive first (tags paired them on gloo).
    problems = check([[send(1, 4, "isend"), send(1, 6, "isend")], [recv(0, 6, "irecv"), recv(0, 4, "irecv")]])
    assert "message #0 from rank 0 to rank 1" in problems[0]
    assert "sends 4 float32" in problems[0] and "receives 6 float32" in problems[0]


def test_a_send_without_its_receive_fails():
    assert "has no counterpart" in check([[send(1), send(1)], [recv(0)]])[0]


def test_a_receive_from_any_source_or_from_itself_fails():
    assert "names peer -1" in check([[recv(-1)], [send(0)]])[0]
    assert "names peer 0" in check([[send(0)], []])[0]


def test_head_to_head_sends_deadlock():
    # Both ranks send before they receive: each send waits for a receive that its peer posts only later.
    problems = check([[send(1), recv(1)], [send(0), recv(0)]])
    assert len(problems) == 1 and problems[0].startswith("deadlock under NCCL")
    assert "rank 0 at its call #0 (send of 4 float32 to rank 1)" in problems[0]
    assert "rank 1 at its call #0 (send of 4 float32 to rank 0)" in problems[0]


def test_the_same_exchange_in_one_batch_progresses():
    assert check([[batch(send(1), recv(1))], [batch(send(0), recv(0))]]) == []


def test_a_ring_of_unbatched_sends_deadlocks_and_a_batched_ring_does_not():
    n = 4
    unbatched = [[send((r + 1) % n), recv((r - 1) % n)] for r in range(n)]
    assert check(unbatched)[0].startswith("deadlock")
    assert check([[batch(send((r + 1) % n), recv((r - 1) % n))] for r in range(n)]) == []


def test_a_collective_waits_for_every_member():
    # Rank 1 receives from rank 2 before the all-reduce, rank 2 sends only after it: a cycle through the collective.
    group = (0, 1, 2)
    logs = [[all_reduce(4, group)], [recv(2), all_reduce(4, group)], [all_reduce(4, group), send(1)]]
    assert "rank 1 at its call #0 (recv of 4 float32 from rank 2)" in check(logs)[0]
    logs[1] = [all_reduce(4, group), recv(2)]
    assert check(logs) == []


def test_a_batch_finishes_when_each_peer_reaches_its_part():
    # Rank 0's batch talks to ranks 1 and 2; rank 2 first finishes an exchange with rank 1.
    logs = [[batch(send(1), send(2))], [recv(0), send(2)], [recv(1), recv(0)]]
    assert check(logs) == []


# --- on gloo, through launch ----------------------------------------------------------------------------------


def tagged_exchange_out_of_order():
    """Rank 0 sends 4 then 6 elements; rank 1 receives the 6 first, by tag. gloo completes it."""
    if dist.get_rank() == 0:
        works = [dist.isend(torch.zeros(4), dst=1, tag=1), dist.isend(torch.ones(6), dst=1, tag=2)]
    else:
        six, four = torch.empty(6), torch.empty(4)
        works = [dist.irecv(six, src=0, tag=2), dist.irecv(four, src=0, tag=1)]
    for work in works:
        work.wait()
    return dist.get_rank() == 0 or (six.sum().item(), four.sum().item()) == (6.0, 0.0)


def sends_before_receives():
    """Both ranks post their send before their receive, outside a batch. gloo buffers the sends; NCCL could not."""
    me, other = dist.get_rank(), 1 - dist.get_rank()
    into = torch.empty(3)
    outgoing = dist.isend(torch.full((3,), float(me)), dst=other)
    incoming = dist.irecv(into, src=other)
    outgoing.wait()
    incoming.wait()
    return into.tolist()


def batched_ring():
    """Every rank passes its rank to the next in one batch_isend_irecv, then all agree in an all-reduce; ranks 0
    and 1 add up what they received in a group that rank 2 is not part of but calls too."""
    rank, n = dist.get_rank(), dist.get_world_size()
    into = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % n),
           dist.P2POp(dist.irecv, into, (rank - 1) % n)]  # fmt: skip
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    total = into.clone()
    dist.all_reduce(total)
    pair = dist.new_group([0, 1])
    dist.all_reduce(into, group=pair)  # rank 2 is outside the group: torch returns at once, nothing to record
    return into[0].item(), total[0].item()


def test_launch_fails_an_exchange_that_pairs_only_by_tags():
    with pytest.raises(LaunchError, match="message #0 from rank 0 to rank 1: rank 0's call #0 sends 4 float32"):
        launch(tagged_exchange_out_of_order, 2, check_nccl=True)


def test_launch_fails_head_to_head_sends_that_gloo_completes(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")  # the default follows the environment variable
    with pytest.raises(LaunchError, match=r"deadlock under NCCL.*rank 0 at its call #0 \(isend of 3 float32"):
        launch(sends_before_receives, 2)
    # Opting out runs the same exchange on gloo alone, where it completes.
    assert launch(sends_before_receives, 2, check_nccl=False) == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_launch_passes_a_batched_ring():
    # Rank r receives r - 1; the ranks' received values add up to 0 + 1 + 2; ranks 0 and 1 add 2 + 0.
    assert launch(batched_ring, 3, check_nccl=True) == [(2.0, 3.0), (2.0, 3.0), (1.0, 3.0)]


# --- under torchrun: init_from_env records, destroy_process_group checks ------------------------------------

TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
from scalebook.comm import init_from_env
init_from_env()
if dist.get_rank() == 0:
    works = [dist.isend(torch.zeros(4), dst=1, tag=1), dist.isend(torch.ones(6), dst=1, tag=2)]
else:
    works = [dist.irecv(torch.empty(6), src=0, tag=2), dist.irecv(torch.empty(4), src=0, tag=1)]
for work in works:
    work.wait()
dist.barrier()
dist.destroy_process_group()
"""


def test_a_torchrun_job_fails_at_destroy_process_group(tmp_path):
    script = tmp_path / "misordered.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, ENV_VAR: "1", "OMP_NUM_THREADS": "1"}
    # processes.run, not subprocess.run: on a timeout torchrun's ranks (sessions of their own) are killed too.
    run = processes.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                         str(script)], env=env, timeout=240, name="torchrun")  # fmt: skip
    assert run.returncode != 0
    assert "NcclRuleError: message #0 from rank 0 to rank 1: rank 0's call #0 sends 4 float32" in run.stderr
