"""Parameter counts of a decoder-only Transformer: exact, by component, and in closed form.

The exact count is every weight and bias, with a tied embedding / LM-head matrix counted once, which
is what ``sum(p.numel() for p in model.parameters())`` returns in PyTorch. Per layer, with width d,
key/value width d_kv = n_kv_heads * d_head (d without grouped-query attention) and MLP width d_ff:

    attention  W_Q, W_O: d^2 each;  W_K, W_V: d * d_kv each;  biases d + 2 d_kv + d
    MLP        GELU: W_1, W_2 = 2 d d_ff, biases d_ff + d;  SwiGLU: W_gate, W_up, W_down = 3 d d_ff
    norms      two per layer: LayerNorm d weights + d biases, RMSNorm d weights

plus the token embedding V d, learned position embeddings n_ctx d (GPT only; rotary positions have
no parameters), a final norm, and an untied LM head V d.

The closed forms drop the small terms so the count fits in one line:

    GPT     N ~ V d + L (12 d^2 + 13 d)
            12 d^2 = W_QKV 3d^2 + W_O d^2 + W_1 4d^2 + W_2 4d^2 (d_ff = 4d);
            13 d   = biases 3d + d + 4d + d, and two LayerNorms 2 * 2d.
            Omitted: position embeddings n_ctx d and the final LayerNorm 2d.
            (The seed slides write 12 d^2 + 5 d, keeping only the MLP biases 4d + d.)
    Llama   N ~ 2 V d + L (2 d^2 + 2 d d_kv + 3 d d_ff)     (V d once if the head is tied)
            Omitted: the RMSNorm weights, 2d per layer and d at the end.

Source: Vaswani et al. 2017, "Attention Is All You Need"; Radford et al. 2019 (GPT-2);
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 5.1; Touvron et al. 2023 (Llama 2, SwiGLU and GQA).
"""

from __future__ import annotations

import math

from scalebook.accounting import _checks
from scalebook.configs import ModelConfig


def _attention_weights(cfg: ModelConfig) -> int:
    return 2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * cfg.d_kv


def _mlp_weights(cfg: ModelConfig) -> int:
    return (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * cfg.d_ff


def layer_matmul_weights(cfg: ModelConfig) -> int:
    """Weights one layer multiplies activations by (no biases, no norms): attention plus MLP."""
    return _attention_weights(cfg) + _mlp_weights(cfg)


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter count by component; the values sum to :func:`param_count`."""
    _checks.require(_checks.model_config(cfg))
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    attention_biases = 2 * d + 2 * cfg.d_kv
    mlp_biases = (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff + d
    norm = 2 * d if cfg.norm == "layernorm" and cfg.bias else d
    return {
        "token embedding": V * d,
        "position embedding": cfg.max_seq_len * d if cfg.learned_positions else 0,
        "attention weights": L * _attention_weights(cfg),
        "attention biases": L * attention_biases if cfg.bias else 0,
        "MLP weights": L * _mlp_weights(cfg),
        "MLP biases": L * mlp_biases if cfg.bias else 0,
        "norms": (2 * L + 1) * norm,
        "LM head": 0 if cfg.tied_embeddings else V * d,
    }


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters: every weight and bias, a tied matrix once."""
    return sum(param_breakdown(cfg).values())


def param_count_closed_form(cfg: ModelConfig) -> int:
    """The one-line estimate from the module docstring (GPT or Llama form, by ``cfg.arch``)."""
    _checks.require(_checks.model_config(cfg))
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    if cfg.arch == "gpt":
        # N ~ V d + L (12 d^2 + 13 d)
        return V * d + L * (12 * d * d + 13 * d)
    # N ~ 2 V d + L (2 d^2 + 2 d d_kv + 3 d d_ff), one V d when tied
    embeddings = (1 if cfg.tied_embeddings else 2) * V * d
    return embeddings + L * (2 * d * d + 2 * d * cfg.d_kv + 3 * d * cfg.d_ff)


def params_of(model: ModelConfig | float) -> int:
    """N for the rules of thumb: the exact count of a ModelConfig, or a count given directly (175e9)."""
    _checks.require(_checks.model_or_count(model))
    return param_count(model) if isinstance(model, ModelConfig) else math.ceil(model)
