"""Lab 2, gradient accumulation scaled wrong: micro-batch losses not divided by their number, or averaged
per micro-batch although their token counts differ.

:func:`accumulation_lab` trains torch DDP replicas with each way of scaling, and one process on the whole
global batch, with plain SGD so that a wrong gradient scale shows in the losses.

Source: PyTorch documentation, "DistributedDataParallel.no_sync"; torchtitan documentation, "How to
converge" (loss parity).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from scalebook.data import corpus_tokens, get_batch
from scalebook.labs.checks import check_variants
from scalebook.model import GPT, GPTConfig

ACCUMULATION_VARIANTS = (
    "broken: sum of micro-batch means",  # forgot to divide by grad_accum
    "broken: mean of micro-batch means",  # divided by grad_accum, but micro-batches hold different token counts
    "fixed: divide by the global token count",
)


def padded_batch(generator: torch.Generator, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length sequences right-padded to ``seq_len``: targets of padding are -100 (ignored by the loss).

    Each sequence keeps between ``seq_len // 8`` and ``seq_len`` real tokens, so micro-batches hold
    different numbers of tokens, as with packed-free batching of documents of different lengths.
    """
    x, y = get_batch(corpus_tokens(), rows, seq_len, generator)
    lengths = torch.randint(max(1, seq_len // 8), seq_len + 1, (rows,), generator=generator)
    padding = torch.arange(seq_len)[None, :] >= lengths[:, None]
    return x.masked_fill(padding, 0), y.masked_fill(padding, -100)


def _token_losses_sum(model, x, y) -> tuple[torch.Tensor, int]:
    logits, _ = model(x)
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="sum")
    return loss_sum, int((y != -100).sum())


def _relative_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    num = sum(((grads[n] - g) ** 2).sum() for n, g in reference.items())
    return (num / sum((g**2).sum() for g in reference.values())).sqrt().item()


def accumulation_lab(
    variants=ACCUMULATION_VARIANTS,
    *,
    steps: int = 6,
    micro_batch: int = 2,
    grad_accum: int = 4,
    seq_len: int = 32,
    lr: float = 0.05,
    size: str = "tiny",
    seed: int = 0,
) -> dict:
    """Worker: train torch DDP replicas with each way of scaling accumulated micro-batch losses, and one
    process on the whole global batch (the reference), with plain SGD so a wrong gradient scale shows.

    Returns ``{"reference": losses, variant: {"losses", "grad_error"}}``: the token-weighted global loss
    of each step (computed the same way for every variant) and the relative gradient error of step 0.
    """
    variants = check_variants(variants, ACCUMULATION_VARIANTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.named(size)

    def batches(step: int):
        """The global batch of ``step``: world x grad_accum micro-batches; this rank's are [rank::world]."""
        generator = torch.Generator().manual_seed(seed * 1000 + step)
        return [padded_batch(generator, micro_batch, seq_len) for _ in range(world * grad_accum)]

    torch.manual_seed(seed)
    reference = GPT(config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_losses, ref_grads = [], None
    for step in range(steps):
        x, y = (torch.cat(t) for t in zip(*batches(step), strict=True))
        ref_opt.zero_grad()
        _, loss = reference(x, y)  # cross_entropy's mean skips the -100 targets: a token-weighted mean
        loss.backward()
        ref_grads = ref_grads or {n: p.grad.clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_losses.append(loss.item())
    out = {"reference": ref_losses}
    for variant in variants:
        torch.manual_seed(seed)
        model = DistributedDataParallel(GPT(config))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        losses, grad_error = [], None
        for step in range(steps):
            mine = batches(step)[rank::world]
            tokens = torch.tensor([float(sum(int((y != -100).sum()) for _, y in mine))])
            dist.all_reduce(tokens)  # the fix needs the global token count before the first backward
            optimizer.zero_grad()
            logged = torch.zeros(2, dtype=torch.float64)  # (sum of token losses, tokens) for the log
            for i, (x, y) in enumerate(mine):
                last = i == grad_accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss_sum, n = _token_losses_sum(model, x, y)
                    if variant == "broken: sum of micro-batch means":
                        scaled = loss_sum / n
                    elif variant == "broken: mean of micro-batch means":
                        scaled = loss_sum / n / grad_accum
                    else:  # DDP averages over ranks, so undo its 1/world: the result is sum / global tokens
                        scaled = loss_sum * world / tokens[0]
                    scaled.backward()
                logged += torch.tensor([loss_sum.item(), n], dtype=torch.float64)
            if grad_error is None:
                grad_error = _relative_error({n: p.grad for n, p in model.module.named_parameters()}, ref_grads)
            optimizer.step()
            dist.all_reduce(logged)
            losses.append((logged[0] / logged[1]).item())
        out[variant] = {"losses": losses, "grad_error": grad_error}
    return out
