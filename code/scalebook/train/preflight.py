"""Pre-flight: everything ``python -m scalebook.train`` can check before any rank starts work.

Run on every rank before the process group and the model exist, it finds each problem that would
otherwise surface after minutes (or hours) of training, and reports them all in one ValueError:

- the arguments and the layout (:func:`layout`, :class:`~scalebook.parallel.dims.ParallelDims`), with
  ``--global-batch`` derived from the world size when it is not given (:func:`default_global_batch`);
- the paths: ``--checkpoint-dir`` and the folder of ``--metrics`` must be writable, so an unwritable one fails
  before step 1, not at the first save; nothing is created (a probe file without a name, ``O_TMPFILE``, in the
  nearest folder that exists), so a refused run leaves no folder behind. A fresh run (no ``--resume``) into a
  folder that holds checkpoints is refused unless ``--overwrite`` says to start over;
- the data: :func:`scalebook.data.check_corpus` (readable text, valid in ``--encoding``, or prepared token shards
  with their index, each of the size it gives, ids within the model's vocabulary; long enough for one sequence);
- the memory (:func:`memory_problems`): the model states and activations :mod:`scalebook.accounting` counts for
  the model, the micro-batch, the sequence and the layout, against the memory the device has free;
- ``--resume``: the newest checkpoint whose files match their manifest
  (:func:`scalebook.train.checkpoint.newest_intact`), its settings that fix the run (model, data, batch,
  seed: ``RESUME_SETTINGS``; the tokenizer of the data) equal to this run's, and ``--steps`` beyond its step.
  The layout and the number of ranks may differ from the checkpoint's: ``torch.distributed.checkpoint``
  reshards it.

Every rank reaches the same verdict from the same arguments and files, so no rank waits for another that
gave up; the command line prints it on rank 0 only.

Source: torchtitan ``train.py`` and ``config_manager.py`` (checks before ``init_process_group``);
PyTorch documentation, "torch.distributed.checkpoint" (a checkpoint's layout and resharding).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# --strategy -> the data-parallel wrapper of ParallelDims; tp, pp and 3d average their replicas with the book's DDP.
STRATEGIES = {"single": None, "torch-ddp": "torch-ddp", "fsdp": "fsdp", "ddp": "ddp", "zero1": "zero1",
              "zero2": "zero2", "zero3": "zero3", "tp": "ddp", "pp": "ddp", "3d": "ddp"}  # fmt: skip
# The settings a resumed run must share with its checkpoint: the model's shape and the data stream.
RESUME_SETTINGS = ("model", "moe_experts", "moe_top_k", "seq_len", "global_batch", "seed", "data")
DEFAULT_GLOBAL_BATCH = 8  # sequences per step when --global-batch is not given (rounded up to fit the layout)


@dataclass
class Plan:
    """What the pre-flight found: the layout, the step to resume from (0: a fresh start), and the notes
    rank 0 prints (a checkpoint passed over)."""

    dims: object
    start: int = 0
    notes: list[str] = field(default_factory=list)


def model_config(args: argparse.Namespace):
    """The GPTConfig of ``--model``, with ``--moe-experts`` experts per MLP when asked."""
    from scalebook.model import GPTConfig

    moe = {"n_experts": args.moe_experts, "expert_top_k": args.moe_top_k} if args.moe_experts else {}
    return GPTConfig.named(args.model, **moe)


def default_global_batch(args: argparse.Namespace, world_size: int) -> int:
    """``--global-batch`` when it is not given: the smallest multiple of ``--micro-batch x dp`` that is at least
    8 and, under ``--pp``, gives each replica at least ``--pp`` micro-batches (dp: ``--dp``, or the ranks that
    ``--tp x --pp x --cp`` leave; 8 when they do not divide the world, which :func:`layout` reports)."""
    split = args.tp * args.pp * args.cp
    dp = args.dp or (world_size // split if split >= 1 and world_size % split == 0 else 0)
    if dp < 1 or args.micro_batch < 1:
        return DEFAULT_GLOBAL_BATCH
    per_step = args.micro_batch * dp
    return per_step * max(args.pp, math.ceil(DEFAULT_GLOBAL_BATCH / per_step))


def _argument_problems(args: argparse.Namespace) -> list[str]:
    from scalebook import data

    problems = []
    for name in ("seq_len", "micro_batch", "global_batch", "steps", "checkpoint_every", "log_every"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps < 0:
        problems.append(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.skip_nonfinite < 0:
        problems.append(f"--skip-nonfinite must be >= 0, got {args.skip_nonfinite}")
    if args.keep_last < 0:
        problems.append(f"--keep-last must be >= 0 (0 keeps every checkpoint), got {args.keep_last}")
    if not (math.isfinite(args.lr) and 0 < args.min_lr <= args.lr):
        problems.append(f"need 0 < --min-lr <= --lr, both finite, got {args.min_lr} and {args.lr}")
    if args.resume and not args.checkpoint_dir:
        problems.append("--resume needs --checkpoint-dir")
    if args.resume and args.overwrite:
        problems.append("--resume continues the checkpoints that --overwrite would delete: pass one of them")
    try:
        data.check_encoding(args.encoding)
    except ValueError as error:
        problems.append(str(error))
    if args.bucket_cap_mb is not None and not args.bucket_cap_mb > 0:
        problems.append(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    return problems


def layout(args: argparse.Namespace, world_size: int):
    """The run's :class:`~scalebook.parallel.dims.ParallelDims`, or one ValueError listing every problem with
    the arguments, before any process group exists. Fills in ``args.global_batch`` when it is None."""
    from scalebook.parallel.dims import ParallelDims

    if args.global_batch is None:
        args.global_batch = default_global_batch(args, world_size)
    problems = _argument_problems(args)
    try:
        config = model_config(args)
    except ValueError as error:
        problems.append(f"--moe-experts {args.moe_experts} --moe-top-k {args.moe_top_k}: {error}")
        config = model_config(argparse.Namespace(**{**vars(args), "moe_experts": 0}))
    dims = None
    if all(getattr(args, name) >= 1 for name in ("seq_len", "micro_batch", "global_batch")):
        try:
            dims = ParallelDims.build(world_size, config, seq_len=args.seq_len, global_batch=args.global_batch,
                                      micro_batch=args.micro_batch, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp,
                                      ep=args.ep, data_parallel=STRATEGIES[args.strategy],
                                      sequence_parallel=args.sequence_parallel)  # fmt: skip
        except ValueError as error:
            problems += str(error).splitlines()[1:]
    if problems:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(p.strip() for p in problems))
    return dims


def _writable(folder: Path) -> None:
    """Raise OSError unless ``folder`` is, or could be made, a folder this process can write in; create nothing.

    The nearest of ``folder`` and its parents that exists must be a folder that takes a new file: a probe
    (``os.access`` says yes to root on a read-only mount) that never has a name (``O_TMPFILE``), so no trace stays.
    """
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    with tempfile.TemporaryFile(dir=existing):
        pass


def _why(error: OSError, path: Path) -> str:
    """Why ``path`` cannot be written: a file where a folder must be, or the system's reason."""
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    return f"{blocker} is a file, not a folder" if blocker else error.strerror


def path_problems(args: argparse.Namespace) -> list[str]:
    """``--checkpoint-dir`` and ``--metrics``: each one's problem, if it cannot be written (nothing is created);
    checkpoints already in ``--checkpoint-dir`` of a fresh run, unless ``--overwrite``."""
    from scalebook.train import checkpoint

    problems = []
    if args.checkpoint_dir:
        try:
            _writable(Path(args.checkpoint_dir))
        except OSError as error:
            problems.append(f"--checkpoint-dir {args.checkpoint_dir} is not a writable folder "
                            f"({_why(error, Path(args.checkpoint_dir))}); choose another --checkpoint-dir")  # fmt: skip
        held = checkpoint.held(args.checkpoint_dir)
        if held and not (args.resume or args.overwrite):
            problems.append(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints ({held}); pass --resume "
                            "to continue them, --overwrite to delete them and start over, or another "
                            "--checkpoint-dir")  # fmt: skip
    if args.metrics:
        metrics = Path(args.metrics)
        try:
            if metrics.exists():  # appended to: opening it creates nothing
                with open(metrics, "a"):
                    pass
            else:
                _writable(metrics.parent)
        except OSError as error:
            why = _why(error, metrics.parent if not metrics.is_dir() else metrics)
            problems.append(f"--metrics {args.metrics} cannot be appended to ({why}); choose another --metrics")
    return problems


_ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}  # what --strategy shards over the dp x cp replicas
CGROUP = Path("/sys/fs/cgroup")


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def memory_estimate(args: argparse.Namespace, dims) -> tuple[int, str]:
    """A lower bound of the bytes one rank holds at the peak of a step, from :mod:`scalebook.accounting`, and what it
    is made of: fp32 weights, gradients and AdamW's moments (sharded as ``--strategy``, ``--tp`` and ``--pp`` say;
    an MoE counted with one MLP per layer), the activations of fused attention in the step's precision, and the
    logits. Left out, so that a run that fits is never refused: buffers, workspace, the framework's own memory."""
    from scalebook import accounting, configs

    config = model_config(args)
    spec = configs.ModelConfig.from_gpt_config(config, name=args.model)
    states = accounting.model_state_bytes(spec, zero_stage=_ZERO_STAGE.get(args.strategy, 0), dp=dims.dp * dims.cp,
                                          tp=dims.tp, pp=dims.pp, precision="fp32").total  # fmt: skip
    seq_len = args.seq_len // dims.cp
    activations = accounting.activation_bytes(spec, seq_len=seq_len, micro_batch=args.micro_batch, tp=dims.tp,
                                              sp=dims.sequence_parallel, attention="fused", dropout=config.dropout > 0,
                                              dtype_bytes=2 if args.precision == "bf16" else 4)  # fmt: skip
    activations = activations * min(dims.pp, dims.micro_batches) // dims.pp  # 1F1B's first stage: L/p layers x p
    logits = args.micro_batch * seq_len * config.vocab_size * 4 // dims.tp if dims.pp == 1 else 0
    what = (f"model states {_size(states)}: fp32 weights, gradients and AdamW's two moments of "
            f"{accounting.param_count(spec):,} parameters; activations and logits {_size(activations + logits)} for "
            f"--micro-batch {args.micro_batch} x --seq-len {args.seq_len}")  # fmt: skip
    return states + activations + logits, what


def _cgroup_room() -> int | None:
    """The bytes this process's memory cgroup (v2, or v1) still allows, when it sets a limit."""
    v1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
    for limit, usage in (("memory.max", "memory.current"), v1):
        try:
            cap = (CGROUP / limit).read_text().strip()
            if cap.isdigit() and int(cap) < 1 << 60:  # v1 says "no limit" with a huge number
                return int(cap) - int((CGROUP / usage).read_text())
        except (OSError, ValueError):
            pass
    return None


def device_memory(local_rank: int) -> tuple[int, str, bool]:
    """The bytes free for this rank (GPU: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of ``/proc/meminfo``,
    else the physical pages, within the cgroup's limit), what they are, and whether the ranks of a node share them."""
    import torch

    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        free, total = torch.cuda.mem_get_info(index)
        return free, f"free on GPU {index} (of {_size(total)})", False
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free, what = int(meminfo["MemAvailable"].split()[0]) * 1024, "of RAM available (MemAvailable)"
    except (OSError, KeyError, ValueError):
        free, what = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of RAM"
    room = _cgroup_room()
    if room is not None and room < free:
        free, what = room, "left under this cgroup's memory limit"
    return free, what, True


def memory_problems(args: argparse.Namespace, dims) -> list[str]:
    """Refuse a run that clearly cannot fit: :func:`memory_estimate`, a lower bound, above the memory the device has
    free (on a CPU, times the ranks of this machine). ``--skip-memory-check`` skips it."""
    from scalebook.comm import detect_env

    if dims is None or args.skip_memory_check:
        return []
    env = detect_env()
    try:
        need, what = memory_estimate(args, dims)
        free, where, shared = device_memory(env.local_rank)
    except (OSError, RuntimeError, ValueError):  # a layout accounting does not model, memory we cannot read: no verdict
        return []
    ranks = env.local_world_size if shared else 1
    if need * ranks <= free:
        return []
    total = f"; {ranks} ranks on this machine need {_size(need * ranks)}" if ranks > 1 else ""
    return [f"memory: --model {args.model} needs at least {_size(need)} on each rank ({what}){total}, more than the "
            f"{_size(free)} {where}; choose a smaller --model, --micro-batch or --seq-len, or spread the model over "
            "more ranks (--strategy zero3 or fsdp shards it over the replicas, --tp and --pp split it), or pass "
            "--skip-memory-check to try anyway"]  # fmt: skip


def resume_problems(args: argparse.Namespace, plan: Plan, *, verify: bool = True, split_over=None) -> list[str]:
    """``--resume``: set ``plan.start`` to the newest intact checkpoint's step (noting the ones passed over) and
    return what stops this run from continuing it. ``verify=False`` takes the step ``latest`` names and reads
    nothing else (the ranks of a launch then verify the files and check the settings together,
    :func:`settle_resume`); ``split_over`` shares the reading among a process group's ranks, each file read once
    (:func:`scalebook.train.checkpoint.verify`)."""
    from scalebook import data
    from scalebook.train import checkpoint

    root = args.checkpoint_dir
    if not verify:  # not even the manifest: a damaged one must fall back to an older step, as a verified read does
        plan.start = checkpoint.latest_step(root) or 0
        return []
    step, passed_over = checkpoint.newest_intact(root, split_over=split_over)
    if step is None:
        return [f"--resume: no intact checkpoint under {root}: {'; '.join(passed_over)}; delete the folder or "
                "drop --resume to start from step 0"] if passed_over else []  # fmt: skip
    if passed_over:
        plan.notes.append(
            f"--resume: {'; '.join(passed_over)}; resuming from step {step}, the newest intact checkpoint"
        )
    plan.start = step
    manifest = checkpoint.read_manifest(root, step)
    saved = manifest["args"]
    problems = [f"--{name.replace('_', '-')}: the checkpoint (step {step} in {root}) has {saved[name]!r}, this run "
                f"{getattr(args, name)!r}; pass --{name.replace('_', '-')} {saved[name]} or another --checkpoint-dir"
                for name in RESUME_SETTINGS if saved[name] != getattr(args, name)]  # fmt: skip
    saved_tokenizer, tokenizer = manifest.get("tokenizer_id", data.BYTES_TOKENIZER_ID), data.tokenizer_id(args.data)
    if saved_tokenizer != tokenizer:
        problems.append(f"--data: the checkpoint (step {step} in {root}) was trained on tokens of tokenizer "
                        f"{saved_tokenizer}, {args.data or 'the embedded corpus'} holds tokens of {tokenizer}; prepare "
                        "the data with the checkpoint's tokenizer, or pass another --checkpoint-dir")  # fmt: skip
    encoding = saved.get("encoding", args.encoding)  # (a checkpoint older than --encoding does not say)
    if data.codec_name(encoding) != data.codec_name(args.encoding) and args.data and not data.is_prepared(args.data):
        problems.append(f"--encoding: the checkpoint (step {step} in {root}) read its text as {encoding}, this run as "
                        f"{args.encoding}; pass --encoding {encoding} or another --checkpoint-dir")  # fmt: skip
    if args.steps < step:
        problems.append(f"--steps {args.steps} is below the checkpoint's step {step}: a run cannot go back; "
                        f"pass --steps above {step}, or another --checkpoint-dir")  # fmt: skip
    return problems


def settle_resume(args: argparse.Namespace, plan: Plan, *, rank: int, group=None) -> bool:
    """After the process group exists, before training: with ``--resume`` on the ranks of a launch (``group``),
    the ranks read the checkpoint's files together, each file once in all, and agree on the newest intact step
    (an older one, with a note, if the newest is damaged), as the launcher's pre-flight would have; a ValueError
    on every rank if that step cannot be continued. Then rank 0 prints the plan's notes. Returns whether there
    is anything to train (not when the checkpoint is already at ``--steps``, which rank 0 says)."""
    if args.resume and group is not None:
        problems = resume_problems(args, plan, split_over=group)
        if problems:
            raise ValueError("invalid arguments:\n  " + "\n  ".join(problems))
    for note in plan.notes if rank == 0 else ():
        print(note, file=sys.stderr, flush=True)
    if plan.start == args.steps and rank == 0:
        print(f"nothing to do: the checkpoint in {args.checkpoint_dir} is at step {plan.start} = --steps; "
              "pass a larger --steps to train further", file=sys.stderr, flush=True)  # fmt: skip
    return plan.start != args.steps


def preflight(args: argparse.Namespace, world_size: int, *, verify_checkpoint: bool = True) -> Plan:
    """Every check before any rank starts work (see the module docstring): the :class:`Plan`, or one ValueError
    listing every problem. ``verify_checkpoint=False`` (each rank of a launch): ``--resume`` takes the checkpoint
    ``latest`` names without reading its files, which :func:`settle_resume` then does once across the ranks."""
    from scalebook import data

    problems = []
    try:
        dims = layout(args, world_size)
    except ValueError as error:
        dims, problems = None, [line.strip() for line in str(error).splitlines()[1:]]
    problems += path_problems(args)
    try:
        if not any(problem.startswith("--encoding") for problem in problems):
            data.check_corpus(args.data, min_tokens=args.seq_len + 1, vocab_size=model_config(args).vocab_size,
                              encoding=args.encoding)  # fmt: skip
    except ValueError as error:
        problems.append(f"--data: {error}")
    problems += memory_problems(args, dims)
    plan = Plan(dims)
    if args.resume and not problems:
        problems += resume_problems(args, plan, verify=verify_checkpoint)
    if problems:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(problems))
    return plan
