"""The training loop, one for every layout, and its single-device entry point :func:`train`.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` sequences of ``seq_len`` tokens.
Each micro-batch loss is divided by ``grad_accum`` before ``backward`` so the accumulated gradient is the
gradient of the mean loss over the whole step's batch, exactly as if it had been one large batch.

Options: bf16 autocast (mixed precision), activation checkpointing (recompute each block in backward),
gradient clipping, linear warm-up then cosine decay of the learning rate, AdamW with weight decay on
matrices only. The loop is deterministic for a given seed and thread count.

A step whose loss or gradient norm is not finite (NaN or infinite) does not update the weights: the
optimizer skips it, as a mixed-precision loss scaler does, and its record says ``skipped``. Whether the run
goes on is the caller's decision (``python -m scalebook.train`` stops unless ``--skip-nonfinite`` allows
it). Loss and gradient norm are the same on every rank, so every rank skips the same steps.

Source: Loshchilov & Hutter 2019 (AdamW); Chen et al. 2016 (activation checkpointing);
Micikevicius et al. 2018 (mixed precision).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from scalebook.data import get_batch, sequential_batches
from scalebook.parallel.dims import ParallelDims
from scalebook.parallel.parallelize import ParallelModel

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float | None = 1.0
    precision: str = "fp32"
    activation_checkpointing: bool = False
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        problems = []
        for name in ("steps", "batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.min_lr <= self.lr:
            problems.append(f"need 0 < min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if problems:
            raise ValueError("invalid TrainConfig: " + "; ".join(problems))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # training loss of each optimizer step
    lrs: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # wall-clock seconds per optimizer step
    tokens_per_step: int = 0
    optimizer: torch.optim.Optimizer | None = None

    @property
    def tokens_per_second(self) -> float:
        """Throughput over all steps but the first (which pays one-off allocation costs)."""
        times = self.step_times[1:] or self.step_times
        return self.tokens_per_step * len(times) / sum(times)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: weight decay on matrices (dim >= 2), none on biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay applies to matrices (dim >= 2), not to biases and LayerNorm gains.

    ``foreach`` is left to torch, as in torch's own loops: one multi-tensor kernel per step on a GPU, the loop over
    the tensors on a CPU (the same arithmetic, element by element)."""
    groups = weight_decay_groups(model, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def autocast_context(precision: str, device_type: str = "cpu"):
    """bf16 autocast for ``"bf16"``; a no-op for ``"fp32"``."""
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step of :func:`training_steps` measured."""

    step: int  # steps done, counting this one
    loss: float  # mean loss over the step's global batch
    grad_norm: float  # global L2 norm of the step's gradient, before clipping
    lr: float
    step_time: float  # wall-clock seconds
    skipped: bool = False  # the loss or the gradient norm was not finite: no optimizer update


def training_steps(
    model: ParallelModel, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], cfg: TrainConfig,
    *, start: int = 0,
) -> Iterator[StepRecord]:  # fmt: skip
    """The training loop: optimizer steps ``start`` to ``cfg.steps - 1`` of ``model``, yielding after each.

    ``next_batch()`` gives this rank's share of the step's batch; ``model`` (see
    :func:`scalebook.parallel.parallelize.parallelize`) knows how its ranks split it. The same loop trains one
    process and every parallel layout, and never asks which: logging, checkpoints and progress bars are the
    caller's, between the steps. A step with a non-finite loss or gradient norm is yielded with ``skipped``
    set and leaves the weights and the optimizer state as they were.
    """
    clip = math.inf if cfg.grad_clip is None else cfg.grad_clip  # min(1, inf / norm) = 1: no clipping
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in model.optimizer.param_groups:
            group["lr"] = lr
        model.zero_grad()
        x, y = next_batch()
        with autocast_context(cfg.precision, model.device.type):
            loss = model.forward_backward(x.to(model.device), y.to(model.device))
        grad_norm = model.clip_grad_norm_(clip)
        # One wait for the device per step, not one per number: both values come to the host together (float64
        # holds a float32 or a float64 exactly, so the values are those that .item() would give).
        both = [torch.as_tensor(v, device=model.device).detach().reshape(()) for v in (loss, grad_norm)]
        loss_value, norm_value = torch.stack([v.to(torch.float64) for v in both]).tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if finite:
            model.step()
        yield StepRecord(step + 1, loss_value, norm_value, lr, time.perf_counter() - t0, skipped=not finite)


def train(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    cfg: TrainConfig,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    description: str = "training",
) -> TrainResult:
    """Train ``model`` in place on one process, on random windows of ``tokens``; return the per-step record."""
    if hasattr(model, "config") and cfg.seq_len > model.config.block_size:
        raise ValueError(
            f"seq_len {cfg.seq_len} exceeds the model's block_size {model.config.block_size}; lower seq_len"
        )
    torch.manual_seed(cfg.seed)  # dropout masks
    model.train()
    if hasattr(model, "gradient_checkpointing"):
        model.gradient_checkpointing = cfg.activation_checkpointing
    optimizer = optimizer or make_optimizer(model, cfg)
    one_process = ParallelModel(model, optimizer, ParallelDims(1, micro_batches=cfg.grad_accum))
    # Draw the whole step's batch at once and split it, so the data of a step does not depend on
    # how it is cut into micro-batches: grad_accum=2 with batch_size=4 sees what batch_size=8 sees.
    generator = torch.Generator().manual_seed(cfg.seed)
    result = TrainResult(tokens_per_step=cfg.tokens_per_step, optimizer=optimizer)
    bar = tqdm(total=cfg.steps, desc=description, disable=not cfg.progress, unit="step")
    for record in training_steps(
        one_process, lambda: get_batch(tokens, cfg.batch_size * cfg.grad_accum, cfg.seq_len, generator), cfg
    ):
        result.step_times.append(record.step_time)
        result.losses.append(record.loss)
        result.lrs.append(record.lr)
        bar.update()
        bar.set_postfix(loss=f"{record.loss:.3f}", refresh=False)
    bar.close()
    return result


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, tokens: torch.Tensor, *, seq_len: int, batch_size: int = 16, max_batches: int | None = None
) -> float:
    """Mean next-token cross-entropy over consecutive windows of ``tokens`` (model left in eval mode)."""
    model.eval()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(sequential_batches(tokens, batch_size, seq_len)):
        if max_batches is not None and i >= max_batches:
            break
        _, loss = model(x, y)
        total += loss.item() * y.numel()
        count += y.numel()
    return total / count
