"""Training: the one loop, its command line and its checkpoints.

    loop        :func:`train` on one device, and :func:`training_steps`, the loop every layout runs
    cli         ``python -m scalebook.train``: arguments, logging, checkpoints, stopping a diverged run
    preflight   every check before any rank starts work: layout, paths, data, a resume's checkpoint
    checkpoint  atomic per-rank checkpoints with SHA-256 manifests, ``latest``, and consolidation into one state dict

``python -m scalebook.train`` runs ``scalebook/train/__main__.py``, which calls ``scalebook.train.cli.main``.

Source: nanoGPT ``train.py`` (one loop); torchtitan ``train.py`` (the loop over a parallelized model).
"""

from scalebook.train.loop import (
    StepRecord,
    TrainConfig,
    TrainResult,
    autocast_context,
    evaluate,
    lr_at,
    make_optimizer,
    train,
    training_steps,
    weight_decay_groups,
)

__all__ = [
    "StepRecord",
    "TrainConfig",
    "TrainResult",
    "autocast_context",
    "evaluate",
    "lr_at",
    "make_optimizer",
    "train",
    "training_steps",
    "weight_decay_groups",
]
