"""Compute: the time of one layer's forward and backward on one GPU, from its matrix shapes.

Every matrix multiply of a layer is listed with its shape (after tensor and expert parallelism) and timed as

    t = 2 m k n / (P_dtype * matmul_efficiency) + (m k + k n + m n) p / (B_HBM * memory_efficiency)

a roofline whose two terms add instead of overlapping: the first is the achievable fraction of the datasheet
peak a large GEMM reaches, the second the operand traffic, which makes thin or small matrices (a 1.7B model's
2304-wide layers, DeepSeek-V3's 2048-wide experts) slower per FLOP than the 25,600-wide layers of a 1T model.
The backward pass runs each weight matmul twice (input and weight gradients).

Attention, FLOP conventions stated:

- **MFU convention** (Narayanan et al., PaLM, Llama 3's Table 4): Q K^T and P V over all s positions,
  ``2 s n_h (d_qk + d_v)`` FLOPs per token forward, as :func:`scalebook.accounting.flops.flops_per_token` counts.
- **Executed by a causal fused kernel** (FlashAttention 2/3): only the lower triangle, ``(s + 1) / (2 s)`` of
  that, at ``attention_efficiency`` of the bf16 peak; its backward executes 2.5 times its forward (five
  matmuls, one of them the recomputed scores, against two).
- **Explicit attention** (Megatron-LM 2021-22): two batched matmuls over all positions (the mask is applied,
  not exploited), timed like any matmul, plus the softmax and dropout passes over the ``n_h s^2`` scores at HBM
  bandwidth (4.5 two-byte passes forward: softmax read and write, dropout read, write and 1-byte mask; twice
  that backward).

Memory-bound work, in two-byte passes over the tokens of one GPU, at ``B_HBM * memory_efficiency``: per layer
forward two norms (read, write), two residual adds (read two, write one), the MLP activation (GELU reads and
writes d_ff; SwiGLU reads 2 d_ff, writes d_ff), rotary embeddings on Q and K (Llama), and the permutation of
routed tokens to and from their experts (2 x 2 k h per token); backward twice the forward. Without sequence
parallelism the norms and residuals run on the whole sequence in every tensor-parallel rank. The LM head adds
its logits: 16 bytes per logit for the fp32 cross-entropy forward and backward. Recomputation: ``full`` runs
the layer's forward again; ``selective`` reruns the attention core (free with a fused kernel, whose backward
recomputes anyway) and the two norms and the MLP activation, whose outputs it does not keep
(:func:`rematerialized_bytes`, see :mod:`scalebook.system.memory`); ``none`` nothing.

Source: Williams, Waterman and Patterson 2009 (roofline); Narayanan et al. 2021, Sec. 5.1 and Appendix (the
FLOP count); Korthikanti et al. 2022, Sec. 4-5 (explicit attention's score tensors, selective recomputation);
Dao 2023, "FlashAttention-2", Sec. 3.1 (causal blocks skipped; backward of five matmuls); Chowdhery et al.
2022, Appendix B (MFU and HFU).
"""

from __future__ import annotations

from dataclasses import dataclass

from scalebook.accounting.flops import _score_width
from scalebook.configs import Hardware, ModelConfig

EXPLICIT_SCORE_PASSES = 4.5  # two-byte passes over the scores, forward (see the module docstring)
FLASH_BACKWARD_RATIO = 2.5  # executed backward FLOPs / forward FLOPs of a fused attention kernel
LOGIT_BYTES = 16  # fp32 logits written, read by the softmax, gradient written and read: forward + backward


@dataclass(frozen=True)
class SystemParams:
    """The model's free parameters, fitted by :func:`scalebook.system.fit.fit_params` on published runs.

    ``matmul_efficiency``: fraction of the dtype's dense peak a large GEMM reaches. ``attention_efficiency``:
    fraction of the bf16 peak a fused causal attention kernel reaches on the FLOPs it executes.
    ``memory_efficiency``: fraction of HBM bandwidth memory-bound kernels reach."""

    matmul_efficiency: float
    attention_efficiency: float
    memory_efficiency: float

    def as_tuple(self) -> tuple[float, ...]:
        return (self.matmul_efficiency, self.attention_efficiency, self.memory_efficiency)


@dataclass(frozen=True)
class Matmul:
    """``batch`` products (m x k) @ (k x n) in one layer's forward pass on one GPU."""

    name: str
    m: int
    k: int
    n: int
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n

    def operand_elements(self) -> int:
        return self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)


def matmul_time(mm: Matmul, gpu: Hardware, dtype: str, params: SystemParams) -> float:
    """Seconds for ``mm`` in ``dtype`` (bytes per element: 1 for fp8, else 2): peak term plus traffic term."""
    width = 1 if dtype == "fp8" else 2
    compute = mm.flops / (gpu.peak(dtype) * params.matmul_efficiency)
    traffic = mm.operand_elements() * width / (gpu.hbm_bandwidth * params.memory_efficiency)
    return compute + traffic


def _attention_projections(cfg: ModelConfig, n: int, tp: int) -> list[Matmul]:
    h, mla = cfg.d_model, cfg.latent_attention
    if mla is None:
        return [Matmul("QKV", n, h, (h + 2 * cfg.d_kv) // tp), Matmul("attention output", n, h // tp, h)]
    heads = cfg.n_heads // tp
    q = (
        [Matmul("Q down", n, h, mla.q_lora_rank), Matmul("Q up", n, mla.q_lora_rank, heads * mla.qk_head_dim)]
        if mla.q_lora_rank
        else [Matmul("Q", n, h, heads * mla.qk_head_dim)]
    )
    return q + [
        Matmul("KV down", n, h, mla.kv_lora_rank + mla.qk_rope_head_dim),
        Matmul("KV up", n, mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
        Matmul("attention output", n, heads * mla.v_head_dim, h),
    ]


def _mlp(name: str, rows: int, h: int, d_ff: int, swiglu: bool, batch: int = 1) -> list[Matmul]:
    up = 2 * d_ff if swiglu else d_ff
    return [Matmul(f"{name} up", rows, h, up, batch), Matmul(f"{name} down", rows, d_ff, h, batch)]


def layer_matmuls(cfg: ModelConfig, layer: int, n: int, *, tp: int, ep: int) -> list[Matmul]:
    """The weight matmuls of layer ``layer`` for ``n`` tokens on one GPU (attention core excluded).

    Routed experts: the ``ep`` ranks of an expert group exchange tokens so that each GPU runs its
    ``E / ep`` experts on ``n k`` token copies, ``n k ep / E`` rows per expert (balanced routing assumed)."""
    swiglu = cfg.mlp == "swiglu"
    mms = _attention_projections(cfg, n, tp)
    if layer < cfg.n_dense_layers or not cfg.is_moe:
        return mms + _mlp("MLP", n, cfg.d_model, cfg.d_ff // tp, swiglu)
    d_e = cfg.expert_d_ff // tp
    mms.append(Matmul("router", n, cfg.d_model, cfg.n_experts))
    if cfg.n_shared_experts:
        mms += _mlp("shared expert", n, cfg.d_model, cfg.n_shared_experts * d_e, swiglu)
    local_experts = max(1, cfg.n_experts // ep)
    rows = max(1, n * cfg.experts_per_token // local_experts)
    return mms + _mlp("routed experts", rows, cfg.d_model, d_e, swiglu, batch=local_experts)


def attention_flops(cfg: ModelConfig, n: int, context: int, *, tp: int, causal: bool) -> float:
    """Forward FLOPs of Q K^T and P V for ``n`` query tokens over ``context`` positions on one GPU: the MFU
    convention (all positions) or, ``causal=True``, what a causal kernel executes, (s + 1) / (2 s) of it."""
    full = 2 * n * context * _score_width(cfg) / tp
    return full * (context + 1) / (2 * context) if causal else full


def elementwise_bytes(cfg: ModelConfig, layer: int, n: int, *, tp: int, sp: bool) -> float:
    """HBM bytes of one layer's memory-bound kernels, forward, for ``n`` tokens on one GPU (two-byte passes)."""
    h = cfg.d_model
    replicated = h / tp if sp else h
    passes = 2 * 2 * replicated + 2 * 3 * replicated  # two norms, two residual adds
    moe = cfg.is_moe and layer >= cfg.n_dense_layers
    d_ff = cfg.expert_d_ff * (cfg.experts_per_token + cfg.n_shared_experts) if moe else cfg.d_ff
    passes += (3 if cfg.mlp == "swiglu" else 2) * d_ff / tp
    if cfg.arch == "llama":
        passes += 2 * (h + cfg.d_kv) / tp  # rotary embeddings on Q and K
    if moe:
        passes += 2 * 2 * cfg.experts_per_token * h  # permute to the experts and back
    return 2 * n * passes


def rematerialized_bytes(cfg: ModelConfig, layer: int, n: int, *, tp: int, sp: bool) -> float:
    """HBM bytes of the pointwise passes that ``selective`` recomputation reruns in one layer's backward for
    ``n`` tokens: the two norms (read, write) and the MLP activation (GELU reads and writes d_ff; SwiGLU reads
    2 d_ff, writes d_ff), two-byte passes, the same passes as in :func:`elementwise_bytes`."""
    norms = 2 * 2 * (cfg.d_model / tp if sp else cfg.d_model)
    moe = cfg.is_moe and layer >= cfg.n_dense_layers
    d_ff = cfg.expert_d_ff * (cfg.experts_per_token + cfg.n_shared_experts) if moe else cfg.d_ff
    return 2 * n * (norms + (3 if cfg.mlp == "swiglu" else 2) * d_ff / tp)
