"""Context parallelism: ring attention over CP ranks, each holding a slice of the sequence.

Every rank keeps the queries, keys and values of its own s/cp tokens. Attention needs every key and
value, so the K/V blocks travel round a ring of ranks: at step j rank r holds the block that started on
rank (r - j) mod cp, multiplies its queries with it, and passes it on with ``isend``/``irecv`` while the
next block arrives. After cp steps every query has met every key, and no rank ever held more than one
foreign block. The softmax over blocks that arrive one at a time is the online softmax of
FlashAttention: keep per query the running maximum m, the running sum of exponentials l and the running
weighted sum of values, and rescale them by exp(m_old - m_new) when a larger score turns up,

    m' = max(m, max_j S_j),  l' = l e^{m - m'} + sum_j e^{S_j - m'},  o' = o e^{m - m'} + sum_j e^{S_j - m'} v_j,

so that o / l at the end is exactly softmax(S) V. The log-sum-exp ``lse = m + log l`` is all the backward
pass needs to rebuild each block's probabilities P = exp(S - lse): the backward runs the ring again,
and the key/value gradients of each block travel with it and arrive home after one more hop.

Causal masking unbalances a contiguous split: the rank with the last tokens attends to everything, the
first to almost nothing. The zig-zag split cuts the sequence into 2 cp chunks and gives rank r chunks r
and 2 cp - 1 - r, an early and a late one, so every rank computes the same number of unmasked scores.

Source: Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"; Dao et al. 2022, "FlashAttention" (online softmax, Sec. 3.1, and its backward, Appendix B);
Tazi et al. 2025, "The Ultra-Scale Playbook", "Context parallelism" (zig-zag load balancing).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from scalebook import measure
from scalebook.dist import count_traffic, launch

SPLITS = ("zigzag", "contiguous")


# ------------------------------------------------------------------------------------------ the split


def validate_context_parallel(seq_len: int, cp: int, split: str = "zigzag") -> None:
    """Raise one ValueError if a sequence of ``seq_len`` tokens cannot be split over ``cp`` ranks."""
    problems = []
    for name, value in (("seq_len", seq_len), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if split not in SPLITS:
        problems.append(f"split must be one of {SPLITS}, got {split!r}")
    if not problems:
        chunks = 2 * cp if split == "zigzag" else cp
        if seq_len % chunks:
            problems.append(
                f"the {split} split cuts the sequence into {chunks} equal chunks, so seq_len ({seq_len}) must be "
                f"divisible by {chunks}; use seq_len={max(chunks, seq_len // chunks * chunks)}"
            )
    if problems:
        raise ValueError("invalid context-parallel layout: " + "; ".join(problems))


def token_positions(seq_len: int, cp: int, rank: int, split: str = "zigzag") -> torch.Tensor:
    """The positions (in the full sequence) of the tokens rank ``rank`` holds, in the order it holds them."""
    validate_context_parallel(seq_len, cp, split)
    if split == "contiguous":
        return torch.arange(seq_len).chunk(cp)[rank]
    chunks = torch.arange(seq_len).chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, *, dim: int = -2, split: str = "zigzag") -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` along ``dim`` (a copy)."""
    return x.index_select(dim, token_positions(x.shape[dim], cp, rank, split)).clone()


def unshard_sequence(pieces: list[torch.Tensor], *, dim: int = -2, split: str = "zigzag") -> torch.Tensor:
    """Put every rank's tokens back in sequence order (the inverse of :func:`shard_sequence`)."""
    cp = len(pieces)
    seq_len = sum(p.shape[dim] for p in pieces)
    order = torch.cat([token_positions(seq_len, cp, r, split) for r in range(cp)])
    return torch.cat(pieces, dim=dim).index_select(dim, torch.argsort(order))


def unmasked_scores(seq_len: int, cp: int, split: str = "zigzag") -> list[int]:
    """Per rank, the (query, key) pairs causal attention computes: how much work each rank has."""
    counts = []
    for rank in range(cp):
        positions = token_positions(seq_len, cp, rank, split)
        counts.append(int((positions + 1).sum()))  # the query at position i sees keys 0..i
    return counts


# -------------------------------------------------------------------------------------- the reference


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + M) V on one rank, (b, heads, s, d) tensors: the reference ring attention must equal."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def attention_saved_bytes(
    batch: int, heads: int, seq_len: int, head_dim: int, *, cp: int = 1, dtype_bytes: int = 4
) -> dict[str, int]:
    """Bytes one rank keeps for the backward pass of attention, in closed form.

    ``cp == 1`` (:func:`causal_attention`): Q, K, V (3 b a s d), the softmax output (b a s^2) and the
    boolean causal mask (s^2 bytes). Ring attention on ``cp`` ranks: its own Q, K, V and output
    (4 b a (s/cp) d) and the fp32 log-sum-exp (b a s/cp); the score block it works on at a time is
    b a (s/cp)^2 values, which it frees after each step. Returns ``{"saved": ..., "score_block": ...}``.
    """
    local = seq_len // cp
    if cp == 1:
        saved = 3 * batch * heads * seq_len * head_dim * dtype_bytes + batch * heads * seq_len**2 * dtype_bytes
        return {"saved": saved + seq_len**2, "score_block": batch * heads * seq_len**2 * dtype_bytes}
    saved = 4 * batch * heads * local * head_dim * dtype_bytes + batch * heads * local * 4
    return {"saved": saved, "score_block": batch * heads * local**2 * dtype_bytes}


def ring_bytes_per_rank(
    batch: int, heads: int, seq_len: int, head_dim: int, *, cp: int, dtype_bytes: int = 4
) -> dict[str, int]:
    """Bytes each rank sends in ring attention: the forward passes its K and V blocks on cp - 1 times; the
    backward passes K, V and their two gradient blocks cp - 1 times and the gradients once more, home.
    A block is b a (s/cp) d values. Returns ``{"forward": ..., "backward": ...}``."""
    block = batch * heads * (seq_len // cp) * head_dim * dtype_bytes
    return {"forward": 2 * (cp - 1) * block, "backward": (4 * (cp - 1) + 2) * block if cp > 1 else 0}


# --------------------------------------------------------------------------------------- ring attention


def _ring_peers(group) -> tuple[int, int, int, int]:
    """(rank in the group, group size, global rank of the next and of the previous rank in the ring)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return rank, size, global_rank((rank + 1) % size), global_rank((rank - 1) % size)


def _pass_on(tensors: list[torch.Tensor], group, tag: int) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's (same shapes)."""
    _, _, next_rank, prev_rank = _ring_peers(group)
    received = [torch.empty_like(t) for t in tensors]
    works = []
    for i, (out, into) in enumerate(zip(tensors, received, strict=True)):
        # isend never blocks, so every rank can send before it receives without a deadlock.
        works.append(dist.isend(out.contiguous(), dst=next_rank, group=group, tag=tag + i))
        works.append(dist.irecv(into, src=prev_rank, group=group, tag=tag + i))
    for work in works:
        work.wait()
    return received


def _block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    return q_pos.unsqueeze(-1) >= k_pos.unsqueeze(0)  # causal: a query sees keys at or before it


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group, split):
        rank, cp, _, _ = _ring_peers(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        seq_len = positions.numel() * cp
        m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        total = torch.zeros(q.shape[:-1], dtype=q.dtype)  # the running sum of exponentials, l
        acc = torch.zeros_like(q)
        block_k, block_v = k, v
        for step in range(cp):
            owner = (rank - step) % cp
            mask = _block_mask(positions, token_positions(seq_len, cp, owner, split))
            if mask.any():  # a block entirely in this rank's future costs nothing
                scores = (q @ block_k.transpose(-2, -1)) * scale
                scores = scores.masked_fill(~mask, float("-inf"))
                m_new = torch.maximum(m, scores.amax(dim=-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
                rescale = torch.exp(m - m_safe)
                p = torch.exp(scores - m_safe.unsqueeze(-1))
                total = total * rescale + p.sum(dim=-1)
                acc = acc * rescale.unsqueeze(-1) + p @ block_v
                m = m_new
            if step < cp - 1:
                block_k, block_v = _pass_on([block_k, block_v], group, tag=2 * step)
        out = acc / total.unsqueeze(-1)
        lse = m + torch.log(total)  # every query sees at least itself, so l > 0
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.group, ctx.split = positions, group, split
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        positions, group, split = ctx.positions, ctx.group, ctx.split
        rank, cp, _, _ = _ring_peers(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        seq_len = positions.numel() * cp
        # D_i = sum_d dO_id O_id: the softmax Jacobian's correction term, per query.
        correction = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_q = torch.zeros_like(q)
        block_k, block_v = k, v
        block_grad_k, block_grad_v = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(cp):
            owner = (rank - step) % cp
            mask = _block_mask(positions, token_positions(seq_len, cp, owner, split))
            if mask.any():
                scores = (q @ block_k.transpose(-2, -1)) * scale
                p = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(~mask, 0.0)  # softmax, rebuilt
                block_grad_v = block_grad_v + p.transpose(-2, -1) @ grad_out
                grad_scores = p * (grad_out @ block_v.transpose(-2, -1) - correction)
                grad_q = grad_q + grad_scores @ block_k * scale
                block_grad_k = block_grad_k + grad_scores.transpose(-2, -1) @ q * scale
            if step < cp - 1:
                block_k, block_v, block_grad_k, block_grad_v = _pass_on(
                    [block_k, block_v, block_grad_k, block_grad_v], group, tag=1000 + 4 * step
                )
        # One last hop brings each block's gradients home to the rank that owns the block.
        grad_k, grad_v = _pass_on([block_grad_k, block_grad_v], group, tag=2000) if cp > 1 else (
            block_grad_k, block_grad_v)  # fmt: skip
        return grad_q, grad_k, grad_v, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, split: str = "zigzag"
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, with K/V passed round ``group``.

    ``q``, ``k``, ``v`` are (b, heads, s/cp, d): this rank's tokens as :func:`shard_sequence` gives them
    under ``split``. Returns this rank's rows of softmax(Q K^T / sqrt(d) + M) V. Every rank of ``group``
    must call it at the same time (forward and backward both communicate).
    """
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    local = q.shape[-2]
    validate_context_parallel(local * cp, cp, split)
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k and v must have the same (b, heads, s/cp, d) shape, got {q.shape}, {k.shape}, {v.shape}"
        )
    return _RingAttention.apply(q, k, v, token_positions(local * cp, cp, rank, split), group, split)


# ----------------------------------------------------------------------------------- measuring on ranks


def compare_ring_attention(
    *,
    batch: int = 2,
    heads: int = 4,
    seq_len: int = 64,
    head_dim: int = 16,
    splits: tuple[str, ...] = SPLITS,
    seed: int = 0,
) -> dict[str, dict]:
    """On every rank of the default group (run it with :func:`scalebook.dist.launch`): ring attention
    against :func:`causal_attention` on the whole sequence, for each split in ``splits``.

    Every rank draws the same Q, K, V and output gradient, computes the one-rank reference and ring
    attention on its own shard, gathers the shards and reports, per split, the largest deviations of the
    output and of the Q, K, V gradients, the calls and bytes this rank sent in the forward and backward
    passes, the bytes saved for backward (ring and reference) and the unmasked scores of every rank.
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
        with count_traffic() as forward:
            out = ring_attention(*mine, split=split)
        with count_traffic() as backward:
            out.backward(shard_sequence(grad_out, cp, rank, split=split))
        ring_saved = measure.saved_by_call(lambda *t, split=split: ring_attention(*t, split=split), *mine).total

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
            "unmasked_scores": unmasked_scores(seq_len, cp, split),
        }
    return results


def ring_attention_study(
    cps: tuple[int, ...] = (2, 4), *, seq_len: int = 64, timeout: float = 300.0, **kwargs
) -> dict[tuple[int, str], dict]:
    """Check every layout, then run :func:`compare_ring_attention` on ``cp`` fresh ranks for each ``cp``
    (one launch each). Returns rank 0's results keyed by ``(cp, split)``."""
    for cp in cps:
        for split in SPLITS:
            validate_context_parallel(seq_len, cp, split)
    results = {}
    for cp in cps:
        per_split = launch(compare_ring_attention, cp, seq_len=seq_len, timeout=timeout, **kwargs)[0]
        results.update({(cp, split): r for split, r in per_split.items()})
    return results
