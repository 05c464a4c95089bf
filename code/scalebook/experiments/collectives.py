"""Chapter 9's experiments on collectives: every library collective run once on labelled data, the
from-scratch all-reduces compared with gloo's, the ring and the double binary tree timed on small messages,
and a rank that fails inside a collective.

Each worker runs on the ranks of :func:`scalebook.comm.launch` and returns plain data for the notebook to
draw. The algorithms themselves are library code, in :mod:`scalebook.comm.collectives`.

Source: PyTorch documentation, "torch.distributed" (collective semantics, ``gather``/``scatter`` roots,
the launcher's environment variables).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from scalebook.comm.collectives import ALL_REDUCES, library_all_reduce
from scalebook.comm.traffic import count_traffic

ENV_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def labelled_tensor(rank: int, n: int, elements: int | None = None) -> torch.Tensor:
    """Rank ``rank``'s demo data: ``10 (rank + 1) + j`` for ``j < elements`` (default ``n``), so the tens
    digit of every value names the rank it came from (for up to 9 ranks and 10 elements)."""
    elements = n if elements is None else elements
    if not 1 <= n <= 9 or not 0 <= rank < n or not 1 <= elements <= 10:
        raise ValueError(f"labels need 1 <= n <= 9 ranks, 0 <= rank < n and 1..10 elements; got {rank}, {n}, "
                         f"{elements}")  # fmt: skip
    return torch.arange(elements, dtype=torch.float32) + 10 * (rank + 1)


def block_owner(value: float, n: int) -> int | None:
    """The rank whose :func:`labelled_tensor` holds ``value``, or None for a sum of several ranks' values."""
    rank = int(value) // 10 - 1
    return rank if 0 <= rank < n and value == int(value) else None


def _values(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None else [float(v) for v in t.reshape(-1)]


def run_every_collective(barrier_delay: float = 0.05) -> dict:
    """Run each library collective once on labelled data; return this rank's before/after values.

    Returns ``{"env": launcher variables, "backend": ..., "collectives": {name: {"before": [...] or None,
    "after": [...] or None}}, "barrier": {"arrived": t, "left": t}}``. ``None`` means the rank holds no
    such buffer (a non-root's result of reduce or gather, a non-root's input to scatter). Rank ``r`` reaches
    the barrier ``r * barrier_delay`` seconds late; the times are ``time.monotonic()``, one clock for all
    local processes.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    x = labelled_tensor(rank, n)
    out: dict[str, dict] = {}

    def record(name, before, after):
        out[name] = {"before": _values(before), "after": _values(after)}

    t = x.clone()
    dist.broadcast(t, src=0)
    record("broadcast", x, t)

    t = x.clone()
    dist.reduce(t, dst=0)  # only the destination's buffer is defined afterwards
    record("reduce", x, t if rank == 0 else None)

    t = x.clone()
    dist.all_reduce(t)
    record("all_reduce", x, t)

    pieces = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
    dist.gather(x, gather_list=pieces, dst=0)
    record("gather", x, torch.cat(pieces) if rank == 0 else None)

    pieces = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(pieces, x)
    record("all_gather", x, torch.cat(pieces))

    blocks = [labelled_tensor(r, n) for r in range(n)] if rank == 0 else None  # block r is meant for rank r
    t = torch.empty_like(x)
    dist.scatter(t, scatter_list=blocks, src=0)
    record("scatter", torch.cat(blocks) if rank == 0 else None, t)

    t = torch.empty(1)
    dist.reduce_scatter(t, list(x.chunk(n)))
    record("reduce_scatter", x, t)

    t = torch.empty_like(x)
    dist.all_to_all_single(t, x)
    record("all_to_all", x, t)

    t = x.clone()
    if rank == 0 and n > 1:
        dist.send(t, dst=1)
    elif rank == 1:
        dist.recv(t, src=0)
    record("send_recv", x, t)

    time.sleep(rank * barrier_delay)
    arrived = time.monotonic()
    dist.barrier()
    left = time.monotonic()

    return {
        "env": {name: os.environ.get(name) for name in ENV_VARIABLES},
        "backend": dist.get_backend(),
        "collectives": out,
        "barrier": {"arrived": arrived, "left": left},
    }


def compare_all_reduces(numel: int, *, seed: int = 0) -> dict:
    """All-reduce random and integer-valued tensors with gloo and with each from-scratch algorithm, counting
    the bytes each sends.

    Rank ``r``'s inputs are drawn from ``seed + r`` (:func:`seeded_inputs`), so any process can rebuild every
    rank's input. Returns ``{kind: {"input": tensor, "output": {name: tensor}, "bytes_sent": {name: bytes},
    "messages": {name: sends}}}`` for kinds ``float`` (standard normal) and ``integer`` (whole numbers in
    [-1000, 1000)), names ``gloo``, ``ring``, ``tree``, ``double_tree``, ``naive``. The from-scratch
    algorithms' bytes and messages are measured sends; gloo's bytes are what
    :func:`scalebook.comm.traffic.count_traffic` assumes for a library all-reduce (the ring's volume), and its
    messages are not visible (None).
    """
    rank = dist.get_rank()
    runs = {"gloo": library_all_reduce, **ALL_REDUCES}
    report = {}
    for kind in ("float", "integer"):
        x = _seeded_input(numel, seed + rank, kind == "integer")
        result = report[kind] = {"input": x, "output": {}, "bytes_sent": {}, "messages": {}}
        for name, all_reduce in runs.items():
            t = x.clone()
            with count_traffic() as traffic:
                all_reduce(t)
            result["output"][name] = t
            result["bytes_sent"][name] = traffic.bytes_sent()
            result["messages"][name] = None if name == "gloo" else traffic.count("send", "isend")
    return report


def time_small_all_reduces(
    message_bytes: tuple[int, ...] = (4, 4096),
    *,
    rounds: int = 30,
    algorithms: tuple[str, ...] = ("ring", "double_tree"),
) -> dict:
    """Best-of-``rounds`` seconds of each from-scratch all-reduce on float32 messages of ``message_bytes``.

    The comparison is interleaved: every round times each algorithm once per size, in an order that alternates
    from round to round, so that a burst of load on the machine hits all of them alike; each call starts after
    a barrier and counts as long as its slowest rank took. Returns ``{"seconds": {algorithm: [best per size]},
    "load": (1-minute load average before, after)}`` (the load read on each rank; equal on one machine).
    """
    unknown = [name for name in algorithms if name not in ALL_REDUCES]
    if unknown or rounds < 1 or any(m < 4 or m % 4 for m in message_bytes):
        raise ValueError(f"need algorithms from {sorted(ALL_REDUCES)}, rounds >= 1 and sizes that are positive "
                         f"multiples of 4 bytes; got {list(algorithms)}, {rounds}, {list(message_bytes)}")  # fmt: skip
    load_before = os.getloadavg()[0]
    elapsed = torch.zeros(len(algorithms), len(message_bytes), rounds, dtype=torch.float64)
    for i in range(rounds):
        order = list(enumerate(algorithms))
        for j, size in enumerate(message_bytes):
            for a, name in order if i % 2 == 0 else reversed(order):
                buffer = torch.ones(size // 4)
                dist.barrier()
                start = time.perf_counter()
                ALL_REDUCES[name](buffer)
                elapsed[a, j, i] = time.perf_counter() - start
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # each call lasted as long as its slowest rank
    best = elapsed.min(dim=2).values
    return {"seconds": {name: best[a].tolist() for a, name in enumerate(algorithms)},
            "load": (load_before, os.getloadavg()[0])}  # fmt: skip


def compare_and_time_all_reduces(numel: int, *, seed: int = 0, message_bytes=(4, 4096), rounds: int = 30) -> dict:
    """:func:`compare_all_reduces`, then :func:`time_small_all_reduces`, in one launch (one start-up for both):
    ``{"compare": ..., "timing": ...}``."""
    return {"compare": compare_all_reduces(numel, seed=seed),
            "timing": time_small_all_reduces(tuple(message_bytes), rounds=rounds)}  # fmt: skip


def _seeded_input(numel: int, seed: int, integers: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if integers:
        return torch.randint(-1000, 1000, (numel,), generator=generator).float()
    return torch.randn(numel, generator=generator)


def seeded_inputs(numel: int, n: int, *, seed: int = 0, integers: bool = False) -> list[torch.Tensor]:
    """The inputs :func:`compare_all_reduces` gives ranks ``0..n-1`` (its ``integer`` kind when
    ``integers``), rebuilt outside the launch."""
    return [_seeded_input(numel, seed + r, integers) for r in range(n)]


def all_reduce_with_a_failing_rank(failing_rank: int = 1) -> float:
    """Every rank joins an all-reduce except ``failing_rank``, which raises first: the launch must fail
    with that rank's traceback instead of hanging."""
    if dist.get_rank() == failing_rank:
        raise RuntimeError(f"rank {failing_rank} cannot find its data shard (raised on purpose)")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
