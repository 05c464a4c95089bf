"""``python -m scalebook.train``: one training entry point for a laptop, ``torchrun`` and ``srun``.

The same command trains on one CPU process, on N local ranks under ``torchrun``, or on a GPU cluster
under ``srun`` (SLURM's variables are read when torchrun's are absent): gloo on CPUs, NCCL on GPUs,
chosen by :func:`scalebook.comm.launch.backend_and_device`. Every rank draws the same global batch of
``--global-batch`` sequences and keeps its data-parallel slice, cut into micro-batches of
``--micro-batch``; so the logged loss (the mean over the global batch) is the same whatever the layout,
which is how a run on 4 ranks is checked against one on a single process.

The layout. ``--tp``, ``--pp``, ``--cp`` and ``--ep`` are the degrees of tensor (Ch. 12), pipeline (Ch. 13, a
1F1B schedule over the step's micro-batches), context (Ch. 14, ring attention over a zig-zag split) and
expert parallelism (Ch. 14, with ``--moe-experts``); the ranks left over are data-parallel replicas
(``--dp``), kept in step by ``--strategy``: PyTorch's ``torch-ddp`` or ``fsdp`` (FSDP2), or the book's ``ddp``
(Ch. 10's overlapped buckets), ``zero1`` (that DDP and Ch. 11's sharded optimizer), ``zero2`` or ``zero3``
(Ch. 11's ``fully_shard``). ``single`` is one replica; ``tp``, ``pp`` and ``3d`` name Chapters 12-14's layouts
and average their replicas with the book's ``ddp``. :class:`scalebook.parallel.dims.ParallelDims` checks the
layout before any rank starts work, :func:`scalebook.parallel.parallelize.parallelize` builds it, and the
loop of :mod:`scalebook.train.loop` trains it without knowing which it is.

Every layout is the same computation as ``single`` up to float32 rounding, so the logged losses and
gradient norms agree to about 1e-6 relative. ``grad_norm`` is the global L2 norm of the step's gradient
before clipping: losses after AdamW barely move when every gradient is scaled by a constant (Adam divides
the scale out), the gradient norm moves by that factor, from the first step.

Rank 0 prints one JSON object per logged step to stdout (``step``, ``loss``, ``grad_norm``, ``lr``,
``world_size``, ``tokens_per_s``, ``step_time``, ``state_bytes``, and ``mfu`` when ``--peak-flops`` is given)
and appends the same lines to ``--metrics`` if set; a tqdm bar goes to stderr. With ``--checkpoint-dir``
the run saves every ``--checkpoint-every`` steps (atomically, with a manifest of SHA-256 sums, see
:mod:`scalebook.train.checkpoint`) through ``torch.distributed.checkpoint``, each rank writing its part
(``--async-save``: in a background thread; ``--keep-last N``: the N newest kept); ``--resume`` continues from
the newest intact checkpoint, bit-identically on CPU in the layout that wrote it, and in any other layout or
number of ranks (the checkpoint is resharded) to float32 rounding.

Failing loudly. :mod:`scalebook.train.preflight` checks the arguments, layout, paths, data, memory and a
resume's checkpoint (whose files the ranks of a launch read together, each once) on every rank before any
trains; an error is printed once, by rank 0, and every rank exits with code 2. A step whose loss or gradient
norm is not finite never updates the weights, and stops the run (exit code 1, naming the last good
checkpoint) unless ``--skip-nonfinite`` allows it; only finite weights are saved.

Source: PyTorch documentation, "torchrun (Elastic Launch)", "DistributedDataParallel" and
"torch.distributed.fsdp.fully_shard"; SLURM documentation, "srun"; torchtitan ``train.py``;
Micikevicius et al. 2018 (skipping the update of a step with non-finite gradients).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from scalebook.train import checkpoint
from scalebook.train.checkpoint import RunCheckpoints
from scalebook.train.preflight import STRATEGIES, Plan, layout, model_config, preflight, settle_resume

__all__ = ["LocalRun", "TrainingDiverged", "build_parser", "layout", "main", "run", "run_local"]

SIZES = ("tiny", "small", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


class TrainingDiverged(RuntimeError):
    """A non-finite loss, gradient norm or weights: the run stopped (exit code 1) without saving them."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is reported once in a distributed run: rank 0 prints it, without the usage text
    (``--help`` has it), and every rank exits with argparse's code 2 once rank 0 has printed it (no traceback:
    torchrun's report of the exit codes follows, which no rank can silence, so rank 0 says what it is)."""

    refusing = threading.local()  # per thread: a notebook may call run_local from several threads at once

    def error(self, message: str):
        from scalebook.comm.launch import rank0_says

        torchrun = ("\n(torchrun's report below only says that the ranks exited with code 2; --check-only WORLD_SIZE "
                    "runs these checks without torchrun)") if "TORCHELASTIC_RUN_ID" in os.environ else ""  # fmt: skip
        text = f"{self.prog}: error: {message}\n(see {self.prog} --help){torchrun}\n"
        if getattr(self.refusing, "on", False):  # _refusal's pre-flight, in this thread: the text, not printed
            raise SystemExit(text)
        rank0_says(text)  # the others wait for it
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m scalebook.train",
        description="Train the book's GPT in any parallel layout, on CPUs (gloo) or GPUs (NCCL). "
        "Run directly for one process, or under torchrun / srun for several ranks. Every argument, path, the "
        "data and a --resume's checkpoint are checked before any rank starts work. Exit codes: 0 done (or "
        "nothing to do), 1 the run failed or diverged, 2 invalid arguments, 3 stopped by SIGTERM or SIGUSR1, 130 "
        "stopped by Ctrl-C (SIGINT): the step in progress ends and the run saves (--resume continues); a second "
        "Ctrl-C stops at once, without saving.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("layout (dp x tp x pp x cp = the number of ranks)")
    g.add_argument(
        "--strategy",
        choices=tuple(STRATEGIES),
        default="single",
        help="how the data-parallel replicas keep in step: PyTorch's torch-ddp / fsdp, or the book's ddp (Ch. 10), "
        "zero1 / zero2 / zero3 (Ch. 11); single = one replica; tp, pp, 3d (Ch. 12-14) = the book's ddp",
    )
    g.add_argument("--dp", type=int, default=None, help="data-parallel degree, the number of replicas (default: "
                   "the ranks tp x pp x cp leave)")  # fmt: skip
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree (must divide the heads, the width and the vocabulary)")  # fmt: skip
    g.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel degree, the number of 1F1B stages; the layers must split evenly over "
        "the stages, and each step's micro-batches, global-batch / (micro-batch x dp), must be >= --pp",
    )
    g.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: ring attention over a zig-zag split of each sequence into "
        "2 x cp chunks (--seq-len must divide evenly); the cp ranks average their gradients as replicas do, "
        "so with a data-parallel --strategy (not single), and not with --pp or --sequence-parallel",
    )
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree: the experts of --moe-experts sharded "
                   "over ep of the dp replicas")  # fmt: skip
    g.add_argument("--sequence-parallel", action="store_true", help="with --tp: LayerNorms, residuals and dropout "
                   "on seq-len / tp tokens per rank (Ch. 12)")  # fmt: skip
    g.add_argument("--bucket-cap-mb", type=float, default=None, help="gradient bucket size in MiB for ddp, zero1 "
                   "and torch-ddp; None means PyTorch's 25")  # fmt: skip
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=SIZES, default="tiny", help="model size (GPTConfig.named)")
    g.add_argument("--moe-experts", type=int, default=0, help="experts per mixture-of-experts MLP (0: the dense MLP)")
    g.add_argument("--moe-top-k", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    g.add_argument(
        "--data",
        default=None,
        help="a text file or folder, or a folder of token shards written by `python -m scalebook.data prepare` "
        "(memory-mapped; default: the embedded corpus)",
    )
    g.add_argument(
        "--encoding",
        default="utf-8",
        help="how a text --data is decoded, strictly: a byte that is not valid stops the run before it starts, "
        "naming the file and the byte's offset; latin-1, cp1252 or any Python codec is decoded and trained on as "
        "UTF-8, and bytes trains on the files' exact bytes, whatever they encode",
    )
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward on one rank")
    g.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step over all ranks = micro-batch x dp x micro-batches per step "
        "(under --pp the micro-batches are the pipeline's); default: the smallest multiple of micro-batch x dp "
        "that is at least 8 and gives each replica at least --pp micro-batches, so any number of ranks works",
    )
    g.add_argument("--steps", type=int, default=20, help="optimizer steps")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the cosine decay")
    g.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps")
    g.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 = autocast mixed precision")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data order")
    g.add_argument(
        "--skip-nonfinite",
        type=int,
        default=0,
        metavar="N",
        help="a step whose loss or gradient norm is NaN or infinite never updates the weights; the run stops at "
        "the first such step (exit code 1, naming the last good checkpoint) unless N > 0: then up to N such "
        "steps are skipped (no optimizer update, a line on stderr each) and the run stops at the next one",
    )
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (none are written if unset)")
    g.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    g.add_argument(
        "--keep-last",
        type=int,
        default=0,
        metavar="N",
        help="keep only the N newest complete checkpoints (older step folders are deleted once a newer one is "
        "published; never the one 'latest' names); 0 keeps them all",
    )
    g.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints in a background thread (torch.distributed.checkpoint.async_save): training "
        "stalls only while the state is copied to host memory; a checkpoint is published when the next one "
        "starts or the run ends",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint in --checkpoint-dir (each file's SHA-256 is checked; "
        "a corrupt one is passed over, saying so); --model, --moe-experts, --moe-top-k, --seq-len, "
        "--global-batch, --seed and --data must equal the checkpoint's; the layout and the number of ranks may "
        "change (the checkpoint is resharded); with no checkpoint yet, start at step 0",
    )
    g.add_argument("--overwrite", action="store_true", help="a run without --resume into a --checkpoint-dir "
                   "holding checkpoints is refused; this deletes them (latest, step folders), starts over")  # fmt: skip
    g.add_argument("--log-every", type=int, default=1, help="steps between metric lines")
    g.add_argument("--metrics", default=None, help="also append the JSON metric lines to this file")
    g.add_argument("--peak-flops", type=float, default=None, help="per-device peak FLOP/s, to report MFU")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--check-only",
        type=int,
        default=None,
        metavar="WORLD_SIZE",
        help="run the pre-flight checks for WORLD_SIZE ranks (arguments, layout, paths, data, memory, a --resume's "
        "checkpoint), then exit: 0 if the run would start, 2 with the message if not (the sbatch scripts "
        "call it once before starting any rank)",
    )
    g.add_argument("--skip-memory-check", action="store_true", help="start even when the pre-flight's estimate of a "
                   "rank's memory (scalebook.accounting's model states and activations, a lower bound) exceeds what "
                   "the device has free (RAM on a CPU, shared by its ranks)")  # fmt: skip
    g.add_argument(
        "--simulate-failure-at",
        type=int,
        default=None,
        metavar="STEP",
        help="testing aid: the last rank exits with an error before STEP, on a job's first attempt "
        "only (TORCHELASTIC_RESTART_COUNT unset or 0), to exercise restarts and --resume",
    )
    g.add_argument(
        "--simulate-signal-at",
        type=int,
        default=None,
        metavar="STEP",
        help="testing aid: the last rank alone sends itself SIGUSR1 after STEP, as SLURM does before a time "
        "limit: every rank stops after that step, saves and exits with code 3; --resume continues",
    )
    return p  # fmt: skip


class _Log:
    """Rank 0's metric lines (stdout and ``--metrics``) and progress bar; silent on the other ranks."""

    def __init__(self, args: argparse.Namespace, dims, rank: int, start: int):
        self.args, self.dims, self.on = args, dims, rank == 0
        if args.metrics and self.on:  # the pre-flight created nothing: a refused run leaves no trace
            Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(args.metrics, "a") if args.metrics and self.on else None  # noqa: SIM115
        self.bar = None
        if self.on and not args.no_progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=args.steps, initial=start, desc=f"{args.strategy} x{dims.world_size}", unit="step",
                            file=sys.stderr)  # fmt: skip
        self.flops_per_token = None
        if args.peak_flops:
            from scalebook import accounting, configs

            spec = configs.ModelConfig.from_gpt_config(model_config(args), name=args.model)
            self.flops_per_token = accounting.flops_per_token(spec)

    def __call__(self, record, model) -> None:
        """Log ``record``, a StepRecord of ``model`` (a ParallelModel), if this rank logs and the step is due."""
        if not self.on:
            return
        args = self.args
        if record.step % args.log_every == 0 or record.step == args.steps:
            tokens_per_s = args.global_batch * args.seq_len / record.step_time
            line = {"step": record.step, "loss": record.loss, "grad_norm": record.grad_norm, "lr": record.lr,
                    "world_size": self.dims.world_size, "step_time": record.step_time, "tokens_per_s": tokens_per_s,
                    "state_bytes": model.held_bytes()}  # fmt: skip
            if self.flops_per_token:
                line["mfu"] = self.flops_per_token * tokens_per_s / (self.dims.world_size * args.peak_flops)
            text = json.dumps(line)
            print(text, flush=True)
            if self.file:
                self.file.write(text + "\n")
                self.file.flush()
        if self.bar:
            self.bar.update()
            self.bar.set_postfix(loss=f"{record.loss:.3f}", refresh=False)

    def close(self) -> None:
        for handle in (self.bar, self.file):
            if handle:
                handle.close()


def _finite_weights(model) -> bool:
    """Whether every weight on every rank is finite: one all-reduce, so every rank gets the same answer."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.model.parameters()]
    finite = torch.tensor(float(all(bool(torch.isfinite(p).all()) for p in local)), device=model.device)
    if model.dims.world_size > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def _diverged(args, what: str, last_good: int | None) -> TrainingDiverged:
    """The error that stops a diverged run: what was not finite, and where the last good checkpoint is."""
    if last_good is not None:
        where = f"the last good checkpoint is step {last_good} in {args.checkpoint_dir}"
    else:
        where = "no checkpoint was saved" + ("" if args.checkpoint_dir else " (no --checkpoint-dir)")
    return TrainingDiverged(f"{what}: training diverged and stopped; {where}. Resume with a lower --lr, or let "
                            "--skip-nonfinite N skip up to N such steps")  # fmt: skip


def _fail_if_asked(args, step: int, rank: int, world_size: int) -> None:
    """``--simulate-failure-at``: the last rank dies before step ``step + 1`` on the job's first attempt."""
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if args.simulate_failure_at == step + 1 and first_attempt and rank == world_size - 1:
        print(f"rank {rank}: simulated failure before step {step + 1}", file=sys.stderr, flush=True)
        os._exit(1)


def run(args: argparse.Namespace, plan: Plan | None = None) -> list:
    """Train as ``args`` say on this process's rank; return its :class:`~scalebook.train.loop.StepRecord` list
    (rank 0 logs them). Runs :func:`~scalebook.train.preflight.preflight` unless given its ``plan``, then joins
    the launcher's process group, or starts one under torchrun / srun. Raises :class:`TrainingDiverged` on
    every rank at a non-finite step beyond ``--skip-nonfinite``, or non-finite weights at a checkpoint."""
    from scalebook import data
    from scalebook.comm import backend_and_device, detect_env, init_from_env
    from scalebook.model import GPT
    from scalebook.parallel.parallelize import parallelize
    from scalebook.train.loop import TrainConfig, weight_decay_groups

    env = detect_env()
    plan = plan or preflight(args, env.world_size, verify_checkpoint=env.world_size == 1)
    dims = plan.dims
    # A data-parallel wrapper needs a process group, even of one rank (--strategy fsdp on one process).
    owns_group = (env.world_size > 1 or dims.data_parallel is not None) and not dist.is_initialized()
    if owns_group:
        init_from_env()
    if not settle_resume(args, plan, rank=env.rank, group=dist.group.WORLD if env.world_size > 1 else None):
        if owns_group:
            dist.destroy_process_group()
        return []
    _, device = backend_and_device(env.local_rank)
    torch.manual_seed(args.seed)
    cfg = TrainConfig(steps=args.steps, batch_size=args.micro_batch, grad_accum=dims.micro_batches,
                      seq_len=args.seq_len, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
                      precision=args.precision, seed=args.seed, progress=False)  # fmt: skip
    config = model_config(args)
    model = parallelize(GPT(config).to(device), dims,
                        param_groups=lambda m: weight_decay_groups(m, cfg.weight_decay),
                        bucket_cap_mb=args.bucket_cap_mb, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))  # fmt: skip
    tokens = data.load_tokens(args.data, args.encoding)  # a prepared folder is memory-mapped: each rank its rows
    generator = torch.Generator().manual_seed(args.seed)
    if args.overwrite and args.checkpoint_dir and env.rank == 0:
        checkpoint.clear(args.checkpoint_dir)  # before the first save, whose barrier the other ranks wait at
    checkpoints = RunCheckpoints(args, model, generator, config.to_dict()) if args.checkpoint_dir else None
    losses = checkpoints.resume(plan.start) if checkpoints else []
    log = _Log(args, dims, env.rank, plan.start)
    per_replica = args.micro_batch * dims.micro_batches

    def next_batch():  # every rank draws the global batch and keeps its replica's rows
        return data.get_batch(tokens, per_replica, args.seq_len, generator, rank=model.coords["dp"], world_size=dims.dp)

    try:
        return _train(args, model, next_batch, checkpoints, cfg, plan.start, losses, log)
    finally:
        log.close()
        if checkpoints:
            checkpoints.wait()  # an asynchronous save finishes and is published before the ranks exit
        if owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _train(
    args, model, next_batch, checkpoints: RunCheckpoints | None, cfg, start: int, losses: list[float], log: _Log
) -> list:
    """The loop of :func:`run`: steps, logging, checkpoints, the non-finite steps' verdicts, and a stop on SIGTERM,
    SIGUSR1 or Ctrl-C (:mod:`scalebook.train.preemption`): save, then raise its ``Stopped`` (a SystemExit)."""
    from scalebook.train.loop import training_steps
    from scalebook.train.preemption import Stopped, StopSignals

    rank, world_size = (model.mesh.rank, model.dims.world_size) if model.mesh else (0, 1)
    records, skipped, last_good = [], 0, start or None
    _fail_if_asked(args, start, rank, world_size)
    model.model.train()
    with StopSignals(model.device) as stop:  # SIGTERM / SIGUSR1 / SIGINT: finish the step, save, exit
        for record in training_steps(model, next_batch, cfg, start=start):
            records.append(record)
            losses.append(record.loss)
            log(record, model)
            if record.skipped:
                skipped += 1
                what = f"step {record.step}: loss {record.loss}, gradient norm {record.grad_norm}, not finite"
                if skipped > args.skip_nonfinite:
                    raise _diverged(args, what, last_good)
                if rank == 0:
                    print(f"{what}: its update skipped ({skipped} of --skip-nonfinite {args.skip_nonfinite})",
                          file=sys.stderr, flush=True)  # fmt: skip
            if args.simulate_signal_at == record.step and rank == world_size - 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # --simulate-signal-at: to one rank, as a signal may arrive
            stop_signal = stop.agreed()  # one all-reduce: every rank stops after the same step (see preemption)
            due = record.step % args.checkpoint_every == 0 or record.step == args.steps or stop_signal
            if args.checkpoint_dir and due:
                if not _finite_weights(model):
                    raise _diverged(args, f"step {record.step}: the weights are not finite (not saved)", last_good)
                checkpoints.save(record.step, losses)
                last_good = record.step
            _fail_if_asked(args, record.step, rank, world_size)
            if stop_signal and record.step < args.steps:
                stopped = Stopped(stop_signal, record.step, args.checkpoint_dir)
                if checkpoints:
                    checkpoints.wait()  # an asynchronous save is on disk before the line says so
                if rank == 0:
                    print(stopped, file=sys.stderr, flush=True)
                raise stopped
    return records


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
    ``timeout`` seconds the launcher and every process it started are killed and
    :class:`scalebook.comm.processes.LaunchTimeout` (a ``subprocess.TimeoutExpired``) raised, so no orphaned
    rank keeps running.
    """
    from scalebook.comm import processes

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    python = sys.executable
    launcher = [python, "-m", "scalebook.train"] if nproc == 1 and not torchrun_args else [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *torchrun_args,
        "-m", "scalebook.train"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    name = "torchrun" if launcher[1:3] == ["-m", "torch.distributed.run"] else "python -m scalebook.train"
    if name == "torchrun" and (refused := _refusal(train_args, nproc)) is not None:
        return LocalRun(2, [], refused)
    finished = processes.run([*launcher, *train_args], env=env, timeout=timeout, name=name)
    records = [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]
    return LocalRun(finished.returncode, records, finished.stderr)


def _refusal(train_args: list[str], world_size: int) -> str | None:
    """The pre-flight's message for ``world_size`` ranks of ``train_args`` (as rank 0 prints it) if it refuses them,
    else None. Run here, in the launching process, a refused run never starts torchrun, whose own report (a
    ChildFailedError traceback, exit code 1) would follow the message: the message alone, and exit code 2. The
    memory check is left to the ranks, each on its device (here it would open a CUDA context the run never uses)."""
    _Parser.refusing.on = True  # not contextlib.redirect_stderr, which swaps sys.stderr for every thread
    try:
        main([*train_args, "--check-only", str(world_size), "--skip-memory-check"])
    except SystemExit as exited:  # 0: --help or the like, nothing refused
        return None if exited.code in (0, None) else str(exited.code)
    finally:
        _Parser.refusing.on = False
    return None


def main(argv: list[str] | None = None) -> int:
    from scalebook.comm import detect_env

    parser = build_parser()
    args = parser.parse_args(argv)
    env = detect_env()
    if args.check_only is not None and args.check_only < 1:
        parser.error(f"--check-only takes the number of ranks to check for, at least 1 (got {args.check_only})")
    try:
        plan = preflight(args, env.world_size if args.check_only is None else args.check_only,
                         verify_checkpoint=args.check_only is not None or env.world_size == 1)  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    if args.check_only is not None:
        return 0
    try:
        run(args, plan)
    except ValueError as error:  # the ranks' shared reading of a resume's checkpoint (settle_resume) refused it
        parser.error(str(error))
    except TrainingDiverged as error:
        if env.rank == 0:
            print(f"{parser.prog}: {error}", file=sys.stderr, flush=True)
        return 1
    return 0
