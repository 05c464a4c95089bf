"""A GPT-style decoder-only Transformer, written from scratch.

The layout is GPT-2's, so that weights move both ways between this model and Hugging Face's
``GPT2LMHeadModel``: token embeddings plus learned absolute position embeddings, a stack of
pre-LayerNorm blocks (causal multi-head self-attention, then a 4x GELU MLP, each wrapped in a
residual connection), a final LayerNorm and a language-model head tied to the token embedding.
With ``n_experts > 0`` every block's MLP is a mixture of experts (:mod:`scalebook.moe`).

Attention comes in two interchangeable implementations selected by ``GPTConfig.attn_impl``:
``"explicit"`` spells out softmax(QK^T / sqrt(d_head) + M) V so that every intermediate tensor is
visible (the book measures them), and ``"sdpa"`` calls ``torch.nn.functional.scaled_dot_product_attention``.

Source: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (GPT-2);
Vaswani et al. 2017, "Attention Is All You Need".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from scalebook.moe import moe_mlp

ATTN_IMPLS = ("explicit", "sdpa")


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT`. Use :func:`GPTConfig.named` for the book's standard sizes."""

    vocab_size: int = 256
    block_size: int = 128  # longest sequence; rows of the position-embedding table
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    layer_norm_eps: float = 1e-5
    attn_impl: str = "explicit"
    # Mixture of experts (scalebook.moe): 0 keeps the dense MLP; E > 0 gives every block E expert
    # MLPs and a top-k router. No capacity factor: dropless (every expert has room for all tokens).
    n_experts: int = 0
    expert_top_k: int = 2
    expert_capacity_factor: float | None = None

    def __post_init__(self):
        problems = []
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not problems and self.n_embd % self.n_head:
            problems.append(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"try n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))}"
            )
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attn_impl not in ATTN_IMPLS:
            problems.append(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        problems += self._expert_problems()
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    def _expert_problems(self) -> list[str]:
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            return [f"n_experts must be an integer >= 0 (0: dense MLP), got {self.n_experts!r}"]
        if not self.n_experts:
            return []
        problems = []
        if not isinstance(self.expert_top_k, int) or not 1 <= self.expert_top_k <= self.n_experts:
            problems.append(
                f"expert_top_k must be an integer in [1, n_experts={self.n_experts}], got {self.expert_top_k!r}"
            )
        if self.expert_capacity_factor is not None and not self.expert_capacity_factor > 0:
            problems.append(
                f"expert_capacity_factor must be > 0, or None for no dropping, got {self.expert_capacity_factor!r}"
            )
        return problems

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def named(cls, name: str, **overrides) -> GPTConfig:
        """The book's standard sizes: ``tiny`` and ``small`` for CPU demos, then the GPT-2 family."""
        if name not in NAMED_SIZES:
            raise ValueError(f"unknown model size {name!r}; choose one of {sorted(NAMED_SIZES)}")
        return replace(NAMED_SIZES[name], **overrides)

    def to_dict(self) -> dict:
        return asdict(self)


NAMED_SIZES = {
    # Byte-level vocabulary (256) so the CPU demos need no trained tokenizer.
    "tiny": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=256),
    # GPT-2 family, Radford et al. 2019 Table 2 (vocabulary 50257, context 1024).
    "gpt2": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position i attends only to positions <= i."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.attn_impl = config.attn_impl
        # Context parallelism plugs ring attention in here (scalebook.parallel.context); None: attend().
        self.core_attention = None
        self.dropout = config.dropout
        # One matmul produces Q, K and V for every head: W_QKV is (d, 3d).
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # One matmul gives Q, K and V. The head count is read from the width (-1 below), not from the config,
        # so the same code runs a tensor-parallel shard that holds n_head / tp of the heads.
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim): heads become a batch dimension.
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.core_attention(q, k, v) if self.core_attention is not None else self.attend(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (B, heads, T, head_dim) queries, keys and values."""
        if self.attn_impl == "sdpa":
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        # softmax(Q K^T / sqrt(d_head) + M) V, with M = -inf above the diagonal.
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        scores = scores.masked_fill(~self.causal_mask[:, :, :T, :T], float("-inf"))
        return self.attn_dropout(F.softmax(scores, dim=-1)) @ v


class MLP(nn.Module):
    """Position-wise feed-forward network: d -> 4d -> d with a tanh-approximated GELU (as GPT-2)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN Transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = moe_mlp(config) if config.n_experts else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, computed in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


class GPT(nn.Module):
    """The decoder. ``forward(idx, targets)`` returns ``(logits, loss)``; loss is None without targets."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False
        # Tensor parallelism swaps in a vocabulary-parallel cross-entropy (scalebook.parallel.tensor).
        self.loss_fn = lm_loss
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one (V, d) matrix embeds and un-embeds
        self.apply(self._init_weights)
        # GPT-2 scales the init of the projections that write into the residual stream by 1/sqrt(2L),
        # so the residual variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of distinct parameters (the tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embeddings of ``idx`` (B, T). ``positions`` (T,) defaults to 0..T-1; a context-
        parallel rank passes the positions of the tokens it holds."""
        T = idx.size(1)
        if positions is None:
            if T > self.config.block_size:
                raise ValueError(
                    f"sequence length {T} exceeds block_size {self.config.block_size}; "
                    "crop the input or build the model with a larger block_size"
                )
            positions = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(positions))

    def hidden_states(self, idx: torch.Tensor, *, positions=None) -> torch.Tensor:
        """The last block's output (B, T, d), before the final norm: what the head reads, and what a
        multi-token-prediction module (:mod:`scalebook.mtp`) builds on."""
        x = self.embed(idx, positions) if self.wte is not None else idx
        for block in self.blocks:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # Keep only the block input; recompute the block's activations during backward.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, positions=None):
        """``(logits, loss)`` of token ids ``idx``; loss is None without targets.

        A pipeline stage is a slice of this model (:func:`scalebook.parallel.pipeline.pipeline_stage` drops the
        blocks another stage runs, and ``wte`` or ``lm_head`` where it is not the first or the last stage): without
        ``wte`` the input is the previous stage's hidden states, and without ``lm_head`` the output is this
        stage's hidden states.
        """
        x = self.hidden_states(idx, positions=positions)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else self.loss_fn(logits, targets)
        return logits, loss

    # ----- Hugging Face GPT-2 interoperability -------------------------------------------------
    # HF's GPT-2 stores its linear layers as Conv1D with weight shape (in, out); nn.Linear stores
    # (out, in). Everything else maps one to one.
    _HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    @classmethod
    def from_hf(cls, hf_model, attn_impl: str = "explicit") -> GPT:
        """Build a GPT with the weights of a ``transformers.GPT2LMHeadModel`` (already in memory)."""
        hf_cfg = hf_model.config
        if hf_cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(
                f"GPT-2 activation {hf_cfg.activation_function!r} is not supported; "
                "this model uses the tanh GELU ('gelu_new')"
            )
        config = GPTConfig(
            vocab_size=hf_cfg.vocab_size,
            block_size=hf_cfg.n_positions,
            n_layer=hf_cfg.n_layer,
            n_head=hf_cfg.n_head,
            n_embd=hf_cfg.n_embd,
            layer_norm_eps=hf_cfg.layer_norm_epsilon,
            attn_impl=attn_impl,
        )
        model = cls(config)
        model.load_state_dict(_hf_to_ours(hf_model.state_dict(), config.n_layer))
        return model

    def to_hf(self):
        """Return an equivalent ``transformers.GPT2LMHeadModel`` holding copies of these weights."""
        from transformers import GPT2Config, GPT2LMHeadModel

        c = self.config
        if c.n_experts:
            raise ValueError("GPT-2 has no mixture-of-experts layers; only a model with n_experts=0 can be exported")
        if not c.bias:
            raise ValueError("GPT-2 has biases everywhere; only a model with bias=True can be exported")
        hf_cfg = GPT2Config(
            vocab_size=c.vocab_size,
            n_positions=c.block_size,
            n_embd=c.n_embd,
            n_layer=c.n_layer,
            n_head=c.n_head,
            layer_norm_epsilon=c.layer_norm_eps,
            activation_function="gelu_new",
            resid_pdrop=c.dropout,
            embd_pdrop=c.dropout,
            attn_pdrop=c.dropout,
            tie_word_embeddings=True,
            # GPT-2's end-of-text token is the last id; keep that convention for any vocabulary size.
            bos_token_id=c.vocab_size - 1,
            eos_token_id=c.vocab_size - 1,
        )
        hf_model = GPT2LMHeadModel(hf_cfg)
        missing, unexpected = hf_model.load_state_dict(_ours_to_hf(self.state_dict()), strict=False)
        # Only the tied head (and non-persistent attention biases in older versions) may be missing.
        if unexpected or any(not k.startswith("lm_head") and not k.endswith("attn.bias") for k in missing):
            raise RuntimeError(f"GPT-2 export mismatch: missing={missing}, unexpected={unexpected}")
        hf_model.tie_weights()
        return hf_model.eval()


def _hf_to_ours(hf_state: dict, n_layer: int) -> dict:
    ours = {}
    for key, value in hf_state.items():
        if key.endswith(".attn.bias") or key.endswith(".attn.masked_bias"):
            continue  # causal-mask buffers of older transformers versions
        name = key.removeprefix("transformer.")
        name = name.replace("h.", "blocks.", 1) if name.startswith("h.") else name
        if name.endswith(GPT._HF_TRANSPOSED):
            value = value.t()
        ours[name] = value.clone()
    ours.setdefault("lm_head.weight", ours["wte.weight"])
    return ours


def _ours_to_hf(state: dict) -> dict:
    hf = {}
    for name, value in state.items():
        if name == "lm_head.weight":
            continue  # tied to wte
        key = name.replace("blocks.", "h.", 1) if name.startswith("blocks.") else name
        if name.endswith(GPT._HF_TRANSPOSED):
            value = value.t()
        hf["transformer." + key] = value.detach().clone().contiguous()
    return hf
