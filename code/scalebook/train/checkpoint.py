"""Training checkpoints that survive a crash at any moment: written atomically, read with ``weights_only``.

Layout of a checkpoint directory::

    ckpt/
      step_000040/rank0.pt   everything rank 0 needs to continue (its model and optimizer state, the data
                             stream, the losses), and the whole model gathered from every rank
      step_000040/rank3.pt   ... one file per rank that holds state of its own (a shard, a stage, experts);
                             replicas of the same state read the first replica's file
      latest                 the name of the newest complete step directory

Every file is written to a temporary name and renamed into place (a rename is atomic on POSIX
filesystems), and ``latest`` is updated only after every rank's file exists, so a job killed while
saving leaves the previous checkpoint intact and ``latest`` pointing at it. Loading uses
``torch.load(weights_only=True)``: a checkpoint holds tensors, numbers and strings, never code.

Rank 0's file holds the single-process model whatever the layout (the training run gathers it from the
shards, stages and experts when it saves), so :func:`consolidate` just reads it, and
``python -m scalebook.train.checkpoint CKPT OUT.pt [--hf DIR]`` writes it for ``GPT.load_state_dict`` and, with
``--hf``, as a Hugging Face ``GPT2LMHeadModel`` directory.

Source: PyTorch documentation, "Saving and loading models" and ``torch.load(weights_only=True)``;
POSIX ``rename(2)``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

_STEP_DIR = re.compile(r"step_(\d{6,})")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint taken after ``step`` optimizer steps."""
    return Path(root) / f"step_{step:06d}"


def atomic_save(obj, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file next to ``path``, flush it to disk, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_shard(root: str | os.PathLike, step: int, rank: int, state: dict) -> Path:
    """Write one rank's state for ``step``; :func:`mark_complete` publishes it once all ranks wrote."""
    path = step_dir(root, step) / f"rank{rank}.pt"
    atomic_save(state, path)
    return path


def mark_complete(root: str | os.PathLike, step: int) -> None:
    """Point ``latest`` at ``step`` (call on one rank, after every rank's :func:`save_shard` returned)."""
    latest = Path(root) / "latest"
    tmp = latest.with_name(f".latest.tmp{os.getpid()}")
    tmp.write_text(step_dir(root, step).name + "\n")
    os.replace(tmp, latest)


def latest_step(root: str | os.PathLike) -> int | None:
    """The step of the newest complete checkpoint under ``root``, or None when there is none."""
    latest = Path(root) / "latest"
    if not latest.exists():
        return None
    match = _STEP_DIR.fullmatch(latest.read_text().strip())
    if not match:
        raise ValueError(f"{latest} does not name a step directory; delete it or point it at one")
    return int(match.group(1))


def load_shard(root: str | os.PathLike, step: int, rank: int) -> dict:
    """Read one rank's state for ``step`` (tensors and plain data only)."""
    path = step_dir(root, step) / f"rank{rank}.pt"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint was written by a different number of ranks or strategy"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def consolidate(root: str | os.PathLike, step: int | None = None) -> tuple[dict, dict]:
    """The full model state dict of checkpoint ``step`` (default: the latest), and its metadata: the model
    size, its ``GPTConfig`` as a dict, the step and the world size that wrote it."""
    step = latest_step(root) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {root} (no 'latest' file)")
    first = load_shard(root, step, 0)
    meta = {"model_size": first["model_size"], "config": json.loads(first["config"]), "step": step,
            "world_size": first["world_size"]}  # fmt: skip
    return first["model"], meta


def main(argv: list[str] | None = None) -> int:
    import argparse

    from scalebook.model import GPT, GPTConfig

    parser = argparse.ArgumentParser(
        prog="python -m scalebook.train.checkpoint",
        description="Consolidate a (sharded) training checkpoint into one file.",
    )
    parser.add_argument("checkpoint_dir", help="the --checkpoint-dir of a training run")
    parser.add_argument("output", help="the single .pt file to write (a GPT state dict)")
    parser.add_argument("--step", type=int, default=None, help="which step (default: the latest complete one)")
    parser.add_argument("--hf", default=None, help="also save a Hugging Face GPT2LMHeadModel to this directory")
    args = parser.parse_args(argv)
    state, meta = consolidate(args.checkpoint_dir, args.step)
    model = GPT(GPTConfig(**meta["config"]))
    model.load_state_dict(state)  # strict: a missing or misshapen tensor fails here, before anything is written
    atomic_save(state, args.output)
    if args.hf:
        model.to_hf().save_pretrained(args.hf)
    print(
        f"step {meta['step']} of a {meta['world_size']}-rank run -> {args.output}"
        + (f" and {args.hf}" if args.hf else "")
    )
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
