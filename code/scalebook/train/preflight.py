"""Pre-flight: everything ``python -m scalebook.train`` can check before any rank starts work.

Run on every rank before the process group and the model exist, it finds each problem that would
otherwise surface after minutes (or hours) of training, and reports them all in one ValueError:

- the arguments and the layout (:func:`layout`, :class:`~scalebook.parallel.dims.ParallelDims`), with
  ``--global-batch`` derived from the world size when it is not given (:func:`default_global_batch`);
- the paths: ``--checkpoint-dir`` and the folder of ``--metrics`` are created and written to (a probe
  file), so an unwritable one fails before step 1, not at the first save;
- the data: :func:`scalebook.data.check_corpus` (readable text, or prepared token shards with their index, each of
  the size it gives, ids within the model's vocabulary; long enough for one sequence);
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
import math
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
    """Create ``folder`` and write a probe file in it (``os.access`` says yes to root on a read-only mount)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass


def _why(error: OSError, path: Path) -> str:
    """Why ``path`` cannot be written: a file where a folder must be, or the system's reason."""
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    return f"{blocker} is a file, not a folder" if blocker else error.strerror


def path_problems(args: argparse.Namespace) -> list[str]:
    """``--checkpoint-dir`` and ``--metrics``: each one's problem, if it cannot be written."""
    problems = []
    if args.checkpoint_dir:
        try:
            _writable(Path(args.checkpoint_dir))
        except OSError as error:
            problems.append(f"--checkpoint-dir {args.checkpoint_dir} is not a writable folder "
                            f"({_why(error, Path(args.checkpoint_dir))}); choose another --checkpoint-dir")  # fmt: skip
    if args.metrics:
        try:
            _writable(Path(args.metrics).parent)
            with open(args.metrics, "a"):
                pass
        except OSError as error:
            why = _why(error, Path(args.metrics).parent)
            problems.append(f"--metrics {args.metrics} cannot be appended to ({why}); choose another --metrics")
    return problems


def resume_problems(args: argparse.Namespace, plan: Plan) -> list[str]:
    """``--resume``: set ``plan.start`` to the newest intact checkpoint's step (noting the ones passed over) and
    return what stops this run from continuing it."""
    from scalebook import data
    from scalebook.train import checkpoint

    root = args.checkpoint_dir
    step, passed_over = checkpoint.newest_intact(root)
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
                        f"{saved_tokenizer}, {args.data} holds tokens of {tokenizer}; prepare the data with the "
                        "checkpoint's tokenizer, or pass another --checkpoint-dir")  # fmt: skip
    if args.steps < step:
        problems.append(f"--steps {args.steps} is below the checkpoint's step {step}: a run cannot go back; "
                        f"pass --steps above {step}, or another --checkpoint-dir")  # fmt: skip
    return problems


def preflight(args: argparse.Namespace, world_size: int) -> Plan:
    """Every check before any rank starts work (see the module docstring): the :class:`Plan`, or one ValueError
    listing every problem."""
    from scalebook import data

    problems = []
    try:
        dims = layout(args, world_size)
    except ValueError as error:
        dims, problems = None, [line.strip() for line in str(error).splitlines()[1:]]
    problems += path_problems(args)
    try:
        data.check_corpus(args.data, min_tokens=args.seq_len + 1, vocab_size=model_config(args).vocab_size)
    except ValueError as error:
        problems.append(f"--data: {error}")
    plan = Plan(dims)
    if args.resume and not problems:
        problems += resume_problems(args, plan)
    if problems:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(problems))
    return plan
