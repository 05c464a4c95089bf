"""Context parallelism in closed form: the bytes ring attention and Ulysses send per layer, Ulysses' head
constraint, and the sequence length at which the ring's transfers hide behind its computation.

Each of ``c`` ranks holds s/c tokens of the queries (``a`` heads), keys and values (``n_kv`` heads) of a
b-sequence batch, heads ``d`` wide, ``e`` bytes per value.

**Ring attention** passes K and V blocks (b n_kv (s/c) d values each) to the next rank c - 1 times in the
forward; the backward passes K, V and their gradient blocks c - 1 times and the gradients once more, home:

    forward  2 (c-1) b n_kv (s/c) d e          backward (4 (c-1) + 2) b n_kv (s/c) d e

about 2 b s n_kv d e whatever c is: each rank sees every key and value once.

**Ulysses** (DeepSpeed-Ulysses) re-deals Q, K and V with one all-to-all, from s/c tokens of every head to
all s tokens of a/c heads, and deals the output back with a second one; an all-to-all keeps 1/c of what a
rank holds and sends the rest. The backward runs the two exchanges in reverse, with the same sizes:

    forward = backward = (c-1)/c * b (s/c) d (2 a + 2 n_kv) e

which falls as 1/c. It needs c to divide both a and n_kv (every rank gets whole heads).

**All-gather of K and V** (Llama 3's context parallelism) is neither: each rank all-gathers the keys and
values of the whole sequence and computes its own queries against them, with a zig-zag-like split of the
sequence into 2c chunks for causal balance. An all-gather sends every rank's share to the c - 1 others; the
backward gathers K and V again (keeping every layer's whole-sequence K and V would cost c times the ring's
memory) and reduce-scatters their gradients, as large:

    forward (c-1)/c * 2 b s n_kv d e          backward 2 (c-1)/c * 2 b s n_kv d e

the ring's forward volume exactly, and 2 blocks fewer than its backward, but each as one collective next to
attention, exposed. It is cheap under grouped-query
attention (n_kv much smaller than a) and takes any attention mask (document masks) and any c.

**Overlap.** A zig-zag rank computes about half of each arriving block, 4 b a (s/c)^2 d / 2 FLOPs in the
forward, while the next K and V blocks, 2 b n_kv (s/c) d e bytes, cross one link. At P FLOP/s and B bytes/s
the transfer hides behind the computation once

    s/c >= n_kv e P / (a B)

tokens per rank (the backward computes 2.5 times more per block and sends twice as much, so it hides
earlier). Ulysses' all-to-alls sit between the projections and attention, with nothing to hide behind.

Source: Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"; Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models" (Sec. 3.2, communication analysis); Grattafiori et al. 2024, "The Llama 3
Herd of Models" (Sec. 3.3.2, context parallelism).
"""

from __future__ import annotations

from scalebook.accounting import _checks


def _shape_problems(batch, heads, seq_len, head_dim, cp, kv_heads, dtype_bytes) -> list[str]:
    problems = _checks.positive_int(
        batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, cp=cp, kv_heads=kv_heads, dtype_bytes=dtype_bytes
    )
    if not problems and heads % kv_heads:
        problems.append(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}): each K/V head serves a group")
    return problems


def ulysses_problems(heads: int, kv_heads: int, seq_len: int, cp: int) -> list[str]:
    """Why Ulysses cannot run ``heads`` query and ``kv_heads`` key/value heads of a ``seq_len``-token sequence on
    ``cp`` ranks, as sentences (empty if it can): every rank must get whole heads and equal token shares."""
    problems = _checks.positive_int(heads=heads, kv_heads=kv_heads, seq_len=seq_len, cp=cp)
    if problems:
        return problems
    for name, count in (("heads", heads), ("kv_heads", kv_heads)):
        if count % cp:
            divisors = [c for c in range(1, count + 1) if count % c == 0]
            problems.append(f"Ulysses gives each rank {name}/cp whole heads, so cp ({cp}) must divide {name} "
                            f"({count}); use cp in {divisors} or ring attention")  # fmt: skip
    if seq_len % cp:
        problems.append(f"seq_len ({seq_len}) must be divisible by cp ({cp})")
    return problems


def ring_attention_bytes_per_rank(
    batch: int, heads: int, seq_len: int, head_dim: int, *, cp: int, kv_heads: int | None = None, dtype_bytes: int = 2
) -> dict[str, int]:
    """Bytes each rank sends in one ring-attention layer, ``{"forward": ..., "backward": ...}`` (module docstring)."""
    kv_heads = heads if kv_heads is None else kv_heads
    _checks.require(_shape_problems(batch, heads, seq_len, head_dim, cp, kv_heads, dtype_bytes))
    if cp == 1:
        return {"forward": 0, "backward": 0}
    block = batch * kv_heads * (seq_len // cp) * head_dim * dtype_bytes
    return {"forward": 2 * (cp - 1) * block, "backward": (4 * (cp - 1) + 2) * block}


def kv_allgather_bytes_per_rank(
    batch: int, heads: int, seq_len: int, head_dim: int, *, cp: int, kv_heads: int | None = None, dtype_bytes: int = 2
) -> dict[str, float]:
    """Bytes each rank sends in one layer of Llama 3's all-gather context parallelism, ``{"forward": ...,
    "backward": ...}``: (c-1)/c * 2 b s n_kv d e forward, twice that backward (module docstring)."""
    kv_heads = heads if kv_heads is None else kv_heads
    _checks.require(_shape_problems(batch, heads, seq_len, head_dim, cp, kv_heads, dtype_bytes))
    gathered = (cp - 1) / cp * 2 * batch * seq_len * kv_heads * head_dim * dtype_bytes
    return {"forward": gathered, "backward": 2 * gathered}


def ulysses_bytes_per_rank(
    batch: int, heads: int, seq_len: int, head_dim: int, *, cp: int, kv_heads: int | None = None, dtype_bytes: int = 2
) -> dict[str, float]:
    """Bytes each rank sends in one Ulysses attention layer, ``{"forward": ..., "backward": ...}`` (module
    docstring). Raises a ValueError if ``cp`` does not divide the heads, the K/V heads or the sequence."""
    kv_heads = heads if kv_heads is None else kv_heads
    _checks.require(_shape_problems(batch, heads, seq_len, head_dim, cp, kv_heads, dtype_bytes))
    _checks.require(ulysses_problems(heads, kv_heads, seq_len, cp))
    held = batch * (seq_len // cp) * head_dim * (2 * heads + 2 * kv_heads) * dtype_bytes  # Q, K, V and the output
    sent = (cp - 1) * held / cp
    return {"forward": sent, "backward": sent}


def ring_overlap_min_tokens(
    heads: int, *, kv_heads: int | None = None, dtype_bytes: int = 2, flops: float, bandwidth: float
) -> float:
    """Tokens per rank, s/c, from which a ring step's forward computation (at ``flops`` FLOP/s) takes at least
    as long as passing the next K/V block over a link of ``bandwidth`` bytes/s: n_kv e P / (a B)."""
    kv_heads = heads if kv_heads is None else kv_heads
    _checks.require(
        _checks.positive_int(heads=heads, kv_heads=kv_heads, dtype_bytes=dtype_bytes),
        _checks.positive(flops=flops, bandwidth=bandwidth),
    )
    return kv_heads * dtype_bytes * flops / (heads * bandwidth)
