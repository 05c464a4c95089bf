"""Chapter 11's runs: every ZeRO stage next to one process, ``ZeroRedundancyOptimizer`` and FSDP2, reduced to numbers.

Each function trains the same small GPT on the same global batches with one method and returns what the
chapter compares: the parameters after the last step, the first step's averaged gradient (after the
backward pass, before any update, gathered into whole named tensors), the bytes each kind of state holds
(:func:`scalebook.parallel.zero.held_bytes`) after the last step and at most within it, and the collectives
of the last step (:func:`scalebook.comm.traffic.count_traffic`). Methods:

    "DDP"                       stage 0: torch's DistributedDataParallel and AdamW
    "ZeRO-1"                    our ZeroRedundancyOptimizer, reduce_scatter_gradients=True (the ZeRO paper's)
    "ZeRO-1 on DDP"             our ZeroRedundancyOptimizer behind DDP (torch's usage)
    "ZeRO-2", "ZeRO-3"          our fully_shard(stage=2 | 3), then torch's AdamW on the shards
    "ZeroRedundancyOptimizer"   torch's, behind DDP
    "FSDP2"                     torch's fully_shard on each block, then the root

Source: Rajbhandari et al. 2020 (ZeRO); PyTorch documentation, ``torch.distributed.fsdp.fully_shard``,
``torch.distributed.optim.ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from scalebook import data
from scalebook.comm import count_traffic
from scalebook.measure import StateBytes
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import zero
from scalebook.parity import max_relative_difference

STAGES = (0, 1, 2, 3)
STAGE_METHODS = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


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
        return [data.get_batch(data.corpus_tokens(), self.batch_size, self.seq_len, generator, rank=rank,
                               world_size=world_size) for _ in range(self.steps)]  # fmt: skip


def train_single_process(recipe: Recipe, world_size: int, dtype: torch.dtype = torch.float32) -> dict:
    """The reference: one process, the whole global batch, ``torch.optim.AdamW``. Needs no process group."""
    model = recipe.model(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **recipe.adamw())
    losses, grads = [], None
    for x, y in replace(recipe, batch_size=recipe.batch_size * world_size).batches(0, 1):
        _, loss = model(x, y)
        loss.backward()
        grads = grads or {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()}, "losses": losses,
            "grads": grads}  # fmt: skip


def shard_with_fsdp2(model: nn.Module, mesh, *, reshard_after_forward: bool | None = True, mp_policy=None):
    """FSDP2 with the units of our stage 3: one ``fully_shard`` group per block, then the root.

    ``reshard_after_forward=None`` is FSDP2's default: ``True`` for the blocks, ``False`` for the root,
    whose parameters would otherwise be gathered again at once when the backward pass begins.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(mp_policy.param_dtype, mp_policy.reduce_dtype) if mp_policy else None
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy or MixedPrecisionPolicy())  # fmt: skip
    return model


def wrap(model: nn.Module, method: str, recipe: Recipe, **options):
    """``(module to call, optimizer)`` of ``method``; options: ``mp_policy``, ``quantized_gather``
    (ours), ``reshard_after_forward`` (FSDP2)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    adamw = {"foreach": False, **recipe.adamw()}
    if method in ("DDP", "ZeRO-1 on DDP", "ZeroRedundancyOptimizer"):
        # DDP all-reduces from C++; the default hook does the same from Python, where count_traffic sees it.
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, allreduce_hook)
        wrapper = {"DDP": None, "ZeRO-1 on DDP": zero.ZeroRedundancyOptimizer}.get(method, ZeroRedundancyOptimizer)
        optimizer = wrapper(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw) if wrapper else None
        return ddp, optimizer or torch.optim.AdamW(model.parameters(), **adamw)
    if method == "ZeRO-1":
        return model, zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                   reduce_scatter_gradients=True, **adamw)  # fmt: skip
    if method in ("ZeRO-2", "ZeRO-3"):
        zero.fully_shard(model, stage=int(method[-1]), mp_policy=options.get("mp_policy"),
                         quantized_gather=options.get("quantized_gather", False))  # fmt: skip
    elif method == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        shard_with_fsdp2(model, mesh, reshard_after_forward=options.get("reshard_after_forward", True),
                         mp_policy=options.get("mp_policy"))  # fmt: skip
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return model, torch.optim.AdamW(model.parameters(), **adamw)


METHODS = ("DDP", "ZeRO-1", "ZeRO-1 on DDP", "ZeRO-2", "ZeRO-3", "ZeroRedundancyOptimizer", "FSDP2")


def full_gradients(model: nn.Module, method: str, shapes: dict[str, torch.Size], captured: list) -> dict:
    """Every parameter's averaged gradient of the step just taken, whole and by name (a collective).

    Where ``.grad`` holds it whole (DDP, ZeRO-1 on DDP, torch's ZeRO-1) it is read; our stages 2 and 3 hold
    dim-0 shards, all-gathered here; FSDP2 holds DTensors; our ZeRO-1 computes it inside ``step()``,
    where ``captured`` took this rank's flat shard of each parameter group.
    """
    named = dict(getattr(model, "module", model).named_parameters())
    if method == "FSDP2":
        return {name: p.grad.full_tensor() for name, p in named.items()}
    if method in ("ZeRO-2", "ZeRO-3"):
        return {name: _all_gather(p.grad)[: shapes[name][0]] for name, p in named.items()}
    if method == "ZeRO-1":  # one parameter group, the parameters end to end in model.parameters() order
        flat, grads, offset = _all_gather(captured[0]), {}, 0
        for name, p in named.items():
            grads[name], offset = flat[offset : offset + p.numel()].view(p.shape).clone(), offset + p.numel()
        return grads
    return {name: p.grad.clone() for name, p in named.items()}


def _all_gather(shard: torch.Tensor) -> torch.Tensor:
    out = shard.new_empty(dist.get_world_size() * shard.shape[0], *shard.shape[1:])
    dist.all_gather_single(out, shard.contiguous())
    return out


def _peak_tracker(model: nn.Module) -> tuple[dict[str, int], Callable]:
    """``(peak, measure)``: ``measure()`` records the most parameter and gradient bytes ``model`` holds."""
    peak = {"params": 0, "grads": 0}

    def measure(*_):
        held = zero.held_bytes(model)
        peak["params"], peak["grads"] = max(peak["params"], held.params), max(peak["grads"], held.grads)

    return peak, measure


def _measure_after_gathers(unit: nn.Module, measure) -> None:
    """Hooks installed after fully_shard's run after its own: after the gather before forward, and (on the
    output's gradient) after the gather before backward."""

    def on_output(module, args, output):
        for tensor in output if isinstance(output, tuple) else (output,):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(measure)

    unit.register_forward_pre_hook(measure)
    unit.register_forward_hook(on_output)


def _fsdp2_held_bytes(model: nn.Module, optimizer) -> StateBytes:
    """FSDP2's parameters, gradients and AdamW state are DTensors: the bytes of their local shards."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    kinds = (params, [p.grad for p in params], state)
    return StateBytes(*(sum(t.to_local().nbytes for t in tensors if t is not None) for tensors in kinds))


def train(recipe: Recipe, method: str, dtype: torch.dtype = torch.float32, **options) -> dict:
    """``recipe`` trained by ``method`` (see the module's docstring) on this rank: final parameters, losses,
    first-step averaged gradients (:func:`full_gradients`), bytes held after the last step and, for our stages
    2 and 3, at most within it, and that step's collectives: ``traffic`` (calls, ring bytes sent) and
    ``messages`` (message bytes) by operation. Options: ``mp_policy``, ``quantized_gather``,
    ``reshard_after_forward`` (FSDP2)."""
    model = recipe.model(dtype)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    peak, measure = _peak_tracker(model)
    sharded = method in ("ZeRO-2", "ZeRO-3")
    for p in model.parameters() if sharded else ():  # before fully_shard's hooks: just before each reduction
        p.register_post_accumulate_grad_hook(measure)
    module, optimizer = wrap(model, method, recipe, **options)
    for unit in [model, *model.blocks] if sharded else ():
        _measure_after_gathers(unit, measure)
    captured = []  # our ZeRO-1's averaged gradient exists only inside step(), as its shard's .grad
    if method == "ZeRO-1":
        shard = optimizer.optim.param_groups[0]["params"][0]
        optimizer.optim.register_step_pre_hook(lambda *_: captured.append(shard.grad.clone()))
    losses, grads = [], None
    for x, y in recipe.batches(dist.get_rank(), dist.get_world_size()):
        peak.update(params=0, grads=0)
        with count_traffic() as traffic:
            _, loss = module(x, y)
            loss.backward()
        if grads is None and method != "ZeRO-1":  # outside the count: the step's traffic stays the step's own
            grads = full_gradients(model, method, shapes, captured)
        with count_traffic() as update:
            optimizer.step()
        traffic.calls += update.calls
        grads = grads or full_gradients(model, method, shapes, captured)
        held = _fsdp2_held_bytes(model, optimizer) if method == "FSDP2" else zero.held_bytes(model, optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"params": _full_parameters(model, method, shapes), "losses": losses, "grads": grads, "held": held,
            "peak": StateBytes(max(peak["params"], held.params), max(peak["grads"], held.grads), held.optimizer),
            "traffic": traffic.by_op(), "messages": traffic.message_bytes_by_op()}  # fmt: skip


def _full_parameters(model: nn.Module, method: str, shapes: dict) -> dict[str, torch.Tensor]:
    """Every parameter by name, whole (a collective for the sharded methods)."""
    if method in ("ZeRO-2", "ZeRO-3"):
        full = zero.full_state_dict(model)
        return {name: full[name] for name in shapes}
    if method == "FSDP2":
        return {name: p.full_tensor() for name, p in model.named_parameters()}
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference between two sets of named tensors (same names required)."""
    if a.keys() != b.keys():
        raise ValueError(f"different names: {sorted(a.keys() ^ b.keys())}")
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


COMPARED = ("DDP", "ZeRO-1", "ZeRO-1 on DDP", "ZeRO-2", "ZeRO-3", "ZeroRedundancyOptimizer", "FSDP2")
TORCH_PAIRS = [("ZeRO-1 on DDP", "ZeroRedundancyOptimizer"), ("ZeRO-1", "ZeroRedundancyOptimizer"), ("ZeRO-3", "FSDP2")]
PAIRS = [(method, "single process") for method in COMPARED] + TORCH_PAIRS


def chapter_experiments(recipe: Recipe, curve_recipe: Recipe | None = None) -> dict:
    """Every run of Chapter 11 on this rank, reduced to numbers (run it with ``scalebook.comm.launch``).

    * ``errors[dtype][(a, b)]`` (rank 0 only): the largest absolute difference of the parameters after
      ``recipe.steps`` AdamW steps between methods ``a`` and ``b`` (``PAIRS``) in float64 and float32, and
      (``"bf16"``) our stage 3 against FSDP2 with the same ``MixedPrecisionPolicy(bf16)``.
    * ``grad_errors[dtype][(a, b)]`` (rank 0 only): the same pairs on the first step's averaged gradient, by
      :func:`scalebook.parity.max_relative_difference`.
    * ``states[(precision, stage)]``: held and peak bytes and one step's traffic, in fp32 (stages 0-3, from the
      fp32 runs) and with bf16 gathers and reductions (stages 2 and 3).
    * ``torch_zero1``, ``zero1_on_ddp``, ``fsdp2[reshard_after_forward]``: PyTorch's bytes and traffic.
    * with ``curve_recipe``: ``curves`` (losses of our stage 3 in fp32, with int8 gathers, in bf16, and of FSDP2
      with bf16 parameters and fp32 reductions) and the int8 run's ``quantized_traffic``.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {"world_size": world, "rank": rank, "errors": {}, "grad_errors": {}, "states": {}}
    for dtype_name, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
        runs = {method: train(recipe, method, dtype) for method in COMPARED}
        if rank == 0:  # the reference needs no peers
            runs["single process"] = train_single_process(recipe, world, dtype)
            out["errors"][dtype_name] = {(a, b): max_abs_difference(runs[a]["params"], runs[b]["params"])
                                         for a, b in PAIRS}  # fmt: skip
            out["grad_errors"][dtype_name] = {(a, b): max_relative_difference(runs[a]["grads"], runs[b]["grads"])
                                              for a, b in PAIRS}  # fmt: skip
    bf16 = zero.MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gathers, compute and reductions in bf16
    ours, theirs = train(recipe, "ZeRO-3", mp_policy=bf16), train(recipe, "FSDP2", mp_policy=bf16)
    if rank == 0:
        out["errors"]["bf16"] = {("ZeRO-3", "FSDP2"): max_abs_difference(ours["params"], theirs["params"])}
        out["grad_errors"]["bf16"] = {("ZeRO-3", "FSDP2"): max_relative_difference(ours["grads"], theirs["grads"])}
    # float32 was the last dtype of the loop: its runs measured the bytes that the fp32 formulas predict.
    keep = ("held", "peak", "traffic", "messages")
    for stage in STAGES:
        out["states"][("fp32", stage)] = {k: runs[STAGE_METHODS[stage]][k] for k in keep}
    out["torch_zero1"] = {k: runs["ZeroRedundancyOptimizer"][k] for k in ("held", "traffic")}
    out["zero1_on_ddp"] = {k: runs["ZeRO-1 on DDP"][k] for k in ("held", "traffic")}
    out["fsdp2"] = {True: {k: runs["FSDP2"][k] for k in ("held", "traffic")}}
    one_step = replace(recipe, steps=1)  # bytes held and sent are the same at every step
    for stage in (2, 3):
        run = train(one_step, STAGE_METHODS[stage], mp_policy=bf16)
        out["states"][("bf16", stage)] = {k: run[k] for k in keep}
    for reshard in (None, False):
        out["fsdp2"][reshard] = {"traffic": train(one_step, "FSDP2", reshard_after_forward=reshard)["traffic"]}
    if curve_recipe is not None:
        quantized = train(curve_recipe, "ZeRO-3", quantized_gather=True)
        fsdp2_policy = zero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        out["curves"] = {
            "ZeRO-3 fp32": train(curve_recipe, "ZeRO-3")["losses"],
            "ZeRO-3 int8 all-gather": quantized["losses"],
            "ZeRO-3 bf16": train(curve_recipe, "ZeRO-3", mp_policy=bf16)["losses"],
            "FSDP2 bf16 (fp32 reduce)": train(curve_recipe, "FSDP2", mp_policy=fsdp2_policy)["losses"],
        }
        out["quantized_traffic"] = quantized["traffic"]
    return out
