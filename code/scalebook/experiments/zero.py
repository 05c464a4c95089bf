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

The sections on prefetching and hybrid sharding: :func:`prefetch_runs` (our stage 3 timed unit by unit without
and with prefetch, :func:`timeline_totals`; FSDP2 with explicit prefetch), :func:`hsdp_runs` (HSDP on a 2-D
group against FSDP2 on a 2-D mesh) and :func:`ring_bytes_by_link` (full sharding's bytes inside and across
nodes, counted on rings built from send/recv).

Source: Rajbhandari et al. 2020 (ZeRO); Zhao et al. 2023 (PyTorch FSDP: prefetching, hybrid sharding); PyTorch
documentation, ``torch.distributed.fsdp.fully_shard``, ``torch.distributed.optim.ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    micro_batches: int = 1  # gradient accumulation: each rank's rows split into this many forward-backward passes

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


def shard_with_fsdp2(model: nn.Module, mesh, *, reshard_after_forward: bool | None = True, mp_policy=None,
                     prefetch: bool = False):  # fmt: skip
    """FSDP2 with the units of our stage 3: one ``fully_shard`` group per block, then the root.

    ``reshard_after_forward=None`` is FSDP2's default: ``True`` for the blocks, ``False`` for the root,
    whose parameters would otherwise be gathered again at once when the backward pass begins. A 2-D ``mesh``
    (replicate, shard) makes it HSDP. ``prefetch``: FSDP2's explicit prefetching, as torchtitan sets it: each
    unit prefetches the next block in the forward pass and the previous one in the backward pass.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(mp_policy.param_dtype, mp_policy.reduce_dtype) if mp_policy else None
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy or MixedPrecisionPolicy())  # fmt: skip
    if prefetch:
        blocks = list(model.blocks)
        model.set_modules_to_forward_prefetch(blocks[:1])
        model.set_modules_to_backward_prefetch(blocks[-1:])
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
    return model


SHARD_OPTIONS = ("process_group", "replicate_group", "forward_prefetch", "backward_prefetch")


def wrap(model: nn.Module, method: str, recipe: Recipe, *, group=None, **options):
    """``(module to call, optimizer)`` of ``method`` over ``group`` (default: all ranks); options: ``mp_policy``,
    ``quantized_gather`` and ``SHARD_OPTIONS`` (ours, passed to ``fully_shard``), ``reshard_after_forward``,
    ``mesh`` and ``prefetch`` (FSDP2, see :func:`shard_with_fsdp2`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    adamw = {"foreach": False, **recipe.adamw()}
    if method in ("DDP", "ZeRO-1 on DDP", "ZeroRedundancyOptimizer"):
        # DDP all-reduces from C++; the default hook does the same from Python, where count_traffic sees it.
        ddp = DistributedDataParallel(model, process_group=group)
        ddp.register_comm_hook(group, allreduce_hook)  # the hook's state is the group it all-reduces over
        wrapper = {"DDP": None, "ZeRO-1 on DDP": zero.ZeroRedundancyOptimizer}.get(method, ZeroRedundancyOptimizer)
        optimizer = (wrapper(model.parameters(), optimizer_class=torch.optim.AdamW, process_group=group, **adamw)
                     if wrapper else None)  # fmt: skip
        return ddp, optimizer or torch.optim.AdamW(model.parameters(), **adamw)
    if method == "ZeRO-1":
        return model, zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, group,
                                                   reduce_scatter_gradients=True, **adamw)  # fmt: skip
    if method in ("ZeRO-2", "ZeRO-3"):
        shard_options = {"process_group": group} | {key: options[key] for key in SHARD_OPTIONS if key in options}
        zero.fully_shard(model, stage=int(method[-1]), mp_policy=options.get("mp_policy"),
                         quantized_gather=options.get("quantized_gather", False), **shard_options)  # fmt: skip
    elif method == "FSDP2":
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        mesh = options.get("mesh") or (DeviceMesh.from_group(group, "cpu") if group is not None
                                       else init_device_mesh("cpu", (dist.get_world_size(),)))  # fmt: skip
        shard_with_fsdp2(model, mesh, reshard_after_forward=options.get("reshard_after_forward", True),
                         mp_policy=options.get("mp_policy"), prefetch=options.get("prefetch", False))  # fmt: skip
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return model, torch.optim.AdamW(model.parameters(), **adamw)


METHODS = ("DDP", "ZeRO-1", "ZeRO-1 on DDP", "ZeRO-2", "ZeRO-3", "ZeroRedundancyOptimizer", "FSDP2")


def full_gradients(model: nn.Module, method: str, shapes: dict[str, torch.Size], captured: list, group=None) -> dict:
    """Every parameter's averaged gradient of the step just taken, whole and by name (a collective).

    Where ``.grad`` holds it whole (DDP, ZeRO-1 on DDP, torch's ZeRO-1) it is read; our stages 2 and 3 hold
    dim-0 shards, all-gathered here; FSDP2 holds DTensors; our ZeRO-1 computes it inside ``step()``,
    where ``captured`` took this rank's flat shard of each parameter group.
    """
    named = dict(getattr(model, "module", model).named_parameters())
    if method == "FSDP2":
        return {name: p.grad.full_tensor() for name, p in named.items()}
    if method in ("ZeRO-2", "ZeRO-3"):  # over the shard group (HSDP: the replicas hold the same shards)
        group = model._zero_sharding.group
        return {name: _all_gather(p.grad, group)[: shapes[name][0]] for name, p in named.items()}
    if method == "ZeRO-1":  # one parameter group, the parameters end to end in model.parameters() order
        flat, grads, offset = _all_gather(captured[0], group), {}, 0
        for name, p in named.items():
            grads[name], offset = flat[offset : offset + p.numel()].view(p.shape).clone(), offset + p.numel()
        return grads
    return {name: p.grad.clone() for name, p in named.items()}


def _all_gather(shard: torch.Tensor, group=None) -> torch.Tensor:
    out = shard.new_empty(dist.get_world_size(group) * shard.shape[0], *shard.shape[1:])
    dist.all_gather_single(out, shard.contiguous(), group=group)
    return out


def _peak_tracker(model: nn.Module) -> tuple[dict[str, int], Callable]:
    """``(peak, measure)``: ``measure()`` records the most parameter and gradient bytes ``model`` holds."""
    peak, params = {"params": 0, "grads": 0}, list(model.parameters())  # listed once: measure runs very often

    def measure(*_):
        held = zero.held_bytes(model, params=params)
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


def _forward_backward(module, model, method: str, x, y, micro_batches: int, sync_each: bool, after_first):
    """The step's forward and backward passes over ``micro_batches`` slices of the rows, each loss divided by
    their number; without ``sync_each`` the sharded methods reduce only in the last (``set_requires_gradient_sync``,
    ours or FSDP2's). ``after_first()`` runs after the first backward. Returns the mean loss."""
    if not sync_each and method not in ("ZeRO-2", "ZeRO-3", "FSDP2"):
        raise ValueError(f"sync_each=False needs ZeRO-2, ZeRO-3 or FSDP2, not {method!r}")
    losses = []
    for i, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
        sync = sync_each or i == micro_batches - 1
        if method == "FSDP2":
            model.set_requires_gradient_sync(sync)
        elif method in ("ZeRO-2", "ZeRO-3"):
            zero.set_requires_gradient_sync(model, sync)
        _, loss = module(xs, ys)
        (loss / micro_batches).backward()
        losses.append(loss.detach())
        if i == 0:
            after_first()
    return sum(losses) / micro_batches


def train(recipe: Recipe, method: str, dtype: torch.dtype = torch.float32, *, timeline: bool = False,
          track_peak: bool = True, sync_each: bool = True, group=None, **options) -> dict:  # fmt: skip
    """``recipe`` trained by ``method`` (see the module's docstring) on this rank: final parameters, losses,
    first-step averaged gradients (:func:`full_gradients`), bytes held after the last step and, for our stages
    2 and 3, at most within it, and that step's collectives: ``traffic`` (calls, ring bytes sent) and
    ``messages`` (message bytes) by operation, ``calls`` ((operation, message bytes) in issue order). Options:
    those of :func:`wrap`. ``timeline`` (our stages 2 and 3): the ranks start each step together (a barrier),
    and ``timelines`` holds each step's length and :func:`scalebook.parallel.fsdp.record_timeline` events, in
    seconds from the step's start (the bytes held within the step are then not tracked, nor with ``track_peak=False``).
    ``group``: the ranks that train together (default: all), each taking its rank's rows of the global batch.
    ``recipe.micro_batches`` > 1 accumulates gradients; ``sync_each=False`` reduces them only in the last micro-batch
    (``_forward_backward``); ``grad_bytes_after_first`` (ours): gradient bytes held after the first backward."""
    model = recipe.model(dtype)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    peak, measure = _peak_tracker(model)
    sharded = method in ("ZeRO-2", "ZeRO-3")
    tracked = sharded and track_peak and not timeline  # the trackers' hooks would run inside the timed computations
    for p in model.parameters() if tracked else ():  # before fully_shard's hooks: just before each reduction
        p.register_post_accumulate_grad_hook(measure)
    module, optimizer = wrap(model, method, recipe, group=group, **options)
    for unit in [model, *model.blocks] if tracked else ():
        _measure_after_gathers(unit, measure)
    captured = []  # our ZeRO-1's averaged gradient exists only inside step(), as its shard's .grad
    if method == "ZeRO-1":
        shard = optimizer.optim.param_groups[0]["params"][0]
        optimizer.optim.register_step_pre_hook(lambda *_: captured.append(shard.grad.clone()))
    losses, grads, timelines, after_first = [], None, [], []

    def record_first():
        after_first.append(zero.held_bytes(model).grads if sharded else None)

    for x, y in recipe.batches(dist.get_rank(group), dist.get_world_size(group)):
        peak.update(params=0, grads=0)
        with _timed_step(model, timeline and sharded, group) as timed, count_traffic() as traffic:
            loss = _forward_backward(module, model, method, x, y, recipe.micro_batches, sync_each, record_first)
        timelines += [timed] if timed else []
        if grads is None and method != "ZeRO-1":  # outside the count: the step's traffic stays the step's own
            grads = full_gradients(model, method, shapes, captured, group)
        with count_traffic() as update:
            optimizer.step()
        traffic.calls += update.calls
        grads = grads or full_gradients(model, method, shapes, captured, group)
        held = _fsdp2_held_bytes(model, optimizer) if method == "FSDP2" else zero.held_bytes(model, optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"params": _full_parameters(model, method, shapes), "losses": losses, "grads": grads, "held": held,
            "peak": StateBytes(max(peak["params"], held.params), max(peak["grads"], held.grads), held.optimizer),
            "traffic": traffic.by_op(), "messages": traffic.message_bytes_by_op(),
            "calls": [(c.op, c.message_bytes) for c in traffic.calls], "timelines": timelines,
            "grad_bytes_after_first": after_first}  # fmt: skip


@contextmanager
def _timed_step(model: nn.Module, record: bool, group=None) -> Iterator[dict]:
    """``{"length": seconds, "events": [TimelineEvent, ...]}`` of the step the block runs, times from its start
    (an empty dict when not ``record``)."""
    timed = {}
    if not record:
        yield timed
        return
    dist.barrier(group)  # the ranks start the step together (outside train's count of the step's traffic)
    with zero.record_timeline(model) as events:
        start = time.perf_counter()
        yield timed
        end = time.perf_counter()
    timed.update(length=end - start, events=[replace(e, start=e.start - start, end=e.end - start) for e in events])


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


def timeline_totals(timed: dict) -> dict[str, float]:
    """Seconds of one timed step (:func:`train` with ``timeline=True``) by what the computation did: waited for
    all-gathers in the forward and in the backward pass (exposed communication), reduced gradients, and the
    step's length; and the seconds the all-gathers were in flight in all."""
    totals = {"forward wait": 0.0, "backward wait": 0.0, "reduce": 0.0, "all-gather": 0.0, "step": timed["length"]}
    for event in timed["events"]:
        key = f"{event.phase} wait" if event.kind == "wait" else event.kind
        if key in totals:
            totals[key] += event.end - event.start
    return totals


def prefetch_runs(recipe: Recipe, group=None) -> dict:
    """Our stage 3 without and with forward and backward prefetch (timed step by step: :func:`train` with
    ``timeline=True``), and FSDP2 with its explicit prefetch, on this rank. ``timelines[prefetch]``: each
    step's timeline; ``calls[name]``: the last step's collectives in issue order; ``errors`` and ``losses_equal``
    against FSDP2 with prefetch (every rank: the parameters are gathered by every rank anyway)."""
    both = {"forward_prefetch": True, "backward_prefetch": True}
    runs = {
        "ZeRO-3": train(recipe, "ZeRO-3", timeline=True, group=group),
        "ZeRO-3, prefetch": train(recipe, "ZeRO-3", timeline=True, group=group, **both),
        "FSDP2, prefetch": train(recipe, "FSDP2", prefetch=True, group=group),
    }
    reference = runs["FSDP2, prefetch"]
    return {
        "timelines": {False: runs["ZeRO-3"]["timelines"], True: runs["ZeRO-3, prefetch"]["timelines"]},
        "calls": {name: run["calls"] for name, run in runs.items()},
        "errors": {name: max_abs_difference(run["params"], reference["params"]) for name, run in runs.items()},
        "losses_equal": {name: run["losses"] == reference["losses"] for name, run in runs.items()},
    }


def accumulation_runs(recipe: Recipe, group=None) -> dict:
    """Gradient accumulation over ``recipe.micro_batches`` in float64, both ways (``sync_each``: reduce-scatter every
    micro-batch into the shard, or only the last, keeping full gradients meanwhile), our stage 3 and FSDP2.
    ``runs[(method, sync_each)]``: the last step's ``traffic`` and ``messages``, ``grad_bytes_after_first``;
    ``errors`` (rank 0): the parameters after the last step against each other and one process on the global batch."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    runs = {(method, sync): train(recipe, method, torch.float64, sync_each=sync, track_peak=False, group=group)
            for sync in (True, False) for method in ("ZeRO-3", "FSDP2")}  # fmt: skip
    out = {"runs": {key: {k: run[k] for k in ("traffic", "messages", "grad_bytes_after_first")}
                    for key, run in runs.items()}}  # fmt: skip
    if rank == 0:
        single = train_single_process(recipe, world, torch.float64)["params"]
        out["errors"] = {key: {"single process": max_abs_difference(run["params"], single),
                               "FSDP2": max_abs_difference(run["params"], runs[("FSDP2", key[1])]["params"])}
                         for key, run in runs.items()}  # fmt: skip
    return out


def ring_bytes_by_link(unit_numels: list[int], gpus_per_node: int) -> dict[str, float]:
    """This rank's bytes sent to ranks of its own node (``intra_node``) and of other nodes (``inter_node``) when a
    ZeRO-3 step's collectives over all ranks (per unit of ``numel`` fp32 elements two all-gathers and one
    reduce-scatter) run as Chapter 9's rings built from send/recv (:mod:`scalebook.comm.collectives`), whose
    messages :func:`scalebook.comm.traffic.count_traffic` sees one by one. Node k holds ranks k s ... k s + s - 1."""
    from scalebook.comm.collectives import ring_all_gather, ring_chunk_sizes, ring_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    with count_traffic() as traffic:
        for numel in unit_numels:
            for _ in range(2):
                ring_all_gather(torch.zeros(ring_chunk_sizes(numel, world)[rank]), numel)
            ring_reduce_scatter(torch.zeros(numel))
    sent = {"intra_node": 0.0, "inter_node": 0.0}
    for call in traffic.of("isend"):
        sent["intra_node" if call.peer // gpus_per_node == rank // gpus_per_node else "inter_node"] += call.bytes_sent
    return sent


def hsdp_runs(recipe: Recipe, gpus_per_node: int = 2) -> dict:
    """HSDP on this rank's ``world / gpus_per_node`` nodes of ``gpus_per_node`` ranks, each node a shard group (a 2-D
    ``DeviceMesh``, dims ("replicate", "shard"), whose two groups both use): our stage 3 with ``process_group`` and
    ``replicate_group`` against FSDP2 on the mesh, in float64 and float32. ``errors`` and ``grad_errors`` (rank 0)
    against each other and against one process; our fp32 run's ``held`` bytes, ``traffic`` and ``messages``;
    FSDP2's ``fsdp2_traffic``; and ``ring`` (:func:`ring_bytes_by_link`): where full sharding's bytes go."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % gpus_per_node or world == gpus_per_node:
        raise ValueError(f"HSDP needs at least two nodes of gpus_per_node={gpus_per_node} ranks; world is {world}")
    mesh = init_device_mesh("cpu", (world // gpus_per_node, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    groups = {"process_group": mesh.get_group("shard"), "replicate_group": mesh.get_group("replicate")}
    out = {"errors": {}, "grad_errors": {}}
    for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
        runs = {"HSDP": train(recipe, "ZeRO-3", dtype, backward_prefetch=True, **groups),
                "FSDP2 HSDP": train(recipe, "FSDP2", dtype, mesh=mesh)}  # fmt: skip
        if rank == 0:
            runs["single process"] = train_single_process(recipe, world, dtype)
            pairs = [("HSDP", "FSDP2 HSDP"), ("HSDP", "single process"), ("FSDP2 HSDP", "single process")]
            out["errors"][name] = {(a, b): max_abs_difference(runs[a]["params"], runs[b]["params"]) for a, b in pairs}
            out["grad_errors"][name] = {(a, b): max_relative_difference(runs[a]["grads"], runs[b]["grads"])
                                        for a, b in pairs}  # fmt: skip
    out.update({key: runs["HSDP"][key] for key in ("held", "traffic", "messages")})
    out["fsdp2_traffic"] = runs["FSDP2 HSDP"]["traffic"]
    model = recipe.model()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    units = [model.num_parameters() - len(model.blocks) * block] + [block] * len(model.blocks)
    out["ring"] = ring_bytes_by_link(units, gpus_per_node)
    return out


COMPARED = ("DDP", "ZeRO-1", "ZeRO-1 on DDP", "ZeRO-2", "ZeRO-3", "ZeroRedundancyOptimizer", "FSDP2")
TORCH_PAIRS = [("ZeRO-1 on DDP", "ZeroRedundancyOptimizer"), ("ZeRO-1", "ZeroRedundancyOptimizer"), ("ZeRO-3", "FSDP2")]
PAIRS = [(method, "single process") for method in COMPARED] + TORCH_PAIRS


def chapter_experiments(
    recipe: Recipe,
    curve_recipe: Recipe | None = None,
    *,
    prefetch_recipe: Recipe | None = None,
    hsdp_gpus_per_node: int | None = None,
    accumulation_recipe: Recipe | None = None,
    group=None,
) -> dict:
    """The runs of Chapter 11 over ``group`` (default: all ranks) on this rank, reduced to numbers
    (:func:`chapter_runs` runs them for every world size in one launch).

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
    * with ``prefetch_recipe``: ``prefetch`` (:func:`prefetch_runs`); with ``hsdp_gpus_per_node``: ``hsdp``
      (:func:`hsdp_runs`); with ``accumulation_recipe``: ``accumulation`` (:func:`accumulation_runs`).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = {"world_size": world, "rank": rank, "errors": {}, "grad_errors": {}, "states": {}}
    for dtype_name, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
        runs = {method: train(recipe, method, dtype, group=group) for method in COMPARED}
        if rank == 0:  # the reference needs no peers
            runs["single process"] = train_single_process(recipe, world, dtype)
            out["errors"][dtype_name] = {(a, b): max_abs_difference(runs[a]["params"], runs[b]["params"])
                                         for a, b in PAIRS}  # fmt: skip
            out["grad_errors"][dtype_name] = {(a, b): max_relative_difference(runs[a]["grads"], runs[b]["grads"])
                                              for a, b in PAIRS}  # fmt: skip
    bf16 = zero.MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gathers, compute and reductions in bf16
    ours = train(recipe, "ZeRO-3", mp_policy=bf16, group=group)
    theirs = train(recipe, "FSDP2", mp_policy=bf16, group=group)
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
    one_step = replace(recipe, steps=1)  # bytes held and sent are the same at every step: stage 3's bf16 run above
    out["states"][("bf16", 2)] = {k: train(one_step, "ZeRO-2", mp_policy=bf16, group=group)[k] for k in keep}
    out["states"][("bf16", 3)] = {k: ours[k] for k in keep}
    for reshard in (None, False):
        out["fsdp2"][reshard] = {"traffic": train(one_step, "FSDP2", reshard_after_forward=reshard,
                                                  group=group)["traffic"]}  # fmt: skip
    if curve_recipe is not None:  # losses only: no bytes tracked within the steps
        curve = functools.partial(train, curve_recipe, track_peak=False, group=group)
        quantized = curve("ZeRO-3", quantized_gather=True)
        fsdp2_policy = zero.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        out["curves"] = {
            "ZeRO-3 fp32": curve("ZeRO-3")["losses"],
            "ZeRO-3 int8 all-gather": quantized["losses"],
            "ZeRO-3 bf16": curve("ZeRO-3", mp_policy=bf16)["losses"],
            "FSDP2 bf16 (fp32 reduce)": curve("FSDP2", mp_policy=fsdp2_policy)["losses"],
        }
        out["quantized_traffic"] = quantized["traffic"]
    if prefetch_recipe is not None:
        out["prefetch"] = prefetch_runs(prefetch_recipe, group)
    if hsdp_gpus_per_node is not None:
        out["hsdp"] = hsdp_runs(recipe, hsdp_gpus_per_node)
    if accumulation_recipe is not None:
        out["accumulation"] = accumulation_runs(accumulation_recipe, group)
    return out


def chapter_runs(
    recipe: Recipe,
    curve_recipe: Recipe | None = None,
    *,
    prefetch_recipe: Recipe | None = None,
    hsdp_gpus_per_node: int | None = None,
    accumulation_recipe: Recipe | None = None,
) -> dict[int, dict]:
    """Chapter 11's runs at two world sizes in one launch (starting processes and importing torch cost more than
    most runs): on more than 2 ranks, ranks 0 and 1 first run :func:`chapter_experiments` with ``curve_recipe``,
    ``prefetch_recipe`` and ``accumulation_recipe`` as a group of their own (the other ranks meanwhile wait in their
    first collective), then every rank runs it with ``hsdp_gpus_per_node``. Returns ``{world size: that run's
    numbers}`` on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    if world > 2:
        two = dist.new_group([0, 1])  # every rank takes part in creating a group, members or not
        if rank < 2:
            out[2] = chapter_experiments(recipe, curve_recipe, prefetch_recipe=prefetch_recipe,
                                         accumulation_recipe=accumulation_recipe, group=two)  # fmt: skip
        curve_recipe = prefetch_recipe = accumulation_recipe = None
    out[world] = chapter_experiments(recipe, curve_recipe, prefetch_recipe=prefetch_recipe,
                                     hsdp_gpus_per_node=hsdp_gpus_per_node,
                                     accumulation_recipe=accumulation_recipe)  # fmt: skip
    return out
