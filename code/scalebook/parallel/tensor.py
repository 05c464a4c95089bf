"""Tensor parallelism for scalebook's GPT, as Megatron-LM does it: every matrix multiply split over t ranks.

Each half of a Transformer layer widens, works per column, and narrows back: QKV, attention per head,
output projection; the MLP's first linear layer, GELU per element, its second layer. Megatron-LM splits
the widening matrix by columns and the narrowing one by rows,

    Y = X A,  A = [A_1, ..., A_t]        rank i computes Y_i = X A_i             (column-parallel)
    Z = Y B,  B = [B_1; ...; B_t]        rank i computes Y_i B_i, Z = sum_i Y_i B_i   (row-parallel)

so the per-column work needs no communication and each half costs one all-reduce in the forward pass
(the sum, operator g) and one in the backward pass (every rank used all of X, so the gradients of X sum
over ranks: operator f). f and g are conjugate: f is the identity forward and an all-reduce backward,
g the reverse.

Attention splits by heads: rank i holds heads [i a/t, (i+1) a/t). Our ``c_attn`` fuses the Q, K and V
projections into one (3h, h) matrix, so its shard is the matching rows of each of the three thirds,
and the output projection's shard is the matching columns.

The vocabulary is split too. The embedding matrix (V, h), which the LM head shares, is cut into V/t
rows per rank; a token another rank holds embeds to zeros here and the all-reduce g fills it in. The
head is a column-parallel layer producing V/t logits per token on each rank, and
:func:`vocab_parallel_cross_entropy` computes the loss from the shards with three all-reduces of one
number per token (maximum, sum of exponentials, target logit), so the (b s, V) logits never exist on one rank.

With ``sequence_parallel=True`` the operators at the borders become those of
:mod:`scalebook.parallel.sequence` (all-gather / reduce-scatter along the sequence), and the LayerNorms,
residual additions and position embeddings work on s/t tokens per rank.

:func:`apply_tensor_parallel` does all of this in place on a :class:`scalebook.model.GPT` (or a pipeline
stage of one), the shape of PyTorch's ``parallelize_module``: it swaps in the parallel layers, each rank
copying its shard of the existing weights (as Megatron-LM's CPU initialization does, so that results do not
depend on t), and the model's own forward then runs tensor-parallel. :func:`full_state_dict` and
:func:`full_gradients` gather the shards back into the unsharded model's layout.

Source: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", Sec. 3 and Fig. 3; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.2; Megatron-LM, ``megatron/core/tensor_parallel/{layers,mappings,cross_entropy}.py``;
PyTorch, ``torch.distributed.tensor.parallel.parallelize_module``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scalebook.model import GPT, GPTConfig
from scalebook.parallel.sequence import (
    SequenceShardedEmbedding,
    gather_sequence_at_input,
    mark_sequence_parallel,
    reduce_scatter_to_sequence_parallel_region,
    sequence_shard_saving_linear,
)

__all__ = [
    "SHARDING",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "copy_to_tensor_parallel_region",
    "full_gradients",
    "full_state_dict",
    "reduce_from_tensor_parallel_region",
    "shard_tensor",
    "sharding_of",
    "unshard_tensor",
    "validate_tensor_parallel",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_lm_loss",
]

# ------------------------------------------------------------------------------------------ the layout


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_tensor_parallel(
    config: GPTConfig, tp: int, *, sequence_parallel: bool = False, seq_len: int | None = None
) -> None:
    """Raise one ValueError naming every reason why ``config`` cannot run with tensor-parallel size ``tp``.

    Call it before launching ranks: heads, width and vocabulary must split evenly over ``tp``, and under
    sequence parallelism so must ``seq_len``.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    problems = []
    if config.n_head % tp:
        problems.append(
            f"n_head ({config.n_head}) must be divisible by tp ({tp}), since each rank takes whole attention "
            f"heads; choose tp from {_divisors(config.n_head)}"
        )
    if config.n_embd % tp:
        problems.append(f"n_embd ({config.n_embd}) must be divisible by tp ({tp})")
    if config.vocab_size % tp:
        problems.append(
            f"vocab_size ({config.vocab_size}) must be divisible by tp ({tp}) for the vocabulary-parallel "
            f"embedding; pad the vocabulary to {-(-config.vocab_size // tp) * tp}"
        )
    if config.n_experts:
        problems.append(
            f"n_experts ({config.n_experts}) must be 0: tensor parallelism here splits the dense MLP; spread the "
            "experts over ranks with expert parallelism (scalebook.parallel.expert) instead"
        )
    if config.dropout:
        problems.append(
            f"dropout must be 0 (got {config.dropout}): tensor-parallel dropout needs a random stream per "
            "region (shared by the ranks where activations are replicated, distinct where they are split), "
            "which this implementation does not keep"
        )
    if sequence_parallel and seq_len is None:
        problems.append("sequence parallelism splits the sequence over tp ranks: pass seq_len to check it")
    if seq_len is not None:
        if seq_len > config.block_size:
            problems.append(f"seq_len ({seq_len}) exceeds block_size ({config.block_size})")
        if sequence_parallel and seq_len % tp:
            problems.append(
                f"seq_len ({seq_len}) must be divisible by tp ({tp}) under sequence parallelism; "
                f"use seq_len={seq_len // tp * tp or tp}"
            )
    if problems:
        raise ValueError("invalid tensor-parallel layout: " + "; ".join(problems))


# How each GPT parameter is split (matched by the end of its name): "qkv" takes whole heads from each of
# the Q, K and V thirds; 0 splits the rows of the weight (output features, or vocabulary entries); 1 its
# columns (input features). Parameters not listed (norms, biases of row-parallel layers, position
# embeddings) are replicated.
SHARDING = {
    "attn.c_attn.weight": "qkv",
    "attn.c_attn.bias": "qkv",
    "attn.c_proj.weight": 1,
    "mlp.c_fc.weight": 0,
    "mlp.c_fc.bias": 0,
    "mlp.c_proj.weight": 1,
    "wte.weight": 0,
    "lm_head.weight": 0,
}


def sharding_of(name: str) -> str | int | None:
    """How the GPT parameter ``name`` is split over tensor-parallel ranks (see ``SHARDING``); None: replicated."""
    return next((layout for suffix, layout in SHARDING.items() if name.endswith(suffix)), None)


def shard_tensor(full: torch.Tensor, layout: str | int | None, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` (a copy) under ``layout``."""
    if layout is None:
        return full.clone()
    if layout == "qkv":  # (3h, ...) -> (3, h, ...): take the same rows (heads) of Q, K and V
        return full.unflatten(0, (3, -1)).chunk(tp, dim=1)[rank].flatten(0, 1).clone()
    return full.chunk(tp, dim=layout)[rank].clone()


def unshard_tensor(pieces: list[torch.Tensor], layout: str | int | None) -> torch.Tensor:
    """Reassemble the full tensor from every rank's piece, in rank order (the inverse of :func:`shard_tensor`)."""
    if layout is None:
        return pieces[0]
    if layout == "qkv":
        return torch.cat([p.unflatten(0, (3, -1)) for p in pieces], dim=1).flatten(0, 1)
    return torch.cat(pieces, dim=layout)


# ------------------------------------------------------------------------------- the conjugate operators


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity in the forward pass, all-reduce of the gradient in the backward pass."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce in the forward pass, identity in the backward pass."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f, before a column-parallel layer: forward unchanged, backward all-reduces the gradient."""
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g, after a row-parallel layer: forward all-reduces the partial sums, backward unchanged."""
    return _ReduceFromTensorParallelRegion.apply(x, group)


# ------------------------------------------------------------------------------------------ the layers


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i``: this rank's ``out_features / t`` outputs of a linear layer; the input is whole.

    The LM head is one too (``bias=False``, its weight the vocabulary-parallel embedding's): each rank
    computes the logits of its ``V / t`` vocabulary entries.
    """

    def __init__(
        self, in_features, out_features, *, bias, group=None, sequence_parallel=False, device=None, dtype=None
    ):
        super().__init__()
        tp, kw = dist.get_world_size(group), {"device": device, "dtype": dtype}
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features // tp, **kw)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x is the sequence gathered at the module's input: keep only our tokens of it
            return sequence_shard_saving_linear(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Z = sum_i Y_i B_i``: this rank's ``in_features / t`` inputs; the partial products are summed."""

    def __init__(
        self, in_features, out_features, *, bias, group=None, sequence_parallel=False, device=None, dtype=None
    ):
        super().__init__()
        tp, kw = dist.get_world_size(group), {"device": device, "dtype": dtype}
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, **kw))
        # The bias is added once, after the sum, so every rank holds all of it.
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            out = reduce_from_tensor_parallel_region(partial, self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ranks: rows ``[vocab_start, vocab_end)`` live here."""

    def __init__(self, vocab_size, dim, *, group=None, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = rank * (vocab_size // tp)
        self.vocab_end = self.vocab_start + vocab_size // tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp, dim, device=device, dtype=dtype))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        elsewhere = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = F.embedding((idx - self.vocab_start).masked_fill(elsewhere, 0), self.weight)
        local = local.masked_fill(elsewhere.unsqueeze(-1), 0.0)  # another rank's row: it contributes it
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(local, self.group)
        return reduce_from_tensor_parallel_region(local, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split along the vocabulary, one all-reduce per statistic."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        # log softmax_y = z_y - m - log sum_v exp(z_v - m), with m the maximum over the whole vocabulary.
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        here = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
        local_targets = (targets - vocab_start).masked_fill(~here, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        dist.all_reduce(target_logit, group=group)  # exactly one rank holds each target
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_targets, here)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d z_v = softmax_v - [v = y]: local to each shard, no communication.
        softmax, local_targets, here = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_targets] -= here.to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group=None
) -> torch.Tensor:
    """Cross-entropy of each row of ``logits`` ((n, V/t): this rank's vocabulary slice starting at
    ``vocab_start``) against ``targets`` ((n,) ids in the whole vocabulary); returns the (n,) losses."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group)


def vocab_parallel_lm_loss(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """:func:`scalebook.model.lm_loss` for (B, T, V/t) logits of rank ``r``'s vocabulary slice ``[r V/t, (r+1) V/t)``:
    the mean next-token cross-entropy over every position, in float32, the same number on every rank."""
    logits = logits.reshape(-1, logits.size(-1)).float()
    vocab_start = dist.get_rank(group) * logits.size(-1)
    return vocab_parallel_cross_entropy(logits, targets.reshape(-1), vocab_start, group).mean()


# ----------------------------------------------------------------------------------- applying it to a GPT


def _parallel_linear(cls, linear: nn.Linear, **kw) -> nn.Module:
    """An empty ``cls`` (column- or row-parallel) shaped like ``linear``, on its device and in its dtype."""
    return cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
               device=linear.weight.device, dtype=linear.weight.dtype, **kw)  # fmt: skip


def _parallelize_block(block: nn.Module, group, sequence_parallel: bool) -> None:
    kw = {"group": group, "sequence_parallel": sequence_parallel}
    block.attn.c_attn = _parallel_linear(ColumnParallelLinear, block.attn.c_attn, **kw)
    block.attn.c_proj = _parallel_linear(RowParallelLinear, block.attn.c_proj, **kw)
    block.mlp.c_fc = _parallel_linear(ColumnParallelLinear, block.mlp.c_fc, **kw)
    block.mlp.c_proj = _parallel_linear(RowParallelLinear, block.mlp.c_proj, **kw)
    if sequence_parallel:
        # The norms see s/t tokens (their gradients are partial sums); attention and MLP gather the sequence.
        for p in (*block.ln_1.parameters(), *block.ln_2.parameters()):
            mark_sequence_parallel(p)
        gather_sequence_at_input(block.attn, group)
        gather_sequence_at_input(block.mlp, group)


def apply_tensor_parallel(model: GPT, group=None, *, sequence_parallel: bool = False) -> GPT:
    """Make ``model`` this rank's tensor-parallel part over ``group``, in place; returns it.

    ``model`` is a :class:`scalebook.model.GPT` or a pipeline stage of one (``wte`` or ``lm_head`` may be
    None, ``blocks`` any of its layers). Every rank must pass the same weights: each keeps its shard of them
    (``SHARDING``). The QKV and first MLP layers become :class:`ColumnParallelLinear`, the output
    projections :class:`RowParallelLinear`, ``wte`` a :class:`VocabParallelEmbedding`, the head a
    column-parallel layer over the vocabulary holding the same Parameter as ``wte`` when they were tied, and
    ``model.loss_fn`` :func:`vocab_parallel_lm_loss`. ``model(idx, targets)`` then returns this rank's
    (B, T, V/t) logits and the full loss. Build the optimizer afterwards: the sharded parameters are new.

    With ``sequence_parallel`` the residual stream between the layers holds T/t tokens per rank (a stage's
    input and output too), ``wpe`` returns this rank's positions, and the head gathers the sequence; call
    :func:`scalebook.parallel.sequence.all_reduce_sequence_parallel_grads` after the backward pass.
    """
    if not isinstance(model, GPT):
        raise ValueError(f"apply_tensor_parallel shards a scalebook.model.GPT (or a pipeline stage of one), got a "
                         f"{type(model).__name__}; build the model with scalebook.model.GPT")  # fmt: skip
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    validate_tensor_parallel(model.config, tp)
    full = dict(model.named_parameters())  # the unsharded weights, by name; a tied head appears once
    kw = {"group": group, "sequence_parallel": sequence_parallel}
    for block in model.blocks:
        _parallelize_block(block, group, sequence_parallel)
    tied = model.wte is not None and model.lm_head is not None and model.lm_head.weight is model.wte.weight
    if model.wte is not None:
        wte = model.wte.weight
        model.wte = VocabParallelEmbedding(*wte.shape, device=wte.device, dtype=wte.dtype, **kw)
    if model.lm_head is not None:
        model.lm_head = _parallel_linear(ColumnParallelLinear, model.lm_head, **kw)
        if tied:
            model.lm_head.weight = model.wte.weight
        model.loss_fn = functools.partial(vocab_parallel_lm_loss, group=group)
    if sequence_parallel:
        if model.wte is not None:
            wpe = model.wpe.weight
            model.wpe = SequenceShardedEmbedding(*wpe.shape, group=group, device=wpe.device, dtype=wpe.dtype)
        if model.lm_head is not None:
            for p in model.ln_f.parameters():
                mark_sequence_parallel(p)
            gather_sequence_at_input(model.lm_head, group)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param is not full[name]:  # a new (sharded or re-homed) parameter: copy this rank's piece
                param.copy_(shard_tensor(full[name], sharding_of(name), rank, tp))
    return model


# ---------------------------------------------------------------------------------- gathering it back


def _gather(tensors: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """Each tensor reassembled from every rank's piece by its name's layout; a tensor named twice (a tied
    weight) is gathered once."""
    tp, full, done = dist.get_world_size(group), {}, {}
    for name, tensor in tensors.items():
        if id(tensor) not in done:  # ``tensors`` holds every tensor alive, so ids are not reused meanwhile
            layout, local = sharding_of(name), tensor.detach()
            if layout is None:
                done[id(tensor)] = local.clone()
            else:
                pieces = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(pieces, local.contiguous(), group=group)
                done[id(tensor)] = unshard_tensor(pieces, layout)
        full[name] = done[id(tensor)]
    return full


def full_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict`` (same names, shapes and values), gathered from a model made
    tensor-parallel by :func:`apply_tensor_parallel` over ``group``: a collective, every rank calls it and
    every rank gets it. A pipeline stage gives its own entries."""
    return _gather(model.state_dict(keep_vars=True), group)


def full_gradients(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in the unsharded model's layout, by ``named_parameters`` name (a tied
    weight once); a collective over ``group``. Under sequence parallelism call it after
    :func:`scalebook.parallel.sequence.all_reduce_sequence_parallel_grads`."""
    return _gather({name: p.grad for name, p in model.named_parameters() if p.grad is not None}, group)
