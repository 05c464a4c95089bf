"""Scaled dot-product attention and multi-head attention, from scratch, and what they cost.

Every query row of ``Q`` scores every key row of ``K``, the scores become weights with a softmax,
and the output is the weighted average of the rows of ``V``:

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V

``M`` is 0 where a query may attend to a key and -inf where it may not (a causal mask hides the
future, a padding mask hides padding). Masks follow ``torch.nn.functional.scaled_dot_product_attention``:
a boolean mask is True where attention is allowed, a float mask is added to the scores. (Beware:
``torch.nn.MultiheadAttention`` uses the opposite boolean convention, True = masked out.)

Multi-head attention projects the input with W_Q, W_K, W_V, splits the width d_model into h heads of
d_k = d_model / h, attends in every head independently, concatenates the heads and mixes them with W_O.

The explicit computation keeps the T x T softmax output of every head for the backward pass, so its
saved activations grow as T^2; a fused (flash) kernel keeps only one log-sum-exp per query row and
recomputes the weights in backward. :func:`attention_saved_bytes` counts both exactly and
:func:`saved_for_backward` measures them.

Source: Vaswani et al. 2017, "Attention Is All You Need", Sec. 3.2; PyTorch documentation,
``torch.nn.functional.scaled_dot_product_attention`` and ``torch.nn.MultiheadAttention``;
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1;
Dao et al. 2022, "FlashAttention".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .measure import saved_by_call


def causal_mask(seq_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean (T, T) mask, True on and below the diagonal: query i may attend to keys 0..i."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The boolean mask as the matrix M of the formula: 0 where allowed, -inf where masked."""
    if mask.dtype != torch.bool:
        raise ValueError(f"additive_mask converts a boolean mask, got dtype {mask.dtype}")
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _check_attention_inputs(q, k, v, mask, causal, dropout_p) -> None:
    problems = []
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        problems.append(
            f"q, k and v need at least 2 dimensions (..., positions, features), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    else:
        if q.shape[-1] != k.shape[-1]:
            problems.append(
                f"query and key must have the same feature size d_k to be compared, got q {tuple(q.shape)} "
                f"and k {tuple(k.shape)}; project both to one size"
            )
        if k.shape[-2] != v.shape[-2]:
            problems.append(
                f"key and value must have the same number of positions, got k {tuple(k.shape)} "
                f"and v {tuple(v.shape)}"
            )
        if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
            problems.append(
                f"q, k and v must have the same leading (batch, head) dimensions, got "
                f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}"
            )
        if causal and q.shape[-2] != k.shape[-2]:
            problems.append(
                f"causal=True needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}; "
                "pass an explicit boolean mask instead"
            )
        if mask is not None:
            scores_shape = (*q.shape[:-1], k.shape[-2])
            if mask.dtype != torch.bool and not mask.is_floating_point():
                problems.append(f"mask must be boolean (True = attend) or float (added), got {mask.dtype}")
            try:
                if torch.broadcast_shapes(mask.shape, scores_shape) != scores_shape:
                    raise RuntimeError
            except RuntimeError:
                problems.append(
                    f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                    f"{scores_shape} (..., queries, keys)"
                )
    if not 0.0 <= dropout_p < 1.0:
        problems.append(f"dropout_p must be in [0, 1), got {dropout_p}")
    if problems:
        raise ValueError("; ".join(problems))


def _allowed(mask, causal, n_queries, device) -> torch.Tensor | None:
    """Boolean mask of allowed (query, key) pairs, or None when everything is allowed.

    Raises if some query is left with no key at all: its softmax would be over nothing.
    """
    allowed = None
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask != float("-inf")
    if causal:
        tril = causal_mask(n_queries, device=device)
        allowed = tril if allowed is None else allowed & tril
    if allowed is not None and not allowed.any(dim=-1).all():
        row = tuple(int(i) for i in (~allowed.any(dim=-1)).nonzero()[0])
        raise ValueError(
            f"the mask leaves query {row} (index into the mask's (..., query) dimensions) with no key to "
            "attend to, and a softmax over nothing is undefined; let every query see at least one key "
            "(with padding, mask padded keys only and drop sequences that are all padding)"
        )
    return allowed


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + M) v for q (..., L, d_k), k (..., S, d_k), v (..., S, d_v).

    ``mask`` broadcasts to (..., L, S): boolean (True = may attend) or float (added to the scores).
    ``causal`` additionally hides the keys after each query. ``scale`` defaults to 1/sqrt(d_k).
    ``dropout_p`` drops weights (and rescales the rest by 1/(1 - p)) whenever it is positive, as the
    PyTorch function does; a module passes 0 in eval mode. Returns ``(output, weights)``, where
    ``weights`` (..., L, S) are the weights that multiplied ``v`` (after dropout).
    A query that the masks leave with no key at all is an error, not a row of NaNs.
    """
    _check_attention_inputs(q, k, v, mask, causal, dropout_p)
    allowed = _allowed(mask, causal, q.shape[-2], q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask
    if causal or (mask is not None and mask.dtype == torch.bool):
        # -inf before the softmax is exactly weight 0 after it.
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = F.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, d_model) -> (B, n_heads, T, d_model / n_heads): each head becomes a batch entry."""
    if x.dim() != 3:
        raise ValueError(f"split_heads expects (batch, positions, d_model), got shape {tuple(x.shape)}")
    batch, seq_len, d_model = x.shape
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1 or d_model % n_heads:
        divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
        raise ValueError(
            f"d_model ({d_model}) must be divisible by n_heads ({n_heads!r}); choose n_heads from {divisors}"
        )
    return x.view(batch, seq_len, n_heads, d_model // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, h, T, d_head) -> (B, T, h * d_head): the concatenation of the heads, the inverse of split_heads."""
    if x.dim() != 4:
        raise ValueError(f"merge_heads expects (batch, heads, positions, d_head), got shape {tuple(x.shape)}")
    batch, n_heads, seq_len, d_head = x.shape
    return x.transpose(1, 2).reshape(batch, seq_len, n_heads * d_head)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate W_Q, W_K, W_V, W_O; inputs are batch first, (B, T, d_model).

    ``forward(query, key=None, value=None)`` is self-attention when ``key`` and ``value`` are None.
    ``mask`` broadcasts to (B, h, L, S) with the conventions of :func:`scaled_dot_product_attention`
    (boolean True = may attend). ``padding_mask`` (B, S) is True (or 1) at real tokens and False (0)
    at padding, as the ``attention_mask`` of a Hugging Face tokenizer. Returns ``(output, weights)``:
    the weights (B, L, S) averaged over heads, or (B, h, L, S) with ``average_weights=False``, or
    None with ``need_weights=False``.
    """

    def __init__(self, d_model: int, n_heads: int, *, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        problems = []
        for name, value in (("d_model", d_model), ("n_heads", n_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if not problems and d_model % n_heads:
            divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
            problems.append(
                f"d_model ({d_model}) must be divisible by n_heads ({n_heads}); "
                f"choose n_heads from {divisors}"
            )
        if not 0.0 <= dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {dropout}")
        if problems:
            raise ValueError("invalid MultiHeadAttention: " + "; ".join(problems))
        self.d_model, self.n_heads, self.dropout = d_model, n_heads, dropout
        self.head_dim = d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model, bias=bias)
        self.w_k = nn.Linear(d_model, d_model, bias=bias)
        self.w_v = nn.Linear(d_model, d_model, bias=bias)
        self.w_o = nn.Linear(d_model, d_model, bias=bias)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = True,
        average_weights: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value, mask, padding_mask, causal)
        if padding_mask is not None:
            # (B, S) -> (B, 1, 1, S): the same keys are hidden from every head and every query.
            keys_allowed = padding_mask.to(torch.bool)[:, None, None, :]
            if mask is None:
                mask = keys_allowed
            elif mask.dtype == torch.bool:
                mask = mask & keys_allowed
            else:
                mask = mask.masked_fill(~keys_allowed, float("-inf"))
        _allowed(mask, causal, query.shape[1], query.device)  # every query must see a key, checked up front
        q = split_heads(self.w_q(query), self.n_heads)
        k = split_heads(self.w_k(key), self.n_heads)
        v = split_heads(self.w_v(value), self.n_heads)
        heads, weights = scaled_dot_product_attention(
            q, k, v, mask=mask, causal=causal, dropout_p=self.dropout if self.training else 0.0
        )
        output = self.w_o(merge_heads(heads))
        if not need_weights:
            return output, None
        return output, weights.mean(dim=1) if average_weights else weights

    def _check_inputs(self, query, key, value, mask, padding_mask, causal) -> None:
        problems = []
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 3 or t.shape[-1] != self.d_model:
                problems.append(
                    f"{name} must be (batch, positions, d_model={self.d_model}), got {tuple(t.shape)}"
                )
        if not problems:
            if not query.shape[0] == key.shape[0] == value.shape[0]:
                problems.append(
                    f"query, key and value must have the same batch size, got "
                    f"{query.shape[0]}, {key.shape[0]}, {value.shape[0]}"
                )
            if key.shape[1] != value.shape[1]:
                problems.append(
                    f"key and value must have the same length, got {key.shape[1]} and {value.shape[1]}"
                )
            if padding_mask is not None and tuple(padding_mask.shape) != (key.shape[0], key.shape[1]):
                problems.append(
                    f"padding_mask must be (batch, key positions) = {(key.shape[0], key.shape[1])}, "
                    f"got {tuple(padding_mask.shape)}"
                )
            scores_shape = (query.shape[0], self.n_heads, query.shape[1], key.shape[1])
            if mask is not None:
                try:
                    broadcast_ok = torch.broadcast_shapes(mask.shape, scores_shape) == scores_shape
                except RuntimeError:
                    broadcast_ok = False
                if not broadcast_ok:
                    problems.append(
                        f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                        f"{scores_shape} (batch, heads, queries, keys)"
                    )
            if causal and query.shape[1] != key.shape[1]:
                problems.append(
                    f"causal=True needs as many queries as keys, got {query.shape[1]} and {key.shape[1]}"
                )
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy the weights of a ``torch.nn.MultiheadAttention`` (same width for query, key and value).

        PyTorch packs W_Q, W_K and W_V into one (3 d_model, d_model) ``in_proj_weight``, in that order.
        """
        if not mha._qkv_same_embed_dim:
            raise ValueError("only an nn.MultiheadAttention with kdim == vdim == embed_dim can be copied")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no counterpart in MultiHeadAttention")
        ours = cls(mha.embed_dim, mha.num_heads, bias=mha.in_proj_bias is not None, dropout=mha.dropout)
        w_q, w_k, w_v = mha.in_proj_weight.detach().chunk(3, dim=0)
        biases = mha.in_proj_bias.detach().chunk(3) if mha.in_proj_bias is not None else (None, None, None)
        for linear, weight, bias in zip((ours.w_q, ours.w_k, ours.w_v), (w_q, w_k, w_v), biases, strict=True):
            _copy_linear(linear, weight, bias)
        _copy_linear(ours.w_o, mha.out_proj.weight.detach(), _detached(mha.out_proj.bias))
        return ours

    @classmethod
    def from_bert(cls, bert_attention: nn.Module) -> MultiHeadAttention:
        """Copy the weights of one attention layer of a Hugging Face BERT (``encoder.layer[i].attention``).

        W_O is BERT's ``output.dense``; the residual connection and LayerNorm that follow it in BERT
        are not part of attention and are not copied.
        """
        attn, out = bert_attention.self, bert_attention.output.dense
        n_heads = attn.num_attention_heads
        ours = cls(out.out_features, n_heads, bias=attn.query.bias is not None, dropout=attn.dropout.p)
        for linear, theirs in (
            (ours.w_q, attn.query),
            (ours.w_k, attn.key),
            (ours.w_v, attn.value),
            (ours.w_o, out),
        ):
            _copy_linear(linear, theirs.weight.detach(), _detached(theirs.bias))
        return ours


def _detached(t):
    return None if t is None else t.detach()


def _copy_linear(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)


# ----- What attention costs: saved activations, and the sqrt(d_k) of the scores ----------------------


@dataclass(frozen=True)
class SavedStorage:
    """One storage that autograd keeps for the backward pass, named by the first tensor saved on it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class SavedForBackward:
    """What one forward pass keeps for its backward pass: the total, and each storage."""

    total_bytes: int
    storages: tuple[SavedStorage, ...]


def saved_for_backward(fn: Callable, *args, exclude: Iterable[torch.Tensor] = ()) -> SavedForBackward:
    """Run ``fn(*args)`` and count the bytes of the tensors autograd saves for its backward pass.

    Every saved tensor passes through a ``saved_tensors_hooks`` pack hook (``measure.saved_by_call``).
    Views share their base's storage (``k.transpose(-2, -1)`` is ``k``), so storages are counted once
    each. Tensors whose storage belongs to ``exclude`` (pass the module's parameters: a Linear saves its
    weight, as a transposed view) are not activations and are left out.
    """
    saved = saved_by_call(fn, *args, exclude=exclude)
    storages = tuple(SavedStorage(t.shape, t.dtype, t.nbytes) for t in saved.tensors if t.nbytes)
    return SavedForBackward(saved.total, storages)


ATTENTION_IMPLS = ("explicit", "sdpa")


def attention_saved_bytes(
    batch: int,
    seq_len: int,
    n_heads: int,
    head_dim: int,
    *,
    impl: str = "explicit",
    masked: bool = True,
    dtype_bytes: int = 4,
    projections: bool = False,
) -> dict[str, int]:
    """Bytes saved for backward by one attention call on (B, h, T, d_head) inputs, term by term.

    ``explicit`` (this module's function, or the model's explicit path) keeps Q, K, V, the softmax
    output P of every head (B h T^2 numbers, the T^2 term) and, if masked, the boolean mask once
    (T^2 bytes, shared by the batch and the heads). ``sdpa`` (PyTorch's fused CPU flash kernel)
    keeps Q, K, V, the output O and one float32 log-sum-exp per query row (B h T numbers).
    ``projections`` adds what the surrounding layer keeps: the input of the Q/K/V projection and the
    input of the output projection, B T d_model each (for ``sdpa`` the latter is O itself). Without
    dropout and with 2-byte numbers, the explicit layer's terms are Korthikanti et al.'s
    10 s b h + 2 a s^2 b (plus the mask).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    sizes = {
        "batch": batch,
        "seq_len": seq_len,
        "n_heads": n_heads,
        "head_dim": head_dim,
        "dtype_bytes": dtype_bytes,
    }
    bad = [
        f"{k} must be an integer >= 1, got {v!r}" for k, v in sizes.items() if not isinstance(v, int) or v < 1
    ]
    if bad:
        raise ValueError("; ".join(bad))
    b, t, h, d = batch, seq_len, n_heads, head_dim
    terms = {}
    if projections:
        terms["layer input x (for W_Q, W_K, W_V)"] = b * t * h * d * dtype_bytes
    terms["Q, K, V"] = 3 * b * h * t * d * dtype_bytes
    if impl == "explicit":
        terms["softmax output P (s x s per head)"] = b * h * t * t * dtype_bytes
        if masked:
            terms["mask (s x s booleans)"] = t * t
        if projections:
            terms["merged heads (input of W_O)"] = b * t * h * d * dtype_bytes
    else:
        # The kernel allocates O as (B, T, h, d_head), so merging the heads is free and W_O saves
        # the same storage: no separate term for the input of W_O.
        terms["output O (also the input of W_O)"] = b * h * t * d * dtype_bytes
        terms["log-sum-exp (s per head, float32)"] = b * h * t * 4
    return terms


def attention_forward_flops(batch: int, seq_len: int, n_heads: int, head_dim: int) -> int:
    """Matmul FLOPs of one attention forward: Q K^T and P V, each 2 T^2 d_head per head (mask ignored)."""
    return 2 * (2 * batch * n_heads * seq_len * seq_len * head_dim)


def forward_backward_seconds(
    fn: Callable, make_args: Callable[[int], list], lengths: Iterable[int], *, rounds: int = 5,
    clock: Callable[[], float] = time.process_time,
) -> list[float]:
    """Seconds of ``fn(*make_args(s)).sum().backward()`` at each length ``s``: the fastest of ``rounds``.

    Made to give the shape of time against length on a shared machine:

    - ``clock`` defaults to the CPU time of this process, so the time slices the operating system gives
      to other programs do not count (wall time would; run with ``torch.set_num_threads(1)`` so that the
      CPU time of one thread is the time of the work);
    - the lengths are interleaved, one call of each per round, so that a busy period slows every length
      alike instead of one length wholesale;
    - each length keeps its fastest round (a competing program can only make a call slower), after one
      warm-up call per length that pays for allocation and kernel selection.
    """
    lengths = list(lengths)
    if rounds < 1 or not lengths:
        raise ValueError(f"need rounds >= 1 and at least one length, got rounds={rounds}, lengths={lengths}")
    inputs = [make_args(s) for s in lengths]
    best = [math.inf] * len(lengths)
    for round_ in range(rounds + 1):
        for i, args in enumerate(inputs):
            start = clock()
            out = fn(*args)
            out = out[0] if isinstance(out, tuple) else out
            out.sum().backward()
            elapsed = clock() - start
            if round_:  # round 0 is the warm-up
                best[i] = min(best[i], elapsed)
            for a in args:
                if isinstance(a, torch.Tensor):
                    a.grad = None
    return best


@dataclass(frozen=True)
class SoftmaxStats:
    """How peaked the attention weights of random queries and keys are, and what gradient flows back.

    Means over the rows unless said otherwise: over the queries for the weights and for d loss / d q,
    over the keys for d loss / d k.
    """

    score_std: float  # standard deviation of the scores fed to the softmax
    max_weight: float  # the largest weight in a row: 1/n_keys when uniform, 1 when saturated
    entropy: float  # nats: ln(n_keys) when uniform, 0 when saturated
    score_grad_norm: float  # ||d loss / d S|| of a row, S the (scaled) scores, for a random upstream gradient
    query_grad_norm: float  # ||d loss / d q|| of a query: what reaches W_Q
    query_grad_median: float  # its median over the queries: what a typical query receives
    query_grad_max: float  # its largest value over the queries
    query_grad_top_share: float  # the share of sum_i ||d loss / d q_i||^2 held by the 10 % of queries with most
    key_grad_norm: float  # ||d loss / d k|| of a key: what reaches W_K


def dot_product_variance(d_k: int, *, n_pairs: int = 10_000, seed: int = 0) -> float:
    """Sample variance of q . k for independent q, k with i.i.d. N(0, 1) entries (theory: d_k)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_pairs, d_k, generator=gen, dtype=torch.float64)
    k = torch.randn(n_pairs, d_k, generator=gen, dtype=torch.float64)
    return float((q * k).sum(dim=-1).var())


def attention_score_gradients(
    q: torch.Tensor, k: torch.Tensor, upstream: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights P = softmax(S), S = scale q k^T, and the gradients of L = sum(P * upstream), by autograd.

    Returns (P, dL/dS, dL/dq, dL/dk). By the chain rule dL/dS = P * (upstream - rowsum(P * upstream)),
    dL/dq = scale dL/dS k and dL/dk = scale (dL/dS)^T q: the scale that shrinks the scores also shrinks
    the gradient that goes back through them.
    """
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    scores = scale * (q @ k.T)
    scores.retain_grad()
    p = F.softmax(scores, dim=-1)
    (p * upstream).sum().backward()
    return p.detach(), scores.grad, q.grad, k.grad


def softmax_stats(
    d_k: int, *, scaled: bool, n_queries: int = 512, n_keys: int = 64, seed: int = 0
) -> SoftmaxStats:
    """Softmax of q k^T (divided by sqrt(d_k) if ``scaled``) for N(0, 1) queries and keys of width d_k.

    Unscaled, the scores of a wide head have standard deviation sqrt(d_k) and the softmax saturates: its
    entropy collapses and d loss / d S shrinks, since the Jacobian diag(p) - p p^T vanishes as p becomes
    one-hot. The gradient that reaches q and k is d loss / d S times keys (queries) of norm sqrt(d_k), not
    sqrt(d_k) / sqrt(d_k): on average it is larger than with the scaling, and it is concentrated on the few
    rows whose two largest scores nearly tie, while a typical row receives almost nothing.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_queries, d_k, generator=gen, dtype=torch.float64)
    k = torch.randn(n_keys, d_k, generator=gen, dtype=torch.float64)
    upstream = torch.randn(n_queries, n_keys, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(d_k) if scaled else 1.0
    p, d_scores, d_q, d_k_ = attention_score_gradients(q, k, upstream, scale=scale)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=-1)
    query_grads = d_q.norm(dim=-1)
    squares = (query_grads**2).sort(descending=True).values
    return SoftmaxStats(
        score_std=float((scale * (q @ k.T)).std()),
        max_weight=float(p.max(dim=-1).values.mean()),
        entropy=float(entropy.mean()),
        score_grad_norm=float(d_scores.norm(dim=-1).mean()),
        query_grad_norm=float(query_grads.mean()),
        query_grad_median=float(query_grads.median()),
        query_grad_max=float(query_grads.max()),
        query_grad_top_share=float(squares[: max(1, n_queries // 10)].sum() / squares.sum()),
        key_grad_norm=float(d_k_.norm(dim=-1).mean()),
    )
