"""Pipeline parallelism for the book's GPT: a stage is a slice of the model, a schedule is a list of actions,
and one runtime executes it over a process group.

**Stages.** The model's layers are cut into consecutive stages, one per rank (or ``v`` per rank when
interleaving). :func:`pipeline_stage` turns a :class:`~scalebook.model.GPT` into one, in place: it keeps its
own blocks (under their indices in the full model, so parameter names and checkpoints are the full
model's), the embeddings only on the first stage, and the final norm and the head only on the last; the
GPT's own forward then takes hidden states in and gives hidden states out where those are missing. The
head is tied to the token embedding, so the first and the last stage each hold a copy of that matrix;
after the backward pass :func:`sync_tied_embedding` sums the two copies' gradients (as Megatron-LM does),
which is exactly the tied matrix's gradient. With ``activation_checkpointing=True`` a stage keeps only each
block's input per micro-batch in flight and recomputes the block in its backward, so the runtime is the
same function with or without it.

**Schedules.** A batch is split into M micro-batches. A schedule is, for every rank, the ordered list of
what it computes: ``F`` (forward of micro-batch m through stage s) and ``B`` (its backward). It is a pure
function of (P, M, v), so it can be printed, simulated and checked before any process starts:

    gpipe        all M forwards, then all M backwards (Huang et al. 2019)
    1f1b         P - r - 1 warm-up forwards on rank r, then one forward, one backward, ... (PipeDream-Flush)
    interleaved  v model chunks per rank, stage c P + r on rank r; Megatron-LM's warm-up of
                 2 (P - r - 1) + (v - 1) P forwards, then 1F1B over the chunks (Narayanan et al. 2021)

**The runtime.** :func:`run_schedule` executes one rank's list over the pipeline's process group (stage
ranks are ranks of that group, so a pipeline can live inside a DP x TP x PP mesh). Activations travel
forward and their gradients backward through ``torch.distributed.batch_isend_irecv``, never through tags:
NCCL ignores tags and pairs the sends and receives between two ranks in the order they were issued, so
the runtime issues them in an order that pairs by position alone (:func:`p2p_plan`). With ``overlap_p2p``
a rank posts them ahead in that order and waits for a receive only when an action needs it, so transfers run
while it computes (Megatron-LM's ``--overlap-p2p-communication``); the results are the same bit for bit.

Source: Huang et al. 2019, "GPipe"; Narayanan et al. 2019, "PipeDream: Generalized Pipeline
Parallelism for DNN Training"; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Sec. 2.2, and Megatron-LM ``schedules.py`` (``overlap_p2p_comm``); PyTorch,
``torch.distributed.pipelining`` (``schedules.py``: the send of one step batched with the receive of the
next); picotron ``pipeline_parallel.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from scalebook.accounting.pipeline import layout_problems
from scalebook.model import GPT

__all__ = [
    "Action",
    "Schedule",
    "Slot",
    "StageBlocks",
    "Transfer",
    "build_schedule",
    "p2p_plan",
    "pipeline_stage",
    "run_schedule",
    "simulate",
    "stage_layers",
    "sync_tied_embedding",
]

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


class StageBlocks(nn.ModuleDict):
    """The blocks a stage keeps, keyed by their index in the full model (so a parameter is ``blocks.4.attn...``
    on every stage that holds block 4); iterates over the blocks, like the ``nn.ModuleList`` it replaces."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, index: int | str) -> nn.Module:
        return super().__getitem__(str(index))


def pipeline_stage(
    model: GPT,
    stage: int,
    n_stages: int,
    layers_per_stage: Sequence[int] | None = None,
    *,
    activation_checkpointing: bool | None = None,
) -> GPT:
    """Make ``model`` stage ``stage`` of ``n_stages``, in place; returns it.

    The blocks of the other stages are dropped, ``wte`` and ``wpe`` kept only on the first stage, ``ln_f``
    and ``lm_head`` only on the last (where ``lm_head.weight`` stays the Parameter it shared with ``wte``).
    ``model(x)`` then maps the previous stage's hidden states (token ids on the first stage) to this stage's
    (``(logits, loss)`` on the last). Every rank must start from the same weights; a rank that holds several
    stages (interleaving) slices one copy of the model per stage.

    ``activation_checkpointing=True`` makes the stage keep only each block's input for every micro-batch in
    flight and recompute the block during its backward (``torch.utils.checkpoint`` per block, the GPT's own
    ``gradient_checkpointing``); None leaves the model's setting as it is.
    """
    if isinstance(model.blocks, StageBlocks):
        raise ValueError("model is already a pipeline stage; slice a full GPT (copy.deepcopy it first)")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n_stages:
        raise ValueError(f"stage must be an integer in [0, n_stages={n_stages}), got {stage!r}")
    if activation_checkpointing is not None and not isinstance(activation_checkpointing, bool):
        raise ValueError(f"activation_checkpointing must be True, False or None, got {activation_checkpointing!r}")
    layers = stage_layers(len(model.blocks), n_stages, layers_per_stage)[stage]
    if activation_checkpointing is not None:
        model.gradient_checkpointing = activation_checkpointing
    model.blocks = StageBlocks({str(i): model.blocks[i] for i in layers})
    if stage > 0:
        model.wte = model.wpe = None
    if stage < n_stages - 1:
        model.ln_f = model.lm_head = None
    return model


def sync_tied_embedding(model: nn.Module, group=None) -> None:
    """Sum the tied matrix's gradient over its two copies, the first stage's ``wte`` and the last stage's
    ``lm_head``: an all-reduce over ``group`` (those two ranks). A no-op on a stage holding neither, or both."""
    first, last = model.wte is not None, model.lm_head is not None
    if first != last:
        dist.all_reduce((model.wte if first else model.lm_head).weight.grad, group=group)


# ----- schedules -----------------------------------------------------------------------------------


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
            warmup = min(P - r - 1, M)  # warm-up: fill the pipeline
            actions = [Action("F", m, r) for m in range(warmup)]
            for m in range(M - warmup):  # steady state: the next forward, then the oldest backward
                actions += [Action("F", warmup + m, r), Action("B", m, r)]
            actions += [Action("B", m, r) for m in range(M - warmup, M)]  # cool-down: drain it
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


@dataclass(frozen=True)
class Slot:
    """An action placed in time on its rank."""

    rank: int
    action: Action
    start: float
    end: float


def _dependencies(a: Action, last_stage: int) -> list[tuple[str, int, int]]:
    """What must be done before ``a``: the previous stage's forward; or this stage's forward and the next
    stage's backward (I, a backward to the input only, stands in for B); W needs its I."""
    if a.kind == "F":
        return [("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
    if a.kind == "W":
        return [("I", a.microbatch, a.stage)]
    after = [("B", a.microbatch, a.stage + 1)] if a.stage < last_stage else []
    return [("F", a.microbatch, a.stage)] + after


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
    it. Raises ValueError if the order deadlocks.
    """
    v = schedule.virtual_stages
    duration = {"F": forward / v, "B": backward / v, "I": backward_input / v, "W": backward_weight / v}
    last_stage = schedule.n_stages - 1
    rank_of = {s: r for r in range(schedule.pp) for s in schedule.stages_of(r)}
    done: dict[tuple[str, int, int], float] = {}
    slots: list[list[Slot]] = [[] for _ in range(schedule.pp)]
    position, free = [0] * schedule.pp, [0.0] * schedule.pp
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(schedule.actions):
            while position[r] < len(actions):
                a = actions[position[r]]
                deps = _dependencies(a, last_stage)
                if not all(d in done for d in deps):
                    break
                ready = [done[d] + (latency if rank_of[d[2]] != r else 0.0) for d in deps]
                start = max([free[r]] + ready)
                free[r] = start + duration[a.kind]
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


# ----- point-to-point plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One message a rank posts: activations (``kind`` F) or their gradient (B) of a micro-batch, for the
    stage that consumes them, sent to or received from ``peer`` (a rank of the pipeline's group)."""

    kind: str
    microbatch: int
    stage: int
    peer: int
    send: bool


def p2p_plan(schedule: Schedule, rank: int) -> list[Action | tuple[Transfer, ...]]:
    """What rank ``rank`` does, in order: an :class:`Action` to compute, or a batch of transfers to post with
    one ``batch_isend_irecv`` and wait for.

    NCCL pairs the n-th send from A to B with the n-th receive on B from A, whatever their tags, and runs a
    rank's batches one after another; a send does not finish before its receive is posted. So every message
    gets one place in a single order that all ranks share: the time its producer finishes in
    :func:`simulate` (a forward one unit, a backward two, per chunk), and each rank posts the messages it
    sends or receives in that order, a receive before the action that needs it. The oldest unfinished
    message then always has both ranks at it, so no two ranks can wait on each other. Messages with the same
    time go in one batch, as ``torch.distributed.pipelining`` batches the send of one step with the receive
    of the next: two neighbours sending to each other at once post both directions together.
    """
    last, v = schedule.n_stages - 1, schedule.virtual_stages
    timeline = []  # (time, 0 for a message and 1 for an action, item); a message before an action at a tie
    for row in simulate(schedule, forward=v, backward=2 * v):  # whole numbers: ties are exact
        for slot in row:
            a = slot.action
            if a.kind not in ("F", "B"):
                raise ValueError(f"the runtime runs F and B actions; {a} of {schedule.name!r} is neither")
            if slot.rank == rank:
                timeline.append((slot.start, 1, a))
            target = a.stage + 1 if a.kind == "F" else a.stage - 1
            if 0 <= target <= last and rank in (slot.rank, schedule.rank_of(target)):
                sender = slot.rank == rank
                if sender and schedule.rank_of(target) == rank:
                    raise ValueError(f"stages {a.stage} and {target} are both on rank {rank}; use pp >= 2 ranks")
                peer = schedule.rank_of(target) if sender else slot.rank
                timeline.append((slot.end, 0, Transfer(a.kind, a.microbatch, target, peer, sender)))
    plan, batch_time = [], None
    for time, is_action, item in sorted(timeline, key=lambda entry: entry[:2]):
        if not is_action and plan and isinstance(plan[-1], tuple) and time == batch_time:
            plan[-1] += (item,)
        else:
            plan.append(item if is_action else (item,))
            batch_time = time
    return plan


# ----- runtime -------------------------------------------------------------------------------------

Recorder = Callable[[str, Action | None], AbstractContextManager]


def _no_recorder(phase: str, action: Action | None) -> AbstractContextManager:
    return nullcontext()


def _check_run(schedule: Schedule, stages: Mapping[int, nn.Module], rank: int, batch: int, group, overlap) -> None:
    problems = [] if isinstance(overlap, bool) else [f"overlap_p2p must be True or False, got {overlap!r}"]
    if dist.get_world_size(group) != schedule.pp:
        problems.append(f"the schedule is for pp={schedule.pp} ranks but the group has {dist.get_world_size(group)}")
    elif sorted(stages) != schedule.stages_of(rank):
        problems.append(f"rank {rank} holds stages {schedule.stages_of(rank)}, got stages {sorted(stages)}")
    if batch % schedule.microbatches:
        problems.append(f"batch size {batch} does not split into {schedule.microbatches} equal micro-batches")
    if problems:
        raise ValueError("; ".join(problems))


class _Transfers:
    """One rank's batches of transfers, posted in the plan's order, each with one ``batch_isend_irecv``. A send
    takes its tensor from ``outbox``; a receive's buffer (shaped and placed ``like``) is handed out by
    :meth:`take` once its request is done; both keyed by (kind, micro-batch, receiving stage)."""

    def __init__(self, plan: list, like: torch.Tensor, group):
        self.batches = [step for step in plan if isinstance(step, tuple)]
        self.like, self.group, self.posted = like, group, 0
        self.outbox, self.inbox, self.requests, self.sends = {}, {}, {}, []

    def post_next(self) -> list:
        """Post the plan's next batch; returns its requests."""
        ops, batch = [], self.batches[self.posted]
        for t in batch:
            key = (t.kind, t.microbatch, t.stage)
            if not t.send:
                self.inbox[key] = torch.empty_like(self.like)
            tensor = self.outbox.pop(key) if t.send else self.inbox[key]
            ops.append(dist.P2POp(dist.isend if t.send else dist.irecv, tensor, group=self.group, group_peer=t.peer))
        works, self.posted = dist.batch_isend_irecv(ops), self.posted + 1
        for t, work in zip(batch, works if len(works) == len(ops) else works * len(ops), strict=True):  # NCCL: one
            if t.send:
                self.sends.append(work)
            else:
                self.requests[(t.kind, t.microbatch, t.stage)] = work
        return works

    def post_ready(self) -> None:
        """Post every batch whose sends are computed, in the plan's order: receives go up ahead of time."""
        while self.posted < len(self.batches) and all(
            (t.kind, t.microbatch, t.stage) in self.outbox for t in self.batches[self.posted] if t.send
        ):
            self.post_next()

    def take(self, key: tuple[str, int, int]) -> torch.Tensor:
        """The received tensor for ``key``, after waiting for its request if nobody has (gloo's requests must be
        waited for exactly once)."""
        work = self.requests.pop(key, None)
        if work is not None:
            work.wait()
        return self.inbox.pop(key)


def run_schedule(
    schedule: Schedule,
    stages: nn.Module | Mapping[int, nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    group=None,
    recorder: Recorder | None = None,
    overlap_p2p: bool = False,
) -> torch.Tensor | None:
    """Run this rank's actions of ``schedule`` for one batch; returns the batch's mean loss (detached) on the
    rank holding the last stage, None elsewhere.

    ``group`` is the pipeline's process group (default: the world); this rank's place in it is its rank in
    the schedule. ``stages`` maps each stage this rank holds to its slice of the model
    (:func:`pipeline_stage`), or is that slice when it holds one. ``inputs`` and ``targets`` (B, T) are the
    whole batch, split into M micro-batches along dim 0; the first stage reads the inputs, the last the
    targets, every rank their shape. Gradients accumulate in the stages' parameters, scaled to be the mean
    loss's. By default a rank waits for each batch of transfers where the plan posts it; ``overlap_p2p=True``
    posts each batch as soon as its sends are computed, waits for a receive only when its action needs it,
    and for the sends at the end (keeping their tensors until then). ``recorder(phase, action)``, if given,
    returns a context manager wrapped around each forward (phase ``"F"``), backward (``"B"``) and wait for
    transfers (``"p2p"``, with the action that waits, or None after the last one).

    Under NCCL the first call on a process group must include all its ranks: create the group with a bound
    device (``init_process_group(device_id=...)``) or run a collective on it first.
    """
    rank = dist.get_rank(group)
    if not isinstance(stages, Mapping):
        stages = {schedule.stages_of(rank)[0]: stages}
    _check_run(schedule, stages, rank, inputs.shape[0], group, overlap_p2p)
    M, last, record = schedule.microbatches, schedule.n_stages - 1, recorder or _no_recorder
    # Copies, not views: a micro-batch's ids saved for the backward pass then keep only themselves alive.
    x_mbs, y_mbs = [t.clone() for t in inputs.chunk(M)], [t.clone() for t in targets.chunk(M)]
    some_stage = next(iter(stages.values()))
    weight = next(some_stage.parameters())  # messages are made where and in the precision this rank computes
    plan = p2p_plan(schedule, rank)
    mail = _Transfers(plan, weight.new_empty((*x_mbs[0].shape, some_stage.config.n_embd)), group)
    stage_inputs, stage_outputs, losses = {}, {}, []
    for i, step in enumerate(plan):
        if isinstance(step, tuple):
            if not overlap_p2p:  # blocking: post the batch and wait for all of it before going on
                works = mail.post_next()
                with record("p2p", next((a for a in plan[i:] if isinstance(a, Action)), None)):
                    for work in works:
                        work.wait()
                mail.requests.clear()  # waited for: gloo would wait a second time for a second message
                mail.sends.clear()
            continue
        m, s = step.microbatch, step.stage
        if overlap_p2p:
            mail.post_ready()
        key = ("F", m, s) if step.kind == "F" and s > 0 else ("B", m, s) if step.kind == "B" and s < last else None
        if key is not None:
            with record("p2p", step) if overlap_p2p else nullcontext():
                received = mail.take(key)
        if step.kind == "F":
            x = x_mbs[m] if s == 0 else received.requires_grad_()
            with record("F", step):
                if s == last:
                    _, loss = stages[s](x, y_mbs[m])
                    losses.append(loss.detach())
                    out = loss / M  # the batch loss is the mean over micro-batches
                else:
                    out = stages[s](x)
            stage_inputs[(m, s)], stage_outputs[(m, s)] = x, out
            if s < last:
                mail.outbox[("F", m, s + 1)] = out.detach()
        else:
            with record("B", step):
                torch.autograd.backward(stage_outputs.pop((m, s)), received if key else None)
            x = stage_inputs.pop((m, s))
            if s > 0:
                mail.outbox[("B", m, s - 1)] = x.grad
    if overlap_p2p:  # the last sends
        mail.post_ready()
        with record("p2p", None):
            for work in mail.sends:
                work.wait()
    return torch.stack(losses).mean() if losses else None
