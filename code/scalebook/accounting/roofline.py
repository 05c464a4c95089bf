"""The roofline: arithmetic intensity of each operator of a GPT layer, and the ridge point of a device.

An operator that performs F FLOPs and must move at least Q bytes between memory and the chip (read
each input once, write each output once) has arithmetic intensity I = F / Q. A device with peak P
FLOP/s and memory bandwidth B bytes/s runs it at best at

    attainable FLOP/s = min(P, I B),      ridge point I* = P / B

so an operator below the ridge is memory-bound (bandwidth sets its time, Q / B) and one above it is
compute-bound (F / P). For one GPT layer's forward pass on b sequences of s tokens, width h, a heads,
n = b s tokens, p bytes per element (``dtype_bytes``):

    operator               FLOPs          minimum bytes / p                 intensity for n >> h
    QKV projection         6 n h^2        n h + 3 h^2 + 3 n h               ~ 1.5 h / p
    attention scores QK^T  2 n s h        2 n h + a b s^2                   ~ 2 h / (a p) = 2 d_head / p
    softmax                5 a b s^2      2 a b s^2                         5 / (2 p)
    attention P V          2 n s h        a b s^2 + 2 n h                   ~ 2 d_head / p
    output projection      2 n h^2        2 n h + h^2                       ~ h / p
    MLP up (h -> 4h)       8 n h^2        n h + 4 h^2 + 4 n h               ~ 1.6 h / p
    GELU                   8 * 4 n h      2 * 4 n h                         4 / p
    MLP down (4h -> h)     8 n h^2        4 n h + 4 h^2 + n h               ~ 1.6 h / p
    LayerNorm (x2)         8 n h          2 n h + 2 h                       4 / p
    residual add (x2)      n h            3 n h                             1 / (3 p)

The matrix multiplies' FLOPs are exact (2 per multiply-add, as ``FlopCounterMode`` counts them); the
element-wise operators' are a convention, since no counter counts them: softmax 5 per score (max,
subtract, exp, sum, divide), GELU 8 per element (its tanh form), LayerNorm 8 per element (mean,
variance, normalize, scale and shift), add 1. Any such count leaves them far below every ridge. Biases,
dropout and the attention mask are left out. Attention's QK^T and P V fall to an intensity of about
d_head / p once the a s^2 scores dominate the traffic, which is why FlashAttention never writes the
scores to memory (Ch. 4).

Source: Williams, Waterman and Patterson 2009, "Roofline: An Insightful Visual Performance Model for
Multicore Architectures", CACM 52(4); Austin et al. 2025, "How to Scale Your Model", "All About
Rooflines"; Dao et al. 2022, "FlashAttention", Sec. 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalebook.accounting import _checks

# FLOPs per element of the element-wise operators (see the module docstring): a convention.
ELEMENTWISE_FLOPS = {"softmax": 5, "GELU": 8, "LayerNorm": 8, "residual add": 1}


@dataclass(frozen=True)
class OpCost:
    """One operator's FLOPs and the fewest bytes it must move, and how often a layer runs it."""

    name: str
    flops: int
    bytes: int
    per_layer: int = 1
    matmul: bool = False  # a matrix multiply (FLOPs exact) rather than element-wise (FLOPs a convention)

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved."""
        return self.flops / self.bytes


def matmul_cost(name: str, m: int, k: int, n: int, *, batch: int = 1, dtype_bytes: int = 2) -> OpCost:
    """``batch`` products (m x k) @ (k x n): 2 m k n FLOPs each; read both operands, write the result."""
    _checks.require(_checks.positive_int(m=m, k=k, n=n, batch=batch, dtype_bytes=dtype_bytes))
    return OpCost(name, 2 * batch * m * k * n, batch * (m * k + k * n + m * n) * dtype_bytes, matmul=True)


def _weight_matmul(name: str, tokens: int, d_in: int, d_out: int, p: int) -> OpCost:
    # The activations (tokens x d_in) times one weight matrix (d_in x d_out), shared by every token.
    return OpCost(name, 2 * tokens * d_in * d_out, (tokens * d_in + d_in * d_out + tokens * d_out) * p, matmul=True)


def gpt_layer_ops(batch: int, seq_len: int, d_model: int, n_heads: int, *, dtype_bytes: int = 2) -> list[OpCost]:
    """The operators of one GPT layer's forward pass, in execution order, with FLOPs and minimum bytes."""
    _checks.require(
        _checks.positive_int(batch=batch, seq_len=seq_len, d_model=d_model, n_heads=n_heads, dtype_bytes=dtype_bytes)
    )
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
    b, s, h, a, p = batch, seq_len, d_model, n_heads, dtype_bytes
    n, scores, d_head = b * s, a * b * s * s, d_model // n_heads
    elementwise = ELEMENTWISE_FLOPS
    return [
        OpCost("LayerNorm", elementwise["LayerNorm"] * n * h, (2 * n * h + 2 * h) * p, per_layer=2),
        _weight_matmul("QKV projection", n, h, 3 * h, p),
        matmul_cost("attention scores QK^T", s, d_head, s, batch=a * b, dtype_bytes=p),
        OpCost("softmax", elementwise["softmax"] * scores, 2 * scores * p),
        matmul_cost("attention P V", s, s, d_head, batch=a * b, dtype_bytes=p),
        _weight_matmul("output projection", n, h, h, p),
        OpCost("residual add", elementwise["residual add"] * n * h, 3 * n * h * p, per_layer=2),
        _weight_matmul("MLP up", n, h, 4 * h, p),
        OpCost("GELU", elementwise["GELU"] * 4 * n * h, 2 * 4 * n * h * p),
        _weight_matmul("MLP down", n, 4 * h, h, p),
    ]


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """FLOPs per byte at which a device turns from memory-bound to compute-bound: P / B."""
    _checks.require(_checks.positive(peak_flops=peak_flops, bandwidth=bandwidth))
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: min(P, I B), the most FLOP/s an operator of intensity I can reach."""
    _checks.require(_checks.positive(intensity=intensity, peak_flops=peak_flops, bandwidth=bandwidth))
    return min(peak_flops, intensity * bandwidth)


def memory_bound(op: OpCost, peak_flops: float, bandwidth: float) -> bool:
    """True if ``op`` sits left of the ridge: moving its bytes takes longer than its arithmetic."""
    return op.intensity < ridge_point(peak_flops, bandwidth)
