"""Multi-token prediction (MTP): DeepSeek-V3's extra training objective, on the book's GPT.

Besides the next token, every position also predicts the tokens after it, through D small modules chained one
after the other. Module k (k = 1 .. D) reads the representation of the depth before it, h^{k-1}_i (h^0: the main
model's last block output, before its final norm), and the embedding of the token k places ahead, t_{i+k};
it normalizes each, concatenates them, projects back to width d with M_k (d x 2d), and runs one Transformer
block over the T - k positions that still have a target:

    h'^k_i      = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]
    h^k_{1:T-k} = Block_k(h'^k_{1:T-k})                   (causal, like every block of the model)
    P^k_i       = softmax(OutHead(RMSNorm(h^k_i)))         scored against t_{i+k+1}

Emb and OutHead are the main model's (one tied matrix in the book's GPT), so a module adds only its projection
(2 d^2), one block and three norms. The chain keeps causality: depth k at position i has seen t_{i+1} .. t_{i+k}
through the embeddings of the depths below it, and predicts the token after them. Each depth's loss is the
report's eq. (24), the cross-entropy summed over the B (T - k) predictions and divided by all B T positions,
and the training loss adds their mean, weighted by lambda:

    L = L_main + (lambda / D) sum_k L^k_MTP

DeepSeek-V3 used D = 1 with lambda = 0.3, then 0.1. At inference the modules are dropped (use
``MultiTokenPrediction.model``); they can also serve as a draft model for speculative decoding.

Source: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 2.2 (multi-token prediction, eqs. 21-25);
Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token Prediction" (parallel heads).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scalebook.llama import RMSNorm
from scalebook.model import GPT, GPTConfig


class MTPModule(nn.Module):
    """One depth of multi-token prediction: two norms, the projection M_k (2d -> d), one block and the norm
    before the shared head. ``block_class(config)`` builds the block (the main model's own class)."""

    def __init__(self, config: GPTConfig, block_class: type[nn.Module]):
        super().__init__()
        d = config.n_embd
        self.norm_hidden = RMSNorm(d)
        self.norm_embedding = RMSNorm(d)
        self.proj = nn.Linear(2 * d, d, bias=False)  # M_k
        self.block = block_class(config)
        self.norm_out = RMSNorm(d)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """h^k (B, T - k, d) from h^{k-1} and Emb(t_{i+k}), both already cut to the T - k positions."""
        x = torch.cat([self.norm_hidden(hidden), self.norm_embedding(embedded)], dim=-1)
        return self.block(self.proj(x))


class MultiTokenPrediction(nn.Module):
    """A :class:`~scalebook.model.GPT` trained with ``depth`` MTP modules whose loss is added with ``weight``
    (lambda). ``forward(idx, targets)`` returns ``(logits, loss)`` like the GPT's: the main model's logits and
    L_main + (lambda / D) sum_k L^k_MTP, so any training loop trains it. ``depth=0`` or ``weight=0`` is the
    plain GPT (the modules are not run). The wrapped model, without the modules, is ``.model``."""

    def __init__(self, model: GPT, depth: int = 1, weight: float = 0.3):
        super().__init__()
        problems = _problems(model, depth, weight)
        if problems:
            raise ValueError("invalid MultiTokenPrediction: " + "; ".join(problems))
        self.model = model
        self.depth = depth
        self.weight = float(weight)
        block_class = type(model.blocks[0])  # the model's own block, MoE or dense
        self.mtp_modules = nn.ModuleList(MTPModule(model.config, block_class) for _ in range(depth))
        self.mtp_modules.apply(GPT._init_weights)
        for name, p in self.mtp_modules.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * model.config.n_layer))

    @property
    def config(self) -> GPTConfig:
        return self.model.config

    def num_parameters(self) -> int:
        """Distinct parameters, the main model's included (the shared embedding and head count once)."""
        return sum(p.numel() for p in self.parameters())

    def losses(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``(logits, main loss, [L^1_MTP, ..., L^D_MTP])`` of token ids ``idx`` (B, T) and their next tokens
        ``targets`` (B, T): module k's logits at position i are scored against ``targets[:, i + k]``."""
        B, T = idx.shape
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
        if self.depth >= T:
            raise ValueError(
                f"MTP depth {self.depth} leaves no target in a sequence of {T} tokens (module k scores T - k "
                f"positions); use sequences longer than {self.depth} tokens or depth <= {T - 1}"
            )
        hidden = self.model.hidden_states(idx)
        logits = self.model.lm_head(self.model.ln_f(hidden))
        main = self.model.loss_fn(logits, targets)
        mtp = []
        for k, module in enumerate(self.mtp_modules if self.weight else (), start=1):
            # Positions i = 0 .. T-k-1 read Emb(t_{i+k}) = wte(idx[:, i + k]) and predict targets[:, i + k].
            hidden = module(hidden[:, : T - k], self.model.wte(idx[:, k:]))
            logits_k = self.model.lm_head(module.norm_out(hidden))
            summed = F.cross_entropy(logits_k.flatten(0, 1).float(), targets[:, k:].reshape(-1), reduction="sum")
            mtp.append(summed / (B * T))  # eq. (24): divided by T, not by the T - k positions scored
        return logits, main, mtp

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``(logits, loss)``: the main model's logits and L_main + (lambda / D) sum_k L^k_MTP; loss is None
        without targets (then only the main model runs)."""
        if targets is None:
            return self.model(idx)
        logits, main, mtp = self.losses(idx, targets)
        if not mtp:
            return logits, main
        return logits, main + self.weight / self.depth * sum(mtp)


def _problems(model, depth, weight) -> list[str]:
    if not isinstance(model, GPT):
        return [f"model must be a scalebook.model.GPT, got {type(model).__name__}"]
    problems = []
    if model.wte is None or model.lm_head is None or not len(model.blocks):
        problems.append("model must be a whole GPT (a pipeline stage lacks the embedding, the head or blocks)")
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth < model.config.block_size:
        problems.append(
            f"depth must be an integer in [0, block_size - 1 = {model.config.block_size - 1}] (0: no MTP), "
            f"got {depth!r}"
        )
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        problems.append(f"weight (lambda) must be a finite number >= 0 (DeepSeek-V3: 0.3, then 0.1), got {weight!r}")
    return problems
