"""Train a run once and let a later chapter reuse it: Chapter 1 trains the tiny GPT, Chapter 5 trains the same.

:func:`train_and_keep` trains exactly as :func:`scalebook.train.loop.train` does and stores the trained weights, the
per-step record and torch's random state after training. :func:`reuse_or_train` loads that run when everything
that determines it is the same (the model's class and initial weights, the tokens, the training settings, the
package's source, torch's version, kernel set and thread count), and trains otherwise. A loaded run is the run
the reader would have trained, bit for bit on this machine, minus the minutes; its ``optimizer`` is None (the
optimizer object is not kept) and its ``step_times`` are the timings of the run that was kept.

A stored file whose key does not match, or that cannot be read, is never used: the run is trained again and the
file replaced (``checkpoint.atomic_save``: written to a temporary name, flushed and renamed).

The runs live in ``$SCALEBOOK_CACHE`` (default ``~/.cache/scalebook``) under ``runs/``; delete the folder to
train everything again. Only the newest ``KEEP`` runs are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from scalebook.train.checkpoint import atomic_save
from scalebook.train.loop import TrainConfig, TrainResult, train

KEEP = 8


def cache_dir() -> Path:
    """Where kept runs are stored: ``$SCALEBOOK_CACHE/runs`` (default ``~/.cache/scalebook/runs``)."""
    root = os.environ.get("SCALEBOOK_CACHE") or Path.home() / ".cache" / "scalebook"
    return Path(root) / "runs"


def _package_source_digest() -> str:
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run_key(model: torch.nn.Module, tokens: torch.Tensor, cfg: TrainConfig) -> str:
    """A SHA-256 over everything that determines a run of :func:`scalebook.train.loop.train` (module docstring)."""
    digest = hashlib.sha256()
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "progress"}
    for part in (
        type(model).__qualname__,
        repr(sorted(settings.items())),
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        str(torch.get_num_threads()),
        _package_source_digest(),
    ):
        digest.update(part.encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(tokens.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _path(key: str) -> Path:
    return cache_dir() / f"{key[:32]}.pt"


def train_and_keep(model: torch.nn.Module, tokens: torch.Tensor, cfg: TrainConfig, *, description: str = "training"
                   ) -> TrainResult:
    """:func:`scalebook.train.loop.train`, then keep the run for :func:`reuse_or_train`."""
    return _train_and_keep(model, tokens, cfg, run_key(model, tokens, cfg), description)


def _train_and_keep(model, tokens, cfg: TrainConfig, key: str, description: str) -> TrainResult:
    result = train(model, tokens, cfg, description=description)
    kept = {
        "key": key,
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "losses": result.losses,
        "lrs": result.lrs,
        "step_times": result.step_times,
        "tokens_per_step": result.tokens_per_step,
        "rng_state": torch.get_rng_state(),
    }
    path = _path(key)
    atomic_save(kept, path)
    for old in sorted(path.parent.glob("*.pt"), key=lambda p: p.stat().st_mtime)[:-KEEP]:
        old.unlink(missing_ok=True)
    return result


def _load(key: str) -> dict | None:
    try:
        kept = torch.load(_path(key), weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):  # missing, truncated or not a checkpoint
        return None
    return kept if isinstance(kept, dict) and kept.get("key") == key else None


def reuse_or_train(model: torch.nn.Module, tokens: torch.Tensor, cfg: TrainConfig, *, description: str = "training"
                   ) -> TrainResult:
    """The kept run of ``model`` on ``tokens`` with ``cfg`` if there is one (the model is then in the state
    training would have left it), else :func:`train_and_keep`."""
    key = run_key(model, tokens, cfg)
    kept = _load(key)
    if kept is None:
        return _train_and_keep(model, tokens, cfg, key, description)
    model.load_state_dict(kept["state_dict"])
    model.train()
    if hasattr(model, "gradient_checkpointing"):
        model.gradient_checkpointing = cfg.activation_checkpointing
    torch.set_rng_state(kept["rng_state"])
    print("This very run was kept by an earlier chapter and is loaded (delete scalebook.train.reuse.cache_dir() "
          "to train it here).")
    return TrainResult(
        losses=list(kept["losses"]),
        lrs=list(kept["lrs"]),
        step_times=list(kept["step_times"]),
        tokens_per_step=int(kept["tokens_per_step"]),
        optimizer=None,
    )
