"""Ulysses sequence parallelism: attention over a split sequence, by trading the split for a head split.

Every rank of a group of c holds s/c tokens of the queries, keys and values of all heads, as under ring
attention (:mod:`scalebook.parallel.context`). Heads are independent of each other, so one all-to-all
re-deals the tensors: rank r sends head group j of its tokens to rank j and receives head group r of every
rank's tokens. Afterwards each rank holds all s tokens of a/c query heads and n_kv/c key/value heads and
runs ordinary causal attention on them (any kernel: here PyTorch's ``scaled_dot_product_attention``, a
FlashAttention on GPUs); a second all-to-all deals the output back to the sequence split. The gradient of
an all-to-all is the reverse exchange, so the backward pass runs the same two all-to-alls in reverse
order and autograd needs no custom attention backward.

    sequence split (b, a, s/c, d)  --all-to-all-->  head split (b, a/c, s, d)  --attention-->
    head split (b, a/c, s, d)      --all-to-all-->  sequence split (b, a, s/c, d)

Each rank sends (c-1)/c of what it holds, twice per pass: (c-1)/c * b (s/c) d (2 a + 2 n_kv) values per
layer and pass (:func:`scalebook.accounting.context.ulysses_bytes_per_rank`), which falls as 1/c while the
ring's stays near 2 b s n_kv d. The price is the head constraint: c must divide a and n_kv, so grouped-query
attention with 8 K/V heads caps c at 8. Causal work is balanced by construction (each rank computes whole
sequences), whatever the token split; the chapter keeps the ranks' tokens in zig-zag order so that ring
attention and Ulysses take the same batch (:func:`scalebook.parallel.context.context_parallel_batch`).

Source: Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models"; DeepSpeed ``deepspeed/sequence/layer.py`` (``DistributedAttention``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scalebook.accounting.context import ulysses_problems
from scalebook.parallel.context import SPLITS, token_positions, validate_context_parallel
from scalebook.parallel.expert import all_to_all


def validate_ulysses(heads: int, kv_heads: int, seq_len: int, cp: int, split: str = "zigzag") -> None:
    """Raise one ValueError if ``cp`` ranks cannot share ``heads`` query and ``kv_heads`` key/value heads of a
    ``seq_len``-token sequence held in ``split`` order."""
    problems = ulysses_problems(heads, kv_heads, seq_len, cp)
    if not problems and heads % kv_heads:
        problems.append(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if not problems:
        try:
            validate_context_parallel(seq_len, cp, split)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError("invalid Ulysses layout: " + "; ".join(problems))


def _sequence_order(seq_len: int, cp: int, split: str, device) -> torch.Tensor:
    """The positions of the gathered sequence: rank 0's tokens, then rank 1's, ... in ``split`` order."""
    return torch.cat([token_positions(seq_len, cp, r, split, device) for r in range(cp)])


def sequence_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, h, s/c, d) with this rank's tokens of every head -> (b, h/c, s, d) with every rank's tokens of this
    rank's heads, the ranks' tokens one after the other (autograd-aware)."""
    b, h, local, d = x.shape
    cp = dist.get_world_size(group)
    # Row block j goes to rank j: head group j of my tokens. Received block j: my head group, rank j's tokens.
    received = all_to_all(x.reshape(b, cp, h // cp, local, d).transpose(0, 1), group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * local, d)


def heads_to_sequence(y: torch.Tensor, group=None) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`: (b, h/c, s, d) -> (b, h, s/c, d) (autograd-aware)."""
    b, heads_here, seq_len, d = y.shape
    cp = dist.get_world_size(group)
    # Row block j goes to rank j: its tokens of my heads. Received block j: head group j of my tokens.
    received = all_to_all(y.reshape(b, heads_here, cp, seq_len // cp, d).permute(2, 0, 1, 3, 4), group)
    return received.transpose(0, 1).reshape(b, cp * heads_here, seq_len // cp, d)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of whole sequences, (b, a, s, d) queries over (b, n_kv, s, d) keys and values."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, split: str = "zigzag", attention=causal_sdpa
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, by all-to-all over ``group``.

    ``q`` is (b, a, s/c, d) and ``k``, ``v`` are (b, n_kv, s/c, d): this rank's tokens, in ``split`` order
    (:func:`scalebook.parallel.context.shard_sequence`). Returns this rank's rows of softmax(Q K^T / sqrt(d)
    + M) V, (b, a, s/c, d). ``attention(q, k, v)`` runs on whole sequences in position order. Every rank of
    ``group`` must call it at the same time. Raises a ValueError, before communicating, if c does not divide
    a, n_kv or the sequence.
    """
    cp = dist.get_world_size(group)
    if q.dim() != 4 or k.shape != v.shape or k.shape[::2] != q.shape[::2] or q.shape[-2] != k.shape[-2]:
        raise ValueError(f"q must be (b, a, s/c, d) and k, v (b, n_kv, s/c, d), got {q.shape}, {k.shape}, {v.shape}")
    heads, kv_heads, seq_len = q.shape[1], k.shape[1], q.shape[-2] * cp
    validate_ulysses(heads, kv_heads, seq_len, cp, split)
    # One all-to-all for Q, K and V together: per rank, its a/c query heads then its n_kv/c K and V heads.
    b, _, local, d = q.shape
    packed = torch.cat([t.reshape(b, cp, t.shape[1] // cp, local, d) for t in (q, k, v)], dim=2)
    q_all, k_all, v_all = sequence_to_heads(packed.flatten(1, 2), group).split(
        [heads // cp, kv_heads // cp, kv_heads // cp], dim=1
    )
    order = _sequence_order(seq_len, cp, split, q.device)
    if split == "contiguous":
        out = attention(q_all, k_all, v_all)
    else:  # put the tokens in position order for the causal kernel, and back in the ranks' order after it
        to_positions = torch.argsort(order)
        q_all, k_all, v_all = (t.index_select(2, to_positions) for t in (q_all, k_all, v_all))
        out = attention(q_all, k_all, v_all).index_select(2, order)
    return heads_to_sequence(out, group)


def apply_ulysses(model: nn.Module, group=None, *, split: str = "zigzag") -> nn.Module:
    """Make every attention layer of ``model`` (each module with a ``core_attention`` slot, as
    :class:`scalebook.model.CausalSelfAttention`) run :func:`ulysses_attention` over ``group``, in place;
    returns ``model``. Feed it what :func:`scalebook.parallel.context.context_parallel_batch` gives this rank,
    and average the gradients over the dp x cp ranks, as with ring attention. Raises a ValueError, before
    changing anything, for an unknown split, a model without attention layers, attention dropout, or a
    head count that the group's size does not divide."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    layers = [m for m in model.modules() if hasattr(m, "core_attention")]
    if not layers:
        raise ValueError("the model has no attention layer with a core_attention slot (scalebook.model.GPT has)")
    if any(getattr(m, "dropout", 0.0) for m in layers):
        raise ValueError("Ulysses attention here has no attention dropout: build the model with dropout=0")
    cp = dist.get_world_size(group)
    for layer in layers:
        heads = layer.c_proj.in_features // layer.head_dim
        problems = ulysses_problems(heads, heads, 2 * cp, cp)
        if problems:
            raise ValueError("invalid Ulysses layout: " + "; ".join(problems))
    for layer in layers:
        layer.core_attention = functools.partial(ulysses_attention, group=group, split=split)
    return model
