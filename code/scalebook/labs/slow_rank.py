"""Lab 7, the slow rank: one data-parallel rank computes more slowly than its peers, and every rank runs at its pace.

A synchronous step ends in a collective (here the gradient all-reduce), which completes only when the last
rank has joined it. One slow rank, a **straggler**, therefore makes the step slow on every rank, and a step
time measured on any rank looks the same everywhere: it cannot say which rank is slow. Two signals can:

* **Per-rank split of the step** (:func:`find_straggler`). Each rank times its compute (up to the
  collective) and its wait (inside it) and the ranks all-gather the two numbers every step. The straggler
  has the longest compute and the shortest wait: its peers wait in the all-reduce for it.
* **The flight recorder's entry times** (:func:`straggler_from_trace`). The logs of
  :func:`scalebook.labs.hang.record_collectives` stamp each collective with the time the rank entered it;
  the straggler is the rank that enters the gradient all-reduces last.

:func:`slow_rank_lab` is the worker: the book's ``BucketedDDP`` training the GPT, with a BROKEN variant in
which one rank sleeps ``delay`` seconds in every step after its backward (it stands for a GPU held at a
lower clock, a slow data loader or a noisy neighbour on its host). :func:`diagnose_slow_rank` launches it,
reads the logs and reports what both signals say.

Source: NVIDIA Resiliency Extension, "Straggler Detection" (per-rank performance scores relative to the
best rank); Lin et al. 2025, "Understanding Stragglers in Large Model Training Using What-if Analysis"
(OSDI); PyTorch documentation, "Flight Recorder for Debugging Stuck Jobs" (``time_created_ns``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from scalebook import compat as _compat  # noqa: F401  (all_gather_single on a PyTorch before 2.13)
from scalebook.comm import launch
from scalebook.data import corpus_tokens, get_batch
from scalebook.labs.checks import check_variants
from scalebook.labs.hang import read_trace, record_collectives
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.ddp import BucketedDDP

SLOW_RANK_VARIANTS = ("broken: one rank sleeps in every step", "fixed: every rank does the same work")


def _gather_times(*seconds: float) -> list[list[float]]:
    """Every rank's ``seconds``, in rank order (a collective: every rank calls it, every step)."""
    mine = torch.tensor(seconds, dtype=torch.float64)
    out = torch.empty(dist.get_world_size() * len(seconds), dtype=torch.float64)
    dist.all_gather_single(out, mine)
    return out.view(dist.get_world_size(), len(seconds)).tolist()


def slow_rank_lab(
    trace_dir: str,
    variants=SLOW_RANK_VARIANTS,
    *,
    slow_rank: int = 1,
    delay: float = 0.5,
    steps: int = 8,
    micro_batch: int = 1,
    seq_len: int = 16,
    n_layer: int = 1,
    seed: int = 0,
) -> dict:
    """Worker: ``steps`` data-parallel steps per variant, each rank's compute and wait timed and all-gathered.

    In the BROKEN variant rank ``slow_rank`` sleeps ``delay`` seconds after its backward in every step.
    The flight recorder logs each variant's collectives to ``trace_dir/<variant number>/rank<r>.trace``.
    Returns ``{variant: {"compute": [[s per rank] per step], "wait": ..., "step": ...}}``, the same on every
    rank: compute is forward and backward (and the sleep), wait is the gradient all-reduce, step the whole
    step with the optimizer.
    """
    variants = check_variants(variants, SLOW_RANK_VARIANTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= slow_rank < world:
        raise ValueError(f"slow_rank must name one of the {world} ranks, got {slow_rank}")
    # Little compute, so that little of it is the noise of a busy machine: a rank that waits for a core
    # mid-computation looks slow too, and at a load of 30 on 2 cores that can cost a rank tens of milliseconds.
    config = GPTConfig.named("tiny", n_layer=n_layer)
    out = {}
    for number, variant in enumerate(variants):
        torch.manual_seed(seed)
        # No buffer broadcast in forward (the causal masks never change): it would be a collective, and a wait,
        # inside what is timed as compute.
        model = BucketedDDP(GPT(config), forward_sync_buffers=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(seed)
        directory = Path(trace_dir) / str(number)
        directory.mkdir(parents=True, exist_ok=True)
        times = []
        with record_collectives(directory):
            for _ in range(steps):
                x, y = get_batch(corpus_tokens(), micro_batch, seq_len, generator, rank=rank, world_size=world)
                start = time.perf_counter()
                with model.no_sync():  # keep the all-reduce out of backward, to time it on its own
                    model(x, y)[1].backward()
                if variant.startswith("broken") and rank == slow_rank:
                    time.sleep(delay)  # THE BUG: this rank's work takes longer than its peers'
                computed = time.perf_counter()
                model.sync_gradients()  # the all-reduce: nobody leaves it before the last rank has entered it
                synced = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad()
                times.append(_gather_times(computed - start, synced - computed, time.perf_counter() - start))
        out[variant] = {
            key: [[rank_times[i] for rank_times in step] for step in times]
            for i, key in enumerate(("compute", "wait", "step"))
        }
    return out


def find_straggler(seconds: list[list[float]], *, min_excess: float = 0.05, ratio: float = 1.5) -> int | None:
    """The rank whose median over the steps of ``seconds[step][rank]`` (compute time, or lateness) exceeds the
    median of the other ranks' medians by ``ratio`` times and by at least ``min_excess`` seconds; None if
    no rank does. Medians, so that one step disturbed by something else does not name a rank."""
    if not seconds or len(seconds[0]) < 2:
        raise ValueError("need at least one step of at least 2 ranks: seconds[step][rank]")
    medians = [statistics.median(step[r] for step in seconds) for r in range(len(seconds[0]))]
    slowest = max(range(len(medians)), key=medians.__getitem__)
    others = statistics.median(m for r, m in enumerate(medians) if r != slowest)
    return slowest if medians[slowest] >= ratio * others and medians[slowest] - others >= min_excess else None


def entry_lateness(directory: str | Path, world_size: int, op: str = "all_reduce") -> list[list[float]]:
    """For each ``op`` collective in the ranks' flight-recorder logs, each rank's entry time minus the
    earliest rank's: ``[[seconds per rank] per collective]``. The rank at the maximum entered last."""
    traces = [[c for c in read_trace(Path(directory) / f"rank{r}.trace") if c.op == op] for r in range(world_size)]
    if len({len(t) for t in traces}) != 1:
        raise ValueError(f"the ranks' logs hold different numbers of {op} calls: {[len(t) for t in traces]}")
    lateness = []
    for calls in zip(*traces, strict=True):
        if any(c.entered is None for c in calls):
            raise ValueError("these logs hold no entry times: record them with labs.record_collectives")
        first = min(c.entered for c in calls)
        lateness.append([c.entered - first for c in calls])
    return lateness


def straggler_from_trace(directory: str | Path, world_size: int, *, op: str = "all_reduce",
                         min_excess: float = 0.05) -> int | None:  # fmt: skip
    """The rank that enters the ``op`` collectives last, by a median margin of at least ``min_excess``
    seconds over the others (:func:`find_straggler` of :func:`entry_lateness`); None if no rank does."""
    return find_straggler(entry_lateness(directory, world_size, op), min_excess=min_excess, ratio=1.0)


@dataclass(frozen=True)
class SlowRankReport:
    """What the slow-rank lab shows for one variant."""

    variant: str
    compute: list[list[float]]  # seconds [step][rank]: forward, backward (and the injected sleep)
    wait: list[list[float]]  # seconds [step][rank] in the gradient all-reduce
    step: list[list[float]]  # seconds [step][rank], the whole step
    lateness: list[list[float]]  # seconds [all-reduce][rank] after the first rank entered it (flight recorder)
    from_times: int | None  # the straggler named by the per-rank step times
    from_trace: int | None  # the straggler named by the flight recorder

    def last_to_enter(self) -> list[int]:
        """How many of the all-reduces each rank entered last."""
        counts = [0] * len(self.lateness[0])
        for late in self.lateness:
            counts[max(range(len(late)), key=late.__getitem__)] += 1
        return counts

    def medians(self, what: str) -> list[float]:
        """Each rank's median over the steps of ``what``: "compute", "wait", "step" or "lateness"."""
        if what not in ("compute", "wait", "step", "lateness"):
            raise ValueError(f"what must be 'compute', 'wait', 'step' or 'lateness', got {what!r}")
        seconds = getattr(self, what)
        return [statistics.median(row[r] for row in seconds) for r in range(len(seconds[0]))]


def diagnose_slow_rank(
    variants=SLOW_RANK_VARIANTS, *, world_size: int = 3, slow_rank: int = 1, delay: float = 0.5, steps: int = 8,
    min_excess: float = 0.25, timeout: float = 120.0,
) -> list[SlowRankReport]:  # fmt: skip
    """Run :func:`slow_rank_lab` on ``world_size`` ranks (one launch for all variants) and name the straggler of
    each variant from the step times and from the flight recorder (``min_excess`` seconds: the smallest
    slowness that counts; keep it well under ``delay`` and above the noise of the machine, which on a
    loaded 2-core machine reaches tens of milliseconds)."""
    variants = check_variants(variants, SLOW_RANK_VARIANTS)
    if world_size < 2:
        raise ValueError(f"a straggler needs peers: world_size must be at least 2, got {world_size}")
    if not 0 <= slow_rank < world_size:
        raise ValueError(f"slow_rank must be one of the {world_size} ranks, got {slow_rank}")
    with tempfile.TemporaryDirectory(prefix="scalebook-slow-rank-") as trace_dir:
        runs = launch(slow_rank_lab, world_size, trace_dir, variants, slow_rank=slow_rank, delay=delay, steps=steps,
                      timeout=timeout)[0]  # fmt: skip
        reports = []
        for number, variant in enumerate(variants):
            run, directory = runs[variant], Path(trace_dir) / str(number)
            reports.append(
                SlowRankReport(
                    variant=variant,
                    compute=run["compute"],
                    wait=run["wait"],
                    step=run["step"],
                    lateness=entry_lateness(directory, world_size),
                    from_times=find_straggler(run["compute"], min_excess=min_excess),
                    from_trace=straggler_from_trace(directory, world_size, min_excess=min_excess),
                )
            )
    return reports
