"""All-reduce built from point-to-point messages: the ring (a reduce-scatter, then an all-gather), a binomial
tree, and the naive exchange.

Every rank calls the same function with a tensor of the same shape; afterwards every rank holds the
element-wise sum of all ranks' tensors, exactly as after ``dist.all_reduce(tensor)``. With ``n`` ranks and an
``M``-byte tensor, each rank sends

    ring    2 (n-1)/n M   in 2 (n-1) steps of M/n bytes: reduce-scatter, then all-gather
    tree    2 (n-1)/n M   on average, in 2 ceil(log2 n) rounds of M bytes: reduce to rank 0, broadcast back
    naive     (n-1)   M   in one round: its whole tensor to each of the n-1 others

The ring sends to its left neighbour (rank - 1) and receives from its right one, and cuts the tensor into
chunks the way gloo's ring all-reduce does (:func:`ring_chunk_sizes`), so every element is summed in the
same order as ``dist.all_reduce`` on gloo and the results agree bit for bit, random floats included. The
tree and the naive exchange add the same numbers in other orders, so with floats they agree to rounding
(each of the n-1 additions rounds once); with integer-valued tensors every order is exact.

Only ``torch.distributed`` point-to-point calls move data here (``batch_isend_irecv`` where ranks send and
receive at once, as NCCL needs; ``send``/``recv`` in the tree), called through the module so that
:func:`scalebook.comm.traffic.count_traffic` measures the bytes. Chapter 9's experiments on them (every
library collective on labelled data, the algorithms compared) are in :mod:`scalebook.experiments.collectives`.

Source: Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations"
(ring); Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations in MPICH"
(binomial trees); gloo, ``gloo/allreduce.cc`` (ring direction and chunk layout).
"""

from __future__ import annotations

import math

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


ALL_REDUCES = {"ring": ring_all_reduce, "tree": tree_all_reduce, "naive": naive_all_reduce}


def library_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``dist.all_reduce`` (gloo's or NCCL's), looked up at call time so that ``count_traffic`` sees it."""
    dist.all_reduce(tensor, group=group)
    return tensor
