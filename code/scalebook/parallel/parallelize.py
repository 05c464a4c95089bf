"""``parallelize(model, dims)``: every dimension of a :class:`~scalebook.parallel.dims.ParallelDims` applied to
one GPT, in a fixed order, behind the one small interface a training loop needs.

The order is picotron's ``train.py`` and torchtitan's ``parallelize_llama``, innermost change first:

    1. pipeline   this rank's stage, a slice of the GPT     :func:`~scalebook.parallel.pipeline.pipeline_stage`
    2. tensor     every matrix sharded over the tp group    :func:`~scalebook.parallel.tensor.apply_tensor_parallel`
    3. context    ring attention over the cp group          :func:`~scalebook.parallel.context.apply_context_parallel`
    4. expert     this rank's experts of the ep group       :func:`~scalebook.parallel.expert.apply_expert_parallel`
    5. data       averaged (or sharded) over the dp x cp    the book's ``OverlappedDDP`` (ddp, and zero1 with
                  :class:`~scalebook.parallel.zero.ZeroRedundancyOptimizer`), ``zero.fully_shard(stage=2|3)``,
                  or PyTorch's ``DistributedDataParallel`` / FSDP2 ``fully_shard``

Each step keeps the GPT's parameter names, so one optimizer is built last, from any ``torch.optim`` class,
over whatever parameters this rank holds. The result, a :class:`ParallelModel`, is what the loop of
:mod:`scalebook.train.loop` drives: ``forward_backward(x, y)`` (the step's micro-batches, the mean loss of the
global batch on every rank), ``clip_grad_norm_(max_norm)`` (the global norm before clipping, every gradient
counted once), ``step()``, ``zero_grad()``, ``state_dict()`` / ``load_state_dict()`` (this rank's part of a
reshardable checkpoint) and ``full_state_dict()`` (the single-process GPT's, gathered). The loop never learns
which strategy runs.

Source: picotron ``train.py`` (tp, then pp, then data-parallel wrapper); torchtitan
``torchtitan/models/llama3/infra/parallelize.py`` and ``torchtitan/distributed/utils.py`` (``clip_grad_norm_``
over a mesh); PyTorch documentation, "DistributedDataParallel", ``torch.distributed.fsdp.fully_shard``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from scalebook.parallel.dims import SHARDED_GRADIENTS, DeviceMesh, ParallelDims
from scalebook.parallel.elementwise import check_row_shard_optimizer
from scalebook.parallel.state_dict import get_state_dict, set_state_dict

__all__ = ["ParallelModel", "parallelize"]


class ParallelModel:
    """A model made parallel, with its optimizer: the interface of one training step.

    Built by :func:`parallelize`, or directly for one process: ``ParallelModel(model, optimizer)``. ``model``
    is this rank's part with the GPT's parameter names; ``module`` what runs it (a data-parallel wrapper
    around it, or ``model`` itself).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims | None = None,
                 mesh: DeviceMesh | None = None, *, module: nn.Module | None = None, schedule=None):  # fmt: skip
        self.model, self.optimizer, self.module = model, optimizer, module if module is not None else model
        self.dims, self.mesh, self.schedule = dims or ParallelDims(1), mesh, schedule
        self.coords = mesh.coords if mesh else self.dims.coordinates(0)
        self.device = next(model.parameters()).device
        self.expert_params = {id(p) for p in _expert_parameters(model)}

    def group(self, dim: str):
        """This rank's process group along ``dim`` (see :class:`~scalebook.parallel.dims.DeviceMesh`); None
        on one process."""
        return self.mesh.group(dim) if self.mesh else None

    # ----- one step --------------------------------------------------------------------------------

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's share (B, T) of the step's batch, cut into the layout's
        micro-batches; leaves every gradient that of the global batch's mean loss and returns that loss
        (float64, the same on every rank)."""
        n = self.dims.micro_batches
        if self.schedule is not None:  # the pipeline runs the micro-batches, its last stage has the loss
            with self._accumulating():
                loss = _pipeline_loss(self, x, y)
        else:
            loss = torch.zeros((), dtype=torch.float64, device=self.device)
            for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
                with self._accumulating() if i < n - 1 else contextlib.nullcontext():
                    kwargs = {}
                    if self.dims.cp > 1:
                        from scalebook.parallel.context import context_parallel_batch

                        xm, ym, kwargs["positions"] = context_parallel_batch(xm, ym, self.group("cp"))
                    _, micro_loss = self.module(xm, ym, **kwargs)
                    (micro_loss / n).backward()  # the accumulated gradient is that of the mean over micro-batches
                loss += micro_loss.detach().double() / n
        self._finish_gradients()
        return self._mean_over_replicas(loss)

    def _accumulating(self):
        """No gradient averaging in this block (DDP's ``no_sync``); a no-op for wrappers without one."""
        no_sync = getattr(self.module, "no_sync", None)
        return no_sync() if no_sync else contextlib.nullcontext()

    def _finish_gradients(self) -> None:
        """What each dimension adds after the backward passes. The book's DDP first: it has already averaged inside
        each backward, and ``sync_gradients()`` only averages what passes run under ``no_sync()`` left (the
        pipeline schedule's). The sums over model-parallel copies that follow are linear, so they commute with
        the averaging."""
        sync = getattr(self.module, "sync_gradients", None)
        if sync:
            sync()
        if self.dims.pp > 1:
            from scalebook.parallel.pipeline import sync_tied_embedding

            sync_tied_embedding(self.model, self.group("tied"))
        if self.dims.sequence_parallel:
            from scalebook.parallel.sequence import all_reduce_sequence_parallel_grads

            all_reduce_sequence_parallel_grads(self.model, self.group("tp"))
        if self.expert_params:
            from scalebook.parallel.expert import reduce_expert_gradients

            edp = self.group("edp")
            reduce_expert_gradients(self.model, edp if dist.get_world_size(edp) > 1 else None)

    def _mean_over_replicas(self, loss: torch.Tensor) -> torch.Tensor:
        """The global batch's loss: the mean of the replicas' losses, as the last pipeline stage's first
        tensor-parallel rank holds it (one all-reduce over all ranks)."""
        if self.dims.world_size == 1:
            return loss
        holds = self.coords["pp"] == self.dims.pp - 1 and self.coords["tp"] == 0
        total = loss if holds else torch.zeros_like(loss)
        dist.all_reduce(total)
        return total / self.dims.replicas

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, wherever its gradients live: returns the
        global L2 norm before clipping (the same on every rank) and scales every gradient by
        min(1, max_norm / (norm + 1e-6)).

        Each rank adds the squares of the gradients it is the one to count (``_counted_here``), so that
        a gradient that several ranks hold identically (a replica's, a tensor-parallel rank's copy of a
        replicated LayerNorm, the last stage's copy of the tied embedding) counts once; one all-reduce sums
        them.
        """
        grads = [_local(p.grad) for name, p in self.model.named_parameters() if p.grad is not None]
        counted = [_local(p.grad) for name, p in self.model.named_parameters()
                   if p.grad is not None and self._counted_here(name, p)]  # fmt: skip
        norms = [torch.linalg.vector_norm(g, 2.0) for g in counted]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros((), device=self.device)
        if self.dims.world_size > 1:
            squares = total.double() ** 2
            dist.all_reduce(squares)
            total = squares.sqrt().to(total.dtype)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula, epsilon included
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
        return total

    def _counted_here(self, name: str, param: nn.Parameter) -> bool:
        """Whether this rank counts ``param``'s gradient in the global norm: unless the data-parallel wrapper
        shards the gradients, the first replica (the first of the ranks holding the same experts, for an
        expert); a parameter that tensor parallelism leaves whole, on the first tp rank; the tied embedding,
        on the first pipeline stage."""
        if id(param) in self.expert_params:
            if self.mesh and dist.get_rank(self.group("edp")) > 0:
                return False
        elif self.dims.data_parallel not in SHARDED_GRADIENTS and (self.coords["dp"] or self.coords["cp"]):
            return False
        if self.dims.tp > 1 and self.coords["tp"]:
            from scalebook.parallel.tensor import sharding_of

            if sharding_of(name) is None:
                return False
        return not (self.dims.pp > 1 and name == "lm_head.weight" and self.model.wte is None)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ----- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's model and optimizer state for ``torch.distributed.checkpoint``: the single-process GPT's
        names, a DTensor wherever the rank holds a chunk of a tensor, so that a checkpoint written in one
        layout loads in another (see :mod:`scalebook.parallel.state_dict`)."""
        return get_state_dict(self)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a :meth:`state_dict` of this layout (filled by ``torch.distributed.checkpoint.load``) into the
        live model and optimizer."""
        set_state_dict(self, state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process GPT's state dict (every name, the tied head included), gathered from the
        shards, stages and experts on every rank (a collective), in CPU memory: the whole model need not fit
        on a GPU beside the training state (a checkpoint saves each rank's part instead: :meth:`state_dict`)."""
        return _gather_full_state(self)

    def held_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state this rank holds now (FSDP2's: their local shards;
        ZeRO's: its shards, gathered copies and inner optimizer's state)."""
        from scalebook.measure import model_state_bytes
        from scalebook.parallel.zero import held_bytes

        if any(hasattr(p, "to_local") for p in self.model.parameters()):
            return model_state_bytes(self.model, self.optimizer).total
        return held_bytes(self.model, self.optimizer).total


def _expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    from scalebook.parallel.expert import expert_parameters

    return expert_parameters(model)


def _local(obj):
    """``obj`` with every DTensor (FSDP2's sharded tensors) replaced by this rank's shard, recursively."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local(v) for v in obj]
    return obj


def _pipeline_loss(model: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from scalebook.parallel.pipeline import run_schedule

    # The unwrapped stage: the book's DDP averages through hooks on the parameters, after the schedule.
    loss = run_schedule(model.schedule, model.model, x, y, group=model.group("pp"))
    return torch.zeros((), dtype=torch.float64, device=model.device) if loss is None else loss.double()


def _gather_full_state(model: ParallelModel) -> dict[str, torch.Tensor]:
    """Undo the sharding dimension this rank's state has (ZeRO's or FSDP2's shards, the experts, or the
    tensor-parallel shards; :data:`~scalebook.parallel.dims.UNSUPPORTED` keeps them apart), then gather the
    pipeline's stages, which every rank of a pipeline exchanges."""
    from scalebook.parallel import expert, tensor, zero

    inner, dims = model.model, model.dims
    if dims.data_parallel in ("zero2", "zero3"):
        state = zero.full_state_dict(inner)
    elif model.expert_params:
        state = expert.full_state_dict(inner)
    elif dims.tp > 1:
        state = tensor.full_state_dict(inner, model.group("tp"))
    else:
        state = {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in inner.state_dict().items()}
    state = {name: t.detach().cpu() for name, t in state.items()}  # the documented host copy (full_state_dict)
    if dims.pp > 1:
        parts = [None] * dims.pp
        dist.all_gather_object(parts, state, group=model.group("pp"))
        state = {name: t for part in parts for name, t in part.items()}
        state["lm_head.weight"] = state["wte.weight"]  # the two copies are equal; the first stage's counts
    return state


# ----- composition ------------------------------------------------------------------------------------


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    param_groups: Callable[[nn.Module], list[dict]] | None = None,
    bucket_cap_mb: float | None = None,
    **optimizer_kwargs,
) -> ParallelModel:
    """Apply ``dims`` to ``model`` (a :class:`scalebook.model.GPT`, the same weights on every rank), in place,
    and build the optimizer: ``optimizer_class(param_groups(model) or model.parameters(), **optimizer_kwargs)``
    over this rank's parameters (wrapped in :class:`~scalebook.parallel.zero.ZeroRedundancyOptimizer` for
    zero1). A collective: every rank calls it, after ``torch.distributed`` is initialised when
    ``dims.world_size > 1``. ``bucket_cap_mb`` sizes the gradient buckets of ddp, zero1 and torch-ddp."""
    mesh = DeviceMesh.build(dims) if dist.is_initialized() else None
    if dims.world_size > 1 and mesh is None:
        raise ValueError(f"a layout of {dims.world_size} ranks needs torch.distributed initialised on every rank")
    coords = mesh.coords if mesh else dims.coordinates(0)
    schedule = None
    if dims.pp > 1:
        from scalebook.parallel.pipeline import build_schedule, pipeline_stage

        pipeline_stage(model, coords["pp"], dims.pp)
        schedule = build_schedule("1f1b", dims.pp, dims.micro_batches)
    if dims.tp > 1:
        from scalebook.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=dims.sequence_parallel)
    if dims.cp > 1:
        from scalebook.parallel.context import apply_context_parallel

        apply_context_parallel(model, mesh.group("cp"))
    if dims.ep > 1:
        from scalebook.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, mesh.group("ep"))
    module = _data_parallel(model, dims, mesh, bucket_cap_mb)
    groups = param_groups(model) if param_groups else model.parameters()
    if dims.data_parallel == "zero1":
        from scalebook.parallel.zero import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class, mesh.group("dp_cp"), **optimizer_kwargs)
    else:
        optimizer = optimizer_class(groups, **optimizer_kwargs)
        check_row_shard_optimizer(optimizer)  # ZeRO-2/3's row shards: an optimizer refused now, not at its first step
    return ParallelModel(model, optimizer, dims, mesh, module=module, schedule=schedule)


@contextlib.contextmanager
def _experts_hidden(model: nn.Module):
    """Expert parallelism's experts out of sight while a data-parallel wrapper registers its parameters: it
    must neither broadcast nor average them, since the replicas hold different experts
    (:mod:`scalebook.parallel.expert`, step 2); :func:`~scalebook.parallel.expert.reduce_expert_gradients`
    averages them instead. The book's DDP has no list of parameters to ignore, which this stands in for."""
    from scalebook.parallel.expert import ExpertParallelMoE

    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    experts = [layer.experts for layer in layers]
    for layer in layers:
        layer.experts = nn.ModuleList()
    try:
        yield
    finally:
        for layer, kept in zip(layers, experts, strict=True):
            layer.experts = kept


def _data_parallel(model: nn.Module, dims: ParallelDims, mesh, bucket_cap_mb: float | None) -> nn.Module:
    """Step 5: the module the loop calls, its replicas kept in step over the dp x cp group."""
    if dims.data_parallel is None:
        return model
    group, buckets = mesh.group("dp_cp"), {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    if dims.data_parallel in ("ddp", "zero1"):
        from scalebook.parallel.ddp import OverlappedDDP

        with _experts_hidden(model):
            return OverlappedDDP(model, group, **buckets)
    if dims.data_parallel in ("zero2", "zero3"):
        from scalebook.parallel.zero import fully_shard

        return fully_shard(model, stage=int(dims.data_parallel[-1]), process_group=group)
    device = next(model.parameters()).device
    if dims.data_parallel == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       process_group=group, **buckets)  # fmt: skip
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch_mesh = TorchMesh.from_group(group, device.type)
    for block in model.blocks:
        fsdp2_fully_shard(block, mesh=torch_mesh)
    return fsdp2_fully_shard(model, mesh=torch_mesh)
