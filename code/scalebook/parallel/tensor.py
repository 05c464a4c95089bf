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
head produces V/t logits per token on each rank, and :func:`vocab_parallel_cross_entropy` computes the
loss from the shards with three all-reduces of one number per token (maximum, sum of exponentials,
target logit), so the (b s, V) logits never exist on one rank.

With ``sequence_parallel=True`` the operators at the borders become those of
:mod:`scalebook.parallel.sequence` (all-gather / reduce-scatter along the sequence), and the LayerNorms,
residual additions and position embeddings work on s/t tokens per rank.

A :class:`TensorParallelGPT` is built from an unsharded :class:`scalebook.model.GPT`, each rank copying its
shard (as Megatron-LM's CPU initialization does, so that results do not depend on t), which makes it
comparable, loss and gradients, with the model it came from.

Source: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", Sec. 3 and Fig. 3; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.2; Megatron-LM, ``megatron/core/tensor_parallel/{layers,mappings,cross_entropy}.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scalebook import data, measure
from scalebook.accounting.comm import alpha_beta_time
from scalebook.accounting.params import layer_matmul_weights
from scalebook.comm import count_traffic, launch
from scalebook.configs import ModelConfig
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.sequence import (
    all_gather_linear,
    all_reduce_sequence_parallel_grads,
    mark_sequence_parallel,
    reduce_scatter_to_sequence_parallel_region,
)
from scalebook.parity import max_relative_difference

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
    """``Y_i = X A_i``: this rank's ``out_features / t`` outputs of a linear layer; the input is whole."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group=None, sequence_parallel=False):
        super().__init__()
        tp = dist.get_world_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x holds s/t tokens: gather the sequence first
            return all_gather_linear(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Z = sum_i Y_i B_i``: this rank's ``in_features / t`` inputs; the partial products are summed."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group=None, sequence_parallel=False):
        super().__init__()
        tp = dist.get_world_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        # The bias is added once, after the sum, so every rank holds all of it.
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
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

    def __init__(self, vocab_size: int, dim: int, *, group=None, sequence_parallel=False):
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = rank * (vocab_size // tp)
        self.vocab_end = self.vocab_start + vocab_size // tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp, dim))

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


class TensorParallelAttention(nn.Module):
    """Causal self-attention over this rank's ``n_head / t`` heads."""

    def __init__(self, config: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__()
        tp = dist.get_world_size(group)
        self.n_local_heads, self.head_dim, self.attn_impl = config.n_head // tp, config.head_dim, config.attn_impl
        h = config.n_embd
        kw = dict(bias=config.bias, group=group, sequence_parallel=sequence_parallel)
        self.c_attn = ColumnParallelLinear(h, 3 * h, **kw)
        self.c_proj = RowParallelLinear(h, h, **kw)
        future = torch.ones(config.block_size, config.block_size, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (b, s, 3 h/t): Q, K and V of this rank's heads
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        if self.attn_impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            y = F.softmax(scores.masked_fill(self.future[:T, :T], float("-inf")), dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class TensorParallelMLP(nn.Module):
    """h -> 4h/t (column-parallel) -> GELU -> h (row-parallel)."""

    def __init__(self, config: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__()
        kw = dict(bias=config.bias, group=group, sequence_parallel=sequence_parallel)
        self.c_fc = ColumnParallelLinear(config.n_embd, 4 * config.n_embd, **kw)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = RowParallelLinear(4 * config.n_embd, config.n_embd, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


def _layer_norm(config: GPTConfig, sequence_parallel: bool) -> nn.LayerNorm:
    norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
    if sequence_parallel:
        for p in norm.parameters():
            mark_sequence_parallel(p)
    return norm


class TensorParallelBlock(nn.Module):
    """The pre-LN block of :class:`scalebook.model.Block` with tensor-parallel attention and MLP."""

    def __init__(self, config: GPTConfig, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.ln_1 = _layer_norm(config, sequence_parallel)
        self.attn = TensorParallelAttention(config, group, sequence_parallel)
        self.ln_2 = _layer_norm(config, sequence_parallel)
        self.mlp = TensorParallelMLP(config, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TensorParallelGPT(nn.Module):
    """One tensor-parallel rank's part of a :class:`scalebook.model.GPT`; build it with :meth:`from_gpt`.

    ``forward(idx, targets)`` returns ``(logits, loss)``: this rank's (b, s, V/t) logits and the mean
    cross-entropy over all tokens (the same number on every rank). Parameters carry the names of the
    GPT they came from. Under sequence parallelism call
    :func:`scalebook.parallel.sequence.all_reduce_sequence_parallel_grads` after the backward pass.
    """

    def __init__(self, config: GPTConfig, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        validate_tensor_parallel(config, self.tp)
        self.config, self.group, self.sequence_parallel = config, group, sequence_parallel
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, group=group,
                                          sequence_parallel=sequence_parallel)  # fmt: skip
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        if sequence_parallel:
            mark_sequence_parallel(self.wpe.weight)
        self.blocks = nn.ModuleList(
            TensorParallelBlock(config, group, sequence_parallel) for _ in range(config.n_layer)
        )
        self.ln_f = _layer_norm(config, sequence_parallel)

    @classmethod
    def from_gpt(cls, model: GPT, group=None, *, sequence_parallel: bool = False) -> TensorParallelGPT:
        """This rank's shard of every weight of ``model`` (the LM head is tied to ``wte`` and shares its shard)."""
        tp_model = cls(model.config, group, sequence_parallel=sequence_parallel)
        full = dict(model.named_parameters())  # the tied head appears once, as wte.weight
        with torch.no_grad():
            for name, param in tp_model.named_parameters():
                param.copy_(shard_tensor(full[name].detach(), sharding_of(name), tp_model.rank, tp_model.tp))
        return tp_model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        validate_tensor_parallel(self.config, self.tp, sequence_parallel=self.sequence_parallel, seq_len=T)
        positions = torch.arange(T, device=idx.device)
        if self.sequence_parallel:  # this rank's tokens only, from here to the LM head
            positions = positions.chunk(self.tp)[self.rank]
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.sequence_parallel:
            logits = all_gather_linear(x, self.wte.weight, None, self.group)
        else:
            logits = F.linear(copy_to_tensor_parallel_region(x, self.group), self.wte.weight)
        loss = None
        if targets is not None:
            losses = vocab_parallel_cross_entropy(
                logits.reshape(B * T, -1), targets.reshape(-1), self.wte.vocab_start, self.group
            )
            loss = losses.mean()
        return logits, loss

    def _gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        full = {}
        for name, tensor in tensors.items():
            layout = sharding_of(name)
            if layout is None:
                full[name] = tensor.detach().clone()
                continue
            pieces = [torch.empty_like(tensor) for _ in range(self.tp)]
            dist.all_gather(pieces, tensor.detach().contiguous(), group=self.group)
            full[name] = unshard_tensor(pieces, layout)
        return full

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled in the unsharded GPT's layout (a collective: all ranks call it)."""
        return self._gather(dict(self.named_parameters()))

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient in the unsharded GPT's layout (a collective: all ranks call it)."""
        return self._gather({name: p.grad for name, p in self.named_parameters()})


# ----------------------------------------------------------------------------- time: why TP stays in a node


@dataclass(frozen=True)
class LayerTimes:
    """Seconds one Transformer layer spends per micro-batch (forward + backward) on one tensor-parallel rank."""

    compute: float
    communication: float

    @property
    def communication_fraction(self) -> float:
        """Share of the step spent communicating if nothing overlaps: comm / (compute + comm)."""
        return self.communication / (self.compute + self.communication)


def tensor_parallel_layer_times(
    cfg: ModelConfig,
    tp: int,
    *,
    seq_len: int,
    micro_batch: int,
    peak_flops: float,
    mfu: float,
    bandwidth: float,
    alpha: float,
    dtype_bytes: int = 2,
) -> LayerTimes:
    """Compute and communication time of one layer's forward and backward pass under tensor parallelism.

    Compute: the layer's training FLOPs, ``3 (2 W + 4 s h)`` per token (W its matmul weights, as in
    :func:`scalebook.accounting.flops_per_token`), split over ``tp`` ranks running at ``mfu`` of
    ``peak_flops``. Communication: four ring all-reduces of the ``s b h`` activations (two forward, two
    backward) over ``tp`` ranks in the alpha-beta model, on a link of ``bandwidth`` B/s per direction with
    latency ``alpha`` s. Sequence parallelism moves the same bytes in the same number of ring steps.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be a fraction in (0, 1], got {mfu!r}")
    tokens, h = seq_len * micro_batch, cfg.d_model
    flops = tokens * 3 * (2 * layer_matmul_weights(cfg) + 4 * seq_len * h)
    message = tokens * h * dtype_bytes
    comm = 4 * alpha_beta_time("all_reduce", message, tp, alpha=alpha, bandwidth=bandwidth)
    return LayerTimes(compute=flops / (tp * peak_flops * mfu), communication=comm)


# ---------------------------------------------------------------------------------- measuring it on ranks


def _traffic_by_op(traffic) -> dict[str, tuple[int, float]]:
    """``{op: (calls, bytes sent)}``; a library collective's bytes are the ring algorithm's for its message."""
    return {op: (count, float(sent)) for op, (count, sent) in traffic.by_op().items()}


def _bytes_by_sharding(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of the tensors of sharded parameters and of replicated ones, by the parameter names."""
    sharded = [t for name, t in tensors.items() if sharding_of(name) is not None]
    replicated = [t for name, t in tensors.items() if sharding_of(name) is None]
    return {"sharded": measure.tensor_bytes(sharded), "replicated": measure.tensor_bytes(replicated)}


def _tensor_parallel_groups(tp: int):
    """This rank's group of ``tp`` consecutive ranks (every rank creates every group, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, tp):
        group = dist.new_group(list(range(first, first + tp)))
        if first <= rank < first + tp:
            mine = group
    return mine


def _check_study(config: GPTConfig, tps: tuple[int, ...], world: int, seq_len: int, micro_batch: int) -> None:
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for tp in tps:
        validate_tensor_parallel(config, tp, sequence_parallel=True, seq_len=seq_len)
    if any(world % tp for tp in tps):
        raise ValueError(f"every tensor-parallel size in {tps} must divide the number of ranks ({world})")


def measure_tensor_parallel(
    tps: tuple[int, ...] = (2, 4), *, size: str = "tiny", seq_len: int = 64, micro_batch: int = 4, seed: int = 0
) -> dict:
    """Run on ``max(tps)`` ranks (:func:`scalebook.comm.launch`): compare TP and TP+SP with the unsharded GPT.

    Every rank builds the same GPT and batch of real text, computes the reference loss and gradients,
    then for each ``tp`` in ``tps`` (groups of consecutive ranks) and with and without sequence
    parallelism: the loss and gathered gradients of the sharded model and their largest deviation from
    the reference (``grad_error`` absolute, ``grad_rel_error`` by :func:`scalebook.parity.max_relative_difference`); the
    communication calls, message bytes and ring bytes sent of one block's forward and backward pass and
    of the whole model; the activation bytes saved for backward inside the blocks; the parameter bytes.
    Returns ``{"reference": {...}, (tp, sp): {...}, ...}`` as seen by this rank.
    """
    torch.manual_seed(seed)
    config = GPTConfig.named(size)
    _check_study(config, tps, dist.get_world_size(), seq_len, micro_batch)
    reference = GPT(config)
    tokens = data.tokenize(data.default_corpus())
    idx, targets = data.get_batch(tokens, micro_batch, seq_len, torch.Generator().manual_seed(seed))
    _, ref_loss = reference(idx, targets)
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    ref_grads = {name: p.grad for name, p in ref_params.items()}
    saved = measure.saved_activation_bytes(reference, (idx, targets), layers=reference.blocks)
    results = {
        "reference": {
            "loss": ref_loss.item(),
            "activation_bytes": saved.in_layers,
            "param_bytes": _bytes_by_sharding(ref_params),
            "logits_shape": (micro_batch, seq_len, config.vocab_size),
        }
    }
    groups = {tp: _tensor_parallel_groups(tp) for tp in tps}
    for tp in tps:
        for sp in (False, True):
            model = TensorParallelGPT.from_gpt(reference, groups[tp], sequence_parallel=sp)
            saved = measure.saved_activation_bytes(model, (idx, targets), layers=model.blocks)
            with count_traffic() as forward:
                logits, loss = model(idx, targets)
            with count_traffic() as backward:
                loss.backward()
            with count_traffic() as grad_sync:
                if sp:
                    all_reduce_sequence_parallel_grads(model, groups[tp])
            grads = model.full_gradients()
            # One block alone: the per-layer traffic, free of the embedding, the head and the loss.
            block_input = torch.randn(micro_batch, seq_len // tp if sp else seq_len, config.n_embd,
                                      generator=torch.Generator().manual_seed(seed), requires_grad=True)  # fmt: skip
            with count_traffic() as layer_forward:
                out = model.blocks[0](block_input)
            with count_traffic() as layer_backward:
                out.backward(torch.ones_like(out))
            params = dict(model.named_parameters())
            results[(tp, sp)] = {
                "loss": loss.item(),
                "loss_error": abs(loss.item() - ref_loss.item()),
                "grad_error": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
                "grad_rel_error": max_relative_difference(grads, ref_grads),
                "logits_shape": tuple(logits.shape),
                "activation_bytes": saved.in_layers,
                "layer_forward": _traffic_by_op(layer_forward),
                "layer_backward": _traffic_by_op(layer_backward),
                "layer_forward_messages": layer_forward.message_bytes_by_op(),
                "layer_backward_messages": layer_backward.message_bytes_by_op(),
                "model_forward": _traffic_by_op(forward),
                "model_backward": _traffic_by_op(backward),
                "grad_sync": _traffic_by_op(grad_sync),
                "param_bytes": _bytes_by_sharding(params),
                "grad_bytes": _bytes_by_sharding({n: p.grad for n, p in params.items()}),
            }
    return results


def tensor_parallel_study(
    tps: tuple[int, ...] = (2, 4),
    *,
    size: str = "tiny",
    seq_len: int = 64,
    micro_batch: int = 4,
    seed: int = 0,
    timeout: float = 300.0,
) -> dict:
    """Check every layout, then run :func:`measure_tensor_parallel` on ``max(tps)`` fresh ranks.

    An impossible layout raises ValueError here, before any process starts. Returns rank 0's results.
    """
    tps = tuple(tps)
    if not tps:
        raise ValueError("tps must name at least one tensor-parallel size, e.g. (2, 4)")
    _check_study(GPTConfig.named(size), tps, max(tps), seq_len, micro_batch)
    results = launch(measure_tensor_parallel, max(tps), tps, size=size, seq_len=seq_len,
                     micro_batch=micro_batch, seed=seed, timeout=timeout)  # fmt: skip
    return results[0]
