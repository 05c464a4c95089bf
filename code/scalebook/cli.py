"""``python -m scalebook.train``: one training entry point for a laptop, ``torchrun`` and ``srun``.

The same command trains on one CPU process, on N local ranks under ``torchrun``, or on a GPU cluster
under ``srun`` (SLURM's variables are read when torchrun's are absent): gloo on CPUs, NCCL on GPUs,
chosen by :func:`scalebook.dist.launch.backend_and_device`. Every rank draws the same global batch of
``--global-batch`` sequences and keeps its data-parallel slice, cut into micro-batches of
``--micro-batch``; so the logged loss (the mean over the global batch) is the same whatever the number
of ranks, which is how a run on 4 ranks is checked against one on a single process.

Strategies: ``single`` (one process), ``torch-ddp`` (PyTorch's DistributedDataParallel) and ``fsdp``
(PyTorch's FSDP2 ``fully_shard`` on every block); the book's from-scratch implementations join this list
as the parallelism chapters build them.

Rank 0 prints one JSON object per logged step to stdout (``step``, ``loss``, ``lr``, ``world_size``, ``tokens_per_s``,
``step_time``, ``state_bytes``, and ``mfu`` when ``--peak-flops`` is given) and appends the same lines to
``--metrics`` if set; a tqdm bar goes to stderr. With ``--checkpoint-dir`` the run saves every
``--checkpoint-every`` steps (atomically, see :mod:`scalebook.checkpoint`) and ``--resume`` continues from
the newest complete checkpoint with bit-identical losses on CPU.

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
from dataclasses import dataclass

import torch
import torch.distributed as dist

STRATEGIES = ("single", "torch-ddp", "fsdp")
SIZES = ("tiny", "small", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scalebook.train",
        description="Train the book's GPT with any parallel strategy, on CPUs (gloo) or GPUs (NCCL). "
        "Run directly for one process, or under torchrun / srun for several ranks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("layout")
    g.add_argument("--strategy", choices=STRATEGIES, default="single", help="how the work is split across ranks")
    g.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: all ranks)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
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
        help="sequences per optimizer step over all ranks = micro-batch x dp x accumulation steps",
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
    if args.warmup_steps < 0:
        problems.append(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if not 0 < args.min_lr <= args.lr:
        problems.append(f"need 0 < --min-lr <= --lr, got {args.min_lr} and {args.lr}")
    if args.resume and not args.checkpoint_dir:
        problems.append("--resume needs --checkpoint-dir")
    for name in ("tp", "pp", "cp"):
        if getattr(args, name) != 1:
            problems.append(f"--strategy {args.strategy} has no {name.upper()} dimension; leave --{name} at 1")
    dp = args.dp if args.dp is not None else world_size
    if args.strategy == "single" and world_size != 1:
        problems.append(f"--strategy single runs on one process, but {world_size} ranks were started; "
                        "choose torch-ddp or fsdp, or start one process")  # fmt: skip
    if dp * args.tp * args.pp * args.cp != world_size:
        problems.append(f"dp x tp x pp x cp = {dp} x {args.tp} x {args.pp} x {args.cp} must equal the "
                        f"{world_size} ranks started")  # fmt: skip
    per_step = args.micro_batch * max(dp, 1)
    if args.global_batch % per_step:
        problems.append(
            f"--global-batch ({args.global_batch}) must be a multiple of --micro-batch x dp "
            f"= {per_step}; e.g. --global-batch {max(per_step, args.global_batch // per_step * per_step)}"
        )
    from scalebook.model import GPTConfig

    if args.seq_len > GPTConfig.named(args.model).block_size:
        problems.append(f"--seq-len {args.seq_len} exceeds {args.model}'s context of "
                        f"{GPTConfig.named(args.model).block_size} tokens")  # fmt: skip
    if problems:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(problems))
    return Layout(args.strategy, world_size, dp, args.global_batch // per_step)


def _wrap(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    if strategy == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


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
    for group, saved_group in zip(optimizer.param_groups, saved_opt["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def run(args: argparse.Namespace) -> list[float]:
    """Train as ``args`` say on this process's rank; return the per-step losses (rank 0 logs them)."""
    from scalebook import checkpoint, data
    from scalebook.dist import backend_and_device, detect_env, init_from_env
    from scalebook.measure import model_state_bytes
    from scalebook.model import GPT, GPTConfig
    from scalebook.train import TrainConfig, autocast_context, lr_at, make_optimizer

    env = detect_env()
    layout = validate(args, env.world_size)
    distributed = env.world_size > 1 or args.strategy != "single"
    if distributed:
        init_from_env()
    _, device = backend_and_device(env.local_rank)
    rank, dp_rank = env.rank, env.rank  # every rank is a data-parallel rank in these strategies
    torch.manual_seed(args.seed)
    config = GPTConfig.named(args.model)
    model = GPT(config).to(device)
    model = _wrap(model, args.strategy, device)
    cfg = TrainConfig(steps=args.steps, batch_size=args.micro_batch, grad_accum=layout.grad_accum,
                      seq_len=args.seq_len, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
                      precision=args.precision, seed=args.seed, progress=False)  # fmt: skip
    optimizer = make_optimizer(model, cfg)
    tokens = data.tokenize(data.load_text(args.data))
    generator = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    start = 0
    sharded = args.strategy == "fsdp"
    if args.resume and checkpoint.latest_step(args.checkpoint_dir) is not None:
        start = checkpoint.latest_step(args.checkpoint_dir)
        state = checkpoint.load_shard(args.checkpoint_dir, start, rank if sharded else 0)
        _load_local(model, optimizer, state)
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
            step_loss = torch.zeros((), device=device)
            for i, (xm, ym) in enumerate(zip(x.chunk(layout.grad_accum), y.chunk(layout.grad_accum))):
                last = i == layout.grad_accum - 1
                # DDP communicates on the last micro-batch only; the others accumulate locally.
                sync = model.no_sync() if args.strategy == "torch-ddp" and not last else contextlib.nullcontext()
                with sync, autocast_context(args.precision, device.type):
                    _, loss = model(xm, ym)
                    (loss / layout.grad_accum).backward()
                step_loss += loss.detach() / layout.grad_accum
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if distributed:
                dist.all_reduce(step_loss)
                step_loss /= env.world_size
            losses.append(step_loss.item())
            elapsed = time.perf_counter() - t0
            if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
                record = {"step": step + 1, "loss": losses[-1], "lr": lr, "world_size": env.world_size,
                          "step_time": elapsed,
                          "tokens_per_s": tokens_per_step / elapsed,
                          "state_bytes": model_state_bytes(model, optimizer).total}  # fmt: skip
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
                if sharded or rank == 0:
                    model_state = model.state_dict()
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


def run_local(
    train_args: list[str], *, nproc: int = 1, torchrun_args: tuple[str, ...] = (), timeout: float = 300.0
) -> LocalRun:
    """Run ``python -m scalebook.train`` in a subprocess: directly, or under ``torchrun`` with ``nproc`` ranks.

    For notebooks and tests: the ranks get one thread each, and the JSON metric lines are parsed.
    """
    import subprocess

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    python = sys.executable
    launcher = [python, "-m", "scalebook.train"] if nproc == 1 and not torchrun_args else [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *torchrun_args,
        "-m", "scalebook.train"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*launcher, *train_args], env=env, capture_output=True, text=True, timeout=timeout)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return LocalRun(done.returncode, records, done.stderr)


def main(argv: list[str] | None = None) -> int:
    from scalebook.dist import detect_env

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate(args, detect_env().world_size)
    except ValueError as error:
        parser.error(str(error))
    run(args)
    return 0
