"""ZeRO: data parallelism that shards the model states over the ranks instead of copying them.

DDP (Chapter 10) keeps the parameters, gradients and optimizer state whole on each of N ranks. ZeRO removes
that redundancy one kind of state at a time; here each stage has PyTorch's shape, so that a training loop
with any ``torch.optim`` optimizer runs unchanged:

    stage 1  ZeroRedundancyOptimizer(params, AdamW, ...) wraps an optimizer: each rank steps the optimizer
             state of 1/N of the elements, then an all-gather brings every rank the updated parameters.
    stage 2  fully_shard(model, stage=2): after backward each parameter holds this rank's shard and ``.grad``
             the averaged gradient of that shard; the full parameters stay gathered between steps.
    stage 3  fully_shard(model, stage=3), FSDP2's fully_shard: the full parameters exist only around each
             unit's forward and backward.

Stage 1 lays each parameter group end to end in one flat buffer padded to a multiple of N, and rank r steps
elements [r s, (r + 1) s) as in the ZeRO paper: even shards, for elementwise optimizers (SGD, Adam, AdamW);
torch's version assigns whole tensors. Stages 2 and 3 shard each parameter along dim 0 as FSDP2 does (padded
to a multiple of N, rank r keeps rows [r k, (r + 1) k)), in the same ``nn.Parameter``. A *unit* (a block, or
the root holding the rest) all-gathers its shards in one collective and reduce-scatters its gradients in one.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
Sec. 5 and 7; Zhao et al. 2023, "PyTorch FSDP"; Wang et al. 2023, "ZeRO++" (int8 all-gather); PyTorch
documentation, ``torch.distributed.fsdp.fully_shard`` and ``torch.distributed.optim.ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from scalebook.measure import StateBytes  # bytes by kind; in mixed precision the fp32 shards are the master copy
from scalebook.parallel import dims  # noqa: F401  (torch < 2.13: the collectives' new names)

QUANT_BLOCK = 256  # values sharing one int8 scale in the quantized all-gather


def _group_rank_and_size(process_group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise ValueError("no process group: run under scalebook.comm.launch or torchrun (dist.init_process_group)")
    if (rank := dist.get_rank(process_group)) < 0:
        raise ValueError("this rank is not a member of process_group; pass a group that contains it")
    return rank, dist.get_world_size(process_group)


# ----- stage 1: an optimizer wrapper ---------------------------------------------------------------------
class _FlatGroup:
    """A parameter group's trainable parameters end to end in a zero-padded flat buffer of N s elements: the
    parameters become views of ``flat``, and ``shard`` (a Parameter viewing ``flat[r s : (r + 1) s]``) is what
    this rank's optimizer steps in place, so that the all-gather after the step writes straight into the model."""

    def __init__(self, params: list[nn.Parameter], rank: int, world_size: int):
        self.params, self.offsets = params, _offsets([p.numel() for p in params])
        self.shard_numel = -(-sum(p.numel() for p in params) // world_size)
        self.flat = params[0].new_zeros(self.shard_numel * world_size)
        for p, offset in zip(params, self.offsets, strict=True):
            p.data = self.flat[offset : offset + p.numel()].view_as(p).copy_(p.detach())
        self.owned = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)
        self.shard = nn.Parameter(self.flat[self.owned])

    def flat_gradient(self) -> torch.Tensor:
        flat = torch.zeros_like(self.flat)
        for p, offset in zip(self.params, self.offsets, strict=True):
            if p.grad is not None:  # no gradient: zeros, as DDP's all-reduce would have given it
                flat[offset : offset + p.numel()] = p.grad.reshape(-1)
        return flat


def _unique_param_groups(params) -> list[dict]:
    """Parameter groups as torch.optim takes them; a parameter listed twice in a group (tied) counts once."""
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    members = [[g["params"]] if torch.is_tensor(g["params"]) else g["params"] for g in groups]
    return [{**g, "params": list(dict.fromkeys(m))} for g, m in zip(groups, members, strict=True)]  # hash: identity


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: ``optimizer_class`` steps only this rank's 1/N of the elements, then all-gathers them.

    Like torch's: wrap the model in DDP (or the book's ``scalebook.parallel.ddp.OverlappedDDP``) so that ``.grad``
    holds the averaged gradients when ``step()`` runs. Frozen parameters are skipped; a ``.grad`` of None counts
    as zeros (torch.optim would skip the tensor; a flat shard cannot); a scheduler sets ``param_groups[i]["lr"]``;
    ``state_dict()`` is this rank's shard (one file per rank). ``reduce_scatter_gradients=True`` is the ZeRO
    paper's stage 1: no DDP, ``step()`` reduce-scatters the local gradients so that each rank receives only the
    mean of the slice it steps: the all-reduce's bytes in all, where DDP's all-reduce and the all-gather send 1.5x.
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], process_group=None, *,
                 reduce_scatter_gradients: bool = False, **defaults):  # fmt: skip
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        groups = _unique_param_groups(params)
        trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
        if not any(trainable):
            raise ValueError("no parameter requires a gradient: nothing to optimize")
        if any(len({(p.dtype, p.device) for p in ps}) > 1 for ps in trainable):
            raise ValueError("each parameter group must hold one dtype on one device; split the group")
        self.rank, self.world_size = _group_rank_and_size(process_group)
        super().__init__(groups, defaults)
        self.process_group, self.reduce_scatter_gradients = process_group, reduce_scatter_gradients
        self.flat_groups = [_FlatGroup(ps, self.rank, self.world_size) if ps else None for ps in trainable]
        shards = [{**_hyperparameters(group), "params": [flat.shard]} for group, flat in self._pairs()]
        self.optim = optimizer_class(shards, **defaults)
        for (group, _), inner in zip(self._pairs(), self.optim.param_groups, strict=True):
            group.update(_hyperparameters(inner))  # the inner optimizer's defaults, visible to schedulers

    def _pairs(self) -> list[tuple[dict, _FlatGroup]]:
        return [(g, f) for g, f in zip(self.param_groups, self.flat_groups, strict=True) if f is not None]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Step this rank's shard with the current ``param_groups`` hyper-parameters, then all-gather."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for (group, flat), inner in zip(self._pairs(), self.optim.param_groups, strict=True):
            inner.update(_hyperparameters(group))
            if self.reduce_scatter_gradients:  # the mean over the ranks of this rank's slice only
                flat.shard.grad = torch.empty_like(flat.shard)
                dist.reduce_scatter_single(flat.shard.grad, flat.flat_gradient(), group=self.process_group)
                flat.shard.grad.div_(self.world_size)
            elif any(p.grad is not None for p in flat.params):
                flat.shard.grad = flat.flat_gradient()[flat.owned]
        self.optim.step()
        for _, flat in self._pairs():
            flat.shard.grad = None
            dist.all_gather_single(flat.flat, flat.shard.detach(), group=self.process_group)
        return loss

    def _partition(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "shards": [f.shard_numel for _, f in self._pairs()]}

    def state_dict(self) -> dict:
        """This rank's optimizer state (its shard) and the partition it belongs to."""
        return {"shard": self.optim.state_dict(), **self._partition()}

    def load_state_dict(self, state_dict: dict) -> None:
        if (saved := {key: state_dict.get(key) for key in self._partition()}) != self._partition():
            raise ValueError(f"this state is for the partition {saved}, not {self._partition()}: load this rank's file")
        self.optim.load_state_dict(state_dict["shard"])
        for (group, _), inner in zip(self._pairs(), self.optim.param_groups, strict=True):
            group.update(_hyperparameters(inner))


def _hyperparameters(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


# ----- stages 2 and 3: a module wrapper ------------------------------------------------------------------
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

    def reduce_gradients(self, group, reduce_dtype: torch.dtype | None) -> list[torch.Tensor]:
        """One reduce-scatter of the full gradients (zeros for a parameter that got none) into this rank's shard
        of their mean over the ranks, in the shards' dtype."""
        n, layout = self.world_size, [(p, k) for p, k in zip(self.params, self.rows, strict=True) if p.requires_grad]
        sizes = [k * math.prod(p.shape[1:]) for p, k in layout]
        send = torch.zeros(n, sum(sizes), dtype=reduce_dtype or self.full.dtype, device=self.full.device)
        for (p, k), offset, size in zip(layout, _offsets(sizes), sizes, strict=True):
            if p.grad is not None:
                send[:, offset : offset + size] = _pad_rows(p.grad, n * k).reshape(n, size)
        out = send.new_empty(sum(sizes))
        dist.reduce_scatter_single(out, send.view(-1), group=group)
        out = out.div_(n).to(self.shard_dtype)
        return [out[o : o + m].view(k, *p.shape[1:]) for (p, k), o, m in zip(layout, _offsets(sizes), sizes,
                                                                             strict=True)]  # fmt: skip


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with dim 0 zero-padded to ``rows``."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


class _ShardedModule:
    """What :func:`fully_shard` attaches to the module: its units, and the hooks that gather and reduce them."""

    def __init__(self, units: list[_Unit], stage: int, group, mp_policy: MixedPrecisionPolicy, quantized: bool):
        self.units, self.stage, self.group, self.world_size = units, stage, group, dist.get_world_size(group)
        self.mp_policy, self.quantized_gather, self.backward_callback_queued = mp_policy, quantized, False
        for unit in units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit), with_kwargs=True)
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            for p in unit.trainable:
                p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, unit))

    # ----- forward: gather (stage 3 always, stage 2 once the optimizer changed the shards) -----------------
    def _unshard(self, unit: _Unit) -> None:
        if not unit.is_full and (self.stage == 3 or unit.is_stale()):
            self._gather(unit)
        unit.use_full()

    @torch.no_grad()
    def _gather(self, unit: _Unit) -> None:
        send = unit.send_buffer().to(unit.full.dtype)  # mixed precision: cast before sending, like FSDP2
        if self.quantized_gather:
            q, scales = quantize_int8_blockwise(send)
            gathered = dequantize_int8_blockwise(_all_gather(q, self.group).view(-1),
                                                 _all_gather(scales, self.group).view(-1))  # fmt: skip
        else:
            gathered = _all_gather(send, self.group)
        unit.fill_full(gathered.view(self.world_size, -1)[:, : unit.shard_numel])

    def _pre_forward(self, unit: _Unit, module, args, kwargs):
        self._unshard(unit)
        if (dtype := self.mp_policy.param_dtype) is not None:  # like FSDP2's cast_forward_inputs
            return tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t,
                            (args, kwargs))  # fmt: skip

    def _post_forward(self, unit: _Unit, module, args, output) -> None:
        if unit.in_backward:  # recomputed inside backward (activation checkpointing): stay gathered
            return
        if self.stage == 3 or not torch.is_grad_enabled():
            unit.use_shards()
        if torch.is_grad_enabled():
            # The gradient of a unit's output arrives just before the unit's own backward starts.
            for tensor in tree_leaves(output):
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._pre_backward, unit))

    # ----- backward: gather again (stage 3), reduce-scatter each unit once its gradients are complete ------
    def _pre_backward(self, unit: _Unit, grad: torch.Tensor) -> None:
        if not self.backward_callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self.backward_callback_queued = True
        if not unit.in_backward:
            self._unshard(unit)
            unit.in_backward, unit.ready = True, 0

    def _gradient_ready(self, unit: _Unit, param: nn.Parameter) -> None:
        unit.ready += 1
        if unit.in_backward and unit.ready == len(unit.trainable):
            self._post_backward(unit)

    def _post_backward(self, unit: _Unit) -> None:
        unit.in_backward = False  # reduce-scatter into the shards' .grad, then free (stage 3)
        unit.use_shards(unit.reduce_gradients(self.group, self.mp_policy.reduce_dtype) if unit.trainable else None)

    def _finish_backward(self) -> None:
        """After backward, in unit order: a unit still waiting for a gradient (of a parameter unused in forward)
        reduces with zeros for it; a unit that backward never reached (stage 2) returns to its shards."""
        self.backward_callback_queued = False
        for unit in self.units:
            if unit.in_backward:
                self._post_backward(unit)
            else:
                unit.use_shards()


def _all_gather(shard: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``shard``, one row per rank in rank order: (N, numel)."""
    dist.all_gather_single(out := shard.new_empty(dist.get_world_size(group) * shard.numel()), shard, group=group)
    return out.view(dist.get_world_size(group), -1)


def fully_shard(module: nn.Module, *, stage: int = 3, process_group=None, policy=None,
                mp_policy: MixedPrecisionPolicy | None = None, quantized_gather=False) -> nn.Module:  # fmt: skip
    """Shard ``module``'s parameters, gradients and (through them) optimizer state over ``process_group``, in place.

    Units: the modules ``policy`` selects (a predicate, or a list of submodules), by default ``module.blocks``'s
    entries if any, else each child; the root unit holds the rest, tied weights included. Stage 3 gathers a
    unit before its forward and its backward and frees it after each; stage 2 keeps it gathered and gathers
    again in the first forward after the shards' version counters moved (an optimizer step, a load). After
    backward, ``.grad`` holds the mean over the ranks of the shard's gradient, added to what it held (gradient
    accumulation); a parameter without a gradient gets zeros, a frozen one is gathered but never reduced.
    Parameters and buffers are first broadcast from the group's first rank, as DDP does. ``quantized_gather``
    (stage 3) sends int8 with one scale per 256 values, ZeRO++'s qwZ. ``state_dict()`` holds the shards.
    """
    rank, world_size = _group_rank_and_size(process_group)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    assignment = _check_fully_shard(module, stage, policy, mp_policy, quantized_gather)
    with torch.no_grad():
        first = dist.get_global_rank(process_group or dist.group.WORLD, 0)
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), first, group=process_group)
    units = [_Unit(unit_module, params, rank, world_size, mp_policy.param_dtype or params[0].dtype, stage == 2)
             for unit_module, params in assignment]  # fmt: skip
    module._zero_sharding = _ShardedModule(units, stage, process_group, mp_policy, quantized_gather)
    if stage == 2:  # a shard that views the full copy would make torch.save write the full copy
        module.register_state_dict_post_hook(_clone_views)
    return module


def _clone_views(module, state_dict, prefix, local_metadata) -> None:
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
            state_dict[key] = value.clone()


def _check_fully_shard(module, stage, policy, mp_policy, quantized_gather) -> list[tuple[nn.Module, list]]:
    """Every problem with the request at once, before any work; else the units and their parameters."""
    problems = []
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


@torch.no_grad()
def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    process_group=None) -> torch.Tensor:  # fmt: skip
    """``torch.nn.utils.clip_grad_norm_`` (2-norm, same formula) when each rank holds a different shard of the
    gradients: norm = sqrt(sum over ranks of the squared shard norms), one all-reduce of one number (the padding
    is zeros). Returns the norm. Replicated gradients (DDP, ZeRO-1) need torch's own function instead."""
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    if isinstance(parameters, nn.Module):
        sharding = getattr(parameters, "_zero_sharding", None)
        process_group, parameters = process_group or (sharding and sharding.group), parameters.parameters()
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = list({id(p): p.grad for p in params if p.grad is not None}.values())
    squares = sum((torch.linalg.vector_norm(g, 2.0) ** 2 for g in grads), torch.zeros((), device=params[0].device))
    dist.all_reduce(squares, group=process_group)
    total = squares.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return total


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts once; a freed buffer counts 0)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """Bytes of the tensors this rank holds now, by kind, each storage once: parameters (shards, gathered
    copies), gradients and the optimizer's per-element state (for a ZeRO-1 wrapper, its shard's)."""
    units = module._zero_sharding.units if hasattr(module, "_zero_sharding") else []
    params = [p.data for p in module.parameters()] + [t for u in units for t in (u.full, u.flat_shard)]
    grads = [p.grad for p in module.parameters()] + [g for u in units for g in u.stashed_grads]
    inner = getattr(optimizer, "optim", optimizer)
    state = [t for s in (inner.state.values() if inner else []) for t in s.values() if torch.is_tensor(t) and t.dim()]
    return StateBytes(_storage_bytes(params), _storage_bytes(grads), _storage_bytes(state))


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
