"""ZeRO: data parallelism that shards the model states over the ranks instead of copying them.

Plain data parallelism (stage 0, the DDP of Chapter 10) keeps a full copy of the parameters, the
gradients and Adam's state on each of N ranks: (2 + 2 + K) Psi bytes per rank in mixed precision, K = 12.
Each ZeRO stage here is the previous one plus one change:

    stage 1  each rank keeps the optimizer state (Adam's moments and, in mixed precision, the fp32 master
             weights) of 1/N of the parameters only. The gradients are reduce-scattered, so each rank
             receives the averaged gradient of its own shard; it updates that shard, and the updated
             shards are all-gathered back into every rank's full parameters.
    stage 2  the gradients are sharded too: a unit's full gradient lives only while the backward pass
             fills it; it is reduce-scattered into the owner's shard as soon as it is complete, then freed.
    stage 3  the parameters are sharded too: a unit's parameters are all-gathered just before its forward
             and again just before its backward, and freed after each.

A *unit* is a group of parameters communicated together: one per Transformer block, plus a root unit
for everything outside the blocks (embeddings, final norm, the tied head). Each unit is laid out as one
flat vector, padded with zeros to a multiple of N so that it splits into N equal contiguous shards
(:class:`FlatUnit`), as FSDP1's ``FlatParameter`` and DeepSpeed do. The model's parameters become views
into the unit's flat buffer, so the model runs unchanged; stage 3 frees that buffer's storage between
uses and refills it in place, which autograd's saved views see.

Adam runs on flat shards (:func:`adam_update`): it is elementwise, so updating a shard is exactly
updating those elements of the whole model. ``mixed_precision=True`` computes in bf16 (parameters and
gradients, and the gradients are reduced in bf16) and keeps fp32 master weights and moments, the
ZeRO paper's K = 12 layout. ``quantized_gather=True`` (stage 3) sends the parameters as int8 with one
absmax scale per block of 256 values, ZeRO++'s quantized weight communication.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
Sec. 5 and 7; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel";
Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training";
PyTorch documentation, ``torch.distributed.fsdp.fully_shard`` and ``ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from scalebook import data
from scalebook.comm import count_traffic
from scalebook.measure import StateBytes  # bytes by kind; the fp32 master weights count as optimizer state
from scalebook.model import GPT, GPTConfig
from scalebook.parity import max_relative_difference

STAGES = (0, 1, 2, 3)
QUANT_BLOCK = 256  # values sharing one int8 scale in the quantized all-gather


class FlatUnit:
    """Parameters communicated together, seen as one flat vector split into ``world_size`` equal shards.

    The vector is padded with zeros to ``padded_numel = world_size * shard_numel`` elements, with
    ``shard_numel = ceil(numel / world_size)``; rank r owns elements ``[r * shard_numel, (r + 1) * shard_numel)``.
    """

    def __init__(self, module: nn.Module, named_params: list[tuple[str, nn.Parameter]], world_size: int, rank: int):
        self.module = module  # its forward marks when the unit's parameters are needed
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-self.numel // world_size)
        self.padded_numel = self.shard_numel * world_size
        self.owned = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def flatten(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One tensor per parameter, concatenated into a new zero-padded flat vector."""
        flat = torch.zeros(self.padded_numel, dtype=dtype)
        for view, tensor in zip(self.views(flat), tensors, strict=True):
            view.copy_(tensor)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into tensors shaped like the parameters: views that share its memory."""
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step, in place, with the arithmetic of ``torch.optim.AdamW(foreach=False)``, element by element.

    theta <- theta (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    theta <- theta - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)
    """
    beta1, beta2 = betas
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def quantize_int8_blockwise(x: torch.Tensor, block: int = QUANT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of a 1-D tensor, one scale per ``block`` values: q = round(x / s), s = absmax / 127.

    Returns ``(q, scales)``: ``q`` (int8) is zero-padded to whole blocks, ``scales`` are fp32.
    """
    n_blocks = -(-x.numel() // block)
    blocks = torch.zeros(n_blocks * block, dtype=torch.float32)
    blocks[: x.numel()] = x
    blocks = blocks.view(n_blocks, block)
    scales = blocks.abs().amax(dim=1) / 127
    # An all-zero block has scale 0; dividing by the smallest normal float keeps its codes at 0.
    q = torch.round(blocks / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).to(torch.int8)
    return q.view(-1), scales


def dequantize_int8_blockwise(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``q * s`` that :func:`quantize_int8_blockwise` encoded (padding included)."""
    return (q.view(scales.numel(), -1).to(torch.float32) * scales[:, None]).view(-1)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts once; a freed buffer counts 0)."""
    storages = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _output_tensors(output) -> list[torch.Tensor]:
    items = output if isinstance(output, (tuple, list)) else (output,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class ZeRO0:
    """Stage 0, plain data parallelism (as in Chapter 10) on flat buffers: the baseline the stages change.

    Every rank holds all parameters, all gradients and Adam's state for every element. After the
    backward pass each unit's gradient is all-reduced and averaged; every rank applies the same update.
    ``step(x, y)`` trains on this rank's batch; ``peak_bytes`` is the most each kind of state took
    during the last step and ``held_bytes()`` what it takes now.
    """

    stage = 0

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        mixed_precision: bool = False,
        wrap: Sequence[nn.Module] | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        wrap = list(getattr(model, "blocks", [])) if wrap is None else list(wrap)
        _check_arguments(model, wrap, lr, betas, eps, weight_decay)
        self.model, self.group = model, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.hyper = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.mixed_precision = mixed_precision
        self.master_dtype = next(model.parameters()).dtype
        self.compute_dtype = torch.bfloat16 if mixed_precision else self.master_dtype
        self.units = self._make_units(wrap)
        self.steps = 0
        self.peak_bytes = StateBytes(0, 0, 0)
        for unit in self.units:
            initial = unit.flatten([p.detach() for p in unit.params], self.master_dtype)
            self._init_params(unit, initial)
            self._init_grads(unit)
            self._init_optimizer(unit, initial)
        self._install_hooks()

    def _make_units(self, wrap: list[nn.Module]) -> list[FlatUnit]:
        names = {id(p): name for name, p in self.model.named_parameters()}
        in_blocks = {id(p) for module in wrap for p in module.parameters()}
        root = [(names[id(p)], p) for p in self.model.parameters() if id(p) not in in_blocks]
        groups = [(self.model, root)] if root else []
        groups += [(module, [(names[id(p)], p) for p in module.parameters()]) for module in wrap]
        return [FlatUnit(module, params, self.world_size, self.rank) for module, params in groups]

    # ----- what each rank holds: stage 0 owns every element --------------------------------------
    def _owned(self, unit: FlatUnit) -> slice:
        return slice(0, unit.padded_numel)

    def _init_params(self, unit: FlatUnit, initial: torch.Tensor) -> None:
        unit.full = initial.to(self.compute_dtype)
        self._bind_params(unit)
        unit.param_shard = unit.full[self._owned(unit)]

    def _bind_params(self, unit: FlatUnit) -> None:
        # Assigning ``.data`` makes each Parameter a view of the flat buffer yet keeps the same object (the
        # model, autograd and the hooks still see it) with its own version counter, so refilling the buffer
        # in place (the all-gathers) does not trip autograd's check on the tensors it saved.
        for p, view in zip(unit.params, unit.views(unit.full), strict=True):
            p.data = view

    def _init_grads(self, unit: FlatUnit) -> None:
        # Gradients accumulate straight into one flat buffer per unit: p.grad is a view of it.
        unit.grad_full = torch.zeros(unit.padded_numel, dtype=self.compute_dtype)
        self._bind_grads(unit)
        unit.grad_shard = unit.grad_full[self._owned(unit)]

    def _bind_grads(self, unit: FlatUnit) -> None:
        for p, view in zip(unit.params, unit.views(unit.grad_full), strict=True):
            p.grad = view

    def _init_optimizer(self, unit: FlatUnit, initial: torch.Tensor) -> None:
        # Mixed precision updates an fp32 master copy; otherwise the update goes into the parameters.
        unit.master = initial[self._owned(unit)].clone() if self.mixed_precision else unit.param_shard
        unit.exp_avg = torch.zeros_like(unit.master)
        unit.exp_avg_sq = torch.zeros_like(unit.master)

    def _install_hooks(self) -> None:
        """Stage 0 needs none: the gradients are exchanged after the backward pass."""

    # ----- one training step ---------------------------------------------------------------------
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward on this rank's batch, gradient exchange, one Adam step; returns the local loss."""
        self.peak_bytes = StateBytes(0, 0, 0)
        self._zero_grads()
        self._measure()
        _, loss = self.model(x, y)
        loss.backward()
        self._reduce_gradients()
        self._measure()
        self.steps += 1
        for unit in self.units:
            adam_update(unit.master, unit.grad_shard.to(unit.master.dtype), unit.exp_avg, unit.exp_avg_sq,
                        step=self.steps, **self.hyper)  # fmt: skip
            if self.mixed_precision:
                unit.param_shard.copy_(unit.master)  # round the fp32 master to the bf16 working copy
            self._after_update(unit)
        self._measure()
        return loss.item()

    def _zero_grads(self) -> None:
        for unit in self.units:
            unit.grad_full.zero_()

    def _reduce_gradients(self) -> None:
        # The mean of the ranks' gradients is the gradient of the mean loss over the global batch.
        for unit in self.units:
            dist.all_reduce(unit.grad_full, group=self.group)
            unit.grad_full.div_(self.world_size)

    def _after_update(self, unit: FlatUnit) -> None:
        """Every rank made the same update: nothing to exchange."""

    # ----- inspection --------------------------------------------------------------------------
    def held_bytes(self) -> StateBytes:
        """Bytes of the tensors this rank holds now, by kind; each storage counted once, freed ones as 0."""
        params, grads, optimizer = [], [], []
        for unit in self.units:
            params += [unit.full, unit.param_shard]
            grads += [unit.grad_full, unit.grad_shard]
            optimizer += [unit.exp_avg, unit.exp_avg_sq] + ([unit.master] if self.mixed_precision else [])
        return StateBytes(_storage_bytes(params), _storage_bytes(grads), _storage_bytes(optimizer))

    def _measure(self) -> None:
        now, peak = self.held_bytes(), self.peak_bytes
        self.peak_bytes = StateBytes(
            max(now.params, peak.params), max(now.grads, peak.grads), max(now.optimizer, peak.optimizer)
        )

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, in the optimizer's precision (a collective: call it on every rank)."""
        return self._by_name(lambda unit: unit.master)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient of the last step by name, as the update used it: summed over the ranks
        and divided by d, the gradient of the mean loss over the global batch, in the precision it was
        reduced in (a collective: call it on every rank, after ``step``)."""
        return self._by_name(lambda unit: unit.grad_shard)

    def _by_name(self, shard_of) -> dict[str, torch.Tensor]:
        """The full tensors whose owned shards ``shard_of(unit)`` returns, cut into named parameters."""
        out = {}
        for unit in self.units:
            full = self._gather_shard(unit, shard_of(unit))
            out.update(zip(unit.names, (v.clone() for v in unit.views(full)), strict=True))
        return out

    def _gather_shard(self, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
        return shard  # stage 0 owns every element


class ZeRO1(ZeRO0):
    """Stage 1: each rank keeps the optimizer state of its shard only.

    Gradients are still computed in full, then reduce-scattered: rank r receives the averaged gradient of
    shard r, in place in its own slice of the gradient buffer. It updates that shard, and an all-gather
    (in place, every rank's slice of the flat parameters) brings everyone the updated parameters.
    Reduce-scatter plus all-gather move as many bytes as DDP's all-reduce.
    """

    stage = 1

    def _owned(self, unit: FlatUnit) -> slice:
        return unit.owned

    def _reduce_gradients(self) -> None:
        for unit in self.units:
            dist.reduce_scatter_single(unit.grad_shard, unit.grad_full, group=self.group)
            unit.grad_shard.div_(self.world_size)

    def _after_update(self, unit: FlatUnit) -> None:
        dist.all_gather_single(unit.full, unit.param_shard, group=self.group)

    def _gather_shard(self, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(unit.padded_numel, dtype=shard.dtype)
        dist.all_gather_single(full, shard, group=self.group)
        return full


class ZeRO2(ZeRO1):
    """Stage 2: the gradients are sharded too.

    A unit's full-size gradient buffer is allocated when its backward begins (the gradient of the unit's
    output arrives), filled by autograd, reduce-scattered into the owner's shard as soon as every one of
    its parameters has its gradient, and freed. At most the root and one block hold full gradients at once.
    """

    stage = 2

    def _init_grads(self, unit: FlatUnit) -> None:
        unit.grad_full = None  # exists only during the unit's backward
        unit.grad_shard = torch.zeros(unit.shard_numel, dtype=self.compute_dtype)
        unit.pending = 0
        for p in unit.params:
            p.grad = None
            p.register_post_accumulate_grad_hook(lambda _, unit=unit: self._after_param_grad(unit))

    def _install_hooks(self) -> None:
        for unit in self.units:
            unit.module.register_forward_hook(lambda _, args, out, unit=unit: self._after_forward(unit, out))

    def _zero_grads(self) -> None:
        for unit in self.units:
            unit.grad_shard.zero_()

    def _after_forward(self, unit: FlatUnit, output) -> None:
        if torch.is_grad_enabled():
            # The gradient of the unit's output arrives just before the unit's own backward starts.
            for tensor in _output_tensors(output):
                tensor.register_hook(lambda _, unit=unit: self._before_backward(unit))

    def _before_backward(self, unit: FlatUnit) -> None:
        if unit.grad_full is None:  # a unit with several outputs hears from each of them
            unit.grad_full = torch.zeros(unit.padded_numel, dtype=self.compute_dtype)
            self._bind_grads(unit)
            unit.pending = len(unit.params)
            self._measure()

    def _after_param_grad(self, unit: FlatUnit) -> None:
        unit.pending -= 1
        if unit.pending == 0:
            self._after_backward(unit)

    def _after_backward(self, unit: FlatUnit) -> None:
        self._measure()
        dist.reduce_scatter_single(unit.grad_shard, unit.grad_full, group=self.group)
        unit.grad_shard.div_(self.world_size)
        for p in unit.params:
            p.grad = None
        unit.grad_full = None

    def _reduce_gradients(self) -> None:
        """Already done unit by unit during the backward pass."""


class ZeRO3(ZeRO2):
    """Stage 3: the parameters are sharded too (what FSDP calls full sharding).

    Between uses a unit's flat parameter buffer has no storage; a forward pre-hook all-gathers the
    shards into it, a forward hook frees it, the gradient of the unit's output all-gathers it again
    for the backward, and it is freed once the unit's gradients are reduce-scattered. Nothing is
    gathered after the update: the next forward does it. With ``quantized_gather`` the shards travel
    as int8 with one fp32 scale per 256 values (ZeRO++'s qwZ); the shards themselves stay exact.
    """

    stage = 3

    def __init__(self, model: nn.Module, *, quantized_gather: bool = False, **options):
        self.quantized_gather = quantized_gather
        super().__init__(model, **options)

    def _init_params(self, unit: FlatUnit, initial: torch.Tensor) -> None:
        unit.param_shard = initial[unit.owned].to(self.compute_dtype, copy=True)
        unit.full = torch.empty(unit.padded_numel, dtype=self.compute_dtype)
        self._bind_params(unit)
        self._free(unit)

    def _install_hooks(self) -> None:
        super()._install_hooks()
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda _, args, unit=unit: self._gather(unit))

    def _after_forward(self, unit: FlatUnit, output) -> None:
        self._free(unit)
        super()._after_forward(unit, output)

    def _before_backward(self, unit: FlatUnit) -> None:
        self._gather(unit)
        super()._before_backward(unit)

    def _after_backward(self, unit: FlatUnit) -> None:
        super()._after_backward(unit)
        self._free(unit)

    def _after_update(self, unit: FlatUnit) -> None:
        """The next forward gathers the updated shards."""

    def _gather(self, unit: FlatUnit) -> None:
        storage = unit.full.untyped_storage()
        if storage.nbytes():
            return  # already gathered
        # Refill the same storage: the parameter views, and the copies autograd saved in the forward, see it.
        storage.resize_(unit.padded_numel * unit.full.element_size())
        if self.quantized_gather:
            q, scales = quantize_int8_blockwise(unit.param_shard)
            all_q = torch.empty(q.numel() * self.world_size, dtype=torch.int8)
            all_scales = torch.empty(scales.numel() * self.world_size, dtype=torch.float32)
            dist.all_gather_single(all_q, q, group=self.group)
            dist.all_gather_single(all_scales, scales, group=self.group)
            shards = dequantize_int8_blockwise(all_q, all_scales).view(self.world_size, -1)
            unit.full.view(self.world_size, -1).copy_(shards[:, : unit.shard_numel])
        else:
            dist.all_gather_single(unit.full, unit.param_shard, group=self.group)
        self._measure()

    def _free(self, unit: FlatUnit) -> None:
        unit.full.untyped_storage().resize_(0)


ENGINES = {0: ZeRO0, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}


def zero_data_parallel(model: nn.Module, stage: int, **options) -> ZeRO0:
    """The ZeRO engine of ``stage`` (0-3) for ``model`` over the default (or given) process group.

    Options: ``lr``, ``betas``, ``eps``, ``weight_decay`` (AdamW), ``mixed_precision``, ``wrap`` (the
    modules that get their own unit; default ``model.blocks``), ``group``, and for stage 3
    ``quantized_gather``.
    """
    if stage not in ENGINES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if options.get("quantized_gather") and stage != 3:
        raise ValueError("quantized_gather compresses the parameter all-gathers of stage 3; use stage=3")
    return ENGINES[stage](model, **options)


def _check_arguments(model, wrap, lr, betas, eps, weight_decay) -> None:
    problems = []
    if not dist.is_initialized():
        problems.append("no process group: run under scalebook.comm.launch or torchrun (dist.init_process_group)")
    params = list(model.parameters())
    if not params:
        problems.append("the model has no parameters")
    elif any(p.dtype not in (torch.float32, torch.float64) for p in params):
        problems.append("the model's parameters must be float32 (or float64); mixed precision is an option")
    if any(not p.requires_grad for p in params):
        problems.append("every parameter must require a gradient (frozen parameters are not supported)")
    owners = [id(p) for module in wrap for p in module.parameters()]
    if len(owners) != len(set(owners)):
        problems.append("a parameter belongs to two wrapped modules; wrap disjoint modules")
    inside = {id(m) for m in model.modules()}
    if any(id(module) not in inside for module in wrap):
        problems.append("every wrapped module must be a submodule of the model")
    if not (isinstance(lr, (int, float)) and lr > 0):
        problems.append(f"lr must be a positive number, got {lr!r}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        problems.append(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps > 0 or weight_decay < 0:
        problems.append(f"need eps > 0 and weight_decay >= 0, got eps={eps!r}, weight_decay={weight_decay!r}")
    if problems:
        raise ValueError("; ".join(problems))


# ----- Experiments: the chapter's runs, each rank returning every number it measured ---------------------


@dataclass(frozen=True)
class Recipe:
    """One small training run: model size, steps, per-rank batch and AdamW's hyper-parameters."""

    config: GPTConfig
    steps: int = 3
    batch_size: int = 2  # sequences per rank; the global batch is batch_size * world_size
    seq_len: int = 32
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    seed: int = 0

    def adamw(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    def model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The same freshly initialised GPT on every rank (same seed)."""
        torch.manual_seed(self.seed)
        return GPT(self.config).to(dtype)

    def batches(self, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's rows of each step's global batch (all rows with ``rank=0, world_size=1`` and a larger batch)."""
        generator = torch.Generator().manual_seed(self.seed)
        return [data.get_batch(_corpus_tokens(), self.batch_size, self.seq_len, generator, rank=rank,
                               world_size=world_size) for _ in range(self.steps)]  # fmt: skip


@functools.cache
def _corpus_tokens() -> torch.Tensor:
    return data.tokenize(data.default_corpus())


def train_single_process(recipe: Recipe, world_size: int, dtype: torch.dtype = torch.float32) -> dict:
    """The reference: one process, the whole global batch, ``torch.optim.AdamW``. Needs no process group.

    ``grads`` is the first step's gradient, taken after the backward pass and before the update: every
    method starts from the same weights, so their first gradients must agree to rounding.
    """
    model = recipe.model(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **recipe.adamw())
    global_recipe = replace(recipe, batch_size=recipe.batch_size * world_size)
    losses, grads = [], None
    for x, y in global_recipe.batches(0, 1):
        _, loss = model(x, y)
        loss.backward()
        if grads is None:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()}, "losses": losses,
            "grads": grads}  # fmt: skip


def train_zero(recipe: Recipe, stage: int, dtype: torch.dtype = torch.float32, **options) -> dict:
    """Our ZeRO ``stage`` on this rank: final parameters, losses, the first step's averaged gradients
    (:meth:`ZeRO0.full_gradients`), held and peak bytes, and the collectives of the last step: ``traffic``
    (calls, bytes sent by the ring algorithm) and ``messages`` (message bytes) by operation."""
    engine = zero_data_parallel(recipe.model(dtype), stage, **recipe.adamw(), **options)
    losses, grads = [], None
    for x, y in recipe.batches(dist.get_rank(), dist.get_world_size()):
        with count_traffic() as traffic:
            losses.append(engine.step(x, y))
        if grads is None:  # gathered outside the count: the step's traffic stays the step's own
            grads = engine.full_gradients()
    return {"params": engine.full_parameters(), "losses": losses, "grads": grads, "held": engine.held_bytes(),
            "peak": engine.peak_bytes, "traffic": traffic.by_op(),
            "messages": traffic.message_bytes_by_op()}  # fmt: skip


def _train_reference(model: nn.Module, optimizer, recipe: Recipe, full_gradients) -> tuple[list[float], dict, object]:
    """The training loop of the PyTorch references on this rank: the losses, the first step's gradients
    (``full_gradients()`` called between the backward pass and the update), and the last step's traffic."""
    losses, grads = [], None
    for x, y in recipe.batches(dist.get_rank(), dist.get_world_size()):
        with count_traffic() as traffic:
            _, loss = model(x, y)
            loss.backward()
        if grads is None:  # outside the count, like train_zero's
            grads = full_gradients()
        with count_traffic() as update:
            optimizer.step()
        traffic.calls += update.calls
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads, traffic


def train_torch_zero1(recipe: Recipe, dtype: torch.dtype = torch.float32) -> dict:
    """PyTorch's ZeRO-1: ``DistributedDataParallel`` plus ``ZeroRedundancyOptimizer`` wrapping AdamW.

    DDP all-reduces from C++, invisible to the traffic counter, so a communication hook that all-reduces
    from Python (``allreduce_hook``, what DDP does anyway) makes it count.
    """
    # PyTorch's distributed optimizers and FSDP take seconds to import; only their runs pay for it.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = recipe.model(dtype)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_hook)
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, foreach=False, **recipe.adamw()
    )
    losses, grads, traffic = _train_reference(
        ddp, optimizer, recipe, lambda: {name: p.grad.clone() for name, p in model.named_parameters()}
    )
    state = [t for s in optimizer.optim.state.values() for t in s.values() if t.dim() > 0]
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()}, "losses": losses,
            "grads": grads, "optimizer_bytes": _storage_bytes(state), "traffic": traffic.by_op()}  # fmt: skip


def shard_with_fsdp2(model: nn.Module, mesh, *, reshard_after_forward: bool | None = True, mp_policy=None):
    """FSDP2 as this chapter's ZeRO-3 shards: one ``fully_shard`` group per block, then the root.

    ``reshard_after_forward=None`` is FSDP2's default: ``True`` for the blocks, ``False`` for the root,
    whose parameters would otherwise be gathered again at once when the backward pass begins.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def train_fsdp2(recipe: Recipe, dtype: torch.dtype = torch.float32, **fsdp_options) -> dict:
    """PyTorch's FSDP2 (``fully_shard`` on a CPU device mesh) with AdamW; options go to :func:`shard_with_fsdp2`."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_with_fsdp2(recipe.model(dtype), mesh, **fsdp_options)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **recipe.adamw())
    losses, grads, traffic = _train_reference(
        model, optimizer, recipe, lambda: {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    )
    params = {name: p.full_tensor() for name, p in model.named_parameters()}  # a collective
    local = [p.to_local() for p in model.parameters()]
    state = [t.to_local() for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {"params": params, "losses": losses, "grads": grads, "traffic": traffic.by_op(),
            "param_bytes": _storage_bytes(local), "optimizer_bytes": _storage_bytes(state)}  # fmt: skip


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference between two sets of named parameters (same names required)."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameter names: {sorted(a.keys() ^ b.keys())}")
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def chapter_experiments(recipe: Recipe, curve_recipe: Recipe | None = None) -> dict:
    """Every run of Chapter 11 on this rank, reduced to numbers (run it with ``scalebook.comm.launch``).

    * ``errors[dtype][(a, b)]`` (rank 0 only): the largest absolute difference of the parameters after
      ``recipe.steps`` AdamW steps between methods ``a`` and ``b``: one process on the global batch, our
      four stages, PyTorch's ZeRO-1 (``ZeroRedundancyOptimizer``) and FSDP2; in float64 and in float32,
      and (``"bf16"``) our mixed-precision stage 3 against FSDP2 reducing in bf16.
    * ``grad_errors[dtype][(a, b)]`` (rank 0 only): the same pairs compared on the first step's gradient,
      after the backward pass and before any update, by :func:`scalebook.parity.max_relative_difference`.
    * ``states[(precision, stage)]``: bytes held and at peak, and one step's traffic by operation.
    * ``torch_zero1``, ``fsdp2[reshard_after_forward]``: PyTorch's bytes per rank and traffic.
    * with ``curve_recipe``: ``curves`` (losses of ZeRO-3 in fp32, with int8 gathers, in bf16, and of
      FSDP2 with ``MixedPrecisionPolicy(bf16, reduce fp32)``) and the int8 run's ``quantized_traffic``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {"world_size": world, "rank": rank, "errors": {}, "grad_errors": {}, "states": {}}
    for dtype_name, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
        runs = {f"ZeRO-{stage}": train_zero(recipe, stage, dtype) for stage in STAGES}
        runs["ZeroRedundancyOptimizer"] = train_torch_zero1(recipe, dtype)
        runs["FSDP2"] = train_fsdp2(recipe, dtype)
        if rank == 0:  # the reference needs no peers
            runs["single process"] = train_single_process(recipe, world, dtype)
            pairs = [(name, "single process") for name in runs if name != "single process"]
            pairs += [("ZeRO-1", "ZeroRedundancyOptimizer"), ("ZeRO-3", "FSDP2")]
            out["errors"][dtype_name] = {(a, b): max_abs_difference(runs[a]["params"], runs[b]["params"])
                                         for a, b in pairs}  # fmt: skip
            out["grad_errors"][dtype_name] = {(a, b): max_relative_difference(runs[a]["grads"], runs[b]["grads"])
                                              for a, b in pairs}  # fmt: skip
    # Mixed precision: FSDP2 reducing in bf16 too (reduce_dtype=bf16) does what our mixed_precision does.
    bf16_both = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    ours, theirs = train_zero(recipe, 3, mixed_precision=True), train_fsdp2(recipe, mp_policy=bf16_both)
    if rank == 0:
        out["errors"]["bf16"] = {("ZeRO-3", "FSDP2"): max_abs_difference(ours["params"], theirs["params"])}
        out["grad_errors"]["bf16"] = {("ZeRO-3", "FSDP2"): max_relative_difference(ours["grads"], theirs["grads"])}
    # float32 was the last dtype of the loop: its runs measured the bytes that the fp32 formulas predict.
    for stage in STAGES:
        out["states"][("fp32", stage)] = {k: runs[f"ZeRO-{stage}"][k] for k in ("held", "peak", "traffic", "messages")}
    out["torch_zero1"] = {k: runs["ZeroRedundancyOptimizer"][k] for k in ("optimizer_bytes", "traffic")}
    out["fsdp2"] = {True: {k: runs["FSDP2"][k] for k in ("param_bytes", "optimizer_bytes", "traffic")}}
    one_step = replace(recipe, steps=1)  # bytes held and sent are the same at every step
    for stage in STAGES:
        run = train_zero(one_step, stage, mixed_precision=True)
        out["states"][("mixed", stage)] = {k: run[k] for k in ("held", "peak", "traffic", "messages")}
    for reshard in (None, False):
        out["fsdp2"][reshard] = {"traffic": train_fsdp2(one_step, reshard_after_forward=reshard)["traffic"]}
    if curve_recipe is not None:
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        quantized = train_zero(curve_recipe, 3, quantized_gather=True)
        out["curves"] = {
            "ZeRO-3 fp32": train_zero(curve_recipe, 3)["losses"],
            "ZeRO-3 int8 all-gather": quantized["losses"],
            "ZeRO-3 bf16": train_zero(curve_recipe, 3, mixed_precision=True)["losses"],
            "FSDP2 bf16 (fp32 reduce)": train_fsdp2(curve_recipe, mp_policy=bf16)["losses"],
        }
        out["quantized_traffic"] = quantized["traffic"]
    return out
