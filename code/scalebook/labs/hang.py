"""Lab 1, the hang: ranks issue collectives in different orders, and three ways to find out.

The BROKEN variant of :func:`sync_and_check_stop` has rank 0 check the stop flag before the gradient
all-reduce and its peers after it. gloo waits for the process-group timeout; ``TORCH_DISTRIBUTED_DEBUG=
DETAIL`` compares each collective's fingerprint (operation, shapes) across ranks before running it and
names the mismatch at once; :func:`record_collectives` is a flight recorder whose per-rank logs
:func:`first_mismatch` compares after the fact. :func:`diagnose_hang` runs it all and reports.

Each line of a log is one collective as the rank entered it: ``op message_bytes group_size time``, the
time in seconds of ``time.time()`` (lab 7, :mod:`scalebook.labs.slow_rank`, compares them across ranks).
:func:`read_trace` parses a log.

Source: PyTorch documentation, "torch.distributed: Debugging torch.distributed applications"
(``TORCH_DISTRIBUTED_DEBUG``, collective fingerprints, the flight recorder).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from scalebook.comm import count_traffic, launch
from scalebook.comm.launch import LaunchError
from scalebook.labs.checks import check_variants

HANG_VARIANTS = ("broken: rank 0 checks the stop flag first", "fixed: same order on every rank")


class _TraceFile(list):
    """The call list of a ``count_traffic`` block that also writes each call to a file as it is issued,
    with the time the rank entered it, so the record survives a rank that is killed while blocked in the call."""

    def __init__(self, path: Path):
        super().__init__()
        self.file = path.open("w", buffering=1)  # line-buffered: every call reaches the disk at once

    def append(self, call) -> None:
        super().append(call)
        # The wall clock, as NCCL's flight recorder (time_created_ns): ranks on one machine share it; across
        # machines it is as close as their clock synchronisation (NTP: about a millisecond).
        self.file.write(f"{call.op} {call.message_bytes} {call.group_size} {time.time():.6f}\n")


@dataclass(frozen=True)
class TracedCall:
    """One line of a flight-recorder log: a collective as this rank entered it."""

    op: str
    message_bytes: int
    group_size: int
    entered: float | None  # time.time() seconds; None in a log written without times


def read_trace(path: str | os.PathLike) -> list[TracedCall]:
    """The calls of one rank's flight-recorder log, in the order the rank issued them (none if no file)."""
    path = Path(path)
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        op, message, group, *entered = line.split()
        calls.append(TracedCall(op, int(message), int(group), float(entered[0]) if entered else None))
    return calls


@contextlib.contextmanager
def record_collectives(directory: str | os.PathLike) -> Iterator[None]:
    """Flight recorder: log every collective this rank issues to ``directory/rank<r>.trace`` as it starts."""
    trace = _TraceFile(Path(directory) / f"rank{dist.get_rank()}.trace")
    try:
        with count_traffic() as traffic:
            traffic.calls = trace
            yield
    finally:
        trace.file.close()


def first_mismatch(directory: str | os.PathLike, world_size: int) -> str | None:
    """Compare the ranks' flight-recorder logs; describe the first call where they differ (None: all agree)."""
    # What must match is the call (operation, size, group), not the moment each rank entered it.
    traces = [[(c.op, c.message_bytes, c.group_size) for c in read_trace(Path(directory) / f"rank{rank}.trace")]
              for rank in range(world_size)]  # fmt: skip
    for i in range(max(map(len, traces))):
        calls = [trace[i] if i < len(trace) else None for trace in traces]
        if len(set(calls)) > 1:

            def describe(call):
                return "issued nothing" if call is None else f"{call[0]} of {call[1]:,} bytes"

            return f"collective #{i}: " + ", ".join(f"rank {r} {describe(c)}" for r, c in enumerate(calls))
    return None


def sync_and_check_stop(variant: str, trace_dir: str | None = None, numel: int = 1000) -> float:
    """Worker: one step's gradient all-reduce and rank 0's "should we stop?" broadcast.

    BROKEN variant: rank 0 checks the stop flag before syncing gradients, the others after, so rank 0
    waits in a broadcast while its peers wait in an all-reduce. Returns the gradient sum; raises
    RuntimeError saying how many seconds the failing collective took to fail.
    """
    check_variants([variant], HANG_VARIANTS)
    rank = dist.get_rank()
    grad, stop = torch.full((numel,), float(rank)), torch.zeros(1)
    order = ["stop", "grad"] if variant.startswith("broken") and rank == 0 else ["grad", "stop"]
    recorder = record_collectives(trace_dir) if trace_dir else contextlib.nullcontext()
    start = time.perf_counter()
    try:
        with recorder:
            for what in order:
                if what == "grad":
                    dist.all_reduce(grad)
                else:
                    dist.broadcast(stop, group_src=0)
    except RuntimeError as error:
        raise RuntimeError(f"collective failed after {time.perf_counter() - start:.3f} s: {error}") from error
    return grad.sum().item()


@dataclass(frozen=True)
class HangReport:
    """What the reader sees when the hang lab runs: did it surface, how fast, and what names the cause."""

    variant: str
    debug: str  # TORCH_DISTRIBUTED_DEBUG in the ranks
    surfaced: bool  # the launch raised instead of returning
    seconds_in_rank: float | None  # from the first collective to the error, on the first failing rank
    wall_seconds: float  # the whole launch, including starting the ranks
    first_rank: int | None
    cause: str  # the stable part of the error (no ports, addresses or timings)
    mismatch: str | None  # the flight recorder's verdict


@contextlib.contextmanager
def _environment(**variables: str) -> Iterator[None]:
    """Set environment variables for processes started inside the block (spawned ranks inherit them)."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _cause(message: str) -> str:
    fingerprints = re.findall(
        r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+), "
        r"TensorShape=\[([^\]]*)\]",
        message,
    )
    if fingerprints:
        ranks = dict((int(r), f"{op}{[int(s) for s in shape.split(',') if s.strip()]}")
                     for r, _, op, shape in fingerprints)  # fmt: skip
        return "fingerprint mismatch: " + ", ".join(f"rank {r} runs {ranks[r]}" for r in sorted(ranks))
    if "Timed out" in message or "timed out" in message:
        return "a collective timed out: its peers never joined it"
    if "still running after" in message:
        return "ranks hung and were killed by the launcher"
    return message.strip().splitlines()[-1]


def diagnose_hang(variant: str, *, debug: str = "OFF", timeout: float = 3.0) -> HangReport:
    """Run :func:`sync_and_check_stop` on 2 ranks with a ``timeout``-second process group, with
    ``TORCH_DISTRIBUTED_DEBUG=debug`` (``"OFF"`` or ``"DETAIL"``) and the flight recorder on."""
    check_variants([variant], HANG_VARIANTS)
    if debug not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"debug must be 'OFF', 'INFO' or 'DETAIL' (TORCH_DISTRIBUTED_DEBUG), got {debug!r}")
    with (
        tempfile.TemporaryDirectory(prefix="scalebook-trace-") as trace_dir,
        _environment(TORCH_DISTRIBUTED_DEBUG=debug),
    ):
        start = time.perf_counter()
        try:
            launch(sync_and_check_stop, 2, variant, trace_dir, timeout=timeout)
            surfaced, message = False, ""
        except LaunchError as error:
            surfaced, message = True, str(error)
        wall = time.perf_counter() - start
        mismatch = first_mismatch(trace_dir, 2)
    seconds = re.search(r"collective failed after ([\d.]+) s", message)
    first = re.match(r"rank (\d+) of", message)
    return HangReport(
        variant=variant,
        debug=debug,
        surfaced=surfaced,
        seconds_in_rank=float(seconds.group(1)) if seconds else None,
        wall_seconds=wall,
        first_rank=int(first.group(1)) if first else None,
        cause=_cause(message) if surfaced else "",
        mismatch=mismatch,
    )
