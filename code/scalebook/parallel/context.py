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
The balance is real only if a rank skips what the mask hides, so the ring works on half-chunks: each
rank holds two of the 2 cp chunks, and at every step it meets two chunks of keys, four (query chunk,
key chunk) pairs. A pair whose keys all lie in the queries' future is skipped, a pair whose keys all
lie in their past is a plain block with no mask, and a chunk meeting itself is the causal triangle.
Zig-zag then computes 2 cp + 1 of the 4 cp pairs on every rank; the contiguous split 4 r + 3 on rank r.
Each step posts the send of the block it holds and the receive of the next before it computes, and
waits after: the transfer runs while the block is computed. ``skip_masked=False`` and ``overlap=False``
turn the two savings off (every pair computed, the future ones fully masked; each transfer waited for
before the block is computed): the naive ring the chapter measures them against.

In a training run, on the GPT (:class:`scalebook.model.GPT`):

1. ``apply_context_parallel(model, cp_group)`` sets every attention's ``core_attention`` to ring attention
   over ``cp_group`` (all other layers work token by token and need nothing from other ranks).
2. Every rank of a cp group gets the same (B, T) batch (T divisible by 2 cp) and keeps its share:
   ``idx, targets, positions = context_parallel_batch(idx, targets, cp_group)``, then
   ``logits, loss = model(idx, targets, positions=positions)``. The loss is the mean over this rank's
   B T / cp tokens.
3. Every rank holds the same number of tokens, so the global loss is the mean of the local losses over
   the dp x cp ranks. The ring's backward sends every key/value gradient home, so a rank's parameter
   gradient is that of its own loss through its own tokens plus the other cp ranks' losses through its
   keys and values; summed over the cp group it is the gradient of the sum of their losses. Hence:
   **average the parameters' gradients over the dp x cp ranks** (those with this rank's pp and tp
   coordinates; averaging over cp and then over dp is the same). The data-parallel wrapper does it if it
   spans dp x cp, as torchtitan's FSDP over its ``dp_shard_cp`` mesh. Log ``all_reduce(loss) / (dp cp)``
   over the same ranks.

Source: Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"; Dao et al. 2022, "FlashAttention" (online softmax, Sec. 3.1, and its backward, Appendix B);
Tazi et al. 2025, "The Ultra-Scale Playbook", "Context parallelism" (zig-zag load balancing).
"""

from __future__ import annotations

import functools
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from scalebook.accounting.context import ring_attention_bytes_per_rank

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
        chunks = 2 * cp  # zig-zag deals out 2 cp chunks; ring attention works on half of each rank's share
        if seq_len % chunks:
            problems.append(
                f"ring attention cuts the sequence into {chunks} equal chunks, so seq_len ({seq_len}) must be "
                f"divisible by {chunks}; use seq_len={max(chunks, seq_len // chunks * chunks)}"
            )
    if problems:
        raise ValueError("invalid context-parallel layout: " + "; ".join(problems))


def token_positions(seq_len: int, cp: int, rank: int, split: str = "zigzag", device=None) -> torch.Tensor:
    """The positions (in the full sequence) of the tokens rank ``rank`` holds, in the order it holds them, on
    ``device`` (the default device if None)."""
    validate_context_parallel(seq_len, cp, split)
    if split == "contiguous":
        return torch.arange(seq_len, device=device).chunk(cp)[rank]
    chunks = torch.arange(seq_len, device=device).chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, *, dim: int = -2, split: str = "zigzag") -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` along ``dim`` (a copy)."""
    return x.index_select(dim, token_positions(x.shape[dim], cp, rank, split, x.device)).clone()


def unshard_sequence(pieces: list[torch.Tensor], *, dim: int = -2, split: str = "zigzag") -> torch.Tensor:
    """Put every rank's tokens back in sequence order (the inverse of :func:`shard_sequence`)."""
    cp = len(pieces)
    seq_len = sum(p.shape[dim] for p in pieces)
    order = torch.cat([token_positions(seq_len, cp, r, split, pieces[0].device) for r in range(cp)])
    return torch.cat(pieces, dim=dim).index_select(dim, torch.argsort(order))


def half_blocks_per_rank(cp: int, split: str = "zigzag", *, skip_masked: bool = True) -> list[dict[str, int]]:
    """Per rank, the (query half-chunk, key half-chunk) pairs ring attention computes, in closed form.

    A rank meets 2 x 2 pairs at each of cp steps, 4 cp in all; it computes those with a key at or before
    a query. Zig-zag (chunks r and 2cp-1-r): (r + 1) + (2cp - r) = 2cp + 1 on every rank, two of them on
    the diagonal. Contiguous (chunks 2r and 2r+1): (2r + 1) + (2r + 2) = 4r + 3, from 3 to 4cp - 1.
    The rest are ``"skipped"``; with ``skip_masked=False`` they are computed and masked whole (``"masked"``).
    """
    validate_context_parallel(2 * cp, cp, split)
    computed = [2 * cp + 1 if split == "zigzag" else 4 * r + 3 for r in range(cp)]
    future = "skipped" if skip_masked else "masked"
    return [{"full": n - 2, "diagonal": 2, "masked": 0, "skipped": 0, future: 4 * cp - n} for n in computed]


def ring_attention_flops_per_rank(
    batch: int, heads: int, seq_len: int, head_dim: int, *, cp: int, split: str = "zigzag", skip_masked: bool = True
) -> list[dict[str, int]]:
    """Per rank, the matmul FLOPs of one ring-attention forward and backward pass, in closed form.

    A computed pair of half-chunks of n = s / (2 cp) tokens costs two n x n x d matmuls per head in the
    forward (S = Q K^T and P V: 4 b a n^2 d FLOPs) and five in the backward (S again, dV = P^T dO,
    dP = dO V^T, dQ = dS K, dK = dS^T Q: 10 b a n^2 d); a diagonal pair costs as much as a full one
    (the triangle is masked after the matmul). Returns ``[{"forward": ..., "backward": ...}, ...]``.
    """
    validate_context_parallel(seq_len, cp, split)
    n = seq_len // (2 * cp)
    pair = 2 * batch * heads * n * n * head_dim  # one n x n x d matmul per head and sequence
    return [
        {"forward": 2 * pair * (w["full"] + w["diagonal"] + w["masked"]),
         "backward": 5 * pair * (w["full"] + w["diagonal"] + w["masked"])}
        for w in half_blocks_per_rank(cp, split, skip_masked=skip_masked)
    ]  # fmt: skip


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
    A block is b a (s/cp) d values. Returns ``{"forward": ..., "backward": ...}``
    (:func:`scalebook.accounting.context.ring_attention_bytes_per_rank`, with fp32 by default)."""
    return ring_attention_bytes_per_rank(batch, heads, seq_len, head_dim, cp=cp, dtype_bytes=dtype_bytes)


# --------------------------------------------------------------------------------------- ring attention


def _ring_peers(group) -> tuple[int, int, int, int]:
    """(rank in the group, group size, global rank of the next and of the previous rank in the ring)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return rank, size, global_rank((rank + 1) % size), global_rank((rank - 1) % size)


def _start_pass(tensors: list[torch.Tensor], group, tag: int) -> tuple[list[torch.Tensor], list]:
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's (same shapes).

    Returns the receive buffers and the pending requests; the buffers are valid after :func:`_finish`.
    Nothing waits here, so the caller computes while the blocks travel.
    """
    _, _, next_rank, prev_rank = _ring_peers(group)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]  # q, k, v: views
    ops = []
    for i, (out, into) in enumerate(zip(tensors, received, strict=True)):
        ops.append(dist.P2POp(dist.isend, out.contiguous(), next_rank, group=group, tag=tag + i))
        ops.append(dist.P2POp(dist.irecv, into, prev_rank, group=group, tag=tag + i))
    # One batch: every rank sends before it receives, which NCCL (tags ignored, a rank's calls run in order)
    # completes only when the sends and receives are one group call (scalebook.comm.nccl_rules).
    return received, dist.batch_isend_irecv(ops)


def _pass_on(tensors: list[torch.Tensor], group, tag: int, overlap: bool, work: dict | None):
    """:func:`_start_pass`; without ``overlap`` also wait for it at once, as a ring that does not overlap would
    (then no request is left pending: gloo hangs in a second ``wait`` on a finished send)."""
    received, requests = _start_pass(tensors, group, tag)
    if overlap:
        return received, requests
    _finish(requests, work)
    return received, []


def _finish(works: list, work: dict | None = None) -> None:
    """Wait for a pass to arrive; the seconds spent waiting are added to ``work["seconds"]["wait"]``."""
    start = time.perf_counter()
    for request in works:
        request.wait()
    _clock(work, "wait", start)


def _chunks_of(cp: int, rank: int, split: str) -> tuple[int, int]:
    """The two chunks (of 2 cp equal chunks) a rank holds, in the order it holds them: r and 2cp-1-r
    under zig-zag, 2r and 2r+1 (its one contiguous piece, cut in half) under the contiguous split."""
    return (rank, 2 * cp - 1 - rank) if split == "zigzag" else (2 * rank, 2 * rank + 1)


def _pair_kind(q_chunk: int, k_chunk: int, skip_masked: bool = True) -> str:
    """How a (query half-chunk, key half-chunk) pair is computed under the causal mask."""
    if q_chunk > k_chunk:
        return "full"  # every key is in the past: a plain, unmasked block
    if q_chunk == k_chunk:
        return "diagonal"  # same chunk: the causal triangle
    return "skipped" if skip_masked else "masked"  # all keys in the future: skip, or compute and mask it all


def _block_scores(q: torch.Tensor, k: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if kind == "diagonal":
        n = q.shape[-2]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    elif kind == "masked":  # the naive ring's wasted block: computed, then hidden whole by the mask
        scores = scores.fill_(float("-inf"))
    return scores


def _count(work: dict | None, phase: str, kind: str) -> None:
    if work is not None:
        counts = work.setdefault(phase, {"full": 0, "diagonal": 0, "masked": 0, "skipped": 0})
        counts[kind] += 1


def _clock(work: dict | None, phase: str, start: float) -> None:
    """Add the seconds since ``start`` to ``work["seconds"][phase]``: computing (forward, backward) or waiting."""
    if work is not None:
        seconds = work.setdefault("seconds", {"forward": 0.0, "backward": 0.0, "wait": 0.0})
        seconds[phase] += time.perf_counter() - start


class _RingAttention(torch.autograd.Function):
    """Causal ring attention on half-chunk pairs. Each rank holds two half-chunks of queries, keys and
    values; at every ring step it meets two half-chunks of keys and values, so four (query, key) pairs:
    a pair entirely in the future is skipped, a pair entirely in the past is a plain block, and a pair
    on the diagonal is the causal triangle. The next block's send and receive are posted before the
    current block is computed and waited for after it. ``skip_masked`` and ``overlap`` (both True by
    default) switch the two savings off for comparison."""

    @staticmethod
    def forward(ctx, q, k, v, group, split, work, skip_masked=True, overlap=True):
        rank, cp, _, _ = _ring_peers(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        mine = _chunks_of(cp, rank, split)
        q_halves = q.chunk(2, dim=-2)
        # Per query half-chunk: running max m, running sum of exponentials l, running output o.
        m = [torch.full(h.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device) for h in q_halves]
        total = [torch.zeros(h.shape[:-1], dtype=q.dtype, device=q.device) for h in q_halves]
        acc = [torch.zeros_like(h) for h in q_halves]
        block_k, block_v = k, v
        for step in range(cp):
            pending = None
            if step < cp - 1:  # the next block starts travelling before this one is computed
                pending = _pass_on([block_k, block_v], group, 2 * step, overlap, work)
            theirs = _chunks_of(cp, (rank - step) % cp, split)
            start = time.perf_counter()
            for k_half, v_half, k_chunk in zip(block_k.chunk(2, dim=-2), block_v.chunk(2, dim=-2), theirs,
                                               strict=True):  # fmt: skip
                for i, q_chunk in enumerate(mine):
                    kind = _pair_kind(q_chunk, k_chunk, skip_masked)
                    _count(work, "forward", kind)
                    if kind == "skipped":
                        continue
                    scores = _block_scores(q_halves[i], k_half, kind, scale)
                    # Each query half meets its own chunk, diagonal, and a full pair first (step 0, first key
                    # half), so m is finite before any fully masked pair arrives and m_new stays finite.
                    m_new = torch.maximum(m[i], scores.amax(dim=-1))
                    rescale = torch.exp(m[i] - m_new)
                    p = torch.exp(scores - m_new.unsqueeze(-1))
                    total[i] = total[i] * rescale + p.sum(dim=-1)
                    acc[i] = acc[i] * rescale.unsqueeze(-1) + p @ v_half
                    m[i] = m_new
            _clock(work, "forward", start)
            if pending is not None:
                (block_k, block_v), works = pending
                _finish(works, work)
        out = torch.cat([a / t.unsqueeze(-1) for a, t in zip(acc, total, strict=True)], dim=-2)
        lse = torch.cat([mi + torch.log(t) for mi, t in zip(m, total, strict=True)], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.split, ctx.work, ctx.options = group, split, work, (skip_masked, overlap)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, split, work = ctx.group, ctx.split, ctx.work
        skip_masked, overlap = ctx.options
        rank, cp, _, _ = _ring_peers(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        mine = _chunks_of(cp, rank, split)
        q_halves, do_halves, lse_halves = q.chunk(2, dim=-2), grad_out.chunk(2, dim=-2), lse.chunk(2, dim=-1)
        # D_i = sum_d dO_id O_id: the softmax Jacobian's correction term, per query.
        correction = (grad_out * out).sum(dim=-1, keepdim=True).chunk(2, dim=-2)
        grad_q = [torch.zeros_like(h) for h in q_halves]
        block_k, block_v = k, v
        incoming = None  # the K/V gradients of the block this rank holds, accumulated by the ranks before it
        for step in range(cp):
            pending = None
            if step < cp - 1:
                pending = _pass_on([block_k, block_v], group, 1000 + 2 * step, overlap, work)
            theirs = _chunks_of(cp, (rank - step) % cp, split)
            start = time.perf_counter()
            part_k, part_v = [], []
            for k_half, v_half, k_chunk in zip(block_k.chunk(2, dim=-2), block_v.chunk(2, dim=-2), theirs,
                                               strict=True):  # fmt: skip
                grad_k_half, grad_v_half = torch.zeros_like(k_half), torch.zeros_like(v_half)
                for i, q_chunk in enumerate(mine):
                    kind = _pair_kind(q_chunk, k_chunk, skip_masked)
                    _count(work, "backward", kind)
                    if kind == "skipped":
                        continue
                    p = torch.exp(_block_scores(q_halves[i], k_half, kind, scale) - lse_halves[i].unsqueeze(-1))
                    grad_v_half += p.transpose(-2, -1) @ do_halves[i]
                    grad_scores = p * (do_halves[i] @ v_half.transpose(-2, -1) - correction[i])
                    grad_q[i] += grad_scores @ k_half * scale
                    grad_k_half += grad_scores.transpose(-2, -1) @ q_halves[i] * scale
                part_k.append(grad_k_half)
                part_v.append(grad_v_half)
            block_grad_k, block_grad_v = torch.cat(part_k, dim=-2), torch.cat(part_v, dim=-2)
            _clock(work, "backward", start)
            if incoming is not None:  # the earlier ranks' share of this block's gradients, sent last step
                (earlier_k, earlier_v), works = incoming
                _finish(works, work)
                block_grad_k, block_grad_v = block_grad_k + earlier_k, block_grad_v + earlier_v
            if cp > 1:
                # On to the block's next holder; after the last step that is the block's owner: home.
                incoming = _pass_on([block_grad_k, block_grad_v], group, 2000 + 2 * step, overlap, work)
            if pending is not None:
                (block_k, block_v), works = pending
                _finish(works, work)
        if cp > 1:
            (grad_k, grad_v), works = incoming
            _finish(works, work)
        else:
            grad_k, grad_v = block_grad_k, block_grad_v
        return torch.cat(grad_q, dim=-2), grad_k, grad_v, None, None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, split: str = "zigzag", work: dict | None = None,
    skip_masked: bool = True, overlap: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of this rank's queries over the whole sequence, with K/V passed round ``group``.

    ``q``, ``k``, ``v`` are (b, heads, s/cp, d): this rank's tokens as :func:`shard_sequence` gives them
    under ``split``. Returns this rank's rows of softmax(Q K^T / sqrt(d) + M) V. Every rank of ``group``
    must call it at the same time (forward and backward both communicate). If ``work`` is a dict, the
    (query half-chunk, key half-chunk) pairs this rank computes are counted into it, per pass and kind:
    ``work["forward"] == {"full": .., "diagonal": .., "masked": .., "skipped": ..}``, the same for
    ``"backward"``, and ``work["seconds"]`` adds up the time spent computing them (``"forward"``,
    ``"backward"``) and waiting for blocks (``"wait"``). ``skip_masked=False`` computes the pairs that lie
    entirely in the future and masks them whole; ``overlap=False`` waits for each transfer as soon as it is
    posted: the naive ring, for comparison (same result).
    """
    cp = dist.get_world_size(group)
    local = q.shape[-2]
    validate_context_parallel(local * cp, cp, split)
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k and v must have the same (b, heads, s/cp, d) shape, got {q.shape}, {k.shape}, {v.shape}"
        )
    for name, flag in (("skip_masked", skip_masked), ("overlap", overlap)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    return _RingAttention.apply(q, k, v, group, split, work, skip_masked, overlap)


# ------------------------------------------------------------------------------------- on the model


def apply_context_parallel(model: nn.Module, group=None, *, split: str = "zigzag") -> nn.Module:
    """Make every attention layer of ``model`` (each module with a ``core_attention`` slot, as
    :class:`scalebook.model.CausalSelfAttention`) run ring attention over ``group``, in place; returns ``model``.

    Feed it the tokens :func:`context_parallel_batch` gives this rank, with their positions. Raises a
    ValueError, before changing anything, for an unknown split, a model without attention layers, or
    attention dropout (ring attention has none).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    layers = [m for m in model.modules() if hasattr(m, "core_attention")]
    if not layers:
        raise ValueError("the model has no attention layer with a core_attention slot (scalebook.model.GPT has)")
    if any(getattr(m, "dropout", 0.0) for m in layers):
        raise ValueError("ring attention has no attention dropout: build the model with dropout=0")
    for layer in layers:
        layer.core_attention = functools.partial(ring_attention, group=group, split=split)
    return model


def context_parallel_batch(
    idx: torch.Tensor, targets: torch.Tensor | None, group=None, split: str = "zigzag"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This rank's tokens of a (B, T) batch that every rank of ``group`` holds whole, and their positions.

    Returns ``(idx_local, targets_local, positions)``: (B, T/cp), (B, T/cp) or None, and (T/cp,) positions
    in the full sequence, so that ``model(idx_local, targets_local, positions=positions)`` runs. Raises a
    ValueError if T does not split into 2 cp equal chunks.
    """
    if idx.dim() != 2:
        raise ValueError(f"idx must be a (batch, tokens) tensor, got shape {tuple(idx.shape)}")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    positions = token_positions(idx.shape[1], cp, rank, split, idx.device)
    mine = None if targets is None else targets.index_select(1, positions)
    return idx.index_select(1, positions), mine, positions
