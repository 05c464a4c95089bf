"""The Llama decoder, written from scratch: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

A Llama block keeps GPT's pre-norm residual layout (Chapter 5) and changes four parts:

    RMSNorm      y = w * x / sqrt(mean(x^2) + eps)            no mean subtracted, no bias
    RoPE         q and k rotated by their positions            (scalebook.positions; nothing is added)
    GQA          a query heads share n_kv key/value heads      K and V are a / n_kv times narrower
    SwiGLU       W_down (silu(x W_gate) * (x W_up))           three matrices of width d_ff

so a layer has 2 h^2 + 2 h d_kv attention weights (d_kv = n_kv d_head) and 3 h d_ff MLP weights. With
n_kv = a it is multi-head attention (MHA), with n_kv = 1 multi-query attention (MQA).

For decoding, :class:`KVCache` keeps every layer's keys and values, shape (batch, n_kv, positions, d_head),
so that each new token computes only its own k and v and attends to the stored ones: 2 L n_kv d_head s b
numbers in all. ``LlamaLM.forward(idx, cache=cache)`` appends to the cache and returns the logits of the new
tokens only; :func:`scalebook.generate.generate` with ``use_cache=True`` drives it.

Module names follow Hugging Face's ``LlamaForCausalLM`` without its ``model.`` prefix, so weights move both
ways (:meth:`LlamaLM.from_hf`, :meth:`LlamaLM.to_hf`) with one renaming.

Source: Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models", Sec. 2.2; Zhang and
Sennrich 2019, "Root Mean Square Layer Normalization"; Shazeer 2020, "GLU Variants Improve Transformer";
Ainslie et al. 2023, "GQA"; Shazeer 2019, "Fast Transformer Decoding: One Write-Head is All You Need" (MQA);
Hugging Face transformers, ``models/llama/modeling_llama.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scalebook.model import lm_loss
from scalebook.positions import apply_rope, rope_cache


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of :class:`LlamaLM`. The defaults are a tiny CPU model with 4 query and 2 kv heads."""

    vocab_size: int = 256
    block_size: int = 128  # longest sequence: rows of the RoPE table and of a KV cache
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    d_ff: int = 176
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        problems = []
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems:
            if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
                problems.append(
                    f"n_embd ({self.n_embd}) must be n_head ({self.n_head}) times an even head size "
                    "(RoPE rotates pairs of dimensions)"
                )
            if self.n_head % self.n_kv_head:
                problems.append(
                    f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}): every "
                    "key/value head serves the same number of query heads"
                )
        if problems:
            raise ValueError("invalid LlamaConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_model_config(self, name: str = "scalebook Llama"):
        """The :class:`scalebook.configs.ModelConfig` of the same network, for :mod:`scalebook.accounting`."""
        from scalebook.configs import llama_like

        return llama_like(
            name, vocab_size=self.vocab_size, d_model=self.n_embd, n_layers=self.n_layer, n_heads=self.n_head,
            n_kv_heads=self.n_kv_head, d_ff=self.d_ff, max_seq_len=self.block_size,
            tied_embeddings=self.tie_embeddings, source="built from a scalebook.llama.LlamaConfig",
        )  # fmt: skip


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last axis, computed in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LayerKVCache:
    """One layer's keys and values, (batch, n_kv, max_len, d_head) each, filled from position 0 on."""

    def __init__(self, batch: int, n_kv: int, max_len: int, head_dim: int, dtype, device=None):
        self.k = torch.zeros(batch, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k and v after the old ones; return all keys and values so far."""
        end = self.length + k.size(2)
        if end > self.k.size(2):
            raise ValueError(f"the KV cache holds {self.k.size(2)} positions; {end} were asked for")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Every layer's :class:`LayerKVCache`; ``nbytes`` is what it holds, 2 L b n_kv max_len d_head elements."""

    def __init__(self, config: LlamaConfig, batch: int, max_len: int, dtype=torch.float32, device=None):
        if not isinstance(max_len, int) or not 1 <= max_len <= config.block_size:
            raise ValueError(f"max_len must be an integer in [1, block_size={config.block_size}], got {max_len!r}")
        self.layers = [
            LayerKVCache(batch, config.n_kv_head, max_len, config.head_dim, dtype, device)
            for _ in range(config.n_layer)
        ]

    @property
    def length(self) -> int:
        """Positions already stored (the position of the next token)."""
        return self.layers[0].length

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in (layer.k, layer.v))


class GroupedQueryAttention(nn.Module):
    """Causal attention with n_head query heads and n_kv_head key/value heads (GQA; MHA and MQA as limits)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        h, kv = config.n_embd, config.n_kv_head * config.head_dim
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin, cache: LayerKVCache | None = None) -> torch.Tensor:
        """``x`` (B, T, h); ``cos``/``sin`` (T, d_head) for the positions of ``x``; ``cache`` holds earlier ones."""
        B, T, _ = x.shape
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask, causal = None, True
        if cache is not None:
            start = cache.length
            k, v = cache.update(k, v)
            # Query t sits at position start + t and may see keys 0 .. start + t.
            mask = torch.arange(T, device=x.device)[:, None] + start >= torch.arange(k.size(2), device=x.device)
            causal = False
        # enable_gqa: query head j reads key/value head j // (n_head / n_kv_head), without copying K and V.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """W_down (silu(x W_gate) * (x W_up)): a gated MLP of width d_ff, three matrices."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(rmsnorm(x)), then x + swiglu(rmsnorm(x)); Hugging Face's LlamaDecoderLayer."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = GroupedQueryAttention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, cache: LayerKVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(nn.Module):
    """The decoder. ``forward(idx, targets, cache=None)`` returns ``(logits, loss)`` like :class:`~scalebook.model.GPT`.

    With a :class:`KVCache`, ``idx`` holds the tokens after the cached ones (the prompt first, then one token
    per step); their positions continue from ``cache.length``.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)  # Llama's initializer_range
        cos, sin = rope_cache(config.block_size, config.head_dim, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` (default block_size) positions."""
        w = self.embed_tokens.weight
        return KVCache(self.config, batch, max_len or self.config.block_size, w.dtype, w.device)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache: KVCache | None = None):
        start = 0 if cache is None else cache.length
        end = start + idx.size(1)
        if end > self.config.block_size:
            raise ValueError(
                f"positions up to {end} exceed block_size {self.config.block_size}; crop the input or build the "
                "model with a larger block_size"
            )
        dtype = self.embed_tokens.weight.dtype
        cos, sin = (table[start:end].to(dtype) for table in (self.rope_cos, self.rope_sin))
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if cache is None else cache.layers[i])
        logits = self.lm_head(self.norm(x))
        return logits, None if targets is None else lm_loss(logits, targets)

    # ----- Hugging Face interoperability: the same names, under "model." except the head -------------------
    @classmethod
    def from_hf(cls, hf_model) -> LlamaLM:
        """A LlamaLM holding the weights of a ``transformers.LlamaForCausalLM`` (already in memory)."""
        c = hf_model.config
        if c.rope_parameters.get("rope_type") != "default" or c.attention_bias or c.mlp_bias or c.hidden_act != "silu":
            raise ValueError(
                "only plain Llama layers convert: rope_type 'default' (no RoPE scaling), no biases, hidden_act 'silu'"
            )
        config = LlamaConfig(
            vocab_size=c.vocab_size, block_size=c.max_position_embeddings, n_layer=c.num_hidden_layers,
            n_head=c.num_attention_heads, n_kv_head=c.num_key_value_heads, n_embd=c.hidden_size,
            d_ff=c.intermediate_size, rope_base=float(c.rope_parameters["rope_theta"]), norm_eps=c.rms_norm_eps,
            tie_embeddings=c.tie_word_embeddings,
        )  # fmt: skip
        model = cls(config).to(hf_model.dtype)
        model.load_state_dict(hf_to_ours(hf_model.state_dict()))
        return model

    def to_hf(self):
        """An equivalent ``transformers.LlamaForCausalLM`` holding copies of these weights."""
        from transformers import LlamaConfig as HFLlamaConfig
        from transformers import LlamaForCausalLM

        c = self.config
        hf_cfg = HFLlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.d_ff, num_hidden_layers=c.n_layer,
            num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, max_position_embeddings=c.block_size,
            rms_norm_eps=c.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
            tie_word_embeddings=c.tie_embeddings, attn_implementation="sdpa",
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )  # fmt: skip
        hf_model = LlamaForCausalLM(hf_cfg).to(self.embed_tokens.weight.dtype)
        hf_model.load_state_dict(ours_to_hf(self.state_dict()), strict=not c.tie_embeddings)
        return hf_model.eval()


def hf_to_ours(hf_state: dict) -> dict:
    """Rename a ``LlamaForCausalLM`` state dict to :class:`LlamaLM`'s: drop the ``model.`` prefix."""
    return {key.removeprefix("model."): value.clone() for key, value in hf_state.items()}


def ours_to_hf(state: dict) -> dict:
    """The inverse of :func:`hf_to_ours`: everything but the head moves under ``model.``."""
    return {
        key if key.startswith("lm_head.") else "model." + key: value.detach().clone() for key, value in state.items()
    }
