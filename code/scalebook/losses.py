"""Chunked cross-entropy: the LM head and the loss over a few tokens at a time, so the logits never exist whole.

A language model's last step maps each of n hidden states h_i (width d) to V logits, z_i = W h_i, and takes

    loss = (1/n) sum_i [ logsumexp(z_i) - z_{i, y_i} ]

whose gradient with respect to the logits is (softmax(z_i) - onehot(y_i)) / n. Written as
``F.cross_entropy(lm_head(h), y)``, autograd keeps the (n, V) log-softmax for the backward pass and builds
an (n, V) gradient beside it: for Llama 3 8B (V = 128,256) at 8,192 tokens, 4.2 GB per fp32 copy.

:func:`chunked_cross_entropy` computes the same loss over chunks of ``chunk_size`` tokens. Its forward
keeps only each token's logsumexp (n numbers); its backward recomputes one chunk's logits at a time, turns
them into that chunk's gradient and multiplies it into the gradients of h and W,

    grad_h[chunk] = G W,    grad_W += G^T h[chunk],    G = (softmax(W h[chunk]) - onehot(y[chunk])) / n,

so only one chunk's logits (turned into its gradient in place) is alive at any moment. The price is the head's
matrix multiply once more in the backward pass. Fused kernels (Liger Kernel's fused linear cross-entropy,
Apple's Cut Cross-Entropy) go further and never write a chunk's logits to memory at all.

Source: Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models" (the logits' memory and
blockwise computation); Hsu et al. 2024, "Liger Kernel" (fused linear cross-entropy, chunked over tokens).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # the default of torch.nn.functional.cross_entropy: targets equal to it do not count


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One chunk's logits, in at least fp32 (16-bit inputs: the softmax runs in fp32, as trainers do)."""
    return (h @ weight.T).to(torch.promote_types(h.dtype, torch.float32))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_size):
        counted = targets != IGNORE_INDEX
        lse = torch.empty(h.shape[0], dtype=torch.promote_types(h.dtype, torch.float32))
        total = torch.zeros((), dtype=lse.dtype)
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = _logits(h[rows], weight)
            z_target = z.gather(1, targets[rows].clamp(min=0).unsqueeze(1)).squeeze(1)  # ignored rows: masked
            z_max = z.amax(dim=1)
            # logsumexp in the logits' own storage: no second (chunk, V) tensor
            lse[rows] = z_max + z.sub_(z_max.unsqueeze(1)).exp_().sum(dim=1).log()
            total += ((lse[rows] - z_target) * counted[rows]).sum()
            del z  # free this chunk before the next one is allocated
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk_size = chunk_size
        return total / counted.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, targets, lse = ctx.saved_tensors
        counted = targets != IGNORE_INDEX
        scale = grad_loss / counted.sum()
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=lse.dtype) if ctx.needs_input_grad[1] else None
        for start in range(0, h.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            g = _logits(h[rows], weight).sub_(lse[rows].unsqueeze(1)).exp_()  # softmax, in the logits' storage
            y = targets[rows].clamp(min=0).unsqueeze(1)
            g.scatter_add_(1, y, -torch.ones_like(y, dtype=g.dtype))  # minus the one-hot
            g.mul_((scale * counted[rows]).unsqueeze(1))  # ignored rows get no gradient
            if grad_h is not None:
                grad_h[rows] = g @ weight.to(g.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.T, h[rows].to(g.dtype))  # in place: no (V, d) temporary
            del g
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None


def chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int = 1024
) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T, targets)`` (mean over the targets that are not -100), computed
    ``chunk_size`` tokens at a time so that at most one chunk's (chunk_size, V) logits are alive in the forward
    or the backward pass.

    ``h``: (..., d) hidden states; ``weight``: the LM head's (V, d) matrix (``lm_head.weight``, no bias);
    ``targets``: (...) token ids. Returns the scalar mean loss; its backward gives the gradients of ``h``
    and ``weight``, recomputing each chunk's logits (see the module docstring). As with ``F.cross_entropy``,
    a batch whose targets are all -100 has no mean: the loss is nan.
    """
    if h.shape[-1:] != weight.shape[1:] or weight.dim() != 2:
        raise ValueError(f"need h (..., d) and weight (V, d) with the same d, got {tuple(h.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"targets must have h's shape without its last dimension, {tuple(h.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer (tokens per chunk), got {chunk_size!r}")
    return _ChunkedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), chunk_size)
