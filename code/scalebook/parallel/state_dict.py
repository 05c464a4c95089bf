"""A rank's training state as ``torch.distributed.checkpoint`` (DCP) reads and writes it: global names, and
for every tensor the place of this rank's piece in the global tensor.

DCP saves a flat dict of tensors in which each entry says which part of which *global* tensor this rank
holds: a DTensor names its chunk (its mesh and placement say which rows or columns); a plain tensor is the
whole tensor, and when several ranks hold it (replicas) the save planner writes it once. A load asks, for each
tensor this rank holds in *its* layout, which saved chunks overlap it, and reads only those: a checkpoint
written by one layout loads into another (``torch.distributed.checkpoint`` documentation, "resharding").

:func:`get_state_dict` names everything after the single-process GPT: ``model.<name>`` a parameter or
persistent buffer, ``optim.<name>.<key>`` its optimizer state (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``),
laid out like the parameter. Each layout is a way of cutting the same global tensors:

==================  =====================================================================================
single, ddp, cp,    plain tensors: every replica presents the whole tensor, DCP writes one copy
torch-ddp
fsdp (FSDP2)        its own DTensors, sharded along dim 0 over the data-parallel mesh
zero2, zero3        the same DTensor ``Shard(0)``: ZeRO pads each parameter to N k rows (k = ceil(rows / N))
                    and rank r keeps rows [r k, (r + 1) k); without the padding, that is torch.chunk's split,
                    which is DTensor's
tp                  ``Shard(0)`` or ``Shard(1)`` over the tp mesh (``scalebook.parallel.tensor.SHARDING``);
                    but the fused QKV matrix's shard is three row ranges (the same heads of Q, K and V), not
                    one chunk: it is gathered over the tp group and presented whole (two tensors a block)
pp                  a stage's own blocks (the stages' names are disjoint); the last stage's copy of the tied
                    embedding as ``wte.weight``, the same values as the first stage's, written once
ep                  the local experts under their global index
zero1               the optimizer state lives in one flat buffer cut without regard to the parameters: it is
                    all-gathered over the replicas and presented per parameter, whole (each written once), and
                    a load copies each rank's slice back: a transient buffer the size of the optimizer state,
                    as torch's ``ZeroRedundancyOptimizer.consolidate_state_dict``
==================  =====================================================================================

A state dict's DTensors view the live tensors, so ``dcp.load`` writes straight into the model and the
optimizer; :func:`set_state_dict` then copies what was loaded into a copy (a gathered tensor) back into place.

Saving changes nothing. A parameter without optimizer state (before the first step, or one that never had a
gradient) is saved without ``optim.`` entries; a load asks for the optimizer state the checkpoint holds (its
names: ``get_state_dict(pm, saved=...)``) and leaves the other parameters without state, so a resumed run
creates it at the same step as an uninterrupted one (an earlier version stepped such parameters at lr 0 on
every save, which moved AdamW's step count and so its bias correction).

Source: PyTorch documentation, "Distributed Checkpoint - torch.distributed.checkpoint" and
``torch.distributed.checkpoint.state_dict.get_state_dict`` (FQN-keyed model and optimizer state);
torchtitan ``torchtitan/components/checkpoint.py``; Rajbhandari et al. 2020 (ZeRO's partitions).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["get_state_dict", "set_state_dict"]


@dataclass
class _Layout:
    """How one parameter's local tensor (or a tensor of its local shape: its optimizer state) is presented:
    ``present(local)`` gives DCP's tensor, ``restore(local, loaded)`` copies a loaded one back into ``local``."""

    present: Callable[[torch.Tensor], torch.Tensor]
    restore: Callable[[torch.Tensor, torch.Tensor], None]


def _copy(into: torch.Tensor, value: torch.Tensor) -> None:
    """``into.copy_(value)`` for plain tensors or DTensors, skipped when DCP loaded in place already."""
    into, value = _local(into), _local(value)
    if into.data_ptr() != value.data_ptr() or into.shape != value.shape:
        into.copy_(value)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _chunk(mesh, dim: int, shape: torch.Size) -> _Layout:
    """Rank r of ``mesh`` holds chunk r of ``shape`` along ``dim`` (torch.chunk's split), possibly padded."""
    from torch.distributed.tensor import DTensor, Shard

    size = -(-shape[dim] // mesh.size())
    rows = max(0, min(size, shape[dim] - mesh.get_local_rank() * size))  # the last chunks may be short or empty

    def present(local):
        return DTensor.from_local(local.narrow(dim, 0, rows), mesh, [Shard(dim)], run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))  # fmt: skip

    return _Layout(present, lambda local, loaded: _copy(local.narrow(dim, 0, rows), loaded))


def _replicated() -> _Layout:
    return _Layout(lambda local: local, _copy)


def _gathered_qkv(group) -> _Layout:
    from scalebook.parallel.tensor import shard_tensor, unshard_tensor

    rank, tp = dist.get_rank(group), dist.get_world_size(group)

    def present(local):
        pieces = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return unshard_tensor(pieces, "qkv")

    return _Layout(present, lambda local, loaded: _copy(local, shard_tensor(loaded, "qkv", rank, tp)))


def _unsharded_shapes(model) -> dict[str, torch.Size]:
    """The GPT's parameter shapes, from a copy on the meta device (no memory): ZeRO's shards are padded, so
    their own shapes do not say how many rows the parameter has."""
    from scalebook.model import GPT

    with torch.device("meta"):
        return {name: p.shape for name, p in GPT(model.config).named_parameters()}


class _Presenter:
    """The global name and :class:`_Layout` of each parameter of a :class:`ParallelModel` on this rank."""

    def __init__(self, pm):
        from torch.distributed.device_mesh import DeviceMesh

        self.pm, self.inner = pm, pm.model
        device = pm.device.type
        self.meshes = {dim: DeviceMesh.from_group(pm.group(dim), device) for dim in ("dp_cp", "tp")
                       if pm.mesh and dist.get_world_size(pm.group(dim)) > 1}  # fmt: skip
        sharded = pm.dims.data_parallel in ("zero2", "zero3") and "dp_cp" in self.meshes  # one rank: whole tensors
        self.zero = _unsharded_shapes(self.inner) if sharded else {}
        self.experts = self._expert_names()

    def _expert_names(self) -> dict[str, str]:
        """Each local expert parameter's name -> its name in the unsharded model."""
        from scalebook.parallel.expert import ExpertParallelMoE

        names = {}
        for layer_name, layer in self.inner.named_modules():
            if isinstance(layer, ExpertParallelMoE):
                prefix = f"{layer_name}.experts."
                for i, expert in enumerate(layer.experts):
                    for name, _ in expert.named_parameters():
                        names[f"{prefix}{i}.{name}"] = f"{prefix}{layer.first_expert + i}.{name}"
        return names

    def name(self, name: str) -> str:
        if name == "lm_head.weight" and self.inner.wte is None:  # a pipeline's last stage: the tied copy
            return "wte.weight"
        return self.experts.get(name, name)

    def layout(self, name: str, param: torch.Tensor) -> _Layout:
        from scalebook.parallel.tensor import sharding_of

        if hasattr(param, "to_local"):  # FSDP2's DTensor
            return _replicated()
        if name in self.zero:
            return _chunk(self.meshes["dp_cp"], 0, self.zero[name])
        sharding = sharding_of(name) if "tp" in self.meshes else None
        if sharding == "qkv":
            return _gathered_qkv(self.pm.group("tp"))
        if sharding is not None:
            shape = list(param.shape)
            shape[sharding] *= self.meshes["tp"].size()
            return _chunk(self.meshes["tp"], sharding, torch.Size(shape))
        return _replicated()


def _entries(pm, presenter: _Presenter) -> dict[str, tuple[torch.Tensor, _Layout]]:
    """Every tensor of the state under its global name: the live local tensor and its layout."""
    entries = {}
    params = dict(pm.model.named_parameters())
    for name, param in params.items():
        entries[f"model.{presenter.name(name)}"] = (param.detach(), presenter.layout(name, param))
    persistent = pm.model.state_dict(keep_vars=True).keys()
    for name, buffer in pm.model.named_buffers():
        if name in persistent:
            entries[f"model.{presenter.name(name)}"] = (buffer, _replicated())
    entries.update(_optimizer_entries(pm, presenter, params))
    return entries


def _optimizer_entries(pm, presenter: _Presenter, params: dict) -> dict:
    from scalebook.parallel.zero import ZeroRedundancyOptimizer

    optimizer, entries = pm.optimizer, {}
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return _zero1_entries(optimizer, presenter, params)
    for name, param in params.items():
        for key, value in optimizer.state.get(param, {}).items():  # .get: state is a defaultdict
            layout = presenter.layout(name, param) if value.dim() else _replicated()
            entries[f"optim.{presenter.name(name)}.{key}"] = (value, layout)
    return entries


def _zero1_entries(optimizer, presenter: _Presenter, params: dict) -> dict:
    """ZeRO-1's flat optimizer state, all-gathered and cut per parameter (see the module docstring)."""
    names = {id(p): n for n, p in params.items()}
    entries = {}
    for _, flat in optimizer._pairs():
        for key, value in optimizer.optim.state.get(flat.shard, {}).items():
            if value.dim():
                whole = value.new_empty(flat.flat.numel())
                dist.all_gather_single(whole, value, group=optimizer.process_group)
            for p, offset in zip(flat.params, flat.offsets, strict=True):
                name = names[id(p)]
                if not value.dim():
                    entries[f"optim.{presenter.name(name)}.{key}"] = (value, _replicated())
                    continue
                piece = whole[offset : offset + p.numel()].view(p.shape)
                layout = _slice_back(presenter.layout(name, p), value, flat, offset, p)
                entries[f"optim.{presenter.name(name)}.{key}"] = (piece, layout)
    return entries


def _slice_back(layout: _Layout, shard: torch.Tensor, flat, offset: int, param) -> _Layout:
    """``layout``, whose restore copies into this rank's flat ``shard`` of the optimizer state the part of
    ``param``'s elements [offset, offset + numel) of the flat buffer that it owns, [r s, (r + 1) s)."""
    first, last = max(offset, flat.owned.start), min(offset + param.numel(), flat.owned.stop)

    def restore(_, loaded):
        if first < last:
            whole = torch.empty(param.shape, dtype=shard.dtype, device=shard.device)
            layout.restore(whole, loaded)
            shard[first - flat.owned.start : last - flat.owned.start] = whole.view(-1)[first - offset : last - offset]

    return _Layout(layout.present, restore)


def _state_owners(pm, presenter: _Presenter, params: dict) -> dict[str, tuple[dict, torch.Tensor]]:
    """Each parameter's name prefix in the state, ``optim.<global name>``, -> where its optimizer state lives:
    (the ``state`` dict of an optimizer, its key there). ZeRO-1's parameters of one group share their flat shard."""
    from scalebook.parallel.zero import ZeroRedundancyOptimizer

    optimizer = pm.optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        names = {id(p): n for n, p in params.items()}
        return {f"optim.{presenter.name(names[id(p)])}": (optimizer.optim.state, flat.shard)
                for _, flat in optimizer._pairs() for p in flat.params}  # fmt: skip
    return {f"optim.{presenter.name(name)}": (optimizer.state, p) for name, p in params.items()}


def _prefix(key: str) -> str:
    """``optim.<global name>`` of ``optim.<global name>.<state key>`` (state keys hold no dot: step, exp_avg)."""
    return key.rsplit(".", 1)[0]


def _init_optimizer_state(pm, owners: dict[str, tuple[dict, torch.Tensor]], saved: set[str]) -> None:
    """Before a load only: give every parameter that has optimizer state in the checkpoint (``saved``: its
    ``optim.<name>`` prefixes) and none here the tensors for DCP to fill, by one step at a learning rate of 0
    with zero gradients for those parameters and none for the others, which the optimizer skips (as
    ``torch.distributed.checkpoint.state_dict`` does). The values that step makes are not anyone's state (an
    Adam step count of 1, an Rprop step size of lr = 0): the load overwrites every one of them, and the
    weights too. The gradients are put back. ZeRO-1's inner optimizer steps one flat shard: all of its state
    exists, or none; every rank decides alike, since ``saved`` is the checkpoint's."""
    from scalebook.parallel.zero import ZeroRedundancyOptimizer

    missing = {id(key) for prefix, (state, key) in owners.items() if prefix in saved and not state.get(key)}
    if not missing:
        return
    params = [p for group in pm.optimizer.param_groups for p in group["params"]]
    if isinstance(pm.optimizer, ZeroRedundancyOptimizer):
        missing = {id(p) for p in params}
    grads, lrs = [p.grad for p in params], [group["lr"] for group in pm.optimizer.param_groups]
    for group in pm.optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in missing else None
    pm.optimizer.step()
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
    for group, lr in zip(pm.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def get_state_dict(pm, *, saved: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """This rank's model and optimizer state for DCP: global names, DTensors where the rank holds a chunk
    (see the module docstring). A collective under tp (the QKV matrices) and zero1 (the optimizer state).

    For a save (``saved`` None) it changes nothing: a parameter without optimizer state (before the first
    step, or one that never had a gradient) has no ``optim.`` entries, so a resumed run creates that state
    at the same step as an uninterrupted one. For a load, ``saved`` is the names the checkpoint holds
    (:meth:`~scalebook.train.checkpoint.Checkpointer.saved_names`): the result is the tensors for ``dcp.load``
    to fill, the optimizer state of exactly the parameters that have some there (created here if missing);
    :func:`set_state_dict` then drops the state of the others."""
    presenter = _Presenter(pm)
    if saved is not None:
        saved_prefixes = {_prefix(key) for key in saved if key.startswith("optim.")}
        _init_optimizer_state(pm, _state_owners(pm, presenter, dict(pm.model.named_parameters())), saved_prefixes)
    entries = _entries(pm, presenter)
    if saved is not None:
        entries = {key: entry for key, entry in entries.items() if not key.startswith("optim.") or key in saved}
    return {key: layout.present(local) for key, (local, layout) in entries.items()}


@torch.no_grad()
def set_state_dict(pm, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (a :func:`get_state_dict` of this layout, filled by ``dcp.load``) into the live model
    and optimizer. A parameter whose optimizer state ``state`` lacks entirely has none afterwards (as when the
    checkpoint was saved); a model name missing from ``state``, or part of a parameter's optimizer state, is a
    KeyError naming it, and so is optimizer state this optimizer has no tensors for (build ``state`` with
    ``get_state_dict(pm, saved=...)``)."""
    presenter = _Presenter(pm)
    entries = _entries(pm, presenter)
    unknown = [key for key in state if key.startswith("optim.") and key not in entries]
    if unknown:
        raise KeyError(f"{unknown[0]} has no tensor in this optimizer to load into: build the state to load "
                       "with get_state_dict(pm, saved=<the checkpoint's names>)")  # fmt: skip
    absent = [key for key in entries if key not in state]
    partial = {_prefix(key) for key in absent} & {_prefix(key) for key in state if key.startswith("optim.")}
    if problem := next((key for key in absent if not key.startswith("optim.") or _prefix(key) in partial), None):
        raise KeyError(f"{problem} is not in the loaded state (its names: {', '.join(list(state)[:5])}, ...)")
    for key, (local, layout) in entries.items():
        if key in state:
            layout.restore(local, state[key])
    present = {_prefix(key) for key in state if key.startswith("optim.")}
    owners = _state_owners(pm, presenter, dict(pm.model.named_parameters()))
    kept = {id(owners[prefix][1]) for prefix in present if prefix in owners}
    for prefix, (opt_state, key) in owners.items():
        if prefix not in present and id(key) not in kept:
            opt_state.pop(key, None)
