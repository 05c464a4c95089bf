"""Autoregressive sampling: feed the model its own predictions one token at a time.

At every step the logits ``z`` of the last position become a distribution over the next token,
in the order Hugging Face's ``generate`` applies its logits processors:

    temperature   z / T                       T -> 0 approaches greedy (argmax); T = 0 *is* greedy
    top-k         keep the k largest logits   (ties with the k-th are kept too)
    top-p         keep the smallest set of tokens, most probable first, whose probability mass
                  reaches p (always at least the most probable token), measured after top-k
    softmax       over what is left; the discarded tokens get probability exactly 0

:func:`logits_to_probs` is that pipeline, :func:`generate` samples from it (or takes the argmax when
``temperature == 0``), with or without a KV cache, and :func:`complete` wraps both for text in, text out.

Source: Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration" (nucleus sampling);
Hugging Face transformers, ``generation/logits_process.py`` (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper).
"""

from __future__ import annotations

import math

import torch


def check_sampling_args(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> None:
    """Raise one ValueError listing every sampling argument that is out of range."""
    problems = []
    if not (
        isinstance(temperature, (int, float))
        and not isinstance(temperature, bool)
        and temperature >= 0
        and math.isfinite(temperature)
    ):
        problems.append(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        problems.append(f"top_k must be a positive integer or None (no top-k), got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1):
        problems.append(f"top_p must be in (0, 1] or None (no nucleus cut), got {top_p!r}")
    if problems:
        raise ValueError("invalid sampling arguments: " + "; ".join(problems))


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to ``-inf`` every logit that top-k, then top-p, discards (last dimension = vocabulary)."""
    check_sampling_args(top_k=top_k, top_p=top_p)
    if top_k is not None and top_k < logits.size(-1):
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # A token is dropped when the tokens ranked above it already hold at least p of the mass;
        # the most probable token has nothing above it, so it is always kept.
        mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_above >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The next-token distribution the sampler draws from: temperature, top-k, top-p, softmax.

    ``temperature == 0`` returns the greedy choice as a one-hot distribution (the limit T -> 0).
    """
    check_sampling_args(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.size(-1)).to(logits.dtype)
    return torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)


def _next_token(logits, temperature, top_k, top_p, generator) -> torch.Tensor:
    """(batch, 1) next tokens from the last position's logits: argmax at temperature 0, else one draw."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(logits_to_probs(logits, temperature, top_k, top_p), 1, generator=generator)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = False,
) -> torch.Tensor:
    """Extend each row of ``idx`` (batch, time) by ``max_new_tokens`` tokens; returns the full sequences.

    ``temperature=0`` is greedy decoding. Otherwise each token is drawn with ``torch.multinomial`` from
    :func:`logits_to_probs`, using ``generator`` (or torch's global generator when it is None).

    ``use_cache=True`` decodes incrementally with the model's KV cache (``model.new_cache(batch, max_len)``,
    as :class:`scalebook.llama.LlamaLM` has): the prompt is processed once, then each step feeds only the
    newest token, whose query attends to the cached keys and values. Same tokens, less work per step.
    """
    check_sampling_args(temperature, top_k, top_p)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be a (batch, time) tensor with at least one token, got shape {tuple(idx.shape)}")
    if use_cache and not hasattr(model, "new_cache"):
        raise ValueError(
            f"use_cache=True needs a model with a KV cache (new_cache(), such as scalebook.llama.LlamaLM); "
            f"{type(model).__name__} has none: pass use_cache=False"
        )
    block_size = model.config.block_size
    cached_positions = idx.size(1) + max(max_new_tokens - 1, 0)  # the last token is never fed back
    if use_cache and cached_positions > block_size:
        raise ValueError(
            f"the prompt ({idx.size(1)} tokens) plus max_new_tokens - 1 ({max_new_tokens - 1}) exceeds block_size "
            f"{block_size}, the longest sequence a KV cache holds; generate fewer tokens or use use_cache=False"
        )
    was_training = model.training
    model.eval()
    cache = model.new_cache(idx.size(0), cached_positions) if use_cache else None
    new_tokens = idx  # with a cache, only the tokens the model has not seen yet
    for _ in range(max_new_tokens):
        if use_cache:
            logits, _ = model(new_tokens, cache=cache)
        else:
            logits, _ = model(idx[:, -block_size:])  # the model sees at most block_size tokens
        new_tokens = _next_token(logits[:, -1, :], temperature, top_k, top_p, generator)
        idx = torch.cat([idx, new_tokens], dim=1)
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
    top_p: float | None = None,
    seed: int = 0,
) -> str:
    """Continue ``prompt`` as text: encode, :func:`generate` with a seeded generator, decode."""
    idx = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    out = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    return tokenizer.decode(out[0].tolist())
