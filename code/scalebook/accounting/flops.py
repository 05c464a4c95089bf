"""Training FLOPs: the 6 N D rule, and the count that adds attention scores and the logits.

The rule: the forward pass costs 2 FLOPs (a multiply and an add) per parameter per token, the
backward pass twice that, so training on D tokens costs 6 N D; full activation recomputation runs
the forward pass again, 8 N D.

With attention: per token, a layer's forward pass multiplies by its W weights (2 W FLOPs) and forms
Q K^T and softmax(.) V over s positions (2 * 2 s h); the LM head adds 2 h V. Backward doubles each;
full recomputation reruns the layers' forward pass but not the head's:

    F per token = 3 (2 L W + 4 L s h + 2 h V)  [+ L (2 W + 4 s h) with recomputation]

For the GPT layer, W = 12 h^2, and over an iteration of B sequences this is Narayanan et al.'s count

    F = 72 B s L h^2 (1 + s / (6 h) + V / (12 L h)),
    with recomputation  96 B s L h^2 (1 + s / (6 h) + V / (16 L h)).

Like Narayanan et al., attention is counted over all s positions (the causal mask is not exploited),
and biases, norms, softmax and embedding look-ups are left out. N in 6 N D is the exact parameter
count of a ModelConfig, embeddings included, or whatever count you pass.

A mixture of experts multiplies each token by the weights of the experts it is routed to, so its N
is the active count (``accounting.active_param_count``): 6 N_active D, and in the attention-aware
count 2 W per layer becomes the layer's active weights (the router, the shared and k routed
experts). DeepSeek-V3's latent attention scores over query/key heads of d_nope + d_rope and values of
d_v, so its 4 s h becomes 2 s n_h (d_nope + d_rope + d_v).

A multi-token-prediction module (DeepSeek-V3) runs, per token it scores, its projection (2 d -> d), one
more layer and the shared head: F_MTP per token = 3 (4 h^2 + 2 W + 4 s h + 2 h V) for a module over s
positions (module k of D sees s = T - k), with W the last layer's active weights.

Source: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Sec. 2.1; Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 5.1
and Appendix; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (37B activated parameters per token;
Sec. 2.2, multi-token prediction).
"""

from __future__ import annotations

from scalebook.accounting import _checks
from scalebook.accounting.params import layer_weights, params_of
from scalebook.configs import ModelConfig


def _score_width(cfg: ModelConfig) -> int:
    """n_h (d_qk + d_v): what Q K^T and P V multiply over per position, 2 h without latent attention."""
    mla = cfg.latent_attention
    return 2 * cfg.d_model if mla is None else cfg.n_heads * (mla.qk_head_dim + mla.v_head_dim)


def flops_per_token(model: ModelConfig | float, *, seq_len: int | None = None, recompute: bool = False) -> float:
    """Training FLOPs per token: 6 N (8 N with recomputation), or the attention-aware count at ``seq_len``.

    N is the active parameter count of a mixture of experts."""
    _checks.require(_checks.one_of("recompute", recompute, (False, True)))
    if seq_len is None:
        return (8 if recompute else 6) * params_of(model, active=True)
    _checks.require(_checks.model_config(model), _checks.positive_int(seq_len=seq_len))
    L, h = model.n_layers, model.d_model
    # Two kinds of layer at most, dense ones first: one call per kind (the planner asks this thousands of times).
    L_moe = model.n_moe_layers
    kinds = ((0, L - L_moe), (L - L_moe, L_moe))  # (first layer of the kind, how many)
    weights = sum(count * layer_weights(model, first, active=True) for first, count in kinds if count)
    layers_forward = 2 * weights + 2 * L * seq_len * _score_width(model)
    head_forward = 2 * h * model.vocab_size
    # 3 (2 L W + 4 L s h + 2 h V) [+ L (2 W + 4 s h) with recomputation]
    return (4 if recompute else 3) * layers_forward + 3 * head_forward


def attention_flop_share(model: ModelConfig, *, seq_len: int, causal: bool = False) -> float:
    """Share of a training token's FLOPs (no recomputation) spent on attention's Q K^T and P V.

    ``causal=False`` is the convention of :func:`flops_per_token` and of MFU as Megatron-LM and PaLM count it:
    every query against all ``seq_len`` keys, 4 s h per layer forward. A causal mask leaves query i only
    i + 1 keys, (s + 1) / 2 on average, so ``causal=True`` is the share a kernel that skips masked work
    executes (a tiled kernel computes its diagonal tiles whole, a little more). The weight matmuls and the
    output layer are the same in both."""
    _checks.require(_checks.model_config(model), _checks.one_of("causal", causal, (False, True)))
    full = flops_per_token(model, seq_len=seq_len)
    attention = 3 * 2 * model.n_layers * seq_len * _score_width(model)
    if causal:
        executed = attention * (seq_len + 1) / (2 * seq_len)
        return executed / (full - attention + executed)
    return attention / full


def mtp_flops_per_token(cfg: ModelConfig, *, seq_len: int) -> float:
    """Training FLOPs per scored token of one multi-token-prediction module over ``seq_len`` positions:
    3 (4 h^2 + 2 W + 4 s h + 2 h V): the projection M_k, one more layer (the last layer's active weights W,
    attention counted over all s positions) and the shared head; norms and the embedding look-up are free.

    Module k of D on sequences of T tokens scores B (T - k) tokens at ``seq_len = T - k``; it is not part of
    :func:`flops_per_token`, which counts the main model."""
    _checks.require(_checks.model_config(cfg), _checks.positive_int(seq_len=seq_len))
    h = cfg.d_model
    forward = 2 * 2 * h * h + 2 * layer_weights(cfg, cfg.n_layers - 1, active=True)
    forward += 2 * seq_len * _score_width(cfg) + 2 * h * cfg.vocab_size
    return 3 * forward


def training_flops(model: ModelConfig | float, tokens: float, *, recompute: bool = False) -> float:
    """6 N D FLOPs to train on ``tokens`` tokens (8 N D with full recomputation); N_active for an MoE."""
    _checks.require(_checks.positive(tokens=tokens))
    return tokens * flops_per_token(model, recompute=recompute)


def training_flops_with_attention(cfg: ModelConfig, tokens: float, *, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs counting attention scores and the LM head (Narayanan et al.'s form for GPT)."""
    _checks.require(_checks.positive(tokens=tokens))
    return tokens * flops_per_token(cfg, seq_len=seq_len, recompute=recompute)
