"""Lab 3, ``no_sync`` misuse: the last micro-batch also skips the all-reduce (replicas drift apart, caught
by :func:`scalebook.labs.checks.rank_checksums`), or no micro-batch skips it (correct, but ``grad_accum``
times the traffic, caught by :func:`scalebook.comm.traffic.count_traffic`).

Source: PyTorch documentation, "DistributedDataParallel.no_sync" and "DDP Communication Hooks".
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from scalebook.accounting.comm import bytes_sent_per_rank
from scalebook.comm import count_traffic
from scalebook.data import corpus_tokens, get_batch
from scalebook.experiments.ddp import CommProbe, probed_allreduce_hook
from scalebook.labs.checks import check_variants, rank_checksums
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig, make_optimizer

NO_SYNC_VARIANTS = (
    "broken: no_sync on every micro-batch",  # the last backward never all-reduces
    "broken: no_sync never used",  # every backward all-reduces
    "fixed: no_sync on all but the last",
)


def no_sync_lab(
    variants=NO_SYNC_VARIANTS,
    *,
    steps: int = 3,
    micro_batch: int = 2,
    grad_accum: int = 4,
    seq_len: int = 32,
    size: str = "tiny",
    seed: int = 0,
) -> dict:
    """Worker: torch DDP with gradient accumulation, using ``no_sync`` three ways.

    Per variant: the cross-rank parameter checksums after each step (:func:`scalebook.labs.checks.rank_checksums`), the
    all-reduce calls and bytes of each step (a communication hook makes DDP's all-reduces visible to
    :func:`~scalebook.comm.traffic.count_traffic`), and ``expected_bytes``, one ring all-reduce of every
    gradient (:func:`scalebook.accounting.comm.bytes_sent_per_rank`).
    """
    variants = check_variants(variants, NO_SYNC_VARIANTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.named(size)
    train_config = TrainConfig(steps=steps, lr=1e-3, min_lr=1e-3, warmup_steps=0, grad_clip=None, progress=False)
    out = {}
    for variant in variants:
        torch.manual_seed(seed)
        model = GPT(config)
        ddp = DistributedDataParallel(model)
        probe = CommProbe({id(p): n for n, p in model.named_parameters()})
        ddp.register_comm_hook(probe, probed_allreduce_hook)
        optimizer = make_optimizer(model, train_config)
        generator = torch.Generator().manual_seed(seed)
        checksums, calls, sent = [], [], []
        for _ in range(steps):
            x, y = get_batch(corpus_tokens(), micro_batch * grad_accum, seq_len, generator, rank=rank, world_size=world)
            optimizer.zero_grad()
            with count_traffic() as traffic:
                for i, (xb, yb) in enumerate(zip(x.chunk(grad_accum), y.chunk(grad_accum), strict=True)):
                    if variant == "broken: no_sync on every micro-batch":
                        skip = True
                    elif variant == "broken: no_sync never used":
                        skip = False
                    else:
                        skip = i < grad_accum - 1
                    with ddp.no_sync() if skip else contextlib.nullcontext():
                        (ddp(xb, yb)[1] / grad_accum).backward()
            optimizer.step()
            calls.append(traffic.count("all_reduce"))
            sent.append(traffic.bytes_sent("all_reduce"))
            checksums.append(rank_checksums(model.parameters()))
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        out[variant] = {
            "checksums": checksums,
            "calls": calls,
            "bytes_sent": sent,
            "expected_bytes": bytes_sent_per_rank("all_reduce", grad_bytes, world),
        }
    return out
