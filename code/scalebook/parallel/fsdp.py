"""ZeRO stages 2 and 3 as FSDP2 shapes them: ``fully_shard(model)`` shards any module in place, so that any
elementwise ``torch.optim`` optimizer steps the shards; with prefetching, and hybrid sharding (HSDP) on a 2-D group.

Each parameter is sharded along dim 0 as FSDP2 does (padded to a multiple of N, rank r keeps rows
[r k, (r + 1) k)), in the same ``nn.Parameter``. A *unit* (a block, or the root holding the rest) all-gathers
its shards in one collective and reduce-scatters its gradients in one:

    stage 2  after backward each parameter holds this rank's shard and ``.grad`` the averaged gradient of that
             shard; the full parameters stay gathered between steps.
    stage 3  the full parameters exist only around each unit's forward and backward.

**Prefetch.** Without it a unit's all-gather starts when the unit is needed, and the computation waits for all
of it. ``forward_prefetch`` issues the next unit's all-gather (``async_op=True``) as soon as the current unit
is gathered, before the current unit computes, so that the two overlap; the order is that of the previous
forward pass (the first forward does not prefetch), as in FSDP1 and DeepSpeed. ``backward_prefetch`` does the
same in the backward pass, for the unit whose backward comes next (the reverse of this step's post-forward
order), which is what FSDP2 does by default and what its explicit ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch`` do for the listed modules. Every rank issues the same collectives in the
same order, only earlier. :func:`record_timeline` records when each all-gather was issued and waited for,
and when each unit computed, on this rank.

**HSDP.** With ``replicate_group``, ``process_group`` is the shard group (the GPUs of one node) and
``replicate_group`` the ranks holding the same shard on the other nodes: the all-gathers and the
reduce-scatter stay inside the shard group, and one all-reduce of the reduced shard crosses the replicas.

**Accumulation.** :func:`set_requires_gradient_sync` (FSDP2's name) chooses per micro-batch: reduce now, or wait.

Source: Zhao et al. 2023, "PyTorch FSDP" (Sec. 3.3 hybrid sharding, 3.4 backward and forward prefetching);
Rajbhandari et al. 2020, "ZeRO", Sec. 7; Wang et al. 2023, "ZeRO++" (int8 all-gather); PyTorch documentation,
``torch.distributed.fsdp.fully_shard`` (``set_modules_to_forward_prefetch``, a 2-D ``DeviceMesh`` for HSDP).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from scalebook import compat  # noqa: F401  (torch < 2.13: the collectives' new names)
from scalebook.parallel.elementwise import guard_row_shards

QUANT_BLOCK = 256  # values sharing one int8 scale in the quantized all-gather


def _group_rank_and_size(process_group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise ValueError("no process group: run under scalebook.comm.launch or torchrun (dist.init_process_group)")
    if (rank := dist.get_rank(process_group)) < 0:
        raise ValueError("this rank is not a member of process_group; pass a group that contains it")
    return rank, dist.get_world_size(process_group)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's: shards (and the optimizer) keep the module's dtype; gathered parameters and forward inputs are cast
    to ``param_dtype``; gradients are reduced in ``reduce_dtype`` (default ``param_dtype``), then cast back."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class _Unit:
    """Parameters gathered and reduced together, each sharded along dim 0: parameter i has k_i = ceil(rows_i / N)
    rows, n_i elements, per rank. A rank sends its shards end to end (S = sum n_i) in the all-gather; ``full``
    holds each parameter padded to N k_i rows, one after the other, so that the parameters are views of it."""

    def __init__(self, module, params: list[nn.Parameter], rank: int, world_size: int, compute_dtype, keep_full):
        self.module, self.params, self.world_size = module, params, world_size
        self.trainable = [p for p in params if p.requires_grad]
        self.shapes, self.rows = [p.shape for p in params], [-(-p.shape[0] // world_size) for p in params]
        self.numels = [k * math.prod(s[1:]) for k, s in zip(self.rows, self.shapes, strict=True)]
        self.offsets, self.shard_numel, self.shard_dtype = _offsets(self.numels), sum(self.numels), params[0].dtype
        self.full = params[0].new_zeros(world_size * self.shard_numel, dtype=compute_dtype)
        padded = [self.full[world_size * o : world_size * (o + n)] for o, n in zip(self.offsets, self.numels,
                                                                                    strict=True)]  # fmt: skip
        self.padded = [v.view(world_size, -1) for v in padded]
        self.full_views = [v[: p.numel()].view(p.shape) for v, p in zip(padded, params, strict=True)]
        if keep_full and compute_dtype == self.shard_dtype:  # stage 2: the shard is rows of the kept full copy
            self.flat_shard = None
            for view, p in zip(self.full_views, params, strict=True):
                view.copy_(p.detach())
            self.shards = [v.view(world_size, k, *s[1:])[rank] for v, k, s in zip(padded, self.rows, self.shapes,
                                                                                    strict=True)]  # fmt: skip
        else:
            mine = [_pad_rows(p.detach(), world_size * k)[rank * k : (rank + 1) * k]
                    for p, k in zip(params, self.rows, strict=True)]  # fmt: skip
            self.flat_shard = torch.cat([m.reshape(-1) for m in mine])
            self.shards = [self.flat_shard[o : o + m.numel()].view_as(m) for o, m in zip(self.offsets, mine,
                                                                                        strict=True)]  # fmt: skip
        self.keep_full, self.is_full, self.in_backward, self.ready = keep_full, True, False, 0
        self.pending: tuple | None = None  # an all-gather issued and not yet waited for: (works, outputs, inputs)
        self.issued_at = self.compute_from = 0.0  # perf_counter() of that issue, of the compute's start
        self.stashed_grads: list[torch.Tensor | None] = [None] * len(params)
        self.use_shards()
        self.gathered_versions: list[int] | None = None  # the shards' versions at the last gather; None: never

    def send_buffer(self) -> torch.Tensor:  # this rank's shards end to end, the all-gather's input
        return self.flat_shard if self.flat_shard is not None else torch.cat([s.reshape(-1) for s in self.shards])

    def is_stale(self) -> bool:
        """Has anything written to the shards (an optimizer step, a load) since the last gather?"""
        return self.gathered_versions != [p._version for p in self.params]

    def fill_full(self, rank_major: torch.Tensor) -> None:
        """Copy the gathered shards, (N, S) in rank order, into ``full`` (parameter after parameter)."""
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        for padded, offset, n in zip(self.padded, self.offsets, self.numels, strict=True):
            padded.copy_(rank_major[:, offset : offset + n])
        self.gathered_versions = [p._version for p in self.params]

    def use_full(self) -> None:
        """Point every parameter at its full view; its shard's gradient waits aside until the reduction."""
        if not self.is_full:
            self.stashed_grads = [p.grad for p in self.params]
            for p, view in zip(self.params, self.full_views, strict=True):
                p.grad, p.data = None, view
            self.is_full = True

    def use_shards(self, new_grads: list[torch.Tensor] | None = None) -> None:
        """Point every parameter back at its shard and its gradient, adding ``new_grads`` to the trainable ones'."""
        if self.is_full:
            for p, shard, grad in zip(self.params, self.shards, self.stashed_grads, strict=True):
                p.grad, p.data = None, shard
                p.grad = grad
            self.is_full, self.stashed_grads = False, []
            if not self.keep_full:  # the storage is freed: views of it that autograd saved see the next refill
                self.full.untyped_storage().resize_(0)
        for p, grad in zip(self.trainable, new_grads or [], strict=new_grads is not None):
            p.grad = grad if p.grad is None else p.grad.add_(grad)

    def reduce_gradients(self, group, reduce_dtype: torch.dtype | None, replicate_group=None) -> list[torch.Tensor]:
        """One reduce-scatter of the full gradients (zeros for a parameter that got none) into this rank's shard
        of their mean over the ranks, in the shards' dtype; with ``replicate_group`` (HSDP), then one all-reduce
        of that shard's mean over the replicas, the mean of the means (each divided as FSDP2 divides)."""
        n, layout = self.world_size, [(p, k) for p, k in zip(self.params, self.rows, strict=True) if p.requires_grad]
        sizes = [k * math.prod(p.shape[1:]) for p, k in layout]
        send = torch.zeros(n, sum(sizes), dtype=reduce_dtype or self.full.dtype, device=self.full.device)
        for (p, k), offset, size in zip(layout, _offsets(sizes), sizes, strict=True):
            if p.grad is not None:
                send[:, offset : offset + size] = _pad_rows(p.grad, n * k).reshape(n, size)
        out = send.new_empty(sum(sizes))
        dist.reduce_scatter_single(out, send.view(-1), group=group)
        out.div_(n)
        if replicate_group is not None:
            dist.all_reduce(out, group=replicate_group)
            out.div_(dist.get_world_size(replicate_group))
        out = out.to(self.shard_dtype)
        return [out[o : o + m].view(k, *p.shape[1:]) for (p, k), o, m in zip(layout, _offsets(sizes), sizes,
                                                                             strict=True)]  # fmt: skip


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with dim 0 zero-padded to ``rows``."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


@dataclass(frozen=True)
class TimelineEvent:
    """One interval on this rank, in ``time.perf_counter()`` seconds (one clock for every process of a machine).

    ``kind``: "all-gather" (a unit's all-gather from its issue to the end of its wait: in flight), "wait" (the
    computation blocked on that all-gather: exposed communication; the copy into place follows), "compute"
    (the unit's forward or backward, from the end of its pre-hook to its post-hook; the root's spans the
    blocks'), "reduce" (the reduce-scatter, and HSDP's all-reduce). ``unit`` indexes the units, the root first.
    """

    kind: str
    unit: int
    phase: str  # "forward" or "backward"
    start: float
    end: float


class _ShardedModule:
    """What :func:`fully_shard` attaches to the module: its units, and the hooks that gather and reduce them."""

    def __init__(self, units: list[_Unit], stage: int, group, mp_policy: MixedPrecisionPolicy, quantized: bool,
                 replicate_group=None, forward_prefetch: bool = False, backward_prefetch: bool = False):  # fmt: skip
        self.units, self.stage, self.group, self.world_size = units, stage, group, dist.get_world_size(group)
        self.replicate_group, self.forward_prefetch, self.backward_prefetch = (replicate_group, forward_prefetch,
                                                                               backward_prefetch)  # fmt: skip
        self.mp_policy, self.quantized_gather, self.in_backward_pass = mp_policy, quantized, False
        self.requires_gradient_sync, self.unsynced = True, {}  # unit -> its full gradients kept unreduced
        self.forward_order: list[_Unit] = []  # the units in the order the last complete forward pass used them
        self.this_forward: list[_Unit] = []  # ... the forward pass under way
        self.post_forward_order: list[_Unit] = []  # this step's; the backward pass runs it in reverse
        self.timeline: list[TimelineEvent] | None = None  # recording when a list (record_timeline)
        for unit in units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit), with_kwargs=True)
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            for p in unit.trainable:
                p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, unit))

    def _record(self, kind: str, unit: _Unit, start: float, end: float | None = None) -> None:
        if self.timeline is not None:
            phase, end = "backward" if self.in_backward_pass else "forward", end or time.perf_counter()
            self.timeline.append(TimelineEvent(kind, self.units.index(unit), phase, start, end))

    # ----- gathering: issue (async), wait; stage 3 always, stage 2 once the optimizer changed the shards ----
    def _needs_gather(self, unit: _Unit) -> bool:
        return unit.pending is None and not unit.is_full and (self.stage == 3 or unit.is_stale())

    def _unshard(self, unit: _Unit) -> None:
        if self._needs_gather(unit):
            self._issue_gather(unit)
        if unit.pending is not None:  # issued just now, or prefetched earlier
            self._wait_gather(unit)
        unit.use_full()

    @torch.no_grad()
    def _issue_gather(self, unit: _Unit) -> None:
        unit.issued_at = time.perf_counter()
        send = unit.send_buffer().to(unit.full.dtype)  # mixed precision: cast before sending, like FSDP2
        pieces = quantize_int8_blockwise(send) if self.quantized_gather else (send,)
        outs = [piece.new_empty(self.world_size * piece.numel()) for piece in pieces]
        works = [dist.all_gather_single(out, piece, group=self.group, async_op=True)
                 for out, piece in zip(outs, pieces, strict=True)]  # fmt: skip
        unit.pending = (works, outs, pieces)  # the inputs too: alive until the wait

    @torch.no_grad()
    def _wait_gather(self, unit: _Unit) -> None:
        works, outs, _ = unit.pending
        started = time.perf_counter()
        for work in works:
            work.wait()
        done = time.perf_counter()
        self._record("all-gather", unit, unit.issued_at, done)
        self._record("wait", unit, started, done)
        gathered = dequantize_int8_blockwise(*outs) if self.quantized_gather else outs[0]
        unit.fill_full(gathered.view(self.world_size, -1)[:, : unit.shard_numel])
        unit.pending = None

    def _prefetch(self, unit: _Unit, order: list[_Unit], offset: int) -> None:
        """Issue the all-gather of the unit ``offset`` places from ``unit`` in ``order``, if it needs one."""
        position = order.index(unit) + offset if unit in order else -1
        if 0 <= position < len(order) and self._needs_gather(order[position]):
            self._issue_gather(order[position])

    # ----- forward -----------------------------------------------------------------------------------------
    def _pre_forward(self, unit: _Unit, module, args, kwargs):
        self._unshard(unit)
        if torch.is_grad_enabled() and not unit.in_backward:  # not a recomputation inside backward
            if unit not in self.this_forward:
                self.this_forward.append(unit)
            if self.forward_prefetch:
                self._prefetch(unit, self.forward_order, +1)
            unit.compute_from = time.perf_counter()
        if (dtype := self.mp_policy.param_dtype) is not None:  # like FSDP2's cast_forward_inputs
            return tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t,
                            (args, kwargs))  # fmt: skip

    def _post_forward(self, unit: _Unit, module, args, output) -> None:
        if unit.in_backward:  # recomputed inside backward (activation checkpointing): stay gathered
            return
        if self.stage == 3 or not torch.is_grad_enabled():
            unit.use_shards()
        if torch.is_grad_enabled():
            self._record("compute", unit, unit.compute_from)
            if unit not in self.post_forward_order:
                self.post_forward_order.append(unit)
            # The gradient of a unit's output arrives just before the unit's own backward starts.
            for tensor in tree_leaves(output):
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._pre_backward, unit))

    # ----- backward: gather again (stage 3), reduce-scatter each unit once its gradients are complete ------
    def _pre_backward(self, unit: _Unit, grad: torch.Tensor) -> None:
        if not self.in_backward_pass:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self.in_backward_pass = True
        if not unit.in_backward:
            self._unshard(unit)
            unit.in_backward, unit.ready = True, 0
            if self.backward_prefetch:  # the unit whose backward comes next: the one before in post-forward order
                self._prefetch(unit, self.post_forward_order, -1)
            unit.compute_from = time.perf_counter()

    def _gradient_ready(self, unit: _Unit, param: nn.Parameter) -> None:
        unit.ready += 1
        if unit.in_backward and unit.ready == len(unit.trainable):
            self._post_backward(unit)

    def _post_backward(self, unit: _Unit) -> None:
        self._record("compute", unit, unit.compute_from)
        unit.in_backward, started = False, time.perf_counter()  # reduce-scatter into .grad, then free (stage 3)
        grads, kept = None, self.unsynced.pop(unit, [None] * len(unit.trainable))
        summed = [g if k is None else k if g is None else g.add_(k)
                  for g, k in zip([p.grad for p in unit.trainable], kept, strict=True)]  # fmt: skip
        if unit.trainable and not self.requires_gradient_sync:  # no collective: the full sums wait for the last
            self.unsynced[unit] = summed
        elif unit.trainable:
            for p, grad in zip(unit.trainable, summed, strict=True):
                p.grad = grad
            grads = unit.reduce_gradients(self.group, self.mp_policy.reduce_dtype, self.replicate_group)
            self._record("reduce", unit, started)
        unit.use_shards(grads)

    def _finish_backward(self) -> None:
        """After backward, in unit order: a prefetch that no unit used is waited for and dropped; a unit still
        waiting for a gradient (of a parameter unused in forward) reduces with zeros for it; a unit that backward
        never reached (stage 2) returns to its shards. The pass's forward order is kept for the next prefetch."""
        for unit in self.units:
            if unit.pending is not None:
                for work in unit.pending[0]:
                    work.wait()
                unit.pending = None
            if unit.in_backward:
                self._post_backward(unit)
            else:
                unit.use_shards()
        self.forward_order, self.this_forward = self.this_forward or self.forward_order, []
        self.post_forward_order, self.in_backward_pass = [], False


def _all_gather(shard: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``shard``, one row per rank in rank order: (N, numel)."""
    dist.all_gather_single(out := shard.new_empty(dist.get_world_size(group) * shard.numel()), shard, group=group)
    return out.view(dist.get_world_size(group), -1)


def fully_shard(module: nn.Module, *, stage: int = 3, process_group=None, replicate_group=None, policy=None,
                mp_policy: MixedPrecisionPolicy | None = None, quantized_gather=False, forward_prefetch=False,
                backward_prefetch=False, elementwise_optimizers=()) -> nn.Module:  # fmt: skip
    """Shard ``module``'s parameters, gradients and (through them) optimizer state over ``process_group``, in place.

    Units: the modules ``policy`` selects (a predicate, or a list of submodules), by default ``module.blocks``'s
    entries if any, else each child; the root unit holds the rest, tied weights included. Stage 3 gathers a
    unit before its forward and its backward and frees it after each; stage 2 keeps it gathered and gathers
    again in the first forward after the shards' version counters moved (an optimizer step, a load). After
    backward, ``.grad`` holds the mean over the ranks of the shard's gradient, added to what it held (gradient
    accumulation); a parameter without a gradient gets zeros, a frozen one is gathered but never reduced.
    Parameters and buffers are first broadcast from the group's first rank, as DDP does. ``quantized_gather``
    (stage 3) sends int8 with one scale per 256 values, ZeRO++'s qwZ. ``state_dict()`` holds the shards.

    ``forward_prefetch`` / ``backward_prefetch`` issue the next unit's all-gather before the current unit
    computes (the module's docstring); ``replicate_group`` makes it HSDP: ``process_group`` is then the shard
    group, and the shards' gradients are also averaged over ``replicate_group`` (one rank of each other shard
    group), from whose first rank the parameters are broadcast too.

    The optimizer must be elementwise (:mod:`scalebook.parallel.elementwise`), as a row shard hides the whole
    tensor: its first step refuses any other class before updating (code that builds the optimizer can refuse
    it at once with :func:`~scalebook.parallel.elementwise.check_row_shard_optimizer`), unless
    ``elementwise_optimizers`` lists it.
    """
    rank, world_size = _group_rank_and_size(process_group)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    assignment = _check_fully_shard(module, stage, policy, mp_policy, quantized_gather, process_group,
                                    replicate_group)  # fmt: skip
    guard_row_shards(module.parameters(), elementwise_optimizers)
    with torch.no_grad():
        for group in [process_group] + ([replicate_group] if replicate_group is not None else []):
            first = dist.get_global_rank(group or dist.group.WORLD, 0)
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.detach(), first, group=group)
    units = [_Unit(unit_module, params, rank, world_size, mp_policy.param_dtype or params[0].dtype, stage == 2)
             for unit_module, params in assignment]  # fmt: skip
    module._zero_sharding = _ShardedModule(units, stage, process_group, mp_policy, quantized_gather, replicate_group,
                                           bool(forward_prefetch), bool(backward_prefetch))  # fmt: skip
    if stage == 2:  # a shard that views the full copy would make torch.save write the full copy
        module.register_state_dict_post_hook(_clone_views)
    return module


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """FSDP2's switch for gradient accumulation. ``False``: backward passes reduce nothing; each unit keeps its full
    gradients summed over micro-batches; the next backward with ``True`` adds them to its own and reduce-scatters."""
    if (state := getattr(module, "_zero_sharding", None)) is None:
        raise ValueError("the module is not sharded: call fully_shard(module) first")
    state.requires_gradient_sync = bool(requires_gradient_sync)


@contextmanager
def record_timeline(module: nn.Module) -> Iterator[list[TimelineEvent]]:
    """Record this rank's all-gathers, waits, unit computations and reductions (:class:`TimelineEvent`) while the
    block runs; yields the list they are appended to."""
    if (state := getattr(module, "_zero_sharding", None)) is None:
        raise ValueError("the module is not sharded: call fully_shard(module) first")
    state.timeline = events = []
    try:
        yield events
    finally:
        state.timeline = None


def _clone_views(module, state_dict, prefix, local_metadata) -> None:
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
            state_dict[key] = value.clone()


def _check_fully_shard(module, stage, policy, mp_policy, quantized_gather, process_group,
                       replicate_group) -> list[tuple[nn.Module, list]]:  # fmt: skip
    """Every problem with the request at once, before any work; else the units and their parameters."""
    problems = []
    if replicate_group is not None and dist.get_rank(replicate_group) < 0:
        problems.append("this rank is not a member of replicate_group; pass a group that contains it")
    elif replicate_group is not None:
        shared = set(dist.get_process_group_ranks(process_group or dist.group.WORLD)) & set(
            dist.get_process_group_ranks(replicate_group))  # fmt: skip
        if shared != {dist.get_rank()}:
            problems.append(f"replicate_group shares ranks {sorted(shared - {dist.get_rank()})} with process_group; "
                            "HSDP needs one rank of each shard group in it (a 2-D mesh's other dimension)")  # fmt: skip
    if stage not in (2, 3):
        problems.append(f"stage must be 2 or 3 (stage 1 is ZeroRedundancyOptimizer), got {stage!r}")
    if quantized_gather and stage != 3:
        problems.append("quantized_gather compresses the parameter all-gathers of stage 3; use stage=3")
    if hasattr(module, "_zero_sharding"):
        problems.append("the module is already sharded; call fully_shard once, on the root")
    dtypes = (mp_policy.param_dtype, mp_policy.reduce_dtype) if isinstance(mp_policy, MixedPrecisionPolicy) else (1,)
    if not all(d is None or isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        problems.append(f"mp_policy must be a MixedPrecisionPolicy of floating dtypes, got {mp_policy!r}")
    if not list(module.parameters()):
        problems.append("the module has no parameters")
    if any(p.dim() == 0 for p in module.parameters()):
        problems.append("a 0-d parameter cannot be sharded along dim 0; give it shape (1,)")
    if problems:
        raise ValueError("; ".join(problems))
    assignment = _assign_units(module, _unit_modules(module, policy))
    if any(len({(p.dtype, p.device) for p in ps}) > 1 for _, ps in assignment):
        raise ValueError("a unit holds parameters of different dtypes or devices; convert the module first")
    return assignment


def _unit_modules(module: nn.Module, policy) -> list[nn.Module]:
    if policy is None:
        blocks = getattr(module, "blocks", None)
        return list(blocks) if isinstance(blocks, nn.ModuleList) else list(module.children())
    if callable(policy) and not isinstance(policy, nn.Module):
        return [m for m in module.modules() if m is not module and policy(m)]
    chosen = list(dict.fromkeys(policy))
    inside = {id(m) for m in module.modules() if m is not module}
    if any(not isinstance(m, nn.Module) or id(m) not in inside for m in chosen):
        raise ValueError("policy lists a module that is not a submodule of the module being sharded")
    return chosen


def _assign_units(root: nn.Module, unit_modules: list[nn.Module]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Each parameter goes to the deepest unit whose module holds every place it is registered (a tied
    parameter to the units' common ancestor, which is the root unless one unit holds both places)."""
    path_of, places = {}, {}
    for name, m in root.named_modules(remove_duplicate=False):
        path_of.setdefault(id(m), name)
        for p in m._parameters.values():
            if p is not None:
                places.setdefault(id(p), []).append(name)
    deepest_first = sorted(unit_modules, key=lambda m: -path_of[id(m)].count("."))
    owned = {id(m): [] for m in [root, *unit_modules]}

    def holds(m, p):
        return all(place == path_of[id(m)] or place.startswith(path_of[id(m)] + ".") for place in places[id(p)])

    for p in root.parameters():
        owned[id(next((m for m in deepest_first if holds(m, p)), root))].append(p)
    return [(m, owned[id(m)]) for m in [root, *unit_modules] if owned[id(m)]]


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, gathered from the shards in their own dtype, with the keys of the unsharded
    module (a collective: call it on every rank of the group)."""
    if (state := getattr(module, "_zero_sharding", None)) is None:
        raise ValueError("the module is not sharded: call fully_shard(module) first")
    full = {}
    for unit in state.units:
        gathered = _all_gather(unit.send_buffer(), state.group)
        for p, shape, offset, n, k in zip(unit.params, unit.shapes, unit.offsets, unit.numels, unit.rows,
                                          strict=True):  # fmt: skip
            full[id(p)] = gathered[:, offset : offset + n].reshape(state.world_size * k, *shape[1:])[: shape[0]].clone()
    out = module.state_dict()
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = full[id(p)]
    return out


def quantize_int8_blockwise(x: torch.Tensor, block: int = QUANT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """ZeRO++'s weight quantization: int8, one scale per ``block`` values, q = round(x / s), s = absmax / 127.
    Returns ``(q, scales)``: ``q`` (int8) is zero-padded to whole blocks, ``scales`` are fp32."""
    n_blocks = -(-x.numel() // block)
    blocks = torch.nn.functional.pad(x.float(), (0, n_blocks * block - x.numel())).view(n_blocks, block)
    scales = blocks.abs().amax(dim=1) / 127
    # An all-zero block has scale 0; dividing by the smallest normal float keeps its codes at 0.
    q = torch.round(blocks / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).to(torch.int8)
    return q.view(-1), scales


def dequantize_int8_blockwise(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``q * s`` that :func:`quantize_int8_blockwise` encoded (padding included)."""
    return (q.view(scales.numel(), -1).to(torch.float32) * scales[:, None]).view(-1)
