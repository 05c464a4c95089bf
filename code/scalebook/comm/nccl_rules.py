"""NCCL's rules, enforced on CPU: record every rank's communication on gloo and fail where NCCL could not pair it.

gloo is forgiving where NCCL is not. gloo pairs a send with the receive of the same tag and lets a rank's
posted sends and receives progress independently of the order it posted them in. NCCL ignores tags,
pairs the sends and receives between two ranks in the order they were issued, and runs each rank's calls one
after another on a CUDA stream, where a send or a collective does not finish before its counterparts are
running. Code that passes every test on gloo can therefore deadlock, or silently pair the wrong tensors, on
the first GPU cluster it meets. This module records what each rank issued and checks it against three rules.

**Recording.** :func:`start_recording` registers a listener with :mod:`scalebook.comm.intercept`; from then on
every ``torch.distributed`` collective (all_reduce, broadcast, reduce, all_gather(_into_tensor, _single),
reduce_scatter(_tensor, _single), all_to_all(_single), gather, scatter, barrier) becomes a :class:`Call` with
its group's global ranks, element count, dtype and root, and every point-to-point call (send, recv, isend,
irecv) one with a :class:`Transfer` (the peer as a global rank, element count, dtype; tags are dropped). One
``batch_isend_irecv`` is one call holding all its transfers: NCCL runs it as one group
(``ncclGroupStart``/``ncclGroupEnd``). Recording is one list append per call.

**The rules** (:func:`check`, pure Python on the per-rank lists):

a. *Collectives match.* On every group, every member issues the same sequence of collectives, the k-th with
   the same operation, element count, dtype and root; for all-to-all, what rank i sends to j is what j
   receives from i.
b. *Point-to-point pairs in order.* The k-th send from a to b pairs with the k-th receive at b from a (tags
   ignored), with the same element count and dtype, and every send has its receive.
c. *Progress.* Each rank's calls form one stream, run in issue order. A call finishes only once every call it
   pairs with (its collective on every member, the receive of each send and the send of each receive) has
   been at the head of its own stream at the same time; the transfers of one batch progress independently
   and the batch finishes when all have. The simulation advances every rank as far as it can; ranks left
   waiting are a deadlock that NCCL would hit although gloo completed the run (two ranks each sending to the
   other before receiving, or a ring whose every rank sends before it receives: post both in one
   ``batch_isend_irecv``).

**Limits of the model.** One stream per rank is what PyTorch runs in eager-init mode
(``init_process_group(..., device_id=...)``), where point-to-point calls reuse the group's communicator and
are serialised with everything else on it (pytorch PR #132900). Lazily initialised, ProcessGroupNCCL gives
every pair of ranks its own communicator and stream (pytorch issue #129140), where transfers to different
peers outside a batch may overlap. The model is the stricter of the two: a run it passes cannot deadlock
under either, but an ``isend``/``irecv`` ring outside a batch fails here even where per-pair streams might
have let it through. Asynchronous calls count where they were issued (``wait`` is not recorded). Two groups
over the same ranks count as one. Only calls through the Python functions of ``torch.distributed`` are seen:
torch's ``DistributedDataParallel`` (C++) and DTensor's functional collectives are not recorded.

**Where it runs.** ``launch(..., check_nccl=True)``, or any launch while the environment variable
``SCALEBOOK_CHECK_NCCL=1`` is set, records on every rank and checks the ranks' lists after the function
returned everywhere; a violation is a :class:`~scalebook.comm.launch.LaunchError` naming the ranks, their
call numbers (counted from 0 in issue order) and what differs. Under ``torchrun`` the variable makes
:func:`~scalebook.comm.launch.init_from_env` record, and ``destroy_process_group()`` check (it then raises
:class:`NcclRuleError` on every rank).

Source: NCCL documentation, "Point-to-point communication" and "Group Calls"
(docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html, .../groups.html); PyTorch documentation,
``torch.distributed.batch_isend_irecv`` and ``send`` ("tag is not supported with the NCCL backend");
PyTorch ``ProcessGroupNCCL.cpp`` ``pointToPoint`` (a communicator per pair of ranks, or the group's own in
eager-init mode), pytorch issue #129140 and PR #132900.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from scalebook.comm.intercept import add_listener, named_rank, remove_listener

ENV_VAR = "SCALEBOOK_CHECK_NCCL"
ANY_SOURCE = -1  # the peer of a receive from whoever sends first, which NCCL cannot do
MAX_REPORTED = 5  # violations listed in one error; the first one is usually the cause


class NcclRuleError(RuntimeError):
    """The ranks' communication would not pair, match or progress under NCCL."""


@dataclass(frozen=True)
class Transfer:
    """One send or receive: with whom (global rank), how many elements, of which dtype."""

    send: bool
    peer: int
    numel: int
    dtype: str

    def __str__(self) -> str:
        return _transfer_text("send" if self.send else "recv", self)


def _transfer_text(op: str, t: Transfer) -> str:
    return f"{op} of {t.numel} {t.dtype} {'to' if t.send else 'from'} rank {t.peer}"


@dataclass(frozen=True)
class Call:
    """One communication call as a rank issued it: a collective on ``group`` or point-to-point ``transfers``."""

    op: str
    group: tuple[int, ...] = ()  # global ranks of a collective's group
    numel: int = 0
    dtype: str = ""
    root: int | None = None  # global rank of a broadcast's, reduce's, gather's or scatter's root
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # all-to-all: elements to, from each group rank
    transfers: tuple[Transfer, ...] = ()

    def __str__(self) -> str:
        if self.op == "batch_isend_irecv":
            return f"{self.op} [{', '.join(map(str, self.transfers))}]"
        if self.transfers:
            return _transfer_text(self.op, self.transfers[0])
        size = f"splits {self.splits}" if self.splits else f"{self.numel} {self.dtype}"
        root = f", root {self.root}" if self.root is not None else ""
        return f"{self.op} of {size} on ranks {list(self.group)}{root}"


def checking_enabled() -> bool:
    """Whether ``SCALEBOOK_CHECK_NCCL`` asks for the check (``1``, ``true``, ``yes``)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes")


# --- recording ------------------------------------------------------------------------------------------------

_SIZE_ARG = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor", "all_gather_single": "input_tensor", "reduce_scatter": "output",
    "reduce_scatter_tensor": "output", "reduce_scatter_single": "output", "gather": "tensor", "scatter": "tensor",
}  # fmt: skip
_ROOT_ARG = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src"}


def _dtype(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _per_rank(tensor, splits, n: int) -> tuple[int, ...]:
    """Elements an all_to_all_single moves to (or from) each group rank, by its split sizes or evenly."""
    if not splits:
        return (tensor.numel() // n,) * n
    row = tensor.numel() // tensor.shape[0] if tensor.shape[0] else 0
    return tuple(s * row for s in splits)


def _collective(op: str, a: dict) -> Call:
    group = dist.group.WORLD if a.get("group") is None else a["group"]
    ranks = tuple(dist.get_process_group_ranks(group))
    if op == "barrier":
        return Call(op, ranks)
    if op == "all_to_all":
        outputs, inputs = a["output_tensor_list"], a["input_tensor_list"]
        splits = (tuple(t.numel() for t in inputs), tuple(t.numel() for t in outputs))
        return Call(op, ranks, sum(splits[0]), _dtype(inputs[0]), splits=splits)
    if op == "all_to_all_single":
        out, inp = a["output"], a["input"]
        n = len(ranks)
        splits = (_per_rank(inp, a.get("input_split_sizes"), n), _per_rank(out, a.get("output_split_sizes"), n))
        return Call(op, ranks, inp.numel(), _dtype(inp), splits=splits)
    tensor = a[_SIZE_ARG[op]]
    root = None
    if op in _ROOT_ARG:
        root = named_rank(a, _ROOT_ARG[op], default_group_rank=0)
    return Call(op, ranks, tensor.numel(), _dtype(tensor), root)


def describe_call(op: str, a: dict) -> Call:
    """The :class:`Call` that a reported ``torch.distributed`` call (see :mod:`scalebook.comm.intercept`) is."""
    if op == "batch_isend_irecv":
        ops = zip(a["p2p_op_list"], a["sends"], strict=True)
        return Call(op, transfers=tuple(Transfer(s, p.peer, p.tensor.numel(), _dtype(p.tensor)) for p, s in ops))
    if op in ("send", "isend", "recv", "irecv"):
        peer = named_rank(a, "dst" if op.endswith("send") else "src")
        peer = ANY_SOURCE if peer is None else peer
        return Call(op, transfers=(Transfer(op.endswith("send"), peer, a["tensor"].numel(), _dtype(a["tensor"])),))
    return _collective(op, a)


class Recorder:
    """A listener that keeps this rank's calls, in issue order."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __call__(self, op: str, arguments: dict) -> None:
        group = arguments.get("group")
        if group is not None and c10d._rank_not_in_group(group):
            return  # torch.distributed returns at once, with a warning, on a rank outside the group
        self.calls.append(describe_call(op, arguments))


def start_recording() -> Recorder:
    """Record this process's communication calls from now on (until :func:`stop_recording`)."""
    recorder = Recorder()
    add_listener(recorder)
    return recorder


def stop_recording(recorder: Recorder) -> list[Call]:
    """Stop ``recorder``; return the calls it kept."""
    remove_listener(recorder)
    return recorder.calls


# --- the check ------------------------------------------------------------------------------------------------


def check(logs: list[list[Call]]) -> list[str]:
    """The violations of NCCL's rules in the ranks' call lists (``logs[r]`` is rank ``r``'s): mismatched
    collectives, then unpaired messages, then a deadlock; empty when NCCL would pair, match and progress
    every call. The progress rule is checked only when the
    calls pair and match (otherwise which call waits for which is not defined)."""
    problems = _check_collectives(logs) + _check_point_to_point(logs)
    return (problems or _check_progress(logs))[:MAX_REPORTED]


def _collectives_by_group(logs: list[list[Call]]) -> dict[tuple[int, ...], dict[int, list[int]]]:
    """{group: {rank: indices of its calls on that group, in order}}."""
    by_group: dict[tuple[int, ...], dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, calls in enumerate(logs):
        for i, call in enumerate(calls):
            if not call.transfers and call.group:
                by_group[call.group][rank].append(i)
    return by_group


def _mismatch(logs, group, indices: dict[int, int]) -> str | None:
    """What differs between the members' k-th collectives on ``group`` (``indices``: rank -> call index)."""
    calls = {r: logs[r][i] for r, i in indices.items()}
    first = calls[group[0]]
    for r, call in calls.items():
        if (call.op, call.dtype, call.root) != (first.op, first.dtype, first.root) or (
            not call.splits and call.numel != first.numel
        ):
            return f"rank {group[0]}'s call #{indices[group[0]]} is {first}, rank {r}'s call #{indices[r]} is {call}"
    if first.splits:
        for i, a in enumerate(group):
            for j, b in enumerate(group):
                if calls[a].splits[0][j] != calls[b].splits[1][i]:
                    return (f"rank {a}'s call #{indices[a]} ({calls[a]}) sends {calls[a].splits[0][j]} elements to "
                            f"rank {b}, whose call #{indices[b]} expects {calls[b].splits[1][i]}")  # fmt: skip
    return None


def _check_collectives(logs: list[list[Call]]) -> list[str]:
    problems = []
    for group, per_rank in sorted(_collectives_by_group(logs).items()):
        longest = max(group, key=lambda r: len(per_rank[r]))
        for k in range(len(per_rank[longest])):
            missing = [r for r in group if k >= len(per_rank[r])]
            if missing:
                i = per_rank[longest][k]
                problems.append(f"collective #{k} on ranks {list(group)}: rank {longest}'s call #{i} is "
                                f"{logs[longest][i]}, ranks {missing} issued only {k} on this group")  # fmt: skip
                break
            wrong = _mismatch(logs, group, {r: per_rank[r][k] for r in group})
            if wrong:
                problems.append(f"collective #{k} on ranks {list(group)} differs: {wrong}")
                break
    return problems


def _transfers(logs: list[list[Call]]) -> tuple[dict, dict]:
    """({(a, b): [(call index at a, Transfer)] of a's sends to b}, {(a, b): [... of b's receives from a]})."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, calls in enumerate(logs):
        for i, call in enumerate(calls):
            for t in call.transfers:
                (sends[rank, t.peer] if t.send else recvs[t.peer, rank]).append((i, t))
    return sends, recvs


def _check_point_to_point(logs: list[list[Call]]) -> list[str]:
    problems = [
        f"rank {r}'s call #{i} ({call}) names peer {t.peer}: NCCL needs another rank of the job "
        "(a receive from any source is not supported)"
        for r, calls in enumerate(logs) for i, call in enumerate(calls) for t in call.transfers
        if t.peer == r or not 0 <= t.peer < len(logs)
    ]  # fmt: skip
    if problems:
        return problems
    sends, recvs = _transfers(logs)
    for a, b in sorted(set(sends) | set(recvs)):
        out, into = sends[a, b], recvs[a, b]
        for k in range(max(len(out), len(into))):
            if k >= len(out) or k >= len(into):
                i, t = (out if k < len(out) else into)[k]
                who = a if k < len(out) else b
                problems.append(f"rank {a} sends {len(out)} messages to rank {b}, which receives {len(into)}: "
                                f"rank {who}'s call #{i} ({t}) has no counterpart")  # fmt: skip
                break
            (i, s), (j, r) = out[k], into[k]
            if (s.numel, s.dtype) != (r.numel, r.dtype):
                problems.append(f"message #{k} from rank {a} to rank {b}: rank {a}'s call #{i} sends {s.numel} "
                                f"{s.dtype}, rank {b}'s call #{j} receives {r.numel} {r.dtype} (NCCL ignores tags "
                                "and pairs a pair's messages in issue order)")  # fmt: skip
                break
    return problems


def _links(logs: list[list[Call]]) -> tuple[list[list[list[int]]], list[list[tuple[int, int]]]]:
    """Each call's links (numbered: what must run at once for it to finish) and each link's (rank, call)s."""
    members: list[list[tuple[int, int]]] = []
    for group, per_rank in _collectives_by_group(logs).items():
        members += ([(r, per_rank[r][k]) for r in group] for k in range(len(per_rank[group[0]])))
    sends, recvs = _transfers(logs)
    for (a, b), out in sends.items():
        members += ([(a, i), (b, j)] for (i, _), (j, _) in zip(out, recvs[a, b], strict=True))
    links: list[list[list[int]]] = [[[] for _ in calls] for calls in logs]
    for link, ends in enumerate(members):
        for r, i in ends:
            links[r][i].append(link)
    return links, members


def _check_progress(logs: list[list[Call]]) -> list[str]:
    links, members = _links(logs)
    heads, done = [0] * len(logs), [False] * len(members)
    moved = True
    while moved:
        moved = False
        for r, calls in enumerate(logs):
            while heads[r] < len(calls):
                waiting = False
                for link in links[r][heads[r]]:
                    if not done[link]:
                        done[link] = all(heads[m] == i for m, i in members[link])
                        waiting = waiting or not done[link]
                if waiting:
                    break
                heads[r] += 1
                moved = True
    stuck = [f"rank {r} at its call #{h} ({logs[r][h]})" for r, h in enumerate(heads) if h < len(logs[r])]
    if not stuck:
        return []
    return ["deadlock under NCCL (each rank runs its calls in order; a send, receive or collective finishes only "
            "when its counterparts run too): " + "; ".join(stuck)]  # fmt: skip


# --- runs started by torchrun or srun ----------------------------------------------------------------------------

_torchrun_recorder: Recorder | None = None


def record_until_destroy() -> None:
    """For :func:`~scalebook.comm.launch.init_from_env`: record from now on, and make the default group's
    ``destroy_process_group()`` exchange the ranks' lists and raise :class:`NcclRuleError` on a violation
    (skipped when an exception is already on its way: the run failed for another reason)."""
    global _torchrun_recorder
    if _torchrun_recorder is not None:
        return
    _torchrun_recorder = start_recording()
    original = c10d.destroy_process_group

    def destroy_process_group(group=None):
        global _torchrun_recorder
        problems = []
        if group is None and _torchrun_recorder is not None:
            calls = stop_recording(_torchrun_recorder)
            _torchrun_recorder = None
            if sys.exc_info()[0] is None:
                logs: list = [None] * dist.get_world_size()
                dist.all_gather_object(logs, calls)
                problems = check(logs)
            c10d.destroy_process_group = dist.destroy_process_group = original
        original(group)
        if problems:
            raise NcclRuleError("\n".join(problems))

    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group
