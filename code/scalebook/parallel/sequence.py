"""Sequence parallelism: the parts of a tensor-parallel layer that tensor parallelism leaves whole, split by tokens.

Tensor parallelism (:mod:`scalebook.parallel.tensor`) splits the matrix multiplies of a layer over ``t``
ranks, but between them every rank holds the whole ``(b, s, h)`` residual stream: the LayerNorms, the
residual additions and the dropouts run ``t`` times on identical data, and their activations are saved
``t`` times. These operations work on each token independently, so they can run on ``s / t`` tokens per
rank instead. Korthikanti et al. call this sequence parallelism, and it changes only the operators at
the borders of the tensor-parallel regions:

    tensor parallel                               sequence parallel
    f:  identity       | all-reduce  (backward)   g:      all-gather along s  | reduce-scatter (backward)
    g:  all-reduce     | identity    (backward)   g-bar:  reduce-scatter      | all-gather     (backward)

A ring all-reduce is a reduce-scatter followed by an all-gather, so the bytes sent stay the same; the
LayerNorm region now holds ``s / t`` tokens. The first linear layer after an all-gather needs the whole
sequence again in its backward pass (its weight gradient is ``dY^T X`` over all tokens); keeping the
gathered ``X`` would cost the memory sequence parallelism saves, so :func:`all_gather_linear` keeps only
this rank's shard and all-gathers it a second time in the backward pass, as Megatron-LM does.

Parameters used on a sequence shard (LayerNorm weights, biases added after a reduce-scatter, position
embeddings) receive gradients from ``s / t`` tokens on each rank; :func:`all_reduce_sequence_parallel_grads`
sums them once per step.

Tensors here are batch-first ``(b, s, h)`` like the rest of the package; the sequence is dimension 1.
The collectives move sequence-first copies so that every rank's chunk is one contiguous block.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Sec. 4.2.2 and Fig. 5; Megatron-LM, ``megatron/core/tensor_parallel/mappings.py`` and ``layers.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQUENCE_DIM = 1


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/t, h) on each rank -> (b, s, h) on every rank, the chunks in rank order."""
    tp = dist.get_world_size(group)
    local = x.transpose(0, SEQUENCE_DIM).contiguous()  # sequence first: each rank's chunk is one block
    gathered = local.new_empty((tp * local.shape[0], *local.shape[1:]))
    dist.all_gather_single(gathered, local, group=group)
    return gathered.transpose(0, SEQUENCE_DIM)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, h) partial sums on each rank -> this rank's (b, s/t, h) chunk of their sum."""
    tp = dist.get_world_size(group)
    full = x.transpose(0, SEQUENCE_DIM).contiguous()
    if full.shape[0] % tp:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by the tensor-parallel size {tp}")
    chunk = full.new_empty((full.shape[0] // tp, *full.shape[1:]))
    dist.reduce_scatter_single(chunk, full, op=dist.ReduceOp.SUM, group=group)
    return chunk.transpose(0, SEQUENCE_DIM)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the sequence in the forward pass; reduce-scatter the gradient in the backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's copy of the whole sequence fed a different part of the next layer: sum the
        # gradients over ranks and keep this rank's tokens.
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence in the forward pass; all-gather the gradient in the backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class _AllGatherLinear(torch.autograd.Function):
    """``F.linear(all_gather(x), weight, bias)`` that saves only the local shard of ``x`` for backward."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.save_for_backward(x_shard, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(_gather_sequence(x_shard, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        # The weight gradient sums over every token, so the whole sequence is gathered again.
        x = _gather_sequence(x_shard, ctx.group)
        grad_x = _reduce_scatter_sequence(grad_out @ weight, ctx.group)
        grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s/t, h) -> (b, s, h): all-gather forward, reduce-scatter backward (Korthikanti et al.'s g)."""
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s, h) partial sums -> (b, s/t, h) of the total: reduce-scatter forward, all-gather backward (g-bar)."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def all_gather_linear(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group=None):
    """The column-parallel linear layer under sequence parallelism: all-gather the (b, s/t, h) input along
    the sequence, multiply by this rank's ``weight`` shard; only the shard is saved, so the backward pass
    all-gathers it again (one more all-gather per call) and reduce-scatters the input gradient."""
    return _AllGatherLinear.apply(x_shard, weight, bias, group)


def mark_sequence_parallel(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Tag a parameter that is used on a sequence shard: its gradient is partial on each rank."""
    param.sequence_parallel = True
    return param


def all_reduce_sequence_parallel_grads(model: torch.nn.Module, group=None) -> int:
    """Sum the gradients of the parameters tagged by :func:`mark_sequence_parallel` over the group.

    One all-reduce of one flat buffer, once per optimizer step (after the last micro-batch's backward).
    Returns the number of gradient elements reduced.
    """
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel()
