"""Chapter 9's network benchmark, run the way clusters run theirs: an nccl-tests sweep of message sizes over
one collective, reported as time, algorithm bandwidth and bus bandwidth, here over gloo on CPU ranks.

For each group size ``k`` and message size ``M`` (nccl-tests' ``S``: the all-reduced buffer, the gathered
output, the scattered input), :func:`benchmark` calls the collective ``warmup`` times untimed, the first
call on known values whose result it checks (nccl-tests' ``#wrong`` column), then ``iters`` times, each
after a barrier. An iteration's time is the slowest rank's, since the collective is done only when every
rank is; the reported time is the median over iterations. nccl-tests instead times its iterations back to
back and averages them (over iterations, then ranks); on a shared 2-core machine the median of
barrier-separated calls is less disturbed by the other processes. The bandwidths are
:func:`scalebook.accounting.comm.algbw` and :func:`scalebook.accounting.comm.busbw` of that time.

For all-reduce, reduce-scatter and all-gather, each rank also runs the package's from-scratch ring
(:mod:`scalebook.comm.collectives`) once per size under :func:`scalebook.comm.traffic.count_traffic`,
which counts its bytes at the real sends: the share of ``M`` that each rank puts on the wire, the
quantity that busbw's factor stands for. (A library collective's internal messages are hidden, so its
bytes could only be assumed.)

Source: NVIDIA nccl-tests, ``doc/PERFORMANCE.md`` and ``src/common.cu`` (warm-up and timed iterations, the
data check); PyTorch documentation, "Distributed communication package - torch.distributed".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from scalebook.accounting.comm import algbw, busbw
from scalebook.comm.collectives import ring_all_gather, ring_all_reduce, ring_chunk_sizes, ring_reduce_scatter
from scalebook.comm.traffic import count_traffic

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
_SPLIT = ("all_gather", "reduce_scatter", "all_to_all")  # M is cut into k equal blocks


@dataclass(frozen=True)
class BusbwRow:
    """One line of the benchmark, as nccl-tests prints it (bandwidths in bytes per second)."""

    op: str
    ranks: int
    message_bytes: int
    seconds: float  # median over iterations of the slowest rank's time
    algbw: float
    busbw: float
    wrong: int  # elements of this rank's result that differed from the expected values
    wire_bytes: float | None  # bytes this rank sent in the from-scratch ring, counted; None: no ring here


def _case(op: str, numel: int, k: int, group) -> tuple[Callable[[], object], Callable[[], int]]:
    """``(run, wrong)``: ``run()`` calls ``op`` once on this rank's buffers (rank ``r`` contributes the value
    ``r + 1``); ``wrong()``, after the first call, counts the result's elements that are not as expected."""
    me = dist.get_rank(group)
    mine, block = float(me + 1), numel // k
    total = k * (k + 1) / 2
    by_source = torch.arange(1, k + 1, dtype=torch.float32).repeat_interleave(block)  # block j from rank j
    if op == "all_reduce":
        buffer = torch.full((numel,), mine)
        return lambda: dist.all_reduce(buffer, group=group), lambda: int((buffer != total).sum())
    if op == "all_gather":
        piece, gathered = torch.full((block,), mine), [torch.empty(block) for _ in range(k)]
        return (lambda: dist.all_gather(gathered, piece, group=group),
                lambda: int((torch.cat(gathered) != by_source).sum()))  # fmt: skip
    if op == "reduce_scatter":
        pieces, summed = [torch.full((block,), mine) for _ in range(k)], torch.empty(block)
        return lambda: dist.reduce_scatter(summed, pieces, group=group), lambda: int((summed != total).sum())
    if op == "broadcast":
        buffer = torch.full((numel,), mine)
        return lambda: dist.broadcast(buffer, group_src=0, group=group), lambda: int((buffer != 1).sum())
    sent, received = torch.full((numel,), mine), torch.empty(numel)  # all-to-all
    return (lambda: dist.all_to_all_single(received, sent, group=group),
            lambda: int((received != by_source).sum()))  # fmt: skip


def _ring_wire_bytes(op: str, numel: int, k: int, group) -> float | None:
    """Bytes this rank sends in the from-scratch ring version of ``op``, counted at the sends."""
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        return None
    with count_traffic() as traffic:
        if op == "all_reduce":
            ring_all_reduce(torch.ones(numel), group)
        elif op == "reduce_scatter":
            ring_reduce_scatter(torch.ones(numel), group)
        else:
            ring_all_gather(torch.ones(ring_chunk_sizes(numel, k)[dist.get_rank(group)]), numel, group)
    return traffic.bytes_sent()


def _check_args(message_bytes, group_sizes, op, warmup, iters) -> None:
    problems = []
    if op not in OPS:
        problems.append(f"op must be one of {OPS}, got {op!r}")
    if not group_sizes or any(isinstance(k, bool) or not isinstance(k, int) or k < 2 for k in group_sizes):
        problems.append(f"group sizes must be integers >= 2, got {list(group_sizes)}")
    else:
        unit = 4 * (max(group_sizes) if op in _SPLIT else 1)  # float32, cut into k equal blocks where needed
        if not message_bytes or any(not isinstance(m, int) or m < unit or m % unit for m in message_bytes):
            problems.append(f"message sizes must be positive multiples of {unit} bytes for {op} on "
                            f"{max(group_sizes)} ranks (float32 blocks), got {list(message_bytes)}")  # fmt: skip
    if not (isinstance(warmup, int) and warmup >= 1 and isinstance(iters, int) and iters >= 1):
        problems.append(f"warmup and iters must be integers >= 1 (the first warm-up call is checked), got "
                        f"{warmup!r} and {iters!r}")  # fmt: skip
    if problems:
        raise ValueError("; ".join(problems))


def benchmark(
    message_bytes: Sequence[int],
    group_sizes: Sequence[int] = (2,),
    *,
    op: str = "all_reduce",
    warmup: int = 1,
    iters: int = 5,
) -> list[BusbwRow]:
    """Worker: nccl-tests' sweep of ``op`` over ``message_bytes`` on the first ``k`` ranks, for each ``k``.

    Every rank returns the rows of the groups it belongs to, in order of ``group_sizes`` then size; the
    times and bandwidths are the same on every rank of a group, ``wrong`` and ``wire_bytes`` its own.
    """
    _check_args(message_bytes, group_sizes, op, warmup, iters)  # before any torch.distributed call
    if max(group_sizes) > dist.get_world_size():
        raise ValueError(f"group sizes must not exceed the world size {dist.get_world_size()}, got {list(group_sizes)}")
    groups = {k: dist.new_group(list(range(k))) for k in group_sizes}  # every rank must create every group
    rows = []
    for k, group in groups.items():
        if dist.get_rank() >= k:
            continue
        for size in message_bytes:
            run, wrong = _case(op, size // 4, k, group)
            run()
            errors = wrong()
            for _ in range(warmup - 1):
                run()
            elapsed = torch.empty(iters, dtype=torch.float64)
            for i in range(iters):
                dist.barrier(group=group)
                start = time.perf_counter()
                run()
                elapsed[i] = time.perf_counter() - start
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            seconds = statistics.median(elapsed.tolist())
            rows.append(BusbwRow(op, k, size, seconds, algbw(size, seconds), busbw(op, size, seconds, k), errors,
                                 _ring_wire_bytes(op, size // 4, k, group)))  # fmt: skip
    dist.barrier()
    return rows
