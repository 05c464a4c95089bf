"""Autoregressive sampling: feed the model its own predictions one token at a time.

At every step the logits of the last position become a distribution over the next token. Temperature
``0`` means greedy (argmax); otherwise logits are divided by the temperature and, with ``top_k``, all but
the ``k`` largest are discarded before sampling.

Source: Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration" (sampling strategies).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend each row of ``idx`` (batch, time) by ``max_new_tokens`` tokens; returns the full sequences."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    was_training = model.training
    model.eval()
    block_size = model.config.block_size
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -block_size:])  # the model sees at most block_size tokens
        logits = logits[:, -1, :]
        if temperature == 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, next_token], dim=1)
    model.train(was_training)
    return idx


def complete(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> str:
    """Continue ``prompt`` as text: encode, :func:`generate` with a seeded generator, decode."""
    idx = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    out = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return tokenizer.decode(out[0].tolist())
