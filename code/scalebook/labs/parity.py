"""Lab 5, loss parity across layouts: DP, TP and PP from one seed against one process, their losses and
their gradient norms before the optimizer compared step by step (:func:`scalebook.parity.compare_losses`);
a missing 1/d hides in the losses and shows in the norms.

Source: torchtitan documentation, "How to converge" (loss parity across parallelisms).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scalebook.data import corpus_tokens, get_batch
from scalebook.labs.checks import check_variants
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.ddp import BucketedDDP
from scalebook.parallel.pipeline import build_schedule, pipeline_stage, run_schedule, sync_tied_embedding
from scalebook.parallel.tensor import apply_tensor_parallel, sharding_of
from scalebook.train import TrainConfig, make_optimizer

PARITY_LAYOUTS = ("single", "dp2", "tp2", "pp2", "dp2 broken: gradients summed, not averaged",
                  "pp2 broken: tied embedding not synced")  # fmt: skip


def _global_grad_norm(model: torch.nn.Module, layout: str) -> float:
    """The L2 norm of the whole model's gradient, every parameter counted once, on every rank.

    ``single`` and ``dp2`` hold every gradient on each rank; ``tp2`` splits the sharded matrices over the
    ranks (their squares are summed over ranks) and replicates the rest; ``pp2`` gives each rank one
    stage, and the last stage's head is a copy of the first stage's embedding, counted there.
    """
    named = list(model.named_parameters())
    if layout == "tp2":
        split = [p.grad for name, p in named if sharding_of(name) is not None]
        replicated = [p.grad for name, p in named if sharding_of(name) is None]
    elif layout.startswith("pp2"):
        split, replicated = [p.grad for name, p in named if name != "lm_head.weight"], []
    else:
        split, replicated = [], [p.grad for _, p in named]
    squares = torch.zeros((), dtype=torch.float64)
    for g in split:
        squares += g.double().square().sum()
    if split:
        dist.all_reduce(squares)
    for g in replicated:
        squares += g.double().square().sum()
    return squares.sqrt().item()


def parity_lab(
    layouts=PARITY_LAYOUTS,
    *,
    steps: int = 8,
    batch_size: int = 8,
    seq_len: int = 32,
    lr: float = 3e-3,
    size: str = "tiny",
    seed: int = 0,
) -> dict:
    """Worker (2 ranks): train the same GPT from one seed on the same global batches with each layout.

    ``single`` is one process on the whole batch; ``dp2`` Chapter 10's bucketed DDP; ``tp2`` Chapter 12's
    tensor parallelism; ``pp2`` Chapter 13's 1F1B pipeline with 2 micro-batches. Two BROKEN layouts: DDP
    that sums the gradients over the ranks instead of averaging them (a missing 1/d), and a pipeline that
    skips the all-reduce of the tied embedding's two copies. AdamW without clipping (so that the scale of
    the gradients reaches the optimizer untouched).

    Returns ``{"losses": {layout: [global loss of each step]}, "grad_norms": {layout: [norm of each step's
    gradient, before the optimizer]}}``, the same on every rank. The gradient norms are the sharper
    detector: Adam divides a constant factor on the gradients out of its update, so a missing 1/d barely
    moves the losses, while it doubles the norm (d = 2) from step 0.
    """
    layouts = check_variants(layouts, PARITY_LAYOUTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise ValueError(f"parity_lab's layouts are for 2 ranks, got {world}")
    config = GPTConfig.named(size)
    train_config = TrainConfig(steps=steps, lr=lr, min_lr=lr, warmup_steps=0, grad_clip=None, progress=False)
    out = {"losses": {}, "grad_norms": {}}
    for layout in layouts:
        torch.manual_seed(seed)
        full = GPT(config)
        if layout.startswith("pp2"):
            model = pipeline_stage(full, rank, 2)
        elif layout == "tp2":
            model = apply_tensor_parallel(full)
        else:
            model = full
        ddp = BucketedDDP(model) if layout.startswith("dp2") else None
        optimizer = make_optimizer(model, train_config)
        generator = torch.Generator().manual_seed(seed)
        losses, norms = [], []
        for _ in range(steps):
            x, y = get_batch(corpus_tokens(), batch_size, seq_len, generator)  # the whole global batch
            optimizer.zero_grad(set_to_none=False)
            if layout.startswith("pp2"):
                last_loss = run_schedule(build_schedule("1f1b", 2, 2), model, x, y)
                if layout == "pp2":
                    sync_tied_embedding(model)
                loss = torch.tensor([last_loss.item() if rank == 1 else 0.0])
                dist.broadcast(loss, group_src=1)
            elif layout.startswith("dp2"):
                rows = slice(rank * batch_size // 2, (rank + 1) * batch_size // 2)
                _, local = ddp(x[rows], y[rows])
                local.backward()  # averaged over the ranks by the time it returns, as torch DDP's
                if layout != "dp2":  # BROKEN: undo DDP's division, leaving the sum of the ranks' gradients
                    for p in model.parameters():
                        p.grad.mul_(world)
                loss = local.detach().reshape(1) / world
                dist.all_reduce(loss)
            else:
                _, loss = model(x, y)
                loss.backward()
            norms.append(_global_grad_norm(model, layout))  # before the optimizer: what it is about to apply
            optimizer.step()
            losses.append(loss.item())
        out["losses"][layout], out["grad_norms"][layout] = losses, norms
    return out
