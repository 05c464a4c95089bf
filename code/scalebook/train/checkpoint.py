"""Training checkpoints that survive a crash at any moment: written atomically, read with ``weights_only``.

Layout of a checkpoint directory::

    ckpt/
      step_000040/rank0.pt   everything rank 0 needs to continue (its model and optimizer state, the data
                             stream, the losses), and the whole model gathered from every rank
      step_000040/rank3.pt   ... one file per rank that holds state of its own (a shard, a stage, experts);
                             replicas of the same state read the first replica's file
      step_000040/manifest.json  written last: each file's size and SHA-256, the run's arguments, its layout
      latest                 the name of the newest complete step directory

Every file is written to a temporary name and renamed into place (a rename is atomic on POSIX
filesystems); once every rank's file exists, rank 0 writes the manifest, then moves ``latest``, so a
job killed while saving leaves the previous checkpoint intact and ``latest`` pointing at it. Loading
checks the file against the manifest first, so flipped bytes, a truncated or an empty file are named
(:class:`CheckpointError`) instead of resuming from garbage or failing deep inside ``torch.load``; and
:func:`newest_intact` walks back from ``latest`` to the newest checkpoint whose files all check out.
Loading uses ``torch.load(weights_only=True)``: a checkpoint holds tensors, numbers and strings, never code.

Rank 0's file holds the single-process model whatever the layout (the training run gathers it from the
shards, stages and experts when it saves), so :func:`consolidate` just reads it, and
``python -m scalebook.train.checkpoint CKPT OUT.pt [--hf DIR]`` writes it for ``GPT.load_state_dict`` and, with
``--hf``, as a Hugging Face ``GPT2LMHeadModel`` directory.

Source: PyTorch documentation, "Saving and loading models" and ``torch.load(weights_only=True)``;
POSIX ``rename(2)``; Python documentation, ``hashlib`` (SHA-256).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path

import torch

_STEP_DIR = re.compile(r"step_(\d{6,})")
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint file that is missing, or does not match its manifest; the message names the file."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint taken after ``step`` optimizer steps."""
    return Path(root) / f"step_{step:06d}"


def atomic_save(obj, path: str | os.PathLike, save=torch.save) -> None:
    """``save(obj, file)`` (``torch.save`` by default) to a temporary file next to ``path``, flush it to disk,
    then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            save(obj, f)
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


def _atomic_write_text(path: Path, text: str) -> None:
    atomic_save(text.encode(), path, save=lambda data, f: f.write(data))


def write_manifest(root: str | os.PathLike, step: int, meta: dict | None = None) -> Path:
    """Record the size and SHA-256 of every rank file of ``step``, with ``meta`` (the run's arguments and
    layout), in ``manifest.json``, atomically: call on one rank, after every rank's :func:`save_shard`."""
    folder = step_dir(root, step)
    files = {}
    for path in sorted(folder.glob("rank*.pt")):
        with open(path, "rb") as f:
            files[path.name] = {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    path = folder / MANIFEST
    _atomic_write_text(path, json.dumps({"step": step, "files": files, **(meta or {})}, indent=1) + "\n")
    return path


def mark_complete(root: str | os.PathLike, step: int) -> None:
    """Point ``latest`` at ``step``, whose manifest must exist (call on one rank, after :func:`write_manifest`)."""
    if not (step_dir(root, step) / MANIFEST).exists():
        raise CheckpointError(f"{step_dir(root, step) / MANIFEST} is missing: write_manifest before mark_complete")
    _atomic_write_text(Path(root) / "latest", step_dir(root, step).name + "\n")


def latest_step(root: str | os.PathLike) -> int | None:
    """The step ``latest`` names under ``root`` (the newest complete checkpoint), or None when there is none."""
    latest = Path(root) / "latest"
    if not latest.exists():
        return None
    match = _STEP_DIR.fullmatch(latest.read_text().strip())
    if not match:
        raise ValueError(f"{latest} does not name a step directory; delete it or point it at one")
    return int(match.group(1))


def read_manifest(root: str | os.PathLike, step: int) -> dict:
    """The manifest of checkpoint ``step``; CheckpointError naming it when it is missing or unreadable."""
    path = step_dir(root, step) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: the save of step {step} did not finish (or predates manifests)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is unreadable ({error})") from None


def _checked_bytes(path: Path, manifest: dict) -> bytes:
    """The content of ``path``, after checking its size and SHA-256 against ``manifest``."""
    expected = manifest["files"].get(path.name)
    if expected is None:
        raise CheckpointError(f"{path} is not in its manifest: the checkpoint was written by a different number of "
                              f"ranks or strategy (its files: {', '.join(manifest['files'])})")  # fmt: skip
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    content = path.read_bytes()
    if len(content) != expected["bytes"]:
        what = "empty" if not content else "truncated" if len(content) < expected["bytes"] else "too long"
        raise CheckpointError(f"{path} is {what}: {len(content)} bytes, {MANIFEST} says {expected['bytes']}")
    if hashlib.sha256(content).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{path} is corrupt: its SHA-256 differs from the one in {MANIFEST}")
    return content


def verify(root: str | os.PathLike, step: int) -> dict:
    """Check every file of checkpoint ``step`` against its manifest and return the manifest; CheckpointError
    naming the first bad file."""
    manifest = read_manifest(root, step)
    for name in manifest["files"]:
        _checked_bytes(step_dir(root, step) / name, manifest)
    return manifest


def newest_intact(root: str | os.PathLike) -> tuple[int | None, list[str]]:
    """The newest checkpoint at or before ``latest`` whose files all match their manifest (None if none), and
    why each newer one was passed over. Deterministic, so every rank that calls it picks the same step."""
    latest = latest_step(root)
    if latest is None:
        return None, []
    steps = sorted((int(m.group(1)) for p in Path(root).iterdir() if (m := _STEP_DIR.fullmatch(p.name))),
                   reverse=True)  # fmt: skip
    problems = []
    for step in (s for s in steps if s <= latest):
        try:
            verify(root, step)
            return step, problems
        except CheckpointError as error:
            problems.append(str(error))
    return None, problems


def load_shard(root: str | os.PathLike, step: int, rank: int) -> dict:
    """Read one rank's state for ``step`` (tensors and plain data only), checked against the manifest."""
    content = _checked_bytes(step_dir(root, step) / f"rank{rank}.pt", read_manifest(root, step))
    return torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)


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
    try:
        state, meta = consolidate(args.checkpoint_dir, args.step)
    except (CheckpointError, FileNotFoundError) as error:
        parser.error(f"{error}; --step N reads an older checkpoint")
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
