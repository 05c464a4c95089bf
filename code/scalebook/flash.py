"""FlashAttention-2 in plain PyTorch: attention computed tile by tile, never holding the s x s matrix.

The softmax of a row of scores x_1..x_n needs its maximum and its normaliser before any weight is
known. The **online softmax** keeps both as running values over blocks of columns. After block j,

    m_j = max(m_{j-1}, max(x in block j))                          (running maximum)
    l_j = l_{j-1} exp(m_{j-1} - m_j) + sum(exp(x - m_j), x in block j)   (running sum, rescaled)

so that at the end softmax(x)_i = exp(x_i - m) / l, and log-sum-exp(x) = m + log l. The output
O = softmax(S) V is rescaled the same way: acc_j = acc_{j-1} exp(m_{j-1} - m_j) + exp(S_j - m_j) V_j, and
O = acc / l. :func:`flash_attention_forward` runs this for each tile of ``block_q`` queries over the
tiles of ``block_k`` keys and values (FlashAttention-2, Algorithm 1), and keeps only O and one
log-sum-exp L per query row. :func:`flash_attention_backward` recomputes each tile of weights from L,
P = exp(S - L), instead of reading a stored P (Algorithm 2):

    dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = P * (dP - D_i),  dQ_i += dS K_j,  dK_j += dS^T Q_i

with D = rowsum(dO * O) and the softmax scale applied to dS. With ``causal=True`` a tile that lies
wholly above the diagonal (every key after every query) is skipped, and only tiles that straddle it
are masked. :class:`FlashAttention` wraps the two as a ``torch.autograd.Function``: what it saves for
backward is q, k, v, O and L, O(s) per head against the explicit path's O(s^2).

On a GPU a tile lives in an SM's shared memory (SRAM); :func:`flash_block_sizes` is the paper's choice of
tile size for a given SRAM, and :func:`attention_hbm_bytes` the bytes each algorithm moves to and from
HBM: 4 N d + 4 N^2 numbers for standard attention, 2 N d + 2 N^2 d / B_r for FlashAttention-2's loop with
query tiles of B_r rows (2 N^2 with B_r = d, the 128-row tiles of the released kernels for d = 128).
Theorem 2 of Dao et al. 2022, Theta(N^2 d^2 / M) with M elements of SRAM, bounds FlashAttention-1's loop
order (K and V tiles of M / 4d rows resident, Q and O streamed past each), not this one. The forward here
tallies the bytes of every tile it reads and writes (:class:`HBMTraffic`), so the second formula can be
checked against what the loop does.

Source: Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
Algorithms 0 and 1, Theorem 2; Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and
Work Partitioning", Algorithms 1 and 2; Milakov and Gimelshein 2018, "Online normalizer calculation for
softmax".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import _check_attention_inputs
from .configs import Hardware

FLASH_IMPLS = ("standard", "flash")


def online_softmax_stats(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running maximum m and running sum l of exp(x - m) over the last dimension, ``block`` columns at a time.

    One pass, with each block seen once: softmax(x) = exp(x - m) / l and logsumexp(x) = m + log(l).
    """
    _check_block("block", block)
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    ell = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], block):
        chunk = x[..., start : start + block]
        m_new = torch.maximum(m, chunk.amax(dim=-1))
        ell = ell * torch.exp(m - m_new) + torch.exp(chunk - m_new[..., None]).sum(dim=-1)
        m = m_new
    return m, ell


@dataclass
class HBMTraffic:
    """Bytes a tiled kernel reads from and writes to the full tensors (HBM on a GPU), tallied per tile."""

    read: int = 0
    written: int = 0

    @property
    def total(self) -> int:
        return self.read + self.written


def _check_block(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (a tile size in positions), got {value!r}")


def _check_flash_inputs(q, k, v, causal, block_q, block_k) -> None:
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    _check_attention_inputs(q, k, v, None, causal, 0.0)
    if not q.dtype == k.dtype == v.dtype or not q.is_floating_point():
        raise ValueError(
            f"q, k and v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first"
        )


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulators and the log-sum-exp: float32 for 16-bit inputs (as the CUDA kernels do), else the input's."""
    return torch.promote_types(dtype, torch.float32)


def _blocks(n: int, block: int):
    """The slices [0, block), [block, 2 block), ... covering range(n); the last may be shorter."""
    return [slice(start, min(start + block, n)) for start in range(0, n, block)]


def _causal_tile(qs: slice, ks: slice, causal: bool) -> bool | None:
    """None if the tile is wholly masked (every key after every query), else whether it needs a mask."""
    if not causal:
        return False
    if ks.start > qs.stop - 1:
        return None
    return ks.stop - 1 > qs.start


def _scores(q_tile, k_tile, qs, ks, straddles, scale):
    s = (q_tile @ k_tile.transpose(-2, -1)) * scale
    if straddles:
        rows = torch.arange(qs.start, qs.stop, device=s.device)[:, None]
        cols = torch.arange(ks.start, ks.stop, device=s.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    scale: float | None = None,
    traffic: HBMTraffic | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O = softmax(q k^T * scale) v and L = logsumexp of each score row, one (query, key) tile at a time.

    q (..., L, d), k (..., S, d), v (..., S, d_v); returns O (..., L, d_v) in q's dtype and L (..., L) in
    float32 (float64 for float64 inputs). ``traffic``, if given, accumulates the bytes of every tile read
    from q, k, v and written to O and L.
    """
    _check_flash_inputs(q, k, v, causal, block_q, block_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc_dtype = _stats_dtype(q.dtype)
    lead, n_q = q.shape[:-2], q.shape[-2]
    o = torch.empty((*lead, n_q, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((*lead, n_q), dtype=acc_dtype, device=q.device)
    for qs in _blocks(n_q, block_q):
        q_tile = q[..., qs, :].to(acc_dtype)
        m = torch.full((*lead, q_tile.shape[-2]), float("-inf"), dtype=acc_dtype, device=q.device)
        ell = torch.zeros_like(m)
        acc = torch.zeros((*lead, q_tile.shape[-2], v.shape[-1]), dtype=acc_dtype, device=q.device)
        for ks in _blocks(k.shape[-2], block_k):
            straddles = _causal_tile(qs, ks, causal)
            if straddles is None:  # this and every later key tile are above the diagonal
                break
            k_tile, v_tile = k[..., ks, :].to(acc_dtype), v[..., ks, :].to(acc_dtype)
            s = _scores(q_tile, k_tile, qs, ks, straddles, scale)
            m_new = torch.maximum(m, s.amax(dim=-1))  # finite: a row's first tile holds key 0
            rescale = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            ell = ell * rescale + p.sum(dim=-1)
            acc = acc * rescale[..., None] + p @ v_tile
            m = m_new
            if traffic is not None:
                traffic.read += k[..., ks, :].nbytes + v[..., ks, :].nbytes
        o[..., qs, :] = (acc / ell[..., None]).to(q.dtype)
        lse[..., qs] = m + torch.log(ell)
        if traffic is not None:
            traffic.read += q[..., qs, :].nbytes
            traffic.written += o[..., qs, :].nbytes + lse[..., qs].nbytes
    return o, lse


def flash_attention_backward(
    grad_o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of :func:`flash_attention_forward`, recomputing each tile of weights P = exp(S - L).

    The outer loop runs over key tiles, so dK_j and dV_j are finished in one pass each (Algorithm 2);
    dQ is accumulated across them.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc_dtype = lse.dtype
    q_, k_, v_, o_, do = (t.to(acc_dtype) for t in (q, k, v, o, grad_o))
    d_rows = (do * o_).sum(dim=-1)  # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij
    dq = torch.zeros_like(q_)
    dk, dv = torch.zeros_like(k_), torch.zeros_like(v_)
    for ks in _blocks(k.shape[-2], block_k):
        k_tile, v_tile = k_[..., ks, :], v_[..., ks, :]
        for qs in _blocks(q.shape[-2], block_q):
            straddles = _causal_tile(qs, ks, causal)
            if straddles is None:
                continue
            s = _scores(q_[..., qs, :], k_tile, qs, ks, straddles, scale)
            p = torch.exp(s - lse[..., qs, None])  # the softmax weights, recomputed from L
            dv[..., ks, :] += p.transpose(-2, -1) @ do[..., qs, :]
            dp = do[..., qs, :] @ v_tile.transpose(-2, -1)
            ds = p * (dp - d_rows[..., qs, None]) * scale  # softmax's Jacobian, then the scale of S
            dq[..., qs, :] += ds @ k_tile
            dk[..., ks, :] += ds.transpose(-2, -1) @ q_[..., qs, :]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttention(torch.autograd.Function):
    """Tiled attention whose backward recomputes the weights: saves q, k, v, O and L, never P."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block_q, block_k, scale):
        o, lse = flash_attention_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = dict(causal=causal, block_q=block_q, block_k=block_k, scale=scale)
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(grad_o, q, k, v, o, lse, **ctx.options)
        return dq, dk, dv, None, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v, differentiable, computed in (block_q x block_k) tiles.

    The same call as ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` without a
    mask or dropout; q (..., L, d), k (..., S, d), v (..., S, d_v). Tile sizes need not divide L or S.
    """
    _check_flash_inputs(q, k, v, causal, block_q, block_k)
    return FlashAttention.apply(q, k, v, causal, block_q, block_k, scale)


def flash_block_sizes(hardware: Hardware, head_dim: int, *, dtype_bytes: int = 2) -> tuple[int, int]:
    """(B_r, B_c): FlashAttention's tile sizes for one SM's shared memory, M = smem / dtype_bytes numbers.

    Algorithm 1, line 1: B_c = floor(M / 4d) so that the four tiles K_j, V_j (B_c x d) and Q_i, O_i
    (B_r x d) fit in M together, and B_r = min(B_c, d). (The paper writes ceil; floor is what fits.)
    """
    _check_block("head_dim", head_dim)
    _check_block("dtype_bytes", dtype_bytes)
    if hardware.smem_per_sm_bytes is None:
        raise ValueError(f"{hardware.name} has no smem_per_sm_bytes in scalebook.configs; pick a GPU that has")
    sram_numbers = hardware.smem_per_sm_bytes // dtype_bytes
    block_c = sram_numbers // (4 * head_dim)
    if block_c < 1:
        raise ValueError(f"head_dim {head_dim} is too wide for {hardware.smem_per_sm_bytes:,} bytes of SRAM")
    return min(block_c, head_dim), block_c


def attention_hbm_bytes(
    seq_len: int, head_dim: int, *, impl: str, block_q: int | None = None, dtype_bytes: int = 2, lse_bytes: int = 4
) -> int:
    """Bytes one head's forward pass moves between HBM and the chip, without a causal mask.

    ``standard`` (Dao et al. 2022, Algorithm 0): read Q, K and write S; read S and write P; read P, V and
    write O: (4 N d + 4 N^2) numbers. ``flash`` (FlashAttention-2's loop, as
    :func:`flash_attention_forward` runs it): Q read and O written once, K and V read once per query tile,
    T_r = ceil(N / B_r) times, and one log-sum-exp written per row: (2 N d + 2 T_r N d) numbers plus N L's.
    With B_r = d (what :func:`flash_block_sizes` gives while d <= M / 4d) the K, V term is 2 N^2 numbers,
    half of standard attention's 4 N^2.
    """
    if impl not in FLASH_IMPLS:
        raise ValueError(f"impl must be one of {FLASH_IMPLS}, got {impl!r}")
    for name, value in (("seq_len", seq_len), ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        _check_block(name, value)
    n, d = seq_len, head_dim
    if impl == "standard":
        return (4 * n * d + 4 * n * n) * dtype_bytes
    _check_block("block_q (the flash tile size)", block_q)
    query_tiles = -(-n // block_q)
    return (2 * n * d + 2 * query_tiles * n * d) * dtype_bytes + n * lse_bytes
