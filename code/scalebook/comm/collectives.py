"""All-reduce built from point-to-point messages: the ring (a reduce-scatter, then an all-gather), a binomial
tree, NCCL's double binary tree, and the naive exchange.

Every rank calls the same function with a tensor of the same shape; afterwards every rank holds the
element-wise sum of all ranks' tensors, exactly as after ``dist.all_reduce(tensor)``. With ``n`` ranks and an
``M``-byte tensor, each rank sends

    ring    2 (n-1)/n M   in 2 (n-1) steps of M/n bytes: reduce-scatter, then all-gather
    tree    2 (n-1)/n M   on average, in 2 ceil(log2 n) rounds of M bytes: reduce to rank 0, broadcast back
    double  2 (n-1)/n M   on average (at most 2 M), in 2 log2 n + chunks - 1 rounds: two trees, half each
    naive     (n-1)   M   in one round: its whole tensor to each of the n-1 others

The ring sends to its left neighbour (rank - 1) and receives from its right one, and cuts the tensor into
chunks the way gloo's ring all-reduce does (:func:`ring_chunk_sizes`), so every element is summed in the
same order as ``dist.all_reduce`` on gloo and the results agree bit for bit, random floats included. The
trees and the naive exchange add the same numbers in other orders, so with floats they agree to rounding
(each of the n-1 additions rounds once); with integer-valued tensors every order is exact.

Only ``torch.distributed`` point-to-point calls move data here (``batch_isend_irecv`` where ranks send and
receive at once, as NCCL needs; ``send``/``recv`` in the tree), called through the module so that
:func:`scalebook.comm.traffic.count_traffic` measures the bytes. Chapter 9's experiments on them (every
library collective on labelled data, the algorithms compared) are in :mod:`scalebook.experiments.collectives`.

Source: Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations"
(ring); Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations in MPICH"
(binomial trees); Sanders, Speck and Traeff 2009, "Two-tree algorithms for full bandwidth broadcast, reduction
and scan" and NVIDIA NCCL ``src/graph/trees.cc`` (``ncclGetBtree``, ``ncclGetDtree``: the double binary tree);
gloo, ``gloo/allreduce.cc`` (ring direction and chunk layout).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's AllreduceOptions::kMaxSegmentSize


def ring_chunk_sizes(numel: int, n: int, element_size: int = 4) -> list[int]:
    """Elements in each of the ``n`` ring chunks of a ``numel``-element tensor, cut as gloo cuts them.

    gloo splits the buffer into segments of at most 1 MiB, at least two per rank and a multiple of ``n`` of
    them, each ``ceil(numel / segments)`` elements; chunk ``c`` is the ``c``-th run of ``segments / n``
    segments. When ``numel`` is a multiple of the segment count (``2 n`` up to 1 MiB per segment) the chunks
    are equal; otherwise the first chunks are full and the last ones short or even empty.
    """
    for name, value, least in (("numel", numel, 0), ("n", n, 1), ("element_size", element_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    max_segment = max(1, GLOO_MAX_SEGMENT_BYTES // element_size)
    segments = -(-max(-(-numel // max_segment), 2 * n) // n) * n
    per_chunk = -(-numel // segments) * (segments // n)
    return [min(per_chunk, max(0, numel - c * per_chunk)) for c in range(n)]


def _offsets(sizes: list[int]) -> list[tuple[int, int]]:
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def _check_tensor(tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"the sum needs a real numeric tensor, got dtype {tensor.dtype}")


def _exchange(outgoing: torch.Tensor, to: int, incoming: torch.Tensor, source: int, group) -> None:
    """Send ``outgoing`` to group rank ``to`` while receiving ``incoming`` from ``source``.

    Both go in one ``batch_isend_irecv``: in a ring every rank sends and receives at once, and NCCL runs
    a rank's calls in order, so a send posted on its own would wait for a receive that its neighbour posts
    only after its own send (:mod:`scalebook.comm.nccl_rules`). Empty chunks are not sent at all.
    """
    ops = []
    if incoming.numel():
        ops.append(dist.P2POp(dist.irecv, incoming, group=group, group_peer=source))
    if outgoing.numel():
        ops.append(dist.P2POp(dist.isend, outgoing, group=group, group_peer=to))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's chunk of the sum over ranks (chunk ``r`` of :func:`ring_chunk_sizes` on rank ``r``).

    ``n - 1`` steps: at step ``s`` rank ``r`` passes chunk ``r + 1 + s`` (mod ``n``) to its left neighbour
    and adds the partial sum of chunk ``r + 2 + s`` arriving from its right one. A chunk thus travels once
    around the ring, collecting one rank's contribution per hop, and ends complete on its owner. ``tensor``
    is not modified; the result is a new flat tensor.
    """
    _check_tensor(tensor)
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.detach().reshape(-1).clone()
    bounds = _offsets(ring_chunk_sizes(flat.numel(), n, flat.element_size()))
    left, right = (rank - 1) % n, (rank + 1) % n
    for step in range(n - 1):
        send_lo, send_hi = bounds[(rank + 1 + step) % n]
        recv_lo, recv_hi = bounds[(rank + 2 + step) % n]
        partial = torch.empty(recv_hi - recv_lo, dtype=flat.dtype)
        _exchange(flat[send_lo:send_hi], left, partial, right, group)
        flat[recv_lo:recv_hi] += partial  # my contribution + everything to my right so far
    lo, hi = bounds[rank]
    return flat[lo:hi].clone()


def ring_all_gather(chunk: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    """The ``numel``-element flat tensor whose chunk ``r`` (by :func:`ring_chunk_sizes`) rank ``r`` holds.

    ``n - 1`` steps: at step ``s`` rank ``r`` passes chunk ``r + s`` (its own first, then the one it just
    received) to its left neighbour and receives chunk ``r + 1 + s`` from its right one.
    """
    _check_tensor(chunk)
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    sizes = ring_chunk_sizes(numel, n, chunk.element_size())
    if chunk.numel() != sizes[rank]:
        raise ValueError(
            f"rank {rank} holds {chunk.numel()} elements but chunk {rank} of a {numel}-element tensor over "
            f"{n} ranks has {sizes[rank]} (see ring_chunk_sizes); pass the chunk ring_reduce_scatter returned"
        )
    bounds = _offsets(sizes)
    full = torch.empty(numel, dtype=chunk.dtype)
    lo, hi = bounds[rank]
    full[lo:hi] = chunk.reshape(-1)
    left, right = (rank - 1) % n, (rank + 1) % n
    for step in range(n - 1):
        send_lo, send_hi = bounds[(rank + step) % n]
        recv_lo, recv_hi = bounds[(rank + 1 + step) % n]
        _exchange(full[send_lo:send_hi], left, full[recv_lo:recv_hi], right, group)
    return full


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place, by a ring reduce-scatter and a ring all-gather."""
    mine = ring_reduce_scatter(tensor, group)  # phase 1: each rank ends with one chunk of the sum
    tensor.copy_(ring_all_gather(mine, tensor.numel(), group).view_as(tensor))  # phase 2: share the chunks
    return tensor


def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place: reduce along a binomial tree to rank 0, then broadcast back down it.

    In reduce round ``k`` every rank that is an odd multiple of ``2^k`` sends its partial sum to the rank
    ``2^k`` below it and drops out; after ``ceil(log2 n)`` rounds rank 0 holds the sum. The broadcast runs
    the same rounds in reverse, sending instead of receiving.
    """
    _check_tensor(tensor)
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    total = tensor.detach().reshape(-1).clone()
    incoming = torch.empty_like(total)
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    for k in range(rounds):
        stride = 1 << k
        if rank % (2 * stride) == stride:
            dist.send(total, group_dst=rank - stride, group=group)
            break
        if rank + stride < n:
            dist.recv(incoming, group_src=rank + stride, group=group)
            total += incoming
    for k in reversed(range(rounds)):
        stride = 1 << k
        if rank % (2 * stride) == 0 and rank + stride < n:
            dist.send(total, group_dst=rank + stride, group=group)
        elif rank % (2 * stride) == stride:
            dist.recv(total, group_src=rank - stride, group=group)
    tensor.copy_(total.view_as(tensor))
    return tensor


def binary_tree(n: int) -> list[tuple[int, tuple[int, ...]]]:
    """NCCL's binary tree over ranks ``0..n-1``: ``(parent, children)`` of each rank, parent -1 at the root (0).

    Rank ``r``'s lowest set bit ``b`` places it: its parent is ``(r ^ b) | 2b`` (or ``r ^ b`` when that is out
    of range), its children ``r - b/2`` and ``r + b/2`` (or the largest ``r + b/2^k`` in range); the root 0
    has the single child ``2^k`` with ``2^k < n <= 2^(k+1)``. Odd ranks are the leaves, even ranks interior.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    tree = []
    for rank in range(n):
        bit = 1
        while bit < n and not bit & rank:
            bit <<= 1
        if rank == 0:
            tree.append((-1, (bit >> 1,) if n > 1 else ()))
            continue
        parent = (rank ^ bit) | (bit << 1)
        parent = parent if parent < n else rank ^ bit
        low = bit >> 1
        children = [rank - low] if low else []
        while low and rank + low >= n:  # the second child: the largest rank + low / 2^k inside the range
            low >>= 1
        children += [rank + low] if low else []
        tree.append((parent, tuple(children)))
    return tree


def double_binary_tree(n: int) -> tuple[list[tuple[int, tuple[int, ...]]], ...]:
    """NCCL's two complementary trees over ``n`` ranks: :func:`binary_tree`, and its mirror image (rank ``r``
    plays the part of ``n - 1 - r``) for even ``n`` or its shift by one rank for odd ``n``.

    For even ``n`` the leaves of the first tree (the odd ranks) are the interior ranks of the mirror and the
    other way round, so every rank is a leaf in one tree and interior in the other: a rank forwards data down
    only one tree, and its links carry the same load in both. For odd ``n`` rank 0 is interior in both trees.
    """
    first = binary_tree(n)
    if n % 2:

        def move(r):  # the shifted tree: rank r plays the part of r - 1
            return (r + 1) % n if r >= 0 else -1

        second = [(move(first[(r - 1) % n][0]), tuple(move(c) for c in first[(r - 1) % n][1])) for r in range(n)]
    else:

        def move(r):  # the mirror: rank r plays the part of n - 1 - r
            return n - 1 - r if r >= 0 else -1

        second = [(move(first[n - 1 - r][0]), tuple(move(c) for c in first[n - 1 - r][1])) for r in range(n)]
    return first, second


def _heights_and_depths(tree: list[tuple[int, tuple[int, ...]]]) -> tuple[list[int], list[int]]:
    # height: longest way down to a leaf (leaves 0); depth: hops up to the root (root 0).
    n = len(tree)
    root = next(r for r, (parent, _) in enumerate(tree) if parent < 0)
    order, depth = [root], [0] * n
    for r in order:  # breadth first from the root
        for child in tree[r][1]:
            depth[child] = depth[r] + 1
            order.append(child)
    height = [0] * n
    for r in reversed(order):
        height[r] = max((height[c] + 1 for c in tree[r][1]), default=0)
    return height, depth


class TreeTransfer(NamedTuple):
    """One message of a double-tree all-reduce, as one rank sees it: elements ``start:end`` of its flat tensor,
    chunk ``chunk`` of tree ``tree``'s half, sent to or received from group rank ``peer``; a received partial
    sum is added (``add``), a received final sum overwrites."""

    tree: int
    chunk: int
    send: bool
    peer: int
    start: int
    end: int
    add: bool


def double_tree_schedule(n: int, rank: int, numel: int, chunk_elements: int) -> dict[int, list[TreeTransfer]]:
    """Rank ``rank``'s transfers in a double-tree all-reduce of ``numel`` elements over ``n`` ranks, by round.

    Tree ``t`` of :func:`double_binary_tree` owns half ``t`` of the tensor (the first ``ceil(numel / 2)``
    elements, then the rest), cut into chunks of ``chunk_elements``. Rounds count from 0: a rank at height
    ``h`` (leaves 0) sends chunk ``c``'s partial sum up in round ``c + h``, after its children's arrived; a rank
    at depth ``d`` (root 0) sends the finished chunk down in round ``c + H + d``, ``H`` the root's height, and
    receives it in the round before. Both trees and both directions run at once, so ``C`` chunks take
    ``C - 1 + 2 log2 n`` rounds for ``n`` a power of two. Each round's list is in (tree, chunk) order, the
    order in which both ends of a pair post their messages.
    """
    rounds: dict[int, list[TreeTransfer]] = {}
    halves = _offsets([-(-numel // 2), numel // 2])
    for t, (tree, (lo, hi)) in enumerate(zip(double_binary_tree(n), halves, strict=True)):
        height, depth = _heights_and_depths(tree)
        top = max(height)  # the root's height
        parent, children = tree[rank]
        for c, start in enumerate(range(lo, hi, chunk_elements)):
            end = min(start + chunk_elements, hi)
            moves = [(c + height[child], False, child, True) for child in children]  # partial sums come up
            if parent >= 0:
                moves += [(c + height[rank], True, parent, False), (c + top + depth[rank] - 1, False, parent, False)]
            moves += [(c + top + depth[rank], True, child, False) for child in children]  # the sum goes down
            for when, send, peer, add in moves:
                rounds.setdefault(when, []).append(TreeTransfer(t, c, send, peer, start, end, add))
    return {when: sorted(rounds[when], key=lambda m: (m.tree, m.chunk)) for when in sorted(rounds)}


def double_tree_all_reduce(tensor: torch.Tensor, group=None, *, chunk_bytes: int = GLOO_MAX_SEGMENT_BYTES):
    """Sum ``tensor`` in place with NCCL's double binary tree: each tree of :func:`double_binary_tree` reduces
    one half of the tensor up to its root and broadcasts it back down, both halves at once, pipelined in
    chunks of at most ``chunk_bytes`` (:func:`double_tree_schedule`).

    All of a round's sends and receives go in one ``batch_isend_irecv``, which NCCL runs as one group, so the
    two trees and the two directions progress together. One chunk takes ``2 log2 n`` rounds for ``n`` a power
    of two, against the ring's ``2 (n - 1)``; each rank sends at most twice its tensor.
    """
    _check_tensor(tensor)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.detach().reshape(-1).clone()
    schedule = double_tree_schedule(n, rank, flat.numel(), max(1, chunk_bytes // flat.element_size()))
    for transfers in schedule.values():
        posted, sums = [], []
        for m in transfers:
            buffer = torch.empty(m.end - m.start, dtype=flat.dtype) if m.add else flat[m.start : m.end]
            posted.append(dist.P2POp(dist.isend if m.send else dist.irecv, buffer, group=group, group_peer=m.peer))
            if m.add:
                sums.append((m, buffer))
        for work in dist.batch_isend_irecv(posted):
            work.wait()
        for m, partial in sums:  # children in tree order: every run adds in the same order
            flat[m.start : m.end] += partial
    tensor.copy_(flat.view_as(tensor))
    return tensor


def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place: every rank sends its whole tensor to every other rank, then adds all ``n``
    copies in rank order (the same order everywhere, so every rank gets the same bits)."""
    _check_tensor(tensor)
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    mine = tensor.detach().reshape(-1).clone()
    copies = [mine if peer == rank else torch.empty_like(mine) for peer in range(n)]
    # One batch: NCCL runs it as one group call, where the n - 1 sends and receives progress together.
    ops = [dist.P2POp(dist.irecv, copies[peer], group=group, group_peer=peer) for peer in range(n) if peer != rank]
    ops += [dist.P2POp(dist.isend, mine, group=group, group_peer=peer) for peer in range(n) if peer != rank]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    total = copies[0].clone()
    for copy in copies[1:]:
        total += copy
    tensor.copy_(total.view_as(tensor))
    return tensor


ALL_REDUCES = {
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "double_tree": double_tree_all_reduce,
    "naive": naive_all_reduce,
}


def library_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``dist.all_reduce`` (gloo's or NCCL's), looked up at call time so that ``count_traffic`` sees it."""
    dist.all_reduce(tensor, group=group)
    return tensor
