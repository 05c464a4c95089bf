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
LayerNorm region now holds ``s / t`` tokens. The modules that need the whole sequence (attention, which
mixes tokens; the MLP and the LM head, whose column-parallel layers take every token) gather it at their
input (:func:`gather_sequence_at_input`, where torchtitan's plan gathers it too). Their first linear layer
needs the whole sequence again in its backward pass (its weight gradient is ``dY^T X`` over all tokens);
keeping the gathered ``X`` would cost the memory sequence parallelism saves, so
:func:`sequence_shard_saving_linear` keeps only this rank's shard and all-gathers it a second time in the
backward pass, as Megatron-LM does.

The position embeddings of a sequence shard are those of its own tokens: :class:`SequenceShardedEmbedding`
looks up this rank's chunk of the positions. Parameters used on a sequence shard (LayerNorm weights, biases
added after a reduce-scatter, position embeddings) receive gradients from ``s / t`` tokens on each rank;
:func:`all_reduce_sequence_parallel_grads` sums them once per step.

Tensors here are batch-first ``(b, s, h)`` like the rest of the package; the sequence is dimension 1.
The collectives move sequence-first copies so that every rank's chunk is one contiguous block.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Sec. 4.2.2 and Fig. 5; Megatron-LM, ``megatron/core/tensor_parallel/mappings.py`` and ``layers.py``;
torchtitan, ``torchtitan/models/llama3/infra/parallelize.py`` (``apply_tp``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SequenceShardedEmbedding",
    "all_reduce_sequence_parallel_grads",
    "gather_from_sequence_parallel_region",
    "gather_sequence_at_input",
    "mark_sequence_parallel",
    "reduce_scatter_to_sequence_parallel_region",
    "sequence_shard_saving_linear",
]

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


class _SequenceShardSavingLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of the gathered sequence that saves only this rank's ``s / t`` tokens of
    ``x`` for backward, and all-gathers them again there."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        mine = x.chunk(dist.get_world_size(group), dim=SEQUENCE_DIM)[dist.get_rank(group)]
        ctx.save_for_backward(mine.contiguous(), weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        # The weight gradient sums over every token, so the whole sequence is gathered again.
        x = _gather_sequence(x_shard, ctx.group)
        grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        # The input's gradient is this rank's part of a sum over ranks: the all-gather that produced the
        # input reduce-scatters it in its own backward pass.
        return grad_out @ weight, grad_weight, grad_bias, None


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s/t, h) -> (b, s, h): all-gather forward, reduce-scatter backward (Korthikanti et al.'s g)."""
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s, h) partial sums -> (b, s/t, h) of the total: reduce-scatter forward, all-gather backward (g-bar)."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def sequence_shard_saving_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group=None):
    """The column-parallel linear layer under sequence parallelism: ``F.linear`` of the (b, s, h) input that
    :func:`gather_sequence_at_input` gathered, keeping only this rank's (b, s/t, h) of it for backward, where
    it is all-gathered again (one more all-gather per call)."""
    return _SequenceShardSavingLinear.apply(x, weight, bias, group)


def _gather_first_input(group, module, args):
    return (gather_from_sequence_parallel_region(args[0], group), *args[1:])


def gather_sequence_at_input(module: nn.Module, group=None):
    """Make ``module`` receive the whole sequence: a forward pre-hook all-gathers its first input (b, s/t, h)
    along the sequence (reduce-scatter in the backward pass), like DTensor's
    ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())``. Returns the hook's handle."""
    return module.register_forward_pre_hook(functools.partial(_gather_first_input, group))


class SequenceShardedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` of positions that looks up only this rank's ``1/t`` chunk of them, in rank order:
    ``wpe(positions)`` of s positions gives the (s/t, h) embeddings of the tokens this rank holds."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.group = group
        mark_sequence_parallel(self.weight)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        mine = positions.chunk(dist.get_world_size(self.group))[dist.get_rank(self.group)]
        return super().forward(mine)


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
