"""Chapter 13's pipeline experiments: schedules simulated and drawn, and real runs that are timed, counted
and compared with the unpartitioned model and ``torch.distributed.pipelining``.

:func:`~scalebook.parallel.pipeline.simulate` places a schedule's actions in time from their dependencies alone (each
rank runs its list
in order; an action starts when its rank is free and its inputs exist), which gives the text Gantt charts
(:func:`schedule_table`), the simulated bubble and the peak number of micro-batches in flight without any
process. :func:`run_pipeline` runs schedules for real on P local ranks with the library's one runtime,
:func:`scalebook.parallel.pipeline.run_schedule`, through its recorder hook: it timestamps every forward,
backward and wait for messages, counts the activations the autograd graph holds (``saved_tensors_hooks``),
and can pad every forward and backward to a fixed duration, as a GPU kernel of known length would take, so
that a 2-core machine running 4 ranks still shows the schedule's own timing rather than the ranks' fight
over the cores. With stand-in stages (:class:`StandInStage`) whose arithmetic is negligible and whose
activations are as wide as asked, padded timing makes a step whose compute is all emulated and whose
messages are of real size: what the runtime's ``overlap_p2p`` hides can be measured on CPUs.

Source: Huang et al. 2019, "GPipe"; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Sec. 2.2; Qi et al. 2024, "Zero Bubble Pipeline Parallelism"; PyTorch
documentation, "torch.distributed.pipelining" (its schedule visualizer for ZB-V and DualPipeV).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from scalebook.accounting.pipeline import layout_problems
from scalebook.comm import count_traffic, launch
from scalebook.model import GPT, GPTConfig, lm_loss
from scalebook.parallel.pipeline import (
    Action,
    Schedule,
    Slot,
    build_schedule,
    pipeline_stage,
    run_schedule,
    simulate,
    stage_layers,
    sync_tied_embedding,
)

KINDS = {"F": "forward", "B": "backward", "I": "backward to the input", "W": "backward to the weights"}

# ----- schedules without processes -----------------------------------------------------------------


def label(schedule: Schedule, action: Action) -> str:
    """``F3`` for micro-batch 3's forward; with several chunks per rank a letter names the chunk (``F3b``)."""
    if schedule.virtual_stages == 1:
        return f"{action.kind}{action.microbatch}"
    chunk = schedule.stages_of(schedule.rank_of(action.stage)).index(action.stage)
    return f"{action.kind}{action.microbatch}{chr(ord('a') + chunk)}"


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


def schedule_table(schedule: Schedule) -> str:
    """A text Gantt chart: one row per rank, one column per time slot (every action one slot long)."""
    v = schedule.virtual_stages
    slots = simulate(schedule, forward=v, backward=v, backward_input=v, backward_weight=v)
    width = max(len(label(schedule, s.action)) for row in slots for s in row) + 1
    length = int(max(s.end for row in slots for s in row))
    lines = [
        f"{schedule.name}: p={schedule.pp} ranks, m={schedule.microbatches} micro-batches"
        + (f", v={v} chunks per rank" if v > 1 else "")
    ]
    for r, row in enumerate(slots):
        cells = ["." for _ in range(length)]
        for s in row:
            cells[int(s.start)] = label(schedule, s.action)
        lines.append(f"rank {r} | " + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def simulated_bubble(schedule: Schedule, **durations) -> float:
    """Idle share of the simulated step, averaged over ranks (durations as in
    :func:`~scalebook.parallel.pipeline.simulate`)."""
    slots = simulate(schedule, **durations)
    makespan = max(s.end for row in slots for s in row)
    busy = [sum(s.end - s.start for s in row) for row in slots]
    return sum(1 - b / makespan for b in busy) / len(busy)


def gantt_rows(schedule: Schedule, timeline, *, waits: bool = False) -> list[list[tuple[float, float, str, int, int]]]:
    """``(start, end, kind, micro-batch, chunk)`` of every compute action (and with ``waits`` every
    wait for messages), per rank, for :func:`scalebook.plots.pipeline_gantt`; ``timeline`` is
    :func:`~scalebook.parallel.pipeline.simulate`'s slots or a run's events."""
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


# ----- what a real run records, through run_schedule's recorder hook -------------------------------


@dataclass(frozen=True)
class Event:
    """What a rank did and when (seconds from the common start of the step)."""

    kind: str  # F, B, or recv: waiting for the messages batched before the action
    microbatch: int
    stage: int
    start: float
    end: float


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


class StepRecorder:
    """A recorder for :func:`~scalebook.parallel.pipeline.run_schedule`: an :class:`Event` for every forward,
    backward and wait for messages, the activations alive (``activations``), and with
    ``emulate=(t_f, t_b)`` every forward and backward of a chunk padded to t_f / v and t_b / v seconds."""

    def __init__(self, stages: dict[int, nn.Module], virtual_stages: int, emulate: tuple[float, float] | None = None):
        self.events: list[Event] = []
        self.activations = _LiveActivations([p for s in stages.values() for p in s.parameters()])
        self._pad = {} if emulate is None else {"F": emulate[0] / virtual_stages, "B": emulate[1] / virtual_stages}
        self._t0 = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str, action: Action | None):
        begin = time.perf_counter()
        if phase == "F":
            with self.activations.saving_for((action.microbatch, action.stage)):
                yield
        else:
            yield
        if phase in self._pad:
            remaining = begin + self._pad[phase] - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        if action is not None:
            kind = "recv" if phase == "p2p" else phase
            self.events.append(Event(kind, action.microbatch, action.stage, begin - self._t0,
                                     time.perf_counter() - self._t0))  # fmt: skip


# ----- experiments: launched on P ranks ------------------------------------------------------------


@dataclass(frozen=True)
class PipelineRun:
    """One experiment: a schedule, its micro-batches and chunks per rank, and how to run it.

    ``emulate=(t_f, t_b)`` pads a rank's forward and backward of one micro-batch to these seconds;
    ``repeats`` runs the step that many times and keeps the one that finished first (other processes
    on the machine can only add time, so the fastest repeat is the least disturbed one, as in
    ``timeit``); ``compare_torch`` also runs the same layout with ``torch.distributed.pipelining``;
    ``activation_checkpointing`` makes every stage recompute its blocks in the backward pass
    (:func:`~scalebook.parallel.pipeline.pipeline_stage`); ``overlap_p2p`` runs the runtime with its transfers
    overlapped (:func:`~scalebook.parallel.pipeline.run_schedule`); ``stand_in_width`` replaces the GPT's
    stages by :class:`StandInStage` of that width (its loss and gradients are then its own, not the GPT's).
    """

    schedule: str
    microbatches: int
    virtual_stages: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    emulate: tuple[float, float] | None = None
    repeats: int = 1
    compare_torch: bool = False
    activation_checkpointing: bool = False
    overlap_p2p: bool = False
    stand_in_width: int | None = None


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
        """The measured timeline (forwards, backwards, waits) for :func:`scalebook.plots.pipeline_gantt`."""
        return gantt_rows(self.schedule, self.events, waits=waits)

    def measured_bubble(self) -> list[float]:
        """Per rank, the share of the step it was not computing."""
        span = self.makespan()
        return [1 - sum(e.end - e.start for e in events if e.kind in ("F", "B")) / span for events in self.events]


def _run_problems(config: GPTConfig, pp: int, run: PipelineRun, batch_size: int) -> list[str]:
    problems = layout_problems(run.schedule, pp, run.microbatches, run.virtual_stages)
    if not problems:
        try:
            stage_layers(config.n_layer, pp * run.virtual_stages, run.layers_per_stage)
        except ValueError as error:
            problems.append(str(error))
        if batch_size % run.microbatches:
            problems.append(f"batch size {batch_size} does not split into {run.microbatches} equal micro-batches")
        if run.compare_torch and run.schedule == "1f1b" and run.microbatches < pp:
            problems.append(f"torch's Schedule1F1B needs microbatches >= pp={pp}, got {run.microbatches}")
    if run.emulate is not None and (
        not isinstance(run.emulate, (tuple, list))
        or len(run.emulate) != 2
        or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0 for t in run.emulate)
    ):
        problems.append(f"emulate must be (forward seconds, backward seconds) > 0, got {run.emulate!r}")
    if isinstance(run.repeats, bool) or not isinstance(run.repeats, int) or run.repeats < 1:
        problems.append(f"repeats must be an integer >= 1, got {run.repeats!r}")
    for flag in ("activation_checkpointing", "overlap_p2p"):
        if not isinstance(getattr(run, flag), bool):
            problems.append(f"{flag} must be True or False, got {getattr(run, flag)!r}")
    width = run.stand_in_width
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        problems.append(f"stand_in_width must be a positive integer or None, got {width!r}")
    if width is not None and (run.compare_torch or run.activation_checkpointing):
        problems.append("stand-in stages have no torch.distributed.pipelining twin and no blocks to checkpoint")
    return problems


def check_runs(config: GPTConfig, pp: int, runs: Sequence[PipelineRun], batch_size: int) -> None:
    """Raise one ValueError naming every run that cannot work on ``pp`` ranks, before anything starts."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise ValueError(f"pipeline parallelism needs pp >= 2 ranks, got {pp!r}")
    problems = [
        f"run {i} ({run.schedule}, m={run.microbatches}): {p}"
        for i, run in enumerate(runs)
        for p in _run_problems(config, pp, run, batch_size)
    ]
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
        for key in ("grads", "torch_grads"):  # the last stage's head is the embedding's (summed) copy
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


def build_stages(
    model: GPT, schedule: Schedule, rank: int, layers_per_stage=None, *, activation_checkpointing: bool = False
) -> dict[int, GPT]:
    """The stages ``rank`` holds under ``schedule``, each a slice of its own copy of ``model``."""
    return {
        s: pipeline_stage(copy.deepcopy(model), s, schedule.n_stages, layers_per_stage,
                          activation_checkpointing=activation_checkpointing)
        for s in schedule.stages_of(rank)
    }  # fmt: skip


class StandInStage(nn.Module):
    """A stage for timing transfers: one weight of ``width`` numbers and almost no arithmetic, with the
    runtime's interface. The first stage turns token ids (b, s) into (b, s, width) activations, every other
    multiplies its input by its weight, and the last returns ``(None, loss)``, the mean square of its output.
    Its parameter is named after its stage (``weight3``), so the stages' gradients merge by name."""

    def __init__(self, width: int, stage: int, n_stages: int):
        super().__init__()
        self.config = SimpleNamespace(n_embd=width)
        self.wte = self.lm_head = None  # no tied embedding to synchronise
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.name = f"weight{stage}"
        self.register_parameter(self.name, nn.Parameter(torch.linspace(0.5, 1.5, width)))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        h = (x.unsqueeze(-1).float() / 256 if self.first else x) * getattr(self, self.name)
        return (None, h.square().mean()) if self.last else h


def _stages_for(model: GPT, schedule: Schedule, rank: int, run: PipelineRun) -> dict[int, nn.Module]:
    if run.stand_in_width is not None:
        return {s: StandInStage(run.stand_in_width, s, schedule.n_stages) for s in schedule.stages_of(rank)}
    return build_stages(
        model, schedule, rank, run.layers_per_stage, activation_checkpointing=run.activation_checkpointing
    )


def _grads(stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for stage in stages.values() for name, p in stage.named_parameters()}


def _timed_step(schedule: Schedule, stages, inputs, targets, run: PipelineRun, tied_group):
    """One recorded step: the runtime under a recorder and a traffic counter, then the tied gradients summed."""
    with count_traffic() as traffic:
        dist.barrier()  # a common start for the timestamps of all ranks
        recorder = StepRecorder(stages, schedule.virtual_stages, run.emulate)
        loss = run_schedule(schedule, stages, inputs, targets, recorder=recorder, overlap_p2p=run.overlap_p2p)
        for stage in stages.values():
            sync_tied_embedding(stage, tied_group)
    return loss, recorder, traffic


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
            run_schedule(
                schedule, _stages_for(model, schedule, rank, run), inputs, targets, overlap_p2p=run.overlap_p2p
            )
        attempts = []
        for _ in range(run.repeats):
            stages = _stages_for(model, schedule, rank, run)
            loss, recorder, traffic = _timed_step(schedule, stages, inputs, targets, run, tied_group)
            finished = torch.tensor([max(e.end for e in recorder.events if e.kind in ("F", "B"))])
            dist.all_reduce(finished, op=dist.ReduceOp.MAX)  # every rank keeps the same repeat
            attempts.append((finished.item(), stages, loss, recorder, traffic))
        _, stages, loss, recorder, traffic = min(attempts, key=lambda attempt: attempt[0])
        result = {
            "loss": None if loss is None else loss.item(),
            "grads": _grads(stages),
            "events": recorder.events,
            "peak_in_flight": recorder.activations.peak_sets,
            "peak_activation_bytes": recorder.activations.peak_bytes,
            "bytes_sent": {op: sent for op, (_, sent) in traffic.by_op().items()},
            "message_bytes": traffic.message_bytes_by_op(),
            "torch_loss": None,
            "torch_grads": {},
        }
        if run.compare_torch:
            result["torch_loss"], result["torch_grads"] = torch_pipelining_step(
                model, schedule, run.layers_per_stage, inputs, targets, tied_group
            )
        out.append(result)
    return out


class _Logits(nn.Module):
    """A last stage as ``torch.distributed.pipelining`` wants it: hidden states in, logits out (its schedule
    applies the loss function)."""

    def __init__(self, stage: GPT):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x)[0]


def torch_pipelining_schedule(stages: dict[int, GPT], schedule: Schedule, group=None):
    """``torch.distributed.pipelining``'s schedule object for the same layout, over the same stage modules."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    last, device = schedule.n_stages - 1, next(next(iter(stages.values())).parameters()).device
    pipe_stages = [
        PipelineStage(_Logits(stages[s]) if s == last else stages[s], s, schedule.n_stages, device, group=group)
        for s in sorted(stages)
    ]
    M = schedule.microbatches
    if schedule.name == "interleaved":
        return ScheduleInterleaved1F1B(pipe_stages, M, loss_fn=lm_loss)
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule.name](pipe_stages[0], M, loss_fn=lm_loss)


def torch_pipelining_step(model: GPT, schedule: Schedule, layers_per_stage, inputs, targets, tied_group):
    """The same layout run by ``torch.distributed.pipelining``: fresh stages of ``model``, one step; returns the
    loss (last stage, else None) and this rank's gradients by parameter name."""
    stages = build_stages(model, schedule, dist.get_rank(), layers_per_stage)
    runner = torch_pipelining_schedule(stages, schedule)
    losses: list[torch.Tensor] = []
    args = (inputs,) if 0 in stages else ()
    kwargs = {"target": targets, "losses": losses} if schedule.n_stages - 1 in stages else {}
    runner.step(*args, **kwargs)
    for stage in stages.values():
        sync_tied_embedding(stage, tied_group)
    loss = float(torch.stack(losses).detach().mean()) if losses else None
    return loss, _grads(stages)
