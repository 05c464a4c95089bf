"""Pipeline parallelism for the book's GPT: stages, schedules as explicit action lists, and their runtime.

The model's layers are cut into consecutive **stages**, one per rank (or ``v`` per rank when
interleaving). The first stage also holds the token and position embeddings, because its input is
token ids; the last holds the final LayerNorm, the LM head and the loss, because the loss needs the
targets and the full logits. The GPT ties the head to the token embedding, so the last stage keeps its
own copy of that matrix and, after the backward pass, the first and last ranks all-reduce the two
copies' gradients (as Megatron-LM does), which is exactly the tied matrix's gradient.

A batch is split into M micro-batches. A **schedule** is, for every rank, the ordered list of what it
computes: ``F`` (forward of micro-batch m through stage s) and ``B`` (its backward). It is a pure
function of (P, M, v), so it can be printed, simulated and checked before any process starts:

    gpipe        all M forwards, then all M backwards (Huang et al. 2019)
    1f1b         P - r - 1 warm-up forwards on rank r, then one forward, one backward, ... (PipeDream-Flush)
    interleaved  v model chunks per rank, stage c P + r on rank r; Megatron-LM's warm-up of
                 2 (P - r - 1) + (v - 1) P forwards, then 1F1B over the chunks (Narayanan et al. 2021)

The runtime executes a rank's list in order. Activations go forward and their gradients backward with
``torch.distributed`` point-to-point calls: sends are ``isend`` (never block, so two neighbours that
send to each other at once cannot deadlock), receives are blocking ``recv`` posted when the data is
needed, and every message has its own tag. It records a timestamp for every forward, backward, send and
receive, and counts the activations the autograd graph holds (``saved_tensors_hooks``), so the bubble
and the memory of a schedule are measured, not assumed. An emulation mode pads every forward and
backward to a fixed duration, as a GPU kernel of known length would take, so that a 2-core machine
running 4 ranks still shows the schedule's own timing rather than the ranks' fight over the cores.

Source: Huang et al. 2019, "GPipe"; Narayanan et al. 2019, "PipeDream: Generalized Pipeline
Parallelism for DNN Training"; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Sec. 2.2; PyTorch documentation, "torch.distributed.pipelining".
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scalebook.accounting.pipeline import layout_problems
from scalebook.comm import count_traffic, launch
from scalebook.model import GPT, GPTConfig

# ----- stages --------------------------------------------------------------------------------------


def stage_layers(n_layer: int, n_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """The block indices of each stage: an even split, or the given number of layers per stage."""
    if layers_per_stage is None:
        if n_layer % n_stages:
            raise ValueError(
                f"{n_layer} layers do not split evenly over {n_stages} stages; use a layer count divisible by "
                f"{n_stages} or pass layers_per_stage (e.g. from scalebook.accounting.pipeline.balanced_partition)"
            )
        layers_per_stage = [n_layer // n_stages] * n_stages
    counts = list(layers_per_stage)
    if len(counts) != n_stages or sum(counts) != n_layer or any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(
            f"layers_per_stage must give each of the {n_stages} stages at least one layer and sum to "
            f"n_layer={n_layer}, got {counts}"
        )
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


class GPTStage(nn.Module):
    """Consecutive blocks of a :class:`~scalebook.model.GPT`, plus the embeddings on the first stage and
    the final norm and (untied copy of the) head on the last. Parameter names are the full model's."""

    def __init__(self, model: GPT, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.width = model.config.n_embd  # of the activations that cross a stage boundary
        if first:
            self.wte, self.wpe, self.drop = (copy.deepcopy(m) for m in (model.wte, model.wpe, model.drop))
        self.blocks = nn.ModuleDict({str(i): copy.deepcopy(model.blocks[i]) for i in layers})
        if last:
            self.ln_f = copy.deepcopy(model.ln_f)
            self.lm_head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # x holds token ids
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's mean next-token cross-entropy, computed on the last stage."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


# ----- schedules -----------------------------------------------------------------------------------

KINDS = {"F": "forward", "B": "backward", "I": "backward to the input", "W": "backward to the weights"}


@dataclass(frozen=True)
class Action:
    """One unit of work on a rank: ``kind`` (F, B; I and W for split backwards) of a micro-batch on a stage."""

    kind: str
    microbatch: int
    stage: int


@dataclass(frozen=True)
class Schedule:
    """What each rank computes, in order: ``actions[rank]`` is a tuple of :class:`Action`."""

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        for rank, actions in enumerate(self.actions):
            if any(a.stage == stage for a in actions):
                return rank
        raise ValueError(f"stage {stage} does not appear in schedule {self.name!r}")

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, in order."""
        return sorted({a.stage for a in self.actions[rank]})

    def label(self, action: Action) -> str:
        """``F3`` for micro-batch 3's forward; with several chunks per rank a letter names the chunk (``F3b``)."""
        if self.virtual_stages == 1:
            return f"{action.kind}{action.microbatch}"
        chunk = self.stages_of(self.rank_of(action.stage)).index(action.stage)
        return f"{action.kind}{action.microbatch}{chr(ord('a') + chunk)}"

    def __str__(self) -> str:
        return schedule_table(self)


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The action lists of ``gpipe``, ``1f1b`` or ``interleaved`` for P ranks and M micro-batches."""
    problems = layout_problems(name, pp, microbatches, virtual_stages)
    if problems:
        raise ValueError("; ".join(problems))
    P, M, v = pp, microbatches, virtual_stages
    per_rank = []
    for r in range(P):
        if name == "gpipe":
            actions = [Action("F", m, r) for m in range(M)] + [Action("B", m, r) for m in range(M)]
        elif name == "1f1b":
            warmup = min(P - r - 1, M)
            actions = [Action("F", m, r) for m in range(warmup)]
            for m in range(M - warmup):  # steady state: the next forward, then the oldest backward
                actions += [Action("F", warmup + m, r), Action("B", m, r)]
            actions += [Action("B", m, r) for m in range(M - warmup, M)]
        else:
            actions = _interleaved_actions(P, M, v, r)
        per_rank.append(tuple(actions))
    return Schedule(name, P, M, v, tuple(per_rank))


def _interleaved_actions(P: int, M: int, v: int, r: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: micro-batches go through chunk 0 in groups of P, then chunk 1, ...;
    backwards visit the chunks in reverse. Chunk c of rank r is stage c P + r."""
    total = M * v
    warmup = min(2 * (P - r - 1) + (v - 1) * P, total)

    def chunk(k: int, forward: bool) -> int:
        c = (k % (P * v)) // P
        return c if forward else v - 1 - c

    def microbatch(k: int) -> int:  # the k-th pass over a chunk serves micro-batch (k // (P v)) P + k % P
        return (k // (P * v)) * P + k % P

    forwards = [Action("F", microbatch(k), chunk(k, True) * P + r) for k in range(total)]
    backwards = [Action("B", microbatch(k), chunk(k, False) * P + r) for k in range(total)]
    actions = forwards[:warmup]
    for i in range(total - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[total - warmup :]


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, stage) activations held at once if each is freed by its backward."""
    peaks = []
    for actions in schedule.actions:
        held = peak = 0
        for a in actions:
            held += {"F": 1, "B": -1, "I": -1, "W": 0}[a.kind]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@dataclass(frozen=True)
class Slot:
    """An action placed in time on its rank."""

    rank: int
    action: Action
    start: float
    end: float


def simulate(
    schedule: Schedule,
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    latency: float = 0.0,
) -> list[list[Slot]]:
    """Place every action in time: each rank runs its list in order, an action starts when its rank is
    free and its inputs exist (``latency`` later if they come from another rank).

    Durations are a rank's whole share per micro-batch; a chunk of an interleaved schedule takes 1/v of
    it. A forward needs the previous stage's forward; a backward (or backward-to-input I) needs its own
    forward and the next stage's backward; W needs its I. Raises ValueError if the order deadlocks.
    """
    v = schedule.virtual_stages
    duration = {"F": forward / v, "B": backward / v, "I": backward_input / v, "W": backward_weight / v}
    last_stage = schedule.n_stages - 1
    rank_of = {s: r for r in range(schedule.pp) for s in schedule.stages_of(r)}
    done: dict[tuple[str, int, int], float] = {}
    slots: list[list[Slot]] = [[] for _ in range(schedule.pp)]
    position = [0] * schedule.pp
    free = [0.0] * schedule.pp

    def needs(a: Action) -> list[tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
        if a.kind == "W":
            return [("I", a.microbatch, a.stage)]
        after = [("B", a.microbatch, a.stage + 1)] if a.stage < last_stage else []
        return [("F", a.microbatch, a.stage)] + after

    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(schedule.actions):
            while position[r] < len(actions):
                a = actions[position[r]]
                deps = needs(a)
                if not all(d in done for d in deps):
                    break
                ready = [done[d] + (latency if rank_of[d[2]] != r else 0.0) for d in deps]
                start = max([free[r]] + ready)
                free[r] = start + duration[a.kind]
                # A split backward's I stands in for B as what the previous stage waits for.
                done[("B" if a.kind == "I" else a.kind, a.microbatch, a.stage)] = free[r]
                if a.kind == "I":
                    done[("I", a.microbatch, a.stage)] = free[r]
                slots[r].append(Slot(r, a, start, free[r]))
                position[r] += 1
                progress = True
    stuck = [
        (r, schedule.actions[r][position[r]]) for r in range(schedule.pp) if position[r] < len(schedule.actions[r])
    ]
    if stuck:
        raise ValueError(
            f"schedule {schedule.name!r} deadlocks: " + ", ".join(f"rank {r} waits at {a}" for r, a in stuck)
        )
    return slots


def schedule_table(schedule: Schedule) -> str:
    """A text Gantt chart: one row per rank, one column per time slot (every action one slot long)."""
    v = schedule.virtual_stages
    slots = simulate(schedule, forward=v, backward=v, backward_input=v, backward_weight=v)
    width = max(len(schedule.label(s.action)) for row in slots for s in row) + 1
    length = int(max(s.end for row in slots for s in row))
    lines = [
        f"{schedule.name}: p={schedule.pp} ranks, m={schedule.microbatches} micro-batches"
        + (f", v={v} chunks per rank" if v > 1 else "")
    ]
    for r, row in enumerate(slots):
        cells = ["." for _ in range(length)]
        for s in row:
            cells[int(s.start)] = schedule.label(s.action)
        lines.append(f"rank {r} | " + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def simulated_bubble(schedule: Schedule, **durations) -> float:
    """Idle share of the simulated step, averaged over ranks (durations as in :func:`simulate`)."""
    slots = simulate(schedule, **durations)
    makespan = max(s.end for row in slots for s in row)
    busy = [sum(s.end - s.start for s in row) for row in slots]
    return sum(1 - b / makespan for b in busy) / len(busy)


def gantt_rows(schedule: Schedule, timeline, *, waits: bool = False) -> list[list[tuple[float, float, str, int, int]]]:
    """``(start, end, kind, micro-batch, chunk)`` of every compute action (and with ``waits`` every
    receive), per rank, for :func:`scalebook.plots.pipeline_gantt`; ``timeline`` is :func:`simulate`'s
    slots or a run's events."""
    rows = []
    for rank, items in enumerate(timeline):
        chunks = schedule.stages_of(rank)
        row = []
        for item in items:
            a = item.action if isinstance(item, Slot) else item
            if a.kind in KINDS or (waits and a.kind == "recv"):
                row.append((item.start, item.end, a.kind, a.microbatch, chunks.index(a.stage)))
        rows.append(row)
    return rows


def schedule_from_torch(name: str, pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """The action lists of one of ``torch.distributed.pipelining``'s multi-stage schedules (for example
    ``"ZBVZeroBubble"`` or ``"DualPipeV"``), read from torch's schedule visualizer without running it.

    An overlapped forward-and-backward pair becomes its two actions, one after the other: the overlap
    hides communication, not compute.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(name, pp, microbatches, virtual_stages)
    per_rank = []
    for rank_ops in ops:
        actions = []
        for op in rank_ops:
            if op is None:
                continue
            for part in op.sub_actions or (op,):
                kind = part.computation_type.value
                if kind in KINDS:
                    actions.append(Action(kind, part.microbatch_index, part.stage_index))
        per_rank.append(tuple(actions))
    return Schedule(name, pp, microbatches, virtual_stages, tuple(per_rank))


# ----- runtime -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """What a rank did and when (seconds from the common start of the step)."""

    kind: str  # F, B, send, recv
    microbatch: int
    stage: int  # the stage computed, or for a message the stage that receives it
    start: float
    end: float
    message: str = ""  # for send and recv: "F" (activations going forward) or "B" (their gradient)


class _Saved:
    """A tensor autograd saved for the backward pass, counted while autograd keeps it."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key, tracker: _LiveActivations):
        self.tensor, self.key, self.tracker = tensor, key, tracker
        tracker._add(self)

    def __del__(self):
        self.tracker._remove(self)


class _LiveActivations:
    """The activations (tensors saved for backward, parameters excluded) alive on this rank, by the
    (micro-batch, stage) whose forward saved them; peak count of such sets and peak bytes."""

    def __init__(self, parameters):
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._per_key: Counter = Counter()
        self._per_storage: Counter = Counter()
        self.live_bytes = self.peak_bytes = self.peak_sets = 0

    def _add(self, saved: _Saved) -> None:
        self._per_key[saved.key] += 1
        storage = saved.tensor.untyped_storage()
        if self._per_storage[storage.data_ptr()] == 0:  # views of one storage count once
            self.live_bytes += storage.nbytes()
        self._per_storage[storage.data_ptr()] += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_sets = max(self.peak_sets, len(self._per_key))

    def _remove(self, saved: _Saved) -> None:
        self._per_key[saved.key] -= 1
        if self._per_key[saved.key] == 0:
            del self._per_key[saved.key]
        storage = saved.tensor.untyped_storage()
        self._per_storage[storage.data_ptr()] -= 1
        if self._per_storage[storage.data_ptr()] == 0:
            del self._per_storage[storage.data_ptr()]
            self.live_bytes -= storage.nbytes()

    @contextmanager
    def saving_for(self, key):
        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() in self._parameter_storages:
                return t
            return _Saved(t, key, self)

        def unpack(packed):
            return packed.tensor if isinstance(packed, _Saved) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


@dataclass
class StepRecord:
    """What one rank measured while running its part of a schedule."""

    loss: float | None  # on the rank holding the last stage
    events: list[Event]
    peak_in_flight: int
    peak_activation_bytes: int


def _pad(start: float, seconds: float | None) -> None:
    if seconds is not None:
        remaining = start + seconds - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def run_schedule(
    schedule: Schedule,
    stages: dict[int, GPTStage],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    emulate: tuple[float, float] | None = None,
) -> StepRecord:
    """Run this rank's actions of ``schedule`` for one batch: forward, backward, send, receive.

    ``stages`` are the stages this rank holds; ``inputs`` and ``targets`` are the whole batch (only the
    first and the last stage read them). Gradients accumulate in the stages' parameters, scaled so they
    equal the gradient of the mean loss over the batch. With ``emulate=(t_f, t_b)`` each forward and
    backward of a chunk lasts at least t_f / v and t_b / v seconds.
    """
    rank = dist.get_rank()
    M, v = schedule.microbatches, schedule.virtual_stages
    last = schedule.n_stages - 1
    # Copies, not views: each micro-batch arrives as its own tensor, as it would from a data loader.
    x_mbs, y_mbs = [t.clone() for t in inputs.chunk(M)], [t.clone() for t in targets.chunk(M)]
    first_stage = next(iter(stages.values()))
    message_shape = (*x_mbs[0].shape, first_stage.width)
    device = next(first_stage.parameters()).device  # activations arrive where this rank computes
    tracker = _LiveActivations([p for s in stages.values() for p in s.parameters()])
    stage_inputs, stage_outputs, losses, events, sends = {}, {}, [], [], []
    t_forward, t_backward = (None, None) if emulate is None else (emulate[0] / v, emulate[1] / v)

    def tag(kind: str, m: int, s: int) -> int:  # one tag per message, so receives never match the wrong one
        return ((0 if kind == "F" else 1) * schedule.n_stages + s) * M + m

    def receive(kind: str, m: int, stage: int, from_stage: int) -> torch.Tensor:
        buffer = torch.empty(message_shape, device=device)
        begin = time.perf_counter()
        dist.recv(buffer, src=schedule.rank_of(from_stage), tag=tag(kind, m, stage))
        events.append(Event("recv", m, stage, begin - t0, time.perf_counter() - t0, kind))
        return buffer

    def send(kind: str, m: int, to_stage: int, tensor: torch.Tensor) -> None:
        begin = time.perf_counter()
        # isend returns at once; the tensor must stay alive until the send completes, so keep it.
        sends.append((dist.isend(tensor, dst=schedule.rank_of(to_stage), tag=tag(kind, m, to_stage)), tensor))
        events.append(Event("send", m, to_stage, begin - t0, time.perf_counter() - t0, kind))

    t0 = time.perf_counter()
    for a in schedule.actions[rank]:
        m, s = a.microbatch, a.stage
        if a.kind == "F":
            x = x_mbs[m] if s == 0 else receive("F", m, s, s - 1).requires_grad_()
            begin = time.perf_counter()
            with tracker.saving_for((m, s)):
                out = stages[s](x)
                if s == last:
                    loss = lm_loss(out, y_mbs[m])
                    losses.append(loss.detach())
                    out = loss / M  # the batch loss is the mean over micro-batches
            _pad(begin, t_forward)
            events.append(Event("F", m, s, begin - t0, time.perf_counter() - t0))
            stage_inputs[(m, s)], stage_outputs[(m, s)] = x, out
            if s < last:
                send("F", m, s + 1, out.detach())
        elif a.kind == "B":
            grad = None if s == last else receive("B", m, s, s + 1)
            begin = time.perf_counter()
            torch.autograd.backward(stage_outputs.pop((m, s)), grad)
            _pad(begin, t_backward)
            events.append(Event("B", m, s, begin - t0, time.perf_counter() - t0))
            x = stage_inputs.pop((m, s))
            if s > 0:
                send("B", m, s - 1, x.grad)
        else:
            raise ValueError(f"the runtime runs F and B actions; {a} is a {KINDS.get(a.kind, a.kind)} action")
    for work, _ in sends:
        work.wait()
    loss = float(torch.stack(losses).mean()) if losses else None
    return StepRecord(loss, events, tracker.peak_sets, tracker.peak_bytes)


def sync_tied_embedding(stages: dict[int, GPTStage], group) -> None:
    """Sum the gradients of the tied matrix's two copies: the first stage's embedding, the last's head."""
    for stage in stages.values():
        for module in (stage.wte if stage.first else None, stage.lm_head if stage.last else None):
            if module is not None:
                dist.all_reduce(module.weight.grad, group=group)


# ----- experiments: launched on P ranks ------------------------------------------------------------


@dataclass(frozen=True)
class PipelineRun:
    """One experiment: a schedule, its micro-batches and chunks per rank, and how to run it.

    ``emulate=(t_f, t_b)`` pads a rank's forward and backward of one micro-batch to these seconds;
    ``repeats`` runs the step that many times and keeps the one that finished first (other processes
    on the machine can only add time, so the fastest repeat is the least disturbed one, as in
    ``timeit``); ``compare_torch`` also runs the same layout with ``torch.distributed.pipelining``.
    """

    schedule: str
    microbatches: int
    virtual_stages: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    emulate: tuple[float, float] | None = None
    repeats: int = 1
    compare_torch: bool = False


@dataclass
class PipelineResult:
    """One run's numbers, merged over the ranks."""

    run: PipelineRun
    schedule: Schedule
    loss: float
    grads: dict[str, torch.Tensor]  # by the unpartitioned model's parameter names
    events: list[list[Event]]  # per rank
    peak_in_flight: list[int]
    peak_activation_bytes: list[int]
    # Per rank, by torch.distributed function: point-to-point bytes exactly as sent; a library collective's
    # (the tied embedding's all-reduce) at the ring algorithm's cost of its recorded message.
    bytes_sent: list[dict[str, float]]
    torch_loss: float | None = None
    torch_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    message_bytes: list[dict[str, int]] = field(default_factory=list)  # per rank: sizes handed to each call

    def makespan(self) -> float:
        """Seconds from the common start to the end of the last forward or backward on any rank."""
        return max(e.end for events in self.events for e in events if e.kind in ("F", "B"))

    def gantt_rows(self, *, waits: bool = True) -> list[list[tuple[float, float, str, int, int]]]:
        """The measured timeline (forwards, backwards, waits to receive) for :func:`scalebook.plots.pipeline_gantt`."""
        return gantt_rows(self.schedule, self.events, waits=waits)

    def measured_bubble(self) -> list[float]:
        """Per rank, the share of the step it was not computing."""
        span = self.makespan()
        return [1 - sum(e.end - e.start for e in events if e.kind in ("F", "B")) / span for events in self.events]


def check_runs(config: GPTConfig, pp: int, runs: Sequence[PipelineRun], batch_size: int) -> None:
    """Raise one ValueError naming every run that cannot work on ``pp`` ranks, before anything starts."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise ValueError(f"pipeline parallelism needs pp >= 2 ranks, got {pp!r}")
    problems = []
    for i, run in enumerate(runs):
        mine = layout_problems(run.schedule, pp, run.microbatches, run.virtual_stages)
        if not mine:
            try:
                stage_layers(config.n_layer, pp * run.virtual_stages, run.layers_per_stage)
            except ValueError as error:
                mine.append(str(error))
            if batch_size % run.microbatches:
                mine.append(f"batch size {batch_size} does not split into {run.microbatches} equal micro-batches")
            if run.compare_torch and run.schedule == "1f1b" and run.microbatches < pp:
                mine.append(f"torch's Schedule1F1B needs microbatches >= pp={pp}, got {run.microbatches}")
        if run.emulate is not None and (
            not isinstance(run.emulate, (tuple, list))
            or len(run.emulate) != 2
            or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0 for t in run.emulate)
        ):
            mine.append(f"emulate must be (forward seconds, backward seconds) > 0, got {run.emulate!r}")
        if isinstance(run.repeats, bool) or not isinstance(run.repeats, int) or run.repeats < 1:
            mine.append(f"repeats must be an integer >= 1, got {run.repeats!r}")
        problems += [f"run {i} ({run.schedule}, m={run.microbatches}): {p}" for p in mine]
    if problems:
        raise ValueError("; ".join(problems))


def run_pipeline(
    config: GPTConfig,
    pp: int,
    runs: Sequence[PipelineRun],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    seed: int = 0,
    timeout: float = 300.0,
) -> list[PipelineResult]:
    """Run every experiment on ``pp`` fresh ranks (one launch) from a GPT initialised with ``seed``."""
    runs = list(runs)
    check_runs(config, pp, runs, inputs.shape[0])
    per_rank = launch(_pipeline_worker, pp, config.to_dict(), runs, inputs, targets, seed, timeout=timeout)
    results = []
    for i, run in enumerate(runs):
        parts = [rank_results[i] for rank_results in per_rank]
        merged = {}
        for key in ("grads", "torch_grads"):
            merged[key] = {name: g for part in parts for name, g in part[key].items() if name != "lm_head.weight"}
        results.append(
            PipelineResult(
                run=run,
                schedule=build_schedule(run.schedule, pp, run.microbatches, run.virtual_stages),
                loss=parts[-1]["loss"],
                grads=merged["grads"],
                events=[part["events"] for part in parts],
                peak_in_flight=[part["peak_in_flight"] for part in parts],
                peak_activation_bytes=[part["peak_activation_bytes"] for part in parts],
                bytes_sent=[part["bytes_sent"] for part in parts],
                torch_loss=parts[-1]["torch_loss"],
                torch_grads=merged["torch_grads"],
                message_bytes=[part["message_bytes"] for part in parts],
            )
        )
    return results


def reference_loss_and_grads(
    config: GPTConfig, inputs: torch.Tensor, targets: torch.Tensor, *, seed: int = 0
) -> tuple[float, dict[str, torch.Tensor]]:
    """The unpartitioned model's loss and gradients on the whole batch, in this process."""
    torch.manual_seed(seed)
    model = GPT(config)
    _, loss = model(inputs, targets)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _build_stages(model: GPT, schedule: Schedule, layers_per_stage) -> dict[int, GPTStage]:
    bounds = stage_layers(model.config.n_layer, schedule.n_stages, layers_per_stage)
    last = schedule.n_stages - 1
    return {s: GPTStage(model, bounds[s], first=s == 0, last=s == last) for s in schedule.stages_of(dist.get_rank())}


def _grads(stages: dict[int, GPTStage]) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for stage in stages.values() for name, p in stage.named_parameters()}


def _pipeline_worker(config_dict: dict, runs: list[PipelineRun], inputs, targets, seed: int) -> list[dict]:
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config_dict))
    tied_group = dist.new_group([0, pp - 1])  # every rank takes part in creating a group
    out = []
    for run in runs:
        schedule = build_schedule(run.schedule, pp, run.microbatches, run.virtual_stages)
        if run.emulate is not None:
            # An untimed step on throwaway stages first: the first messages between two ranks and the
            # first allocations of each shape cost extra, once, and would distort the timeline.
            run_schedule(schedule, _build_stages(model, schedule, run.layers_per_stage), inputs, targets)
        attempts = []
        for _ in range(run.repeats):
            stages = _build_stages(model, schedule, run.layers_per_stage)
            with count_traffic() as traffic:
                dist.barrier()  # a common start for the timestamps of all ranks
                record = run_schedule(schedule, stages, inputs, targets, emulate=run.emulate)
                if rank in (0, pp - 1):
                    sync_tied_embedding(stages, tied_group)
            finished = torch.tensor([max(e.end for e in record.events if e.kind in ("F", "B"))])
            dist.all_reduce(finished, op=dist.ReduceOp.MAX)  # every rank keeps the same repeat
            attempts.append((finished.item(), stages, record, traffic))
        _, stages, record, traffic = min(attempts, key=lambda attempt: attempt[0])
        result = {
            "loss": record.loss,
            "grads": _grads(stages),
            "events": record.events,
            "peak_in_flight": record.peak_in_flight,
            "peak_activation_bytes": record.peak_activation_bytes,
            "bytes_sent": {op: sent for op, (_, sent) in traffic.by_op().items()},
            "message_bytes": traffic.message_bytes_by_op(),
            "torch_loss": None,
            "torch_grads": {},
        }
        if run.compare_torch:
            result["torch_loss"], result["torch_grads"] = _torch_pipelining(
                model, schedule, run.layers_per_stage, inputs, targets, tied_group
            )
        out.append(result)
    return out


def _torch_pipelining(model, schedule: Schedule, layers_per_stage, inputs, targets, tied_group):
    """The same layout run by ``torch.distributed.pipelining``: PipelineStage and its schedule classes."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    rank, pp = dist.get_rank(), dist.get_world_size()
    stages = _build_stages(model, schedule, layers_per_stage)
    pipe_stages = [PipelineStage(stages[s], s, schedule.n_stages, torch.device("cpu")) for s in sorted(stages)]
    M = schedule.microbatches
    if schedule.name == "interleaved":
        runner = ScheduleInterleaved1F1B(pipe_stages, M, loss_fn=lm_loss)
    else:
        runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule.name](pipe_stages[0], M, loss_fn=lm_loss)
    losses: list[torch.Tensor] = []
    args = (inputs,) if 0 in stages else ()
    kwargs = {"target": targets, "losses": losses} if schedule.n_stages - 1 in stages else {}
    runner.step(*args, **kwargs)
    if rank in (0, pp - 1):
        sync_tied_embedding(stages, tied_group)
    loss = float(torch.stack(losses).detach().mean()) if losses else None
    return loss, _grads(stages)
