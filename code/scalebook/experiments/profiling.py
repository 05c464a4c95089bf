"""Chapter 16's profiling: ``torch.profiler`` on every rank of a data-parallel and a pipeline step, and what
the Chrome traces say about communication and compute.

**Recording.** :func:`profile_steps` runs on the ranks of a launch: a step of the book's ``OverlappedDDP``
(bucketed all-reduces started during backward) and a step of the book's 1F1B pipeline, each after an
unprofiled warm-up step, each under ``torch.profiler.profile`` and written by ``export_chrome_trace`` to
``<trace_dir>/<setup>_rank<r>.json``, a file that chrome://tracing or https://ui.perfetto.dev opens.

**Reading.** :func:`read_chrome_trace` sorts a trace's complete events (``"ph": "X"``) into three kinds,
by their names alone, as a reader of a trace would:

* *communication*: ``gloo:*`` (gloo runs a collective on a worker thread of its own and records it there,
  from when the thread starts it until it completes, waiting for the peers included; a point-to-point
  send or receive is recorded on the thread that waits for it), ``nccl:*``, ``c10d::*`` (the call that
  hands a collective to the backend) and ``record_param_comms``;
* *backward*: the autograd engine's events (``autograd::engine::evaluate_function: ...``, ``*Backward0``,
  ``AccumulateGrad``);
* *compute*: every other operator (``cpu_op``), unless it runs inside a communication event of its thread
  (packing a message is part of sending it).

On a GPU trace (one with ``kernel`` events) the kernels carry the time: NCCL kernels are the
communication, all other kernels the compute, and the CPU's events only launch them (this branch is
checked on synthetic events only: no GPU was lent to this book's sessions).

:func:`communication_overlap` then intersects one rank's communication intervals with its compute
intervals: the time communication ran while the rank also computed is hidden, the rest is exposed. The
overlap is read from the trace, not from the book's own timers.

Source: PyTorch documentation, "torch.profiler" (``export_chrome_trace``) and "PyTorch Profiler" recipe;
Chrome "Trace Event Format" (complete events: ``ph`` X, ``ts`` and ``dur`` in microseconds).
"""

from __future__ import annotations

import bisect
import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from scalebook.data import corpus_tokens, get_batch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.ddp import OverlappedDDP
from scalebook.parallel.pipeline import build_schedule, p2p_plan, pipeline_stage, run_schedule, sync_tied_embedding

KINDS = ("compute", "backward", "communication")
COMMUNICATION_PREFIXES = ("gloo:", "nccl:", "c10d::", "record_param_comms")


@dataclass(frozen=True)
class TraceEvent:
    """One complete event of a trace: its name, kind (one of ``KINDS``), thread, start and end in seconds."""

    name: str
    kind: str
    thread: int
    start: float
    end: float


@dataclass(frozen=True)
class RankTrace:
    """The classified events of one rank's trace."""

    rank: int
    world_size: int
    events: list[TraceEvent]

    def intervals(self, *kinds: str) -> list[tuple[float, float]]:
        """The union of the events of ``kinds`` (all when none is given), as sorted disjoint intervals."""
        return merge_intervals([(e.start, e.end) for e in self.events if not kinds or e.kind in kinds])

    def busy(self, *kinds: str) -> float:
        """Seconds covered by events of ``kinds`` (each instant counted once)."""
        return sum(end - start for start, end in self.intervals(*kinds))

    def named(self, prefix: str) -> list[TraceEvent]:
        """The events whose name starts with ``prefix``."""
        return [e for e in self.events if e.name.startswith(prefix)]

    def threads(self, *kinds: str) -> set[int]:
        return {e.thread for e in self.events if not kinds or e.kind in kinds}


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly what ``intervals`` cover."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of the intersection of the unions of ``a`` and ``b``."""
    a, b = merge_intervals(a), merge_intervals(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):  # one sweep over both sorted lists
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kind(event: dict, device_trace: bool) -> str | None:
    name, category = event.get("name", ""), event.get("cat", "")
    if device_trace:  # the kernels carry the time; the CPU only launches them
        if category != "kernel":
            return None
        return "communication" if "nccl" in name.lower() else "compute"
    if name.startswith(COMMUNICATION_PREFIXES):
        return "communication"
    if category != "cpu_op":
        return None  # annotations such as "DistributedDataParallel.forward" or "ProfilerStep#1" only label
    if name.startswith("autograd::") or "Backward" in name or "AccumulateGrad" in name:
        return "backward"
    return "compute"


def classify_events(raw_events: list[dict]) -> list[TraceEvent]:
    """The complete events of a Chrome trace as :class:`TraceEvent`, sorted by start (see the module docstring).

    A compute or backward event that lies inside a communication event of its own thread is part of that
    communication and left out.
    """
    complete = [e for e in raw_events if e.get("ph") == "X" and "dur" in e]
    device_trace = any(e.get("cat") == "kernel" for e in complete)
    events = []
    for e in complete:
        kind = _kind(e, device_trace)
        if kind is not None:
            start = float(e["ts"]) * 1e-6
            events.append(TraceEvent(e["name"], kind, int(e.get("tid", 0)), start, start + float(e["dur"]) * 1e-6))
    comm_by_thread: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.kind == "communication":
            comm_by_thread.setdefault(e.thread, []).append((e.start, e.end))
    comm_by_thread = {t: merge_intervals(iv) for t, iv in comm_by_thread.items()}

    def inside_communication(e: TraceEvent) -> bool:
        spans = comm_by_thread.get(e.thread, [])
        i = bisect.bisect_right(spans, (e.start, float("inf"))) - 1
        return i >= 0 and spans[i][0] <= e.start and e.end <= spans[i][1]

    kept = [e for e in events if e.kind == "communication" or not inside_communication(e)]
    return sorted(kept, key=lambda e: (e.start, -e.end))


def read_chrome_trace(path: str | os.PathLike) -> RankTrace:
    """Read one rank's Chrome trace (as ``torch.profiler``'s ``export_chrome_trace`` writes it)."""
    trace = json.loads(Path(path).read_text())
    info = trace.get("distributedInfo", {})
    return RankTrace(int(info.get("rank", 0)), int(info.get("world_size", 1)), classify_events(trace["traceEvents"]))


@dataclass(frozen=True)
class Overlap:
    """One rank's communication against its compute, in seconds, read from its trace."""

    communication: float  # covered by communication events
    compute: float  # covered by compute or backward events
    overlapped: float  # covered by both: communication hidden behind compute
    span: float  # from the first event to the last

    @property
    def exposed(self) -> float:
        """Communication while the rank did not compute."""
        return self.communication - self.overlapped

    @property
    def hidden_share(self) -> float:
        """The share of the communication time that overlapped compute (0 without communication)."""
        return self.overlapped / self.communication if self.communication else 0.0


def communication_overlap(trace: RankTrace) -> Overlap:
    """How much of ``trace``'s communication ran while the rank computed (on any of its threads)."""
    if not trace.events:
        raise ValueError("this trace holds no events: profile a step with torch.profiler first")
    communication, compute = trace.intervals("communication"), trace.intervals("compute", "backward")
    return Overlap(
        communication=sum(e - s for s, e in communication),
        compute=sum(e - s for s, e in compute),
        overlapped=intersection_length(communication, compute),
        span=max(e.end for e in trace.events) - min(e.start for e in trace.events),
    )


# ----- recording, on the ranks of a launch -----------------------------------------------------------


def profiled_step(step, path: str | os.PathLike) -> None:
    """Run ``step()`` once untimed (first messages and allocations cost extra, once), then once under the
    profiler, and write that step's Chrome trace to ``path``."""
    # kineto, the profiler's engine, prints "profiler_start"/"profiler_stop" to stderr unless told not to.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    step()
    dist.barrier()  # a common start, so that the ranks' timelines line up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    prof.export_chrome_trace(str(path))


def profile_steps(
    trace_dir: str,
    *,
    size: str = "tiny",
    micro_batch: int = 4,
    seq_len: int = 64,
    bucket_cap_mb: float = 0.5,
    microbatches: int = 4,
    seed: int = 0,
) -> dict:
    """Worker: profile one data-parallel step and one 1F1B pipeline step on this rank.

    Writes ``ddp_rank<r>.json`` and ``pipeline_rank<r>.json`` to ``trace_dir`` and returns their paths with
    what the traces should hold: the data-parallel step's number of buckets (one all-reduce each) and the
    pipeline's sends and receives on this rank (:func:`~scalebook.parallel.pipeline.p2p_plan`).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = GPT(GPTConfig.named(size))
    generator = torch.Generator().manual_seed(seed)
    x, y = get_batch(corpus_tokens(), micro_batch, seq_len, generator, rank=rank, world_size=world)
    out = {}

    ddp = OverlappedDDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb, forward_sync_buffers=False)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_step() -> None:
        ddp(x, y)[1].backward()  # each bucket's all-reduce starts as soon as its gradients are ready, and is done
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()

    out["ddp"] = {"path": str(Path(trace_dir) / f"ddp_rank{rank}.json"), "all_reduces": len(ddp.buckets)}
    profiled_step(ddp_step, out["ddp"]["path"])

    schedule = build_schedule("1f1b", world, microbatches)
    stage = pipeline_stage(copy.deepcopy(model), rank, world)
    tied_group = dist.new_group([0, world - 1])  # every rank takes part in creating a group
    pipe_optimizer = torch.optim.SGD(stage.parameters(), lr=0.01)
    # Every stage reads the same whole batch (the first its inputs, the last its targets): one seed on all ranks.
    batch_x, batch_y = get_batch(corpus_tokens(), micro_batch * world, seq_len, torch.Generator().manual_seed(seed))

    def pipeline_step() -> None:
        run_schedule(schedule, stage, batch_x, batch_y)
        sync_tied_embedding(stage, tied_group)
        pipe_optimizer.step()
        pipe_optimizer.zero_grad()

    transfers = [t for step in p2p_plan(schedule, rank) if isinstance(step, tuple) for t in step]
    out["pipeline"] = {
        "path": str(Path(trace_dir) / f"pipeline_rank{rank}.json"),
        "sends": sum(t.send for t in transfers),
        "receives": sum(not t.send for t in transfers),
    }
    profiled_step(pipeline_step, out["pipeline"]["path"])
    return out


def timeline_lanes(traces: list[RankTrace]) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """Each rank's intervals by kind, as :func:`scalebook.plots.trace_timeline` draws them."""
    return {trace.rank: {kind: trace.intervals(kind) for kind in KINDS} for trace in traces}
