"""Training checkpoints that reshard and survive a crash at any moment: ``torch.distributed.checkpoint``
(DCP) files, published atomically, checked by SHA-256 before they are read.

Layout of a checkpoint directory::

    ckpt/
      step_000040/__0_0.distcp   rank 0's part of the model and optimizer state (DCP writes every tensor once:
      step_000040/__1_0.distcp   a shard by the rank holding it, a replicated tensor by one of its replicas)
      step_000040/.metadata      DCP's index: every tensor's global shape and which file holds which chunk
      step_000040/manifest.json  written last: each file's size and SHA-256, the run's arguments and model config
      latest                     the name of the newest complete step directory

Each rank presents its state with :func:`scalebook.parallel.state_dict.get_state_dict` (global names, DTensors
for the chunks it holds); DCP's planner decides who writes what, and a load in any other layout reads the
chunks that overlap what each rank holds there. :class:`Checkpointer` saves synchronously, or with
``async_save=True`` through ``dcp.async_save``: the state is copied to host memory (the stall) and written by a
background thread on a process group of its own, while training goes on.

Publishing. Once DCP's save has returned on rank 0 (its coordinator writes ``.metadata`` after every rank's
files are written), rank 0 writes the manifest, then moves ``latest``, each by an atomic rename (POSIX
``rename(2)``) followed by an fsync of the directory, so a job killed while saving leaves the previous checkpoint
intact and ``latest`` pointing at it, and a published checkpoint survives a power loss.
Reading checks the files against the manifest first, so flipped bytes, a truncated or an empty file are named
(:class:`CheckpointError`) instead of resuming from garbage; :func:`newest_intact` walks back from ``latest`` to
the newest checkpoint whose files all check out, and ``keep_last`` retention deletes only older checkpoints.

:func:`consolidate` loads the model part into the single-process GPT on one process (DCP reads every chunk),
and ``python -m scalebook.train.checkpoint CKPT OUT.pt [--hf DIR]`` writes it for ``GPT.load_state_dict`` and,
with ``--hf``, as a Hugging Face ``GPT2LMHeadModel`` directory.

Source: PyTorch documentation, "Distributed Checkpoint - torch.distributed.checkpoint" (``save``, ``load``,
``async_save``); torchtitan ``torchtitan/components/checkpoint.py`` (async save on a gloo group, retention);
Young 1974, "A first order approximation to the optimum checkpoint interval"; POSIX ``rename(2)``, ``fsync(2)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

_STEP_DIR = re.compile(r"step_(\d{6,})")
MANIFEST = "manifest.json"
FORMAT = "torch.distributed.checkpoint"  # the manifest's "format": files of an older layout lack it
# DCP warns on every save and load without a process group (from the writer's thread too, out of reach of
# warnings.catch_warnings) that it assumes one process: which is what such a run means.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming")


class CheckpointError(ValueError):
    """A checkpoint file that is missing, or does not match its manifest; the message names the file."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint taken after ``step`` optimizer steps."""
    return Path(root) / f"step_{step:06d}"


def atomic_save(obj, path: str | os.PathLike, save=torch.save) -> None:
    """``save(obj, file)`` (``torch.save`` by default) to a temporary file next to ``path``, flush it to disk,
    rename it into place, then flush the directory. The rename is atomic against a crash of the process, but it
    is a change to the directory, not to the file: until the directory itself is fsynced, a power loss or a
    crash of the node can undo it, and the old file (or none) is back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_directory(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_directory(folder: Path) -> None:
    """Make the entries of ``folder`` (a rename into it) durable: fsync(2) on the directory itself."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    atomic_save(text.encode(), path, save=lambda data, f: f.write(data))


def write_manifest(root: str | os.PathLike, step: int, meta: dict | None = None) -> Path:
    """Record the size and SHA-256 of every file of checkpoint ``step``, with ``meta`` (the run's arguments and
    model config), in ``manifest.json``, atomically: call on one rank, once DCP's save has returned there."""
    folder = step_dir(root, step)
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    path = folder / MANIFEST
    _atomic_write_text(path, json.dumps({"step": step, "format": FORMAT, "files": files, **(meta or {})},
                                        indent=1) + "\n")  # fmt: skip
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


def _sha256(path: Path) -> str:
    """The SHA-256 of ``path``'s content, read in chunks (never whole into memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_problem(path: Path, manifest: dict) -> str | None:
    """What is wrong with ``path`` against ``manifest`` (missing, its size, then its SHA-256), or None; never
    raises for the file (an unreadable one is a problem too), so that ranks checking their shares all reach
    the exchange of :func:`verify`."""
    expected = manifest["files"].get(path.name)
    if expected is None:
        return f"{path} is not in its manifest (its files: {', '.join(manifest['files'])})"
    if not path.exists():
        return f"{path} is missing"
    try:
        if (size := path.stat().st_size) != expected["bytes"]:
            what = "empty" if not size else "truncated" if size < expected["bytes"] else "too long"
            return f"{path} is {what}: {size} bytes, {MANIFEST} says {expected['bytes']}"
        if _sha256(path) != expected["sha256"]:
            return f"{path} is corrupt: its SHA-256 differs from the one in {MANIFEST}"
    except OSError as error:
        return f"{path} is unreadable ({error})"
    return None


def verify(root: str | os.PathLike, step: int, *, split_over=None) -> dict:
    """Check every file of checkpoint ``step`` against its manifest and return the manifest; CheckpointError
    naming the first bad file.

    ``split_over``: a process group whose every member calls this at once (a collective). The ranks share the
    work, each file read once in all: rank r of N checks the manifest's files i with i mod N = r, then the
    ranks exchange what they found (one ``all_gather_object``), so that every rank raises the same error for a
    bad file any rank found, or none does. Without it this process checks every file."""
    manifest = read_manifest(root, step)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{step_dir(root, step)} holds one torch.save file per rank, the format before "
                              f"{FORMAT}: resume it with that version, or use another --checkpoint-dir")  # fmt: skip
    rank, world = (0, 1) if split_over is None else (dist.get_rank(split_over), dist.get_world_size(split_over))
    problems = {i: problem for i, name in enumerate(manifest["files"])
                if i % world == rank and (problem := _file_problem(step_dir(root, step) / name, manifest))}  # fmt: skip
    if split_over is not None:
        found = [None] * world
        dist.all_gather_object(found, problems, group=split_over)
        problems = {i: problem for part in found for i, problem in part.items()}
    if problems:
        raise CheckpointError(problems[min(problems)])
    return manifest


def _steps(root: str | os.PathLike) -> list[int]:
    """The steps of the step directories under ``root``, newest first."""
    return sorted((int(m.group(1)) for p in Path(root).iterdir() if (m := _STEP_DIR.fullmatch(p.name))), reverse=True)


def held(root: str | os.PathLike) -> str:
    """What under ``root`` is a checkpoint of some run (``latest``, step folders), said in a few words; "" if none."""
    root = Path(root)
    if not root.is_dir():
        return ""
    steps = _steps(root)
    found = (["latest"] if (root / "latest").exists() else []) + [step_dir(root, s).name for s in steps[:2]]
    return ", ".join(found) + (f" and {len(steps) - 2} more" if len(steps) > 2 else "")


def clear(root: str | os.PathLike) -> list[str]:
    """Delete the checkpoints under ``root`` (``latest`` first, then every step folder), nothing else; their names.
    What ``--overwrite`` does before a fresh run saves there (call on one rank)."""
    root = Path(root)
    if not root.is_dir():
        return []
    (root / "latest").unlink(missing_ok=True)  # first: a run killed meanwhile never resumes a half-deleted one
    doomed = [step_dir(root, s) for s in _steps(root)]
    for folder in doomed:
        shutil.rmtree(folder)
    return ["latest", *(f.name for f in doomed)]


def newest_intact(root: str | os.PathLike, *, split_over=None) -> tuple[int | None, list[str]]:
    """The newest checkpoint at or before ``latest`` whose files all match their manifest (None if none), and
    why each newer one was passed over. Deterministic, so every rank that calls it picks the same step.
    ``split_over``: a process group whose ranks share the reading, each file once (see :func:`verify`)."""
    latest = latest_step(root)
    if latest is None:
        return None, []
    steps = _steps(root)
    problems = []
    for step in (s for s in steps if s <= latest):
        try:
            verify(root, step, split_over=split_over)
            return step, problems
        except CheckpointError as error:
            problems.append(str(error))
    return None, problems


def prune(root: str | os.PathLike, keep_last: int) -> list[int]:
    """Delete the step directories older than the ``keep_last`` newest complete ones at or before ``latest``
    (those with a manifest); never ``latest`` itself, nor anything newer. Returns the deleted steps."""
    latest = latest_step(root)
    if latest is None or keep_last < 1:
        return []
    steps = _steps(root)
    complete = [s for s in steps if s <= latest and (step_dir(root, s) / MANIFEST).exists()][:keep_last]
    doomed = [s for s in steps if s < min(complete)]
    for step in doomed:
        shutil.rmtree(step_dir(root, step))
    return doomed


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


class Checkpointer:
    """Save a run's checkpoints under ``root`` and publish them; load one. Every rank builds one and calls
    :meth:`save` at the same steps (a collective); rank 0 publishes.

    ``async_save``: :meth:`save` returns once the state is copied to host memory, and a background thread
    writes it, over a gloo process group created here (a collective) so that its collectives never interleave
    with training's; the checkpoint is published by :meth:`wait`, which the next save and the end of the run
    call first. ``keep_last``: after publishing, :func:`prune`.
    """

    def __init__(self, root: str | os.PathLike, meta: dict, *, keep_last: int | None = None,
                 async_save: bool = False):  # fmt: skip
        self.root, self.meta, self.keep_last, self.async_save = Path(root), meta, keep_last, async_save
        self.rank = 0 if _no_dist() else dist.get_rank()
        self.group = dist.new_group(backend="gloo") if async_save and not _no_dist() else None
        self.pending: tuple[int, object] | None = None  # (step, the background write's future)

    def save(self, state: dict, step: int) -> None:
        """Write ``state`` (:func:`~scalebook.parallel.state_dict.get_state_dict` plus the run's own tensors) as
        checkpoint ``step``."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        where = step_dir(self.root, step)
        if self.rank == 0 and where.exists():  # a step written again (after a corrupt one): no stale file stays
            shutil.rmtree(where)
        if not _no_dist():
            dist.barrier()  # ... before any rank starts writing there
        if self.async_save:
            response = dcp.async_save(state, checkpoint_id=where, process_group=self.group, no_dist=_no_dist())
            self.pending = step, getattr(response, "upload_completion", response)
        else:
            dcp.save(state, checkpoint_id=where, no_dist=_no_dist())
            self._publish(step)

    def wait(self) -> None:
        """Wait for the background save, if any, and publish it."""
        if self.pending:
            step, future = self.pending
            self.pending = None
            future.result()
            self._publish(step)

    def _publish(self, step: int) -> None:
        if self.rank == 0:
            write_manifest(self.root, step, self.meta)
            mark_complete(self.root, step)
            if self.keep_last:
                prune(self.root, self.keep_last)

    def load(self, state: dict, step: int) -> None:
        """Fill ``state`` (this layout's tensors, any values) in place from checkpoint ``step``, whatever
        layout wrote it (call :func:`newest_intact` or :func:`verify` first: this reads without checking)."""
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=step_dir(self.root, step), no_dist=_no_dist())

    def saved_names(self, step: int) -> set[str]:
        """The names of everything checkpoint ``step`` holds (from DCP's ``.metadata``): what a load may ask for."""
        import torch.distributed.checkpoint as dcp

        return set(dcp.FileSystemReader(step_dir(self.root, step)).read_metadata().state_dict_metadata)


class RunCheckpoints:
    """A training run's checkpoints, through a :class:`Checkpointer`: the model's and optimizer's state
    (:meth:`~scalebook.parallel.parallelize.ParallelModel.state_dict`, each rank its part) and the run's own,
    the same on every rank: the data generator, the step and the losses so far. Written by any layout, read
    by any other. ``args`` are ``python -m scalebook.train``'s (their ``--checkpoint-dir``, ``--keep-last``,
    ``--async-save``, and the settings the manifest records); ``config`` the model's configuration as a dict
    (what :func:`consolidate` rebuilds the model from)."""

    def __init__(self, args, model, generator: torch.Generator, config: dict):
        from scalebook import data

        meta = {"args": vars(args), "world_size": model.dims.world_size, "config": config,
                "tokenizer_id": data.tokenizer_id(args.data)}  # fmt: skip
        self.model, self.generator = model, generator
        self.checkpointer = Checkpointer(args.checkpoint_dir, meta, keep_last=args.keep_last,
                                         async_save=args.async_save)  # fmt: skip

    def _run_state(self, step: int, losses: list[float]) -> dict:
        losses = torch.tensor(losses, dtype=torch.float64)
        return {"train.generator": self.generator.get_state(), "train.step": torch.tensor(step),
                "train.losses": losses}  # fmt: skip

    def save(self, step: int, losses: list[float]) -> None:
        self.checkpointer.save({**self.model.state_dict(), **self._run_state(step, losses)}, step)

    def resume(self, start: int) -> list[float]:
        """Load checkpoint ``start`` (the pre-flight's newest intact one; 0: none) into the model and the data
        generator; the losses so far. The optimizer gets the state the checkpoint holds, and only that."""
        from scalebook.parallel.state_dict import get_state_dict

        if not start:
            return []
        saved = self.checkpointer.saved_names(start)
        # Tensors of this layout's shapes for DCP to fill: the optimizer state the checkpoint holds, no other.
        state = {**get_state_dict(self.model, saved=saved), **self._run_state(start, [0.0] * start)}
        self.checkpointer.load(state, start)
        self.model.load_state_dict(state)
        self.generator.set_state(state["train.generator"])
        return state["train.losses"].tolist()

    def wait(self) -> None:
        """Let an asynchronous save finish and publish it."""
        self.checkpointer.wait()


def consolidate(root: str | os.PathLike, step: int | None = None) -> tuple[dict, dict]:
    """The full model state dict of checkpoint ``step`` (default: the latest) on this one process, checked
    against its manifest, and its metadata: the model size, its ``GPTConfig`` as a dict, the step and the
    world size that wrote it."""
    import torch.distributed.checkpoint as dcp

    from scalebook.model import GPT, GPTConfig

    step = latest_step(root) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {root} (no 'latest' file)")
    manifest = verify(root, step)
    model = GPT(GPTConfig(**manifest["config"]))
    state = {f"model.{name}": t for name, t in model.state_dict().items() if name != "lm_head.weight"}  # tied
    dcp.load(state, checkpoint_id=step_dir(root, step), no_dist=True)  # into the model's own tensors
    meta = {"model_size": manifest["args"]["model"], "config": manifest["config"], "step": step,
            "world_size": manifest["world_size"]}  # fmt: skip
    return model.state_dict(), meta


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
