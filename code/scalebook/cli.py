"""``python -m scalebook.train``: one training entry point for a laptop, ``torchrun`` and ``srun``.

The same command trains on one CPU process, on N local ranks under ``torchrun``, or on a GPU cluster
under ``srun`` (SLURM's variables are read when torchrun's are absent): gloo on CPUs, NCCL on GPUs,
chosen by :func:`scalebook.comm.launch.backend_and_device`. Every rank draws the same global batch of
``--global-batch`` sequences and keeps its data-parallel slice, cut into micro-batches of
``--micro-batch``; so the logged loss (the mean over the global batch) is the same whatever the number
of ranks, which is how a run on 4 ranks is checked against one on a single process.

Strategies. PyTorch's own: ``single`` (one process), ``torch-ddp`` (``DistributedDataParallel``) and
``fsdp`` (FSDP2 ``fully_shard`` on every block). The book's from-scratch implementations:

* ``ddp``: Chapter 10's :class:`scalebook.parallel.ddp.OverlappedDDP`, bucketed all-reduces started during
  backward (``--bucket-cap-mb``), ``no_sync`` on every micro-batch but the last.
* ``zero1``, ``zero2``, ``zero3``: Chapter 11's ZeRO engines (:func:`scalebook.parallel.zero.zero_data_parallel`),
  which own flat parameter shards and run Adam on them. An adapter here gives them what the loop needs:
  the learning rate of each step, gradient accumulation (stages 2 and 3 reduce-scatter every
  micro-batch and sum the shards), weight decay on matrices only and global-norm clipping over the
  shards (one all-reduce of the squared norms). Each rank checkpoints its own master and moment shards.
* ``tp``: Chapter 12's :class:`scalebook.parallel.tensor.TensorParallelGPT` over all ranks (``--tp`` = the
  number of ranks; no data-parallel dimension), AdamW on each rank's shards, clipping over the shards.
* ``pp``: Chapter 13's pipeline over all ranks (``--pp`` = the number of ranks, at least 2; no
  data-parallel dimension): rank r holds stage r, a :class:`scalebook.parallel.pipeline.GPTStage`, and
  :func:`scalebook.parallel.pipeline.run_schedule` runs the 1F1B schedule whose micro-batches are the
  step's ``--global-batch / --micro-batch`` micro-batches (at least ``--pp`` of them). The first and the
  last stage sum the gradients of their copies of the tied embedding.
* ``3d``: DP x TP x PP with ``--dp x --tp x --pp`` = the number of ranks, on the mesh of
  :mod:`scalebook.parallel.mesh` (tensor parallelism innermost): each pipeline stage is a
  :class:`scalebook.parallel.mesh.TensorParallelStage`, the mesh-addressed 1F1B runtime of
  :func:`scalebook.parallel.mesh.train_3d` runs each replica's micro-batches, and the gradients are
  averaged over the data-parallel group. Clipping counts every gradient once: the shards of one replica,
  its replicated parameters on one tensor-parallel rank, the tied embedding on the first stage.

Every strategy is the same computation as ``single`` up to float32 rounding, so the logged losses and
gradient norms agree to about 1e-6 relative. ``grad_norm`` is the global L2 norm of the step's gradient
before clipping and before the optimizer: losses after AdamW barely move when every gradient is scaled by
a constant (Adam divides the scale out), the gradient norm moves by that factor, from the first step.

Checkpoints of ``zero*``, ``tp``, ``pp`` and ``3d`` also carry, in rank 0's file, the full model gathered
from the shards and stages, so :func:`scalebook.checkpoint.consolidate` reads them like a replicated one.

Rank 0 prints one JSON object per logged step to stdout (``step``, ``loss``, ``grad_norm``, ``lr``,
``world_size``, ``tokens_per_s``, ``step_time``, ``state_bytes``, and ``mfu`` when ``--peak-flops`` is given)
and appends the same lines to ``--metrics`` if set; a tqdm bar goes to stderr. With ``--checkpoint-dir``
the run saves every ``--checkpoint-every`` steps (atomically, see :mod:`scalebook.checkpoint`) and
``--resume`` continues from the newest complete checkpoint with bit-identical losses on CPU. The
checkpoint records the run's arguments (``"args"``) but the resume does not compare them with the new
ones: resuming with another ``--global-batch`` or ``--steps`` runs a different experiment.

Source: PyTorch documentation, "torchrun (Elastic Launch)", "DistributedDataParallel" and
"torch.distributed.fsdp.fully_shard"; SLURM documentation, "srun".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

STRATEGIES = ("single", "torch-ddp", "fsdp", "ddp", "zero1", "zero2", "zero3", "tp", "pp", "3d")
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
PIPELINED = ("pp", "3d")  # strategies that run Chapter 13's 1F1B schedule
# The model-parallel dimensions each strategy has (none for the others).
MODEL_PARALLEL = {"tp": ("tp",), "pp": ("pp",), "3d": ("tp", "pp")}
PER_RANK_FILES = ("fsdp", "zero1", "zero2", "zero3", "tp", "pp", "3d")  # strategies whose ranks hold distinct state
SIZES = ("tiny", "small", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scalebook.train",
        description="Train the book's GPT with any parallel strategy, on CPUs (gloo) or GPUs (NCCL). "
        "Run directly for one process, or under torchrun / srun for several ranks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("layout")
    g.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="single",
        help="how the work is split across ranks: PyTorch's single / torch-ddp / fsdp, or the book's ddp "
        "(Ch. 10), zero1 / zero2 / zero3 (Ch. 11), tp (Ch. 12, with --tp = the number of ranks), pp (Ch. 13, "
        "with --pp = the number of ranks), 3d (Ch. 14, --dp x --tp x --pp = the number of ranks)",
    )
    g.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel degree, the number of model replicas (default: the ranks left after tp x pp x cp; "
        "1 for --strategy tp and pp)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: all ranks for --strategy tp, the TP dimension of --strategy 3d "
        "(must divide the heads, the width and the vocabulary)",
    )
    g.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="gradient bucket size in MiB for ddp and torch-ddp; None means PyTorch's 25",
    )
    g.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel degree, the number of stages (1F1B schedule): all ranks for --strategy pp (>= 2), "
        "the PP dimension of --strategy 3d; the layers must split evenly over the stages, and each step's "
        "micro-batches, global-batch / (micro-batch x dp), must be at least --pp",
    )
    g.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=SIZES, default="tiny", help="model size (GPTConfig.named)")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    g.add_argument("--data", default=None, help="a text file or folder (default: the embedded corpus)")
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward on one rank")
    g.add_argument(
        "--global-batch",
        type=int,
        default=8,
        help="sequences per optimizer step over all ranks = micro-batch x dp x accumulation steps (under pp "
        "and 3d the accumulation steps are the pipeline's micro-batches)",
    )
    g.add_argument("--steps", type=int, default=20, help="optimizer steps")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the cosine decay")
    g.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps")
    g.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 = autocast mixed precision")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data order")
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (none are written if unset)")
    g.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    g.add_argument("--log-every", type=int, default=1, help="steps between metric lines")
    g.add_argument("--metrics", default=None, help="also append the JSON metric lines to this file")
    g.add_argument("--peak-flops", type=float, default=None, help="per-device peak FLOP/s, to report MFU")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--simulate-failure-at",
        type=int,
        default=None,
        metavar="STEP",
        help="testing aid: the last rank exits with an error before STEP, on a job's first attempt "
        "only (TORCHELASTIC_RESTART_COUNT unset or 0), to exercise restarts and --resume",
    )
    return p  # fmt: skip


@dataclass(frozen=True)
class Layout:
    strategy: str
    world_size: int
    dp: int
    grad_accum: int


def validate(args: argparse.Namespace, world_size: int) -> Layout:
    """Every problem with the arguments at once, as one ValueError, before any process group exists."""
    problems = []
    for name in ("tp", "pp", "cp", "seq_len", "micro_batch", "global_batch", "steps", "checkpoint_every", "log_every"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dp is not None and args.dp < 1:
        problems.append(f"--dp must be >= 1, got {args.dp}")
    if args.warmup_steps < 0:
        problems.append(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if not 0 < args.min_lr <= args.lr:
        problems.append(f"need 0 < --min-lr <= --lr, got {args.min_lr} and {args.lr}")
    if args.resume and not args.checkpoint_dir:
        problems.append("--resume needs --checkpoint-dir")
    for name in ("tp", "pp", "cp"):
        if getattr(args, name) != 1 and name not in MODEL_PARALLEL.get(args.strategy, ()):
            problems.append(f"--strategy {args.strategy} has no {name.upper()} dimension; leave --{name} at 1")
    if args.bucket_cap_mb is not None:
        if args.strategy not in ("ddp", "torch-ddp"):
            problems.append(f"--bucket-cap-mb sizes the gradient buckets of ddp and torch-ddp; drop it for "
                            f"--strategy {args.strategy}")  # fmt: skip
        elif not args.bucket_cap_mb > 0:
            problems.append(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    model_parallel = max(1, args.tp) * max(1, args.pp) * max(1, args.cp)
    dp = args.dp if args.dp is not None else max(1, world_size // model_parallel)
    if args.strategy == "single" and world_size != 1:
        problems.append(f"--strategy single runs on one process, but {world_size} ranks were started; "
                        "choose torch-ddp or fsdp, or start one process")  # fmt: skip
    if dp * args.tp * args.pp * args.cp != world_size:
        problems.append(f"dp x tp x pp x cp = {dp} x {args.tp} x {args.pp} x {args.cp} must equal the "
                        f"{world_size} ranks started")  # fmt: skip
    per_step = args.micro_batch * max(dp, 1)
    if per_step >= 1 and args.global_batch % per_step:  # (--micro-batch < 1 is reported above)
        problems.append(
            f"--global-batch ({args.global_batch}) must be a multiple of --micro-batch x dp "
            f"= {per_step}; e.g. --global-batch {max(per_step, args.global_batch // per_step * per_step)}"
        )
    if args.strategy == "tp" and dp != 1:
        problems.append(f"--strategy tp splits every layer over all ranks and has no data-parallel dimension: "
                        f"set --tp to the {world_size} ranks started (got --tp {args.tp}, dp {dp})")  # fmt: skip
    if args.strategy == "pp" and args.pp == 1:
        problems.append("--strategy pp needs --pp >= 2 stages (the first and the last each hold a copy of the tied "
                        "embedding); on one process use --strategy single")  # fmt: skip
    elif args.strategy == "pp" and dp != 1:
        problems.append(f"--strategy pp runs one pipeline over all ranks and has no data-parallel dimension: set "
                        f"--pp to the {world_size} ranks started (got --pp {args.pp}, dp {dp}), or add data "
                        f"parallelism with --strategy 3d --dp {dp} --pp {args.pp}")  # fmt: skip
    if args.strategy in ZERO_STAGES and torch.cuda.is_available():
        problems.append(f"--strategy {args.strategy}: the ZeRO engines of Chapter 11 keep their flat shards in CPU "
                        "memory; on GPUs use --strategy fsdp")  # fmt: skip
    from scalebook.model import GPTConfig

    config = GPTConfig.named(args.model)
    if args.strategy in ("tp", "3d") and args.tp >= 1:
        from scalebook.parallel.tensor import validate_tensor_parallel

        try:
            validate_tensor_parallel(config, args.tp)
        except ValueError as error:
            problems.append(f"--strategy {args.strategy} --tp {args.tp}: {error}")
    if args.strategy in PIPELINED and args.pp >= 1:
        if config.n_layer % args.pp:
            fits = [n for n in range(2 if args.strategy == "pp" else 1, config.n_layer + 1) if config.n_layer % n == 0]
            problems.append(f"--strategy {args.strategy} --pp {args.pp}: the {config.n_layer} layers of --model "
                            f"{args.model} must split evenly over the stages; choose --pp from {fits}")  # fmt: skip
        # Counted for a consistent layout only: with the wrong dp the count would mislead.
        consistent = dp * args.tp * args.pp * args.cp == world_size and (args.strategy != "pp" or dp == 1)
        microbatches = args.global_batch // per_step if per_step >= 1 and args.global_batch % per_step == 0 else 0
        if consistent and 1 <= microbatches < args.pp:
            problems.append(
                f"--strategy {args.strategy} --pp {args.pp}: the 1F1B schedule needs at least as many micro-batches "
                f"per step as stages, got --global-batch / (--micro-batch x dp) = {args.global_batch} / "
                f"({args.micro_batch} x {dp}) = {microbatches}; raise --global-batch to {args.pp * per_step} or "
                "lower --micro-batch"
            )
    if args.seq_len > config.block_size:
        problems.append(f"--seq-len {args.seq_len} exceeds {args.model}'s context of {config.block_size} "
                        "tokens")  # fmt: skip
    if problems:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(problems))
    return Layout(args.strategy, world_size, dp, args.global_batch // per_step)


def _wrap(model: torch.nn.Module, strategy: str, device: torch.device, bucket_cap_mb: float | None) -> torch.nn.Module:
    buckets = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}  # None: each class's default
    if strategy == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **buckets)
    if strategy == "ddp":
        from scalebook.parallel.ddp import OverlappedDDP

        return OverlappedDDP(model, **buckets)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _clip_grad_norm_over_shards(
    sharded: list[torch.Tensor], replicated: list[torch.Tensor], max_norm: float, *, copies: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` when each rank holds a different part of the gradients.

    The global L2 norm needs every rank's shards: their squared norms are summed over the ranks (one
    all-reduce of one number); gradients that every rank holds identically (``replicated``) count once.
    ``copies`` are gradients that another rank counts among its ``sharded`` (a replica's, a tied copy's):
    scaled, not counted. A rank may count nothing.
    """
    squares = torch.zeros((), device=next(g.device for g in [*sharded, *replicated, *copies]))
    if sharded:
        squares = torch.stack([torch.linalg.vector_norm(g) ** 2 for g in sharded]).sum()
    dist.all_reduce(squares)
    if replicated:
        squares = squares + torch.stack([torch.linalg.vector_norm(g) ** 2 for g in replicated]).sum()
    total = squares.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula, epsilon included
    for g in [*sharded, *replicated, *copies]:
        g.mul_(coefficient)
    return total


class _Pipeline:
    """``pp`` and ``3d``: this rank's pipeline stage on a DP x TP x PP mesh, the 1F1B step, the gradient
    synchronisation, clipping and the gathering of the full model.

    ``pp`` is one pipeline of Chapter 13's :class:`~scalebook.parallel.pipeline.GPTStage` run by
    :func:`~scalebook.parallel.pipeline.run_schedule` (rank r = stage r); ``3d`` cuts a
    :class:`~scalebook.parallel.tensor.TensorParallelGPT` into
    :class:`~scalebook.parallel.mesh.TensorParallelStage` and runs the mesh-addressed 1F1B of
    :mod:`scalebook.parallel.mesh`. Either way the stage's parameters carry the GPT's names.
    """

    def __init__(self, gpt: torch.nn.Module, strategy: str, layout: Layout, tp: int, pp: int, device):
        from scalebook.parallel import mesh
        from scalebook.parallel.pipeline import GPTStage, build_schedule, stage_layers

        self.mesh = mesh.DeviceMesh.build(mesh.ParallelDims(layout.world_size, dp=layout.dp, tp=tp, pp=pp))
        self.tied_group = mesh.tied_embedding_group(self.mesh)  # the first and the last stage
        self.strategy, self.dp, self.pp, self.microbatches = strategy, layout.dp, pp, layout.grad_accum
        self.coords, self.device = self.mesh.coords, device
        index = self.coords["pp"]
        self.first, self.last = index == 0, index == pp - 1
        layers = stage_layers(gpt.config.n_layer, pp)[index]
        if strategy == "3d":
            from scalebook.parallel.tensor import TensorParallelGPT

            tp_model = TensorParallelGPT.from_gpt(gpt, self.mesh.group("tp")).to(device)
            self.stage = mesh.TensorParallelStage(tp_model, layers, first=self.first, last=self.last)
            self.head = "head.weight"
        else:
            self.stage = GPTStage(gpt, layers, first=self.first, last=self.last).to(device)
            self.schedule = build_schedule("1f1b", pp, self.microbatches)
            self.head = "lm_head.weight"
        # The tied embedding's two copies: the embedding on the first stage, the head on the last (one
        # matrix when a stage is both); the stages between hold neither.
        named = dict(self.stage.named_parameters())
        self.tied = named["wte.weight"] if self.first else named.get(self.head)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, precision: str) -> torch.Tensor:
        """The step's micro-batches through the pipeline, gradients summed over the tied copies and averaged
        over the replicas; returns the loss of the global batch (on every rank)."""
        from scalebook.train import autocast_context

        with autocast_context(precision, self.device.type):
            if self.strategy == "3d":
                from scalebook.parallel.mesh import _run_pipeline_step

                loss = _run_pipeline_step(self.mesh, self.stage, x, y, self.microbatches)
            else:
                from scalebook.parallel.pipeline import run_schedule

                loss = run_schedule(self.schedule, {self.coords["pp"]: self.stage}, x, y).loss
        if self.pp > 1 and (self.first or self.last):
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        if self.dp > 1:
            for p in self.stage.parameters():
                dist.all_reduce(p.grad, group=self.mesh.group("dp"))
                p.grad /= self.dp
        # The last stage of each replica has its loss (every tensor-parallel rank of it the same one).
        mine = loss if self.last and self.coords["tp"] == 0 else 0.0
        total = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return total / self.dp

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping with every gradient counted once: the first replica's, replicated parameters
        on its tensor-parallel rank 0, the tied embedding on the first stage (one all-reduce over all ranks)."""
        from scalebook.parallel.tensor import sharding_of

        counted, copies = [], []
        for name, p in self.stage.named_parameters():
            copy = (
                self.coords["dp"] > 0
                or (name == self.head and not self.first)
                or (self.coords["tp"] > 0 and sharding_of(name) is None)
            )
            (copies if copy else counted).append(p.grad)
        return _clip_grad_norm_over_shards(counted, [], max_norm, copies=copies)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """On rank 0 every parameter of the unsharded GPT, by its names, gathered from the stages (and their
        tensor-parallel shards); ``{}`` on the other ranks. A collective: every rank calls it."""
        if self.strategy == "3d":
            mine = self.stage.full_state_dict()  # all-gathers over the tensor-parallel group
        else:
            mine = {name: p.detach() for name, p in self.stage.named_parameters() if name != self.head}
        if self.coords["dp"] or self.coords["tp"]:
            return {}
        # The pipeline of rank 0 (replica 0, tensor-parallel rank 0): its stages send their parts to rank 0.
        parts = [None] * self.pp if self.mesh.rank == 0 else None
        dist.gather_object({name: t.cpu() for name, t in mine.items()}, parts, dst=0, group=self.mesh.group("pp"))
        return {name: t for part in parts for name, t in part.items()} if self.mesh.rank == 0 else {}


class _ZeroAdamW:
    """Chapter 11's ZeRO engine (stage 1, 2 or 3) behind the optimizer calls of the training loop.

    The engine owns each unit's flat parameter shard with its Adam moments and updates it with
    :func:`scalebook.parallel.zero.adam_update` (torch's AdamW arithmetic). Its own ``step(x, y)`` runs one
    batch at a fixed learning rate, so this adapter drives the engine's parts itself and adds what the
    loop needs: ``param_groups[0]["lr"]`` set each step, gradient accumulation, global-norm clipping over
    the shards, weight decay on matrices only (as :func:`scalebook.train.make_optimizer`), and a state
    dict of this rank's shards.
    """

    def __init__(self, model: torch.nn.Module, stage: int, cfg):
        from scalebook.parallel.zero import zero_data_parallel

        # Weight decay is applied below, matrix by matrix; the engine's own (every element) stays off.
        self.engine = zero_data_parallel(model, stage, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=0.0)
        self.weight_decay = cfg.weight_decay
        self.param_groups = [{"lr": cfg.lr}]
        self.decayed = [self._decayed_slices(unit) for unit in self.engine.units]
        self.accumulated: list[torch.Tensor] | None = None

    def _decayed_slices(self, unit) -> list[slice]:
        """Where this rank's shard of ``unit`` holds elements of matrices (dim >= 2), in shard coordinates."""
        owned = self.engine._owned(unit)
        slices, offset = [], 0
        for p in unit.params:
            start, end = max(offset, owned.start), min(offset + p.numel(), owned.stop)
            if p.dim() >= 2 and start < end:
                slices.append(slice(start - owned.start, end - owned.start))
            offset += p.numel()
        return slices

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine._zero_grads()
        self.accumulated = None

    def micro_batch_done(self) -> None:
        """Stages 2 and 3 reduce-scatter during backward, overwriting the gradient shard: add it to a sum.

        Stage 1 needs nothing: its full gradients accumulate in place until :meth:`reduce_gradients`.
        """
        if self.engine.stage < 2:
            return
        shards = [unit.grad_shard for unit in self.engine.units]
        if self.accumulated is None:
            self.accumulated = [shard.clone() for shard in shards]
        else:
            for total, shard in zip(self.accumulated, shards, strict=True):
                total.add_(shard)

    def reduce_gradients(self) -> None:
        """Leave each unit's ``grad_shard`` holding this rank's shard of the mean gradient of the step."""
        if self.engine.stage < 2:
            self.engine._reduce_gradients()
        else:
            for unit, total in zip(self.engine.units, self.accumulated, strict=True):
                unit.grad_shard.copy_(total)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return _clip_grad_norm_over_shards([unit.grad_shard for unit in self.engine.units], [], max_norm)

    def step(self) -> None:
        from scalebook.parallel.zero import adam_update

        engine, lr = self.engine, self.param_groups[0]["lr"]
        engine.steps += 1
        for unit, decayed in zip(engine.units, self.decayed, strict=True):
            for piece in decayed:  # AdamW's decoupled decay, theta <- theta (1 - lr wd), as torch computes it
                unit.master[piece].mul_(1 - lr * self.weight_decay)
            adam_update(unit.master, unit.grad_shard, unit.exp_avg, unit.exp_avg_sq, step=engine.steps, lr=lr,
                        betas=engine.hyper["betas"], eps=engine.hyper["eps"], weight_decay=0.0)  # fmt: skip
            engine._after_update(unit)  # stages 1 and 2 all-gather the updated shards; stage 3 gathers lazily

    def state_dict(self) -> dict:
        units = self.engine.units
        return {"steps": self.engine.steps, "master": [u.master.clone() for u in units],
                "exp_avg": [u.exp_avg.clone() for u in units],
                "exp_avg_sq": [u.exp_avg_sq.clone() for u in units]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.engine.steps = int(state["steps"])
        with torch.no_grad():
            for i, unit in enumerate(self.engine.units):
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    getattr(unit, key).copy_(state[key][i])
                self.engine._after_update(unit)  # the full parameters of stages 1 and 2 from every rank's shard

    def held_bytes(self) -> int:
        return self.engine.held_bytes().total


def _gpt_state_dict(model: torch.nn.Module, parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict ``GPT.load_state_dict`` expects (the tied head included) from full parameters named
    as in ``model.named_parameters()``."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    return {name: parameters[canonical[id(p)]] for name, p in model.named_parameters(remove_duplicate=False)}


def _local(obj):
    """A state dict with every DTensor (FSDP2's sharded tensors) replaced by this rank's shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local().clone()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local(v) for v in obj]
    return obj


def _load_local(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Copy saved (local) tensors into the live model and optimizer, shard by shard."""
    from torch.distributed.tensor import DTensor

    def copy_into(live, saved):
        (live.to_local() if isinstance(live, DTensor) else live).copy_(saved)

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            copy_into(tensor, state["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_opt = state["optimizer"]
    for index, param in enumerate(params):
        saved = saved_opt["state"].get(index)
        if saved is None:
            continue
        live = optimizer.state[param]
        for key, value in saved.items():
            if isinstance(param, DTensor) and torch.is_tensor(value) and value.dim() > 0:
                value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())  # fmt: skip
            live[key] = value
    for group, saved_group in zip(optimizer.param_groups, saved_opt["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def run(args: argparse.Namespace) -> list[float]:
    """Train as ``args`` say on this process's rank; return the per-step losses (rank 0 logs them)."""
    from scalebook import checkpoint, data
    from scalebook.comm import backend_and_device, detect_env, init_from_env
    from scalebook.measure import model_state_bytes
    from scalebook.model import GPT, GPTConfig
    from scalebook.train import TrainConfig, autocast_context, lr_at, make_optimizer

    env = detect_env()
    layout = validate(args, env.world_size)
    distributed = env.world_size > 1 or args.strategy != "single"
    if distributed:
        init_from_env()
    _, device = backend_and_device(env.local_rank)
    rank = env.rank
    zero, tp, pipelined = args.strategy in ZERO_STAGES, args.strategy == "tp", args.strategy in PIPELINED
    torch.manual_seed(args.seed)
    config = GPTConfig.named(args.model)
    gpt = GPT(config).to(device)
    cfg = TrainConfig(steps=args.steps, batch_size=args.micro_batch, grad_accum=layout.grad_accum,
                      seq_len=args.seq_len, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
                      precision=args.precision, seed=args.seed, progress=False)  # fmt: skip
    pipeline = None
    if zero:
        model, optimizer = gpt, _ZeroAdamW(gpt, ZERO_STAGES[args.strategy], cfg)
    else:
        if pipelined:
            pipeline = _Pipeline(gpt, args.strategy, layout, args.tp, args.pp, device)
            model = pipeline.stage
        elif tp:
            from scalebook.parallel.tensor import TensorParallelGPT, sharding_of

            model = TensorParallelGPT.from_gpt(gpt).to(device)
            split = {name for name, _ in model.named_parameters() if sharding_of(name) is not None}
        else:
            model = _wrap(gpt, args.strategy, device, args.bucket_cap_mb)
        optimizer = make_optimizer(model, cfg)
    # Every rank is a data-parallel rank, except under tp and pp, where all ranks share one batch, and 3d,
    # where the ranks of one replica (its tp x pp ranks) share its slice.
    dp_rank = pipeline.coords["dp"] if pipeline else 0 if tp else env.rank
    unwrapped = model.module if args.strategy == "ddp" else model  # what ddp checkpoints: GPT's own names
    data_parallel_wrapper = args.strategy in ("torch-ddp", "ddp")  # the two with no_sync()
    tokens = data.tokenize(data.load_text(args.data))
    generator = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    start = 0
    sharded = args.strategy in PER_RANK_FILES
    if args.resume and checkpoint.latest_step(args.checkpoint_dir) is not None:
        start = checkpoint.latest_step(args.checkpoint_dir)
        state = checkpoint.load_shard(args.checkpoint_dir, start, rank if sharded else 0)
        if zero:
            optimizer.load_state_dict(state["zero"])
        elif tp or pipeline:
            _load_local(model, optimizer, {"model": state["local_model"], "optimizer": state["optimizer"]})
        else:
            _load_local(unwrapped, optimizer, state)
        generator.set_state(state["generator"])
        losses = state["losses"].tolist()
    per_rank = args.micro_batch * layout.grad_accum
    tokens_per_step = args.global_batch * args.seq_len
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    metrics_file = open(args.metrics, "a") if args.metrics and rank == 0 else None  # noqa: SIM115
    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=args.steps, initial=start, desc=f"{args.strategy} x{env.world_size}", unit="step",
                        file=sys.stderr)  # fmt: skip
    model.train()
    try:
        for step in range(start, args.steps):
            if args.simulate_failure_at == step + 1 and first_attempt and rank == env.world_size - 1:
                print(f"rank {rank}: simulated failure before step {step + 1}", file=sys.stderr, flush=True)
                os._exit(1)
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            x, y = data.get_batch(tokens, per_rank, args.seq_len, generator, rank=dp_rank, world_size=layout.dp)
            x, y = x.to(device), y.to(device)
            if pipeline:  # the step's micro-batches are the pipeline's; the loss is the global batch's
                step_loss = pipeline.forward_backward(x, y, args.precision)
            else:
                step_loss = torch.zeros((), device=device)
                for i, (xm, ym) in enumerate(zip(x.chunk(layout.grad_accum), y.chunk(layout.grad_accum), strict=True)):
                    last = i == layout.grad_accum - 1
                    # DDP communicates on the last micro-batch only; the others accumulate locally.
                    sync = model.no_sync() if data_parallel_wrapper and not last else contextlib.nullcontext()
                    with sync, autocast_context(args.precision, device.type):
                        _, loss = model(xm, ym)
                        (loss / layout.grad_accum).backward()
                    if zero:
                        optimizer.micro_batch_done()
                    step_loss += loss.detach() / layout.grad_accum
            if args.strategy == "ddp":
                model.sync_gradients()  # wait for the bucket all-reduces that backward started
            # Each branch returns the global L2 norm of the step's mean gradient before clipping, counting
            # every gradient once: the same number on every strategy, so logging it checks the gradients
            # themselves (a missing 1/dp multiplies it by dp at step 1, which AdamW would hide in the losses).
            if zero:
                optimizer.reduce_gradients()
                grad_norm = optimizer.clip_grad_norm_(1.0)
            elif pipeline:
                grad_norm = pipeline.clip_grad_norm_(1.0)
            elif tp:
                named = list(model.named_parameters())
                grad_norm = _clip_grad_norm_over_shards([p.grad for n, p in named if n in split],
                                                        [p.grad for n, p in named if n not in split], 1.0)  # fmt: skip
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if hasattr(grad_norm, "full_tensor"):  # fsdp: a DTensor, this rank's share of the reduction
                grad_norm = grad_norm.full_tensor()
            optimizer.step()
            # Under tp every rank already has the loss of the whole batch, under pp and 3d too (averaged above).
            if distributed and layout.dp > 1 and not pipeline:
                dist.all_reduce(step_loss)
                step_loss /= layout.dp
            losses.append(step_loss.item())
            elapsed = time.perf_counter() - t0
            if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
                record = {"step": step + 1, "loss": losses[-1], "grad_norm": grad_norm.item(), "lr": lr,
                          "world_size": env.world_size,
                          "step_time": elapsed,
                          "tokens_per_s": tokens_per_step / elapsed,
                          "state_bytes": optimizer.held_bytes() if zero
                                         else model_state_bytes(model, optimizer).total}  # fmt: skip
                if args.peak_flops:
                    from scalebook import accounting, configs

                    per_token = accounting.flops_per_token(configs.ModelConfig.from_gpt_config(config, name=args.model))
                    record["mfu"] = per_token * record["tokens_per_s"] / (env.world_size * args.peak_flops)
                line = json.dumps(record)
                print(line, flush=True)
                if metrics_file:
                    metrics_file.write(line + "\n")
                    metrics_file.flush()
            if progress:
                progress.update()
                progress.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
                if zero or tp or pipeline:
                    # Rank 0's file also holds the full model, gathered from the shards and stages (a
                    # collective), so that consolidate() reads it like a replicated checkpoint.
                    if zero:
                        full = optimizer.engine.full_parameters()
                    else:
                        full = pipeline.full_parameters() if pipeline else model.full_state_dict()
                    state = {"model": _gpt_state_dict(gpt, full) if rank == 0 else {}, "sharded": [],
                             "world_size": env.world_size, "model_size": args.model,
                             "generator": generator.get_state(), "losses": torch.tensor(losses, dtype=torch.float64),
                             "step": step + 1, "args": json.dumps(vars(args))}  # fmt: skip
                    if zero:
                        state["zero"] = optimizer.state_dict()  # this rank's master and moment shards
                    else:
                        state["local_model"], state["optimizer"] = model.state_dict(), optimizer.state_dict()
                    checkpoint.save_shard(args.checkpoint_dir, step + 1, rank, state)
                elif sharded or rank == 0:
                    model_state = unwrapped.state_dict()
                    state = {"model": _local(model_state), "optimizer": _local(optimizer.state_dict()),
                             "sharded": [k for k, v in model_state.items() if type(v).__name__ == "DTensor"],
                             "world_size": env.world_size, "model_size": args.model,
                             "generator": generator.get_state(), "losses": torch.tensor(losses, dtype=torch.float64),
                             "step": step + 1, "args": json.dumps(vars(args))}  # fmt: skip
                    checkpoint.save_shard(args.checkpoint_dir, step + 1, rank, state)
                if distributed:
                    dist.barrier()  # every shard is on disk before `latest` moves
                if rank == 0:
                    checkpoint.mark_complete(args.checkpoint_dir, step + 1)
    finally:
        if progress:
            progress.close()
        if metrics_file:
            metrics_file.close()
        if distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return losses


@dataclass
class LocalRun:
    """The outcome of :func:`run_local`: exit code, the metric records rank 0 printed, and stderr."""

    returncode: int
    records: list[dict]
    stderr: str

    @property
    def losses(self) -> dict[int, float]:
        """Step -> loss; a step run twice (before a crash and after a resume) keeps its last value."""
        return {r["step"]: r["loss"] for r in self.records}

    @property
    def grad_norms(self) -> dict[int, float]:
        """Step -> global gradient norm before clipping, like :attr:`losses`."""
        return {r["step"]: r["grad_norm"] for r in self.records}


def run_local(
    train_args: list[str], *, nproc: int = 1, torchrun_args: tuple[str, ...] = (), timeout: float = 300.0
) -> LocalRun:
    """Run ``python -m scalebook.train`` in a subprocess: directly, or under ``torchrun`` with ``nproc`` ranks.

    For notebooks and tests: the ranks get one thread each, and the JSON metric lines are parsed. After
    ``timeout`` seconds the whole process group (launcher and ranks) is killed and TimeoutExpired raised,
    so no orphaned rank keeps running.
    """
    import signal
    import subprocess

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    python = sys.executable
    launcher = [python, "-m", "scalebook.train"] if nproc == 1 and not torchrun_args else [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *torchrun_args,
        "-m", "scalebook.train"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with subprocess.Popen([*launcher, *train_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM lets torchrun stop its ranks (they run in sessions of their own); then make sure.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
            raise
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return LocalRun(proc.returncode, records, stderr)


def main(argv: list[str] | None = None) -> int:
    from scalebook.comm import detect_env

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate(args, detect_env().world_size)
    except ValueError as error:
        parser.error(str(error))
    run(args)
    return 0
