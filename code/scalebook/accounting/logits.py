"""Bytes of the logits, and the peak of the cross-entropy that turns them into a loss.

The LM head gives each of n tokens one logit per vocabulary entry. The softmax and the cross-entropy run in
fp32 even when the matmuls run in bf16, so one copy takes

    logits bytes = n (V / t) 4                (t: vocabulary-parallel ranks, each holding V/t columns)

For Llama 3 8B (V = 128,256) at n = 8,192 tokens that is 4.2 GB, about three of its layers' 16-bit
activations. PyTorch's ``F.cross_entropy(lm_head(h), y)`` runs log-softmax, then the negative log-likelihood;
its backward first builds the gradient of the log-softmax (an n x V tensor that is zero except at the
targets), then that of the logits, while the saved log-softmax is still alive: three copies at the peak,

    peak (unchunked) = 3 n V 4.

Chunked over c tokens (:func:`scalebook.losses.chunked_cross_entropy`) the peak is one chunk's logits, turned
into their gradient in place, beside the gradients being built for the head's weight and for h, a chunk's
product with the weight, and the logsumexp of every token saved by the forward pass:

    peak (chunked) = 4 (c V + V d + n d + c d + n)      (fp32, d: the model width)

Both count only what the loss allocates (h and the weight exist before it), as
:func:`scalebook.measure.peak_allocated_bytes` measures it.

Source: Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models", Sec. 1-3 (the logits'
share of training memory); PyTorch's ``log_softmax`` and ``nll_loss`` backward formulas
(``tools/autograd/derivatives.yaml``).
"""

from __future__ import annotations

from scalebook.accounting import _checks
from scalebook.configs import ModelConfig

SOFTMAX_BYTES = 4  # the loss runs in fp32, whatever the matmuls' precision
UNCHUNKED_COPIES = 3  # saved log-softmax, its gradient, the logits' gradient (see the module docstring)


def _vocab(model: ModelConfig | int) -> int:
    return model.vocab_size if isinstance(model, ModelConfig) else model


def logits_bytes(model: ModelConfig | int, tokens: int, *, tp: int = 1, dtype_bytes: int = SOFTMAX_BYTES) -> int:
    """Bytes of one copy of the logits of ``tokens`` tokens on one rank: tokens x V/t x ``dtype_bytes``.

    ``model``: a ModelConfig or the vocabulary size V. ``tp``: vocabulary-parallel ranks, which must divide V
    (frameworks pad V so that they do: :func:`scalebook.tokenizer.padded_vocab_size`).
    """
    vocab = _vocab(model)
    _checks.require(_checks.positive_int(vocab_size=vocab, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes))
    if vocab % tp:
        raise ValueError(f"tp = {tp} does not divide the vocabulary V = {vocab:,}: pad it first, to "
                         f"scalebook.tokenizer.padded_vocab_size({vocab}, 128, {tp})")
    return tokens * (vocab // tp) * dtype_bytes


def cross_entropy_peak_bytes(
    model: ModelConfig | int, tokens: int, d_model: int, *, chunk_tokens: int | None = None
) -> int:
    """The most bytes the fp32 loss of ``tokens`` tokens allocates at once, forward and backward: PyTorch's
    ``F.cross_entropy(lm_head(h), y)`` (``chunk_tokens=None``, three copies of the logits) or the chunked
    loss with chunks of ``chunk_tokens`` (see the module docstring for both formulas)."""
    vocab = _vocab(model)
    _checks.require(_checks.positive_int(tokens=tokens, d_model=d_model))
    if chunk_tokens is None:
        return UNCHUNKED_COPIES * logits_bytes(vocab, tokens)
    _checks.require(_checks.positive_int(chunk_tokens=chunk_tokens))
    chunk = min(chunk_tokens, tokens)
    return logits_bytes(vocab, chunk) + SOFTMAX_BYTES * (d_model * (vocab + tokens + chunk) + tokens)
