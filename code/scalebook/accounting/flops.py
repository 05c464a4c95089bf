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

Source: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Sec. 2.1; Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 5.1
and Appendix.
"""

from __future__ import annotations

from scalebook.accounting import _checks
from scalebook.accounting.params import layer_matmul_weights, params_of
from scalebook.configs import ModelConfig


def flops_per_token(
    model: ModelConfig | float, *, seq_len: int | None = None, recompute: bool = False
) -> float:
    """Training FLOPs per token: 6 N (8 N with recomputation), or the attention-aware count at ``seq_len``."""
    _checks.require(_checks.one_of("recompute", recompute, (False, True)))
    if seq_len is None:
        return (8 if recompute else 6) * params_of(model)
    _checks.require(_checks.model_config(model), _checks.positive_int(seq_len=seq_len))
    L, h = model.n_layers, model.d_model
    layers_forward = 2 * L * layer_matmul_weights(model) + 4 * L * seq_len * h
    head_forward = 2 * h * model.vocab_size
    # 3 (2 L W + 4 L s h + 2 h V) [+ L (2 W + 4 s h) with recomputation]
    return (4 if recompute else 3) * layers_forward + 3 * head_forward


def training_flops(model: ModelConfig | float, tokens: float, *, recompute: bool = False) -> float:
    """6 N D FLOPs to train on ``tokens`` tokens (8 N D with full recomputation)."""
    _checks.require(_checks.positive(tokens=tokens))
    return tokens * flops_per_token(model, recompute=recompute)


def training_flops_with_attention(
    cfg: ModelConfig, tokens: float, *, seq_len: int, recompute: bool = False
) -> float:
    """Training FLOPs counting attention scores and the LM head (Narayanan et al.'s form for GPT)."""
    _checks.require(_checks.positive(tokens=tokens))
    return tokens * flops_per_token(cfg, seq_len=seq_len, recompute=recompute)
