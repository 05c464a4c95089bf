"""ZeRO: data parallelism that shards the model states over the ranks instead of copying them.

DDP (Chapter 10) keeps the parameters, gradients and optimizer state whole on each of N ranks. ZeRO removes
that redundancy one kind of state at a time; here each stage has PyTorch's shape, so that a training loop
with any elementwise ``torch.optim`` optimizer runs unchanged:

    stage 1  ZeroRedundancyOptimizer(params, AdamW, ...) wraps an optimizer: each rank steps the optimizer
             state of 1/N of the elements, then an all-gather brings every rank the updated parameters.
    stage 2  fully_shard(model, stage=2): after backward each parameter holds this rank's shard and ``.grad``
             the averaged gradient of that shard; the full parameters stay gathered between steps.
    stage 3  fully_shard(model, stage=3), FSDP2's fully_shard: the full parameters exist only around each
             unit's forward and backward.

Stage 1 lays each parameter group end to end in one flat buffer padded to a multiple of N, and rank r steps
elements [r s, (r + 1) s) as in the ZeRO paper: even shards, right only for elementwise optimizers (SGD, Adam,
AdamW, ...; every stage refuses the others, :mod:`scalebook.parallel.elementwise`); torch's version assigns
whole tensors to ranks instead, which suits an optimizer that looks at one tensor at a time. Stages 2 and 3
(row shards, units, prefetching, HSDP) live in :mod:`scalebook.parallel.fsdp` and are importable from here
too; :func:`clip_grad_norm_` and :func:`held_bytes` serve every stage.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
Sec. 5 and 7; Zhao et al. 2023, "PyTorch FSDP"; Wang et al. 2023, "ZeRO++" (int8 all-gather); PyTorch
documentation, ``torch.distributed.fsdp.fully_shard`` and ``torch.distributed.optim.ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from scalebook.measure import StateBytes  # bytes by kind; in mixed precision the fp32 shards are the master copy
from scalebook.parallel.elementwise import check_elementwise
from scalebook.parallel.fsdp import (  # noqa: F401  (stages 2 and 3, importable from here as before)
    QUANT_BLOCK,
    MixedPrecisionPolicy,
    TimelineEvent,
    _group_rank_and_size,
    _offsets,
    dequantize_int8_blockwise,
    full_state_dict,
    fully_shard,
    quantize_int8_blockwise,
    record_timeline,
    set_requires_gradient_sync,
)


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

    ``optimizer_class`` must be elementwise (:mod:`scalebook.parallel.elementwise`): a slice cut anywhere hides
    the whole tensor, so a class that is neither allowed nor a subclass keeping an allowed class's update is
    refused here, before any work, unless ``elementwise=True`` declares it so. Torch's
    ``ZeroRedundancyOptimizer`` assigns whole tensors to ranks instead, the alternative for per-tensor updates.
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], process_group=None, *,
                 reduce_scatter_gradients: bool = False, elementwise: bool = False, **defaults):  # fmt: skip
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        check_elementwise(optimizer_class, declared=elementwise, declare="pass elementwise=True",
                          shards="each rank steps a slice of a flat buffer that cuts the tensors anywhere")  # fmt: skip
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


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               params: list[nn.Parameter] | None = None) -> StateBytes:  # fmt: skip
    """Bytes of the tensors this rank holds now, by kind, each storage once: parameters (shards, gathered
    copies), gradients and the optimizer's per-element state (for a ZeRO-1 wrapper, its shard's). ``params``:
    ``list(module.parameters())`` computed once by a caller that measures often (walking the modules costs most)."""
    state = getattr(module, "_zero_sharding", None)
    units, unsynced = (state.units, state.unsynced.values()) if state else ([], [])
    params = list(module.parameters()) if params is None else params
    grads = [p.grad for p in params] + [g for u in units for g in u.stashed_grads] + [g for k in unsynced for g in k]
    params = [p.data for p in params] + [t for u in units for t in (u.full, u.flat_shard)]
    params += [t for u in units if u.pending for t in u.pending[1]]  # a prefetched all-gather's output
    inner = getattr(optimizer, "optim", optimizer)
    state = [t for s in (inner.state.values() if inner else []) for t in s.values() if torch.is_tensor(t) and t.dim()]
    return StateBytes(_storage_bytes(params), _storage_bytes(grads), _storage_bytes(state))
