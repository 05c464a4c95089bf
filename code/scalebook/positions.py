"""Four ways to tell a Transformer where each token is: learned, sinusoidal, rotary and ALiBi positions.

Attention compares every token with every other one and is blind to their order, so position has to
be injected. Four schemes, in historical order:

- **Learned absolute** (GPT-2, BERT): a trainable table of ``max_seq_len x d_model`` vectors, one per
  position, added to the token embeddings. ``scalebook.model.GPT`` uses one (its ``wpe``).
- **Sinusoidal** (Vaswani et al. 2017): a fixed table, added the same way, with no parameters::

      PE(pos, 2i)   = sin(pos / base^(2i/d))
      PE(pos, 2i+1) = cos(pos / base^(2i/d))          base = 10000

- **Rotary, RoPE** (Su et al. 2021; Llama, Mistral, Qwen...): nothing is added to the embeddings;
  instead each query and key vector is rotated inside attention, pair of dimensions j by the angle
  ``pos * theta_j`` with ``theta_j = base^(-2j/d)``. Rotations preserve norms, and the dot product
  of a query rotated to position m with a key rotated to position n depends only on m - n.
- **ALiBi** (Press et al. 2022; BLOOM, MPT): nothing is added or rotated; each head adds a fixed
  penalty ``-m_k * (i - j)`` to the score of query i for key j <= i, linear in the distance, with
  a slope m_k per head from a geometric sequence (:func:`alibi_slopes`, :func:`alibi_bias`).

Layout convention for RoPE: **rotate-half**, as in Hugging Face's Llama and GPT-NeoX. Dimension j is
paired with dimension j + d/2 (not with j + 1), and ``cos``/``sin`` hold the d/2 angles twice,
``[a_0 .. a_{d/2-1}, a_0 .. a_{d/2-1}]``. RoFormer and Meta's original Llama code pair neighbouring
dimensions (2j, 2j + 1) instead ("interleaved"); the two are the same rotation after permuting the
dimensions with :func:`interleaved_to_half_permutation`, which is why Hugging Face's conversion script
permutes the rows of W_Q and W_K when it imports Meta's checkpoints.

Angles are computed in float32 even when the result is wanted in bfloat16 or float16: a bfloat16
position is exact only up to 256, beyond which neighbouring positions would share an angle. (float64
is kept when asked for, to check the algebra without rounding.)

Source: Vaswani et al. 2017, "Attention Is All You Need", Sec. 3.5; Su et al. 2021, "RoFormer:
Enhanced Transformer with Rotary Position Embedding", Sec. 3.4; Press, Smith and Lewis 2022, "Train Short,
Test Long: Attention with Linear Biases Enables Input Length Extrapolation", Sec. 3; Hugging Face
transformers, ``models/llama/modeling_llama.py`` (``LlamaRotaryEmbedding``, ``rotate_half``,
``apply_rotary_pos_emb``) and ``models/bloom/modeling_bloom.py`` (``build_alibi_tensor``).
"""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_BASE = 10000.0


def _check_shape(seq_len: int, dim: int, base: float, dim_name: str) -> None:
    problems = []
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        problems.append(f"seq_len must be a positive integer, got {seq_len!r}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 2 or dim % 2:
        problems.append(
            f"{dim_name} must be a positive even integer (dimensions come in sin/cos or rotation pairs), "
            f"got {dim!r}"
        )
    if not isinstance(base, (int, float)) or isinstance(base, bool) or not base > 1:
        problems.append(f"base must be a number greater than 1 (10000 in most models), got {base!r}")
    if problems:
        raise ValueError("; ".join(problems))


def _angle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def inverse_frequencies(
    dim: int, base: float = DEFAULT_BASE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The dim/2 angular frequencies theta_j = base^(-2j/dim), from 1 rad/position down to ~1/base."""
    _check_shape(1, dim, base, "dim")
    exponents = torch.arange(0, dim, 2, dtype=dtype) / dim
    return 1.0 / (base**exponents)


def position_angles(seq_len: int, dim: int, base: float = DEFAULT_BASE, dtype: torch.dtype = torch.float32):
    """(seq_len, dim/2) angles pos * theta_j, the argument of every sine and cosine below."""
    _check_shape(seq_len, dim, base, "dim")
    dtype = _angle_dtype(dtype)
    positions = torch.arange(seq_len, dtype=dtype)
    return torch.outer(positions, inverse_frequencies(dim, base, dtype))


def sinusoidal_positions(
    seq_len: int, d_model: int, base: float = DEFAULT_BASE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The (seq_len, d_model) table of Vaswani et al.: sin in the even columns, cos in the odd ones."""
    _check_shape(seq_len, d_model, base, "d_model")
    angles = position_angles(seq_len, d_model, base, dtype)
    # Stacking on a new last axis and flattening interleaves the columns: sin_0, cos_0, sin_1, cos_1, ...
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).to(dtype)


class LearnedPositions(nn.Module):
    """A trainable vector per position, as GPT-2's ``wpe``: ``max_seq_len * d_model`` parameters.

    ``forward(seq_len)`` returns the first ``seq_len`` rows. The table simply has no row for a
    position it was not built with, so a longer sequence is an error rather than an extrapolation.
    """

    def __init__(self, max_seq_len: int, d_model: int):
        super().__init__()
        for name, value in (("max_seq_len", max_seq_len), ("d_model", d_model)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.max_seq_len = max_seq_len
        self.table = nn.Embedding(max_seq_len, d_model)
        nn.init.normal_(self.table.weight, mean=0.0, std=0.02)  # GPT-2's initialisation

    def forward(self, seq_len: int) -> torch.Tensor:
        if not isinstance(seq_len, int) or not 1 <= seq_len <= self.max_seq_len:
            raise ValueError(
                f"seq_len must be an integer in [1, {self.max_seq_len}] (the rows of this table), got "
                f"{seq_len!r}; learned positions cannot extrapolate: build the table with a larger "
                "max_seq_len"
            )
        return self.table(torch.arange(seq_len, device=self.table.weight.device))


def rope_cache(
    seq_len: int, head_dim: int, base: float = DEFAULT_BASE, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles, each (seq_len, head_dim), in the rotate-half layout.

    Row m holds position m: ``[a_0 .. a_{h/2-1}, a_0 .. a_{h/2-1}]`` with ``a_j = m * base^(-2j/h)``.
    Index the rows (``cos[positions]``) to rotate tokens at positions other than 0, 1, 2, ...
    """
    _check_shape(seq_len, head_dim, base, "head_dim")
    angles = position_angles(seq_len, head_dim, base, dtype)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the halves of the last axis: a 90-degree turn of each pair (j, j + h/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys ``x`` of shape (batch, heads, seq, head_dim) by their positions' angles.

    ``cos`` and ``sin`` are (seq, head_dim), row t for the token at index t of ``x`` (from
    :func:`rope_cache`, sliced or indexed to the positions wanted). Each pair (x_j, x_{j+h/2}) turns by
    its angle a: (x_j cos a - x_{j+h/2} sin a, x_{j+h/2} cos a + x_j sin a).
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"x must be a (batch, heads, seq, head_dim) tensor, got {shape}; for one head, use x[None, None]"
        )
    seq, head_dim = x.shape[-2:]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs of dimensions), got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor) or tuple(table.shape) != (seq, head_dim):
            shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
            raise ValueError(
                f"{name} must have shape (seq, head_dim) = ({seq}, {head_dim}) to match x, got {shape}; "
                f"slice the cache to the positions of x, e.g. {name}[:{seq}]"
            )
    return x * cos + rotate_half(x) * sin


def interleaved_to_half_permutation(head_dim: int) -> torch.Tensor:
    """Indices that reorder interleaved pairs (0,1), (2,3), ... into rotate-half pairs (0, h/2), (1, h/2+1).

    ``x[..., perm]`` puts the even dimensions first and the odd ones second, so interleaved RoPE on
    ``x`` equals rotate-half RoPE on ``x[..., perm]``, permuted back.
    """
    _check_shape(1, head_dim, DEFAULT_BASE, "head_dim")
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes m_1 .. m_n (float32): ``m_k = 2^(-8k/n)`` when n is a power of two.

    For n = 8: 1/2, 1/4, ..., 1/256. For other head counts (BLOOM's 112, for example) Press et al. take
    the slopes of the largest power of two below, n' (``2^(-8k/n')``), and fill the other n - n' heads
    with every second slope of the sequence for 2 n' heads, the odd ones ``2^(-8(2j-1)/(2n'))``: the
    extra heads fall between the first ones instead of all being steep or all flat.
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}")
    n_pow2 = 1 << (n_heads.bit_length() - 1)  # the largest power of two <= n_heads
    slopes = [2.0 ** (-8.0 * k / n_pow2) for k in range(1, n_pow2 + 1)]
    slopes += [2.0 ** (-8.0 * k / (2 * n_pow2)) for k in range(1, 2 * (n_heads - n_pow2), 2)]
    # The exponents are exact in float64, so each slope is rounded once, to the nearest float32.
    return torch.tensor(slopes, dtype=torch.float64).float()


def alibi_bias(n_heads: int, seq_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (n_heads, seq_len, seq_len) causal ALiBi bias to add to the attention scores q.k / sqrt(d_h).

    Entry [k, i, j] is ``-m_k * (i - j)`` for a key j at or before the query i, and ``-inf`` for a key
    after it (the causal mask, folded in), so ``softmax(scores + bias)`` is causal ALiBi attention; it
    can be passed as ``attn_mask`` to ``torch.nn.functional.scaled_dot_product_attention``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    positions = torch.arange(seq_len)
    distance = positions[:, None] - positions[None, :]  # i - j, negative above the diagonal
    bias = -alibi_slopes(n_heads)[:, None, None] * distance.float()
    return bias.masked_fill(distance < 0, float("-inf")).to(dtype)
