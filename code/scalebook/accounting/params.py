"""Parameter counts of a decoder-only Transformer: exact, by component, and in closed form.

The exact count is every weight and bias, with a tied embedding / LM-head matrix counted once, which
is what ``sum(p.numel() for p in model.parameters())`` returns in PyTorch. Per layer, with width d,
key/value width d_kv = n_kv_heads * d_head (d without grouped-query attention) and MLP width d_ff:

    attention  W_Q, W_O: d^2 each;  W_K, W_V: d * d_kv each;  biases d + 2 d_kv + d
    MLP        GELU: W_1, W_2 = 2 d d_ff, biases d_ff + d;  SwiGLU: W_gate, W_up, W_down = 3 d d_ff
    norms      two per layer: LayerNorm d weights + d biases, RMSNorm d weights

plus the token embedding V d, learned position embeddings n_ctx d (GPT only; rotary positions have
no parameters), a final norm, and an untied LM head V d.

A mixture of experts keeps the first L_dense layers dense; each of the other L_moe layers holds E
routed experts and E_s shared ones, SwiGLU MLPs of width d_e (3 d d_e each), and a router W_r of
E d. A token passes through k of the E routed experts, so of the experts it uses E_s + k:

    total    N = (the dense count) + L_moe (3 d d_e (E + E_s) + E d) - L_moe (MLP of width d_ff)
    active   N_active = N - L_moe (E - k) 3 d d_e         (what one token multiplies by, embedding included)

DeepSeek-V3's multi-head latent attention (n_h heads, ranks r_q and r_kv, head dims d_nope, d_rope,
d_v) replaces W_Q, W_K, W_V by low-rank factors and adds two RMSNorms (r_q + r_kv weights):

    d r_q + r_q n_h (d_nope + d_rope) + d (r_kv + d_rope) + r_kv n_h (d_nope + d_v) + n_h d_v d

The closed forms drop the small terms so the count fits in one line:

    GPT     N ~ V d + L (12 d^2 + 13 d)
            12 d^2 = W_QKV 3d^2 + W_O d^2 + W_1 4d^2 + W_2 4d^2 (d_ff = 4d);
            13 d   = biases 3d + d + 4d + d, and two LayerNorms 2 * 2d.
            Omitted: position embeddings n_ctx d and the final LayerNorm 2d.
            (The seed slides write 12 d^2 + 5 d, keeping only the MLP biases 4d + d.)
    Llama   N ~ 2 V d + L (2 d^2 + 2 d d_kv + 3 d d_ff)     (V d once if the head is tied)
            Omitted: the RMSNorm weights, 2d per layer and d at the end.
    MoE     N ~ 2 V d + L A + 3 d (L_dense d_ff + L_moe (E + E_s) d_e) + L_moe E d
            A: the attention weights above (MLA's for DeepSeek-V3). Omitted: every norm.

Source: Vaswani et al. 2017, "Attention Is All You Need"; Radford et al. 2019 (GPT-2);
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 5.1; Touvron et al. 2023 (Llama 2, SwiGLU and GQA); Jiang et al. 2024, "Mixtral
of Experts", Sec. 2; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 2.1 (MLA, DeepSeekMoE);
Hugging Face ``MixtralForCausalLM`` and ``DeepseekV3ForCausalLM``, whose counts the tests match.
"""

from __future__ import annotations

import math

from scalebook.accounting import _checks
from scalebook.configs import ModelConfig


def _attention_weights(cfg: ModelConfig) -> int:
    mla, d, n_h = cfg.latent_attention, cfg.d_model, cfg.n_heads
    if mla is None:
        return 2 * d * d + 2 * d * cfg.d_kv
    # d r_q + r_q n_h (d_nope + d_rope)  [or d n_h (d_nope + d_rope) without a query latent]
    queries = (d + n_h * mla.qk_head_dim) * mla.q_lora_rank if mla.q_lora_rank else d * n_h * mla.qk_head_dim
    # d (r_kv + d_rope) + r_kv n_h (d_nope + d_v), then the output projection n_h d_v d
    keys_values = d * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    keys_values += mla.kv_lora_rank * n_h * (mla.qk_nope_head_dim + mla.v_head_dim)
    return queries + keys_values + n_h * mla.v_head_dim * d


def _mlp_weights(cfg: ModelConfig, d_ff: int | None = None) -> int:
    return (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * (cfg.d_ff if d_ff is None else d_ff)


def _expert_weights(cfg: ModelConfig) -> int:
    return _mlp_weights(cfg, cfg.expert_d_ff)


def layer_matmul_weights(cfg: ModelConfig) -> int:
    """Weights one layer multiplies activations by (no biases, no norms): attention plus MLP.

    A dense model's layers are all alike; a mixture of experts' are not (see :func:`layer_weights`).
    """
    _checks.require(_checks.model_config(cfg))
    if cfg.is_moe:
        raise ValueError(
            f"{cfg.name!r} is a mixture of experts whose layers differ (dense, or routed experts of which a "
            "token uses a few): use accounting.layer_weights(cfg, layer, active=...) per layer"
        )
    return _attention_weights(cfg) + _mlp_weights(cfg)


def layer_weights(cfg: ModelConfig, layer: int, *, active: bool = False) -> int:
    """Matrix weights of layer ``layer`` (0-based): all it stores, or with ``active=True`` the ones a
    token multiplies by (the router, the shared experts and k of the E routed experts)."""
    _checks.require(_checks.model_config(cfg), _checks.one_of("active", active, (False, True)))
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer must be an integer in [0, {cfg.n_layers}) for {cfg.name!r}, got {layer!r}")
    if layer < cfg.n_dense_layers or not cfg.is_moe:
        return _attention_weights(cfg) + _mlp_weights(cfg)
    routed = cfg.experts_per_token if active else cfg.n_experts
    router = cfg.n_experts * cfg.d_model
    return _attention_weights(cfg) + (routed + cfg.n_shared_experts) * _expert_weights(cfg) + router


def _norm_weights(cfg: ModelConfig) -> int:
    """Norm parameters of the whole model: two per layer and a final one, plus MLA's latent norms."""
    norm = 2 * cfg.d_model if cfg.norm == "layernorm" and cfg.bias else cfg.d_model
    mla = cfg.latent_attention
    latent = 0 if mla is None else cfg.n_layers * (mla.q_lora_rank + mla.kv_lora_rank)
    return (2 * cfg.n_layers + 1) * norm + latent


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter count by component; the values sum to :func:`param_count`."""
    _checks.require(_checks.model_config(cfg))
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    attention_biases = 2 * d + 2 * cfg.d_kv
    mlp_biases = (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff + d
    L_dense, L_moe = L - cfg.n_moe_layers, cfg.n_moe_layers
    breakdown = {
        "token embedding": V * d,
        "position embedding": cfg.max_seq_len * d if cfg.learned_positions else 0,
        "attention weights": L * _attention_weights(cfg),
        "attention biases": L * attention_biases if cfg.bias else 0,
        # dense layers' MLPs, and the shared experts every token passes through
        "MLP weights": L_dense * _mlp_weights(cfg) + L_moe * cfg.n_shared_experts * _expert_weights(cfg),
        "MLP biases": L * mlp_biases if cfg.bias else 0,
        "norms": _norm_weights(cfg),
        "LM head": 0 if cfg.tied_embeddings else V * d,
    }
    if cfg.is_moe:
        breakdown["routed experts"] = L_moe * cfg.n_experts * _expert_weights(cfg)
        breakdown["routers"] = L_moe * cfg.n_experts * d
    return breakdown


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters: every weight and bias, a tied matrix once."""
    return sum(param_breakdown(cfg).values())


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: every parameter but the E - k routed experts it is not sent to.

    Equal to :func:`param_count` for a dense model. The embedding is included (as in ``param_count``);
    DeepSeek's "36.6B activated" leaves it out, since a look-up multiplies by nothing.
    """
    idle = cfg.n_moe_layers * (cfg.n_experts - cfg.experts_per_token) * _expert_weights(cfg)
    return param_count(cfg) - idle


def mtp_param_count(cfg: ModelConfig, *, with_shared: bool = False) -> int:
    """Parameters of the multi-token-prediction modules shipped beside the model (DeepSeek-V3: one).

    Each is one more layer (the last layer's shape) with its two norms (and its biases, in a model that
    has them), the RMSNorms of the hidden state and of the next token's embedding (2 d) and their
    projection W_eh (2 d -> d, 2 d^2), and an RMSNorm before the shared head (d):

        N_MTP = D (layer + 2 d^2 + 3 d)      (a GPT layer: 12 d^2 + 13 d, so 14 d^2 + 16 d per module)

    The module uses the model's embedding and LM head; the Hub stores a copy of each (2 V d more) with
    ``with_shared=True``. Not part of :func:`param_count`; ``scalebook.mtp`` builds the module on the GPT.
    """
    _checks.require(_checks.model_config(cfg), _checks.one_of("with_shared", with_shared, (False, True)))
    d, mla = cfg.d_model, cfg.latent_attention
    latent_norms = 0 if mla is None else mla.q_lora_rank + mla.kv_lora_rank
    norm = 2 * d if cfg.norm == "layernorm" and cfg.bias else d
    biases = 2 * d + 2 * cfg.d_kv + (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff + d if cfg.bias else 0
    layer = layer_weights(cfg, cfg.n_layers - 1) + 2 * norm + latent_norms + biases
    module = layer + 2 * d + 2 * d * d + d + (2 * cfg.vocab_size * d if with_shared else 0)
    return cfg.n_mtp_layers * module


def param_count_closed_form(cfg: ModelConfig) -> int:
    """The one-line estimate from the module docstring (GPT, Llama or MoE form)."""
    _checks.require(_checks.model_config(cfg))
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    if cfg.arch == "gpt":
        # N ~ V d + L (12 d^2 + 13 d)
        return V * d + L * (12 * d * d + 13 * d)
    embeddings = (1 if cfg.tied_embeddings else 2) * V * d
    if not cfg.is_moe:
        # N ~ 2 V d + L (2 d^2 + 2 d d_kv + 3 d d_ff), one V d when tied
        return embeddings + L * (2 * d * d + 2 * d * cfg.d_kv + 3 * d * cfg.d_ff)
    # N ~ 2 V d + L A + 3 d (L_dense d_ff + L_moe (E + E_s) d_e) + L_moe E d
    L_moe = cfg.n_moe_layers
    experts = L_moe * (cfg.n_experts + cfg.n_shared_experts) * cfg.expert_d_ff
    return (
        embeddings
        + L * _attention_weights(cfg)
        + 3 * d * ((L - L_moe) * cfg.d_ff + experts)
        + L_moe * cfg.n_experts * d
    )


def params_of(model: ModelConfig | float, *, active: bool = False) -> int:
    """N for the rules of thumb: the exact count of a ModelConfig (its active count with ``active``), or a
    count given directly (175e9)."""
    _checks.require(_checks.model_or_count(model))
    if not isinstance(model, ModelConfig):
        return math.ceil(model)
    return active_param_count(model) if active else param_count(model)
