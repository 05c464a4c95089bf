"""Chapter 14's ring-attention experiments: ring attention on ranks against one-rank causal attention.

:func:`compare_ring_attention` runs :func:`scalebook.parallel.context.ring_attention` on every rank of the
default group against :func:`~scalebook.parallel.context.causal_attention` on the whole sequence, counting
bytes sent, bytes saved for backward and the half-chunk pairs every rank computes; :func:`ring_attention_study`
launches it for several context-parallel sizes; :func:`gpt_context_parallel_errors` trains the GPT one step
with :func:`~scalebook.parallel.context.apply_context_parallel` against one process.

Source: Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context";
Tazi et al. 2025, "The Ultra-Scale Playbook", "Context parallelism".
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from scalebook import measure
from scalebook.comm import count_traffic, launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.context import (
    SPLITS,
    apply_context_parallel,
    causal_attention,
    context_parallel_batch,
    ring_attention,
    shard_sequence,
    unmasked_scores,
    unshard_sequence,
    validate_context_parallel,
)

__all__ = ["compare_ring_attention", "ring_attention_study", "gpt_context_parallel_errors"]


def compare_ring_attention(
    *,
    batch: int = 2,
    heads: int = 4,
    seq_len: int = 64,
    head_dim: int = 16,
    splits: tuple[str, ...] = SPLITS,
    seed: int = 0,
    timed_seq_len: int | None = None,
) -> dict[str, dict]:
    """On every rank of the default group (run it with :func:`scalebook.comm.launch`): ring attention
    against :func:`~scalebook.parallel.context.causal_attention` on the whole sequence, for each split in ``splits``.

    Every rank draws the same Q, K, V and output gradient, computes the one-rank reference and ring
    attention on its own shard, gathers the shards and reports, per split, the largest deviations of the
    output and of the Q, K, V gradients, the calls and bytes this rank sent in the forward and backward
    passes, the bytes saved for backward (ring and reference), the half-chunk pairs every rank computed
    and skipped (counted while it ran, gathered from all ranks) and the unmasked scores of every rank.
    With ``timed_seq_len``, also every rank's seconds of computing in one forward and backward pass at
    that length (machine-dependent).
    """
    rank, cp = dist.get_rank(), dist.get_world_size()
    for split in splits:
        validate_context_parallel(seq_len, cp, split)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = causal_attention(*full)
    reference.backward(grad_out)
    full_saved = measure.saved_by_call(causal_attention, *full).total
    results = {}
    for split in splits:
        mine = [shard_sequence(t, cp, rank, split=split).requires_grad_() for t in (q, k, v)]
        work = {}
        with count_traffic() as forward:
            out = ring_attention(*mine, split=split, work=work)
        with count_traffic() as backward:
            out.backward(shard_sequence(grad_out, cp, rank, split=split))
        ring_saved = measure.saved_by_call(lambda *t, split=split: ring_attention(*t, split=split), *mine).total
        every_rank = [None] * cp
        dist.all_gather_object(every_rank, work)

        def gathered(t: torch.Tensor, split: str = split) -> torch.Tensor:
            pieces = [torch.empty_like(t) for _ in range(cp)]
            dist.all_gather(pieces, t.detach().contiguous())
            return unshard_sequence(pieces, split=split)

        errors = {"output": (gathered(out) - reference).abs().max().item()}
        for name, local, ref in zip(("grad_q", "grad_k", "grad_v"), mine, full, strict=True):
            errors[name] = (gathered(local.grad) - ref.grad).abs().max().item()
        results[split] = {
            "errors": errors,
            "forward": {op: (n, float(sent)) for op, (n, sent) in forward.by_op().items()},
            "backward": {op: (n, float(sent)) for op, (n, sent) in backward.by_op().items()},
            "ring_saved_bytes": ring_saved,
            "full_saved_bytes": full_saved,
            "half_blocks": every_rank,
            "unmasked_scores": unmasked_scores(seq_len, cp, split),
        }
        if timed_seq_len:
            results[split]["seconds"] = _time_ring_attention(batch, heads, timed_seq_len, head_dim, split)
    return results


def _time_ring_attention(batch: int, heads: int, seq_len: int, head_dim: int, split: str) -> list[float]:
    """Every rank's seconds of computing (waits for blocks excluded) in one forward and backward pass, the
    best of three."""
    cp = dist.get_world_size()
    validate_context_parallel(seq_len, cp, split)
    shape = (batch, heads, seq_len // cp, head_dim)
    q, k, v = (torch.randn(shape).requires_grad_() for _ in range(3))
    best = float("inf")
    for _ in range(3):
        work = {}
        ring_attention(q, k, v, split=split, work=work).sum().backward()
        best = min(best, sum(work["seconds"].values()))
    every_rank = [None] * cp
    dist.all_gather_object(every_rank, best)
    return every_rank


def ring_attention_study(
    cps: tuple[int, ...] = (2, 4), *, seq_len: int = 64, timed: dict[int, int] | None = None,
    timeout: float = 300.0, **kwargs,
) -> dict[tuple[int, str], dict]:  # fmt: skip
    """Check every layout, then run :func:`compare_ring_attention` on ``cp`` fresh ranks for each ``cp``
    (one launch each). ``timed`` maps a ``cp`` to a sequence length to time at. Returns rank 0's
    results keyed by ``(cp, split)``."""
    timed = timed or {}
    for cp in cps:
        for split in SPLITS:
            validate_context_parallel(seq_len, cp, split)
            if cp in timed:
                validate_context_parallel(timed[cp], cp, split)
    results = {}
    for cp in cps:
        per_split = launch(compare_ring_attention, cp, seq_len=seq_len, timed_seq_len=timed.get(cp),
                           timeout=timeout, **kwargs)[0]  # fmt: skip
        results.update({(cp, split): r for split, r in per_split.items()})
    return results


def gpt_context_parallel_errors(cp: int, split: str = "zigzag", *, seed: int = 0) -> dict:
    """On every rank of the default group (run it with :func:`scalebook.comm.launch`): a small GPT trained one
    step on dp x cp ranks (cp consecutive ranks share two sequences, dp = world / cp blocks of them hold
    different ones) against the same GPT on the whole batch in this process. The gradients are averaged
    over all dp x cp ranks and the loss is logged as the mean of the local losses, as
    :mod:`scalebook.parallel.context` prescribes. Returns the deviations of the logged loss and of the
    largest gradient entry, the largest gradient entry, and the shape of this rank's tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // cp
    cp_groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(dp)]  # every rank makes all
    torch.manual_seed(seed)
    reference = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(seed + 1)
    idx, targets = (torch.randint(0, 64, (2 * dp, 16), generator=gen) for _ in range(2))
    reference(idx, targets)[1].backward()

    group = cp_groups[rank // cp]
    apply_context_parallel(model, group, split=split)
    rows = slice(2 * (rank // cp), 2 * (rank // cp + 1))  # this dp rank's two sequences
    mine, my_targets, positions = context_parallel_batch(idx[rows], targets[rows], group, split)
    _, loss = model(mine, my_targets, positions=positions)
    loss.backward()
    for p in model.parameters():  # the data-parallel wrapper's job, over dp x cp: here the whole world
        dist.all_reduce(p.grad.div_(world))
    logged = loss.detach().clone()
    dist.all_reduce(logged.div_(world))
    ref_grads = dict(reference.named_parameters())
    return {
        "loss_error": abs(logged.item() - reference(idx, targets)[1].item()),
        "grad_error": max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in model.named_parameters()),
        "grad_scale": max(p.grad.abs().max().item() for p in reference.parameters()),
        "local_tokens": tuple(mine.shape),
    }
