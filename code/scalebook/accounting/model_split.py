"""Cutting a dense model over tp x pp GPUs: which matrix splits how, and what one rank holds.

Tensor parallelism (Megatron-LM) splits each half of a layer as widen-then-narrow: the widening matrices by
their output features ("columns" of Y = X A: W_Q, W_K, W_V or GPT's fused W_QKV, W_gate and W_up or GPT's
W_1, with their biases), whole heads per rank; the narrowing ones by their input features ("rows" of
Z = Y B: W_O, W_down or W_2), whose bias is added once after the all-reduce and so is replicated. The token
embedding and the LM head split by vocabulary, V/t entries per rank. Norms and learned positions are
replicated: every rank holds all of them. Pipeline parallelism gives each of pp stages L/pp whole layers;
the first stage also holds the embeddings, the last the final norm and the head. A head tied to the
embedding is one matrix on one stage; over pp > 1 stages the last one keeps a copy (Megatron-LM's
``share_embeddings_and_output_weights``), which :func:`parameter_split` counts on that stage.

One rank of a stage holds, per piece, ``(L/pp) x (per-layer count) / tp`` for a split per-layer matrix,
``(L/pp) x (per-layer count)`` for a replicated one, ``V h / tp`` for the vocabulary-split ones.

Source: Shoeybi et al. 2019, "Megatron-LM", Sec. 3 and Fig. 3 (column- and row-parallel layers); Narayanan
et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 2.2 and
3 (pipeline stages, embeddings on the first and last stage); Megatron-LM ``VocabParallelEmbedding``.
"""

from __future__ import annotations

from typing import NamedTuple

from scalebook.accounting import _checks
from scalebook.configs import ModelConfig


class Piece(NamedTuple):
    split: str  # "columns", "rows", "vocabulary" or "replicated"
    stages: str  # which pipeline stages hold it: "every", "first" or "last"
    total: int  # parameters of this piece in the whole model (as param_count counts them)
    per_rank: int  # parameters of it on one rank of a stage that holds it


def _problems(cfg, tp, pp) -> list[str]:
    problems = _checks.model_config(cfg) + _checks.positive_int(tp=tp, pp=pp)
    if problems:
        return problems
    if cfg.is_moe or cfg.latent_attention is not None:
        return [
            f"{cfg.name!r} is a mixture of experts or uses latent attention: parameter_split covers dense "
            "models with (grouped-query) attention; spread experts by expert parallelism (Chapter 14)"
        ]
    return _checks.parallel_layout(cfg, tp=tp, pp=pp) + _checks.even_split(cfg, tp=tp, pp=pp)


def parameter_split(cfg: ModelConfig, *, tp: int = 1, pp: int = 1) -> dict[str, Piece]:
    """Every parameter of the dense model ``cfg`` under tensor parallelism ``tp`` and ``pp`` pipeline stages.

    Returns ``{piece: Piece(split, stages, total, per_rank)}`` (see the module's docstring): how each kind of
    matrix is cut, which stages hold it, its size in the whole model and on one rank. One rank of the first
    stage holds ``sum(p.per_rank for p in pieces.values() if p.stages in ("every", "first"))``; with
    ``pp = 1`` the single stage is both first and last.
    """
    _checks.require(_problems(cfg, tp, pp))
    d, d_kv, d_ff, L, V = cfg.d_model, cfg.d_kv, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    layer = {}  # per layer: piece -> (split, parameters in one layer)
    if cfg.arch == "gpt":
        layer["W_QKV"] = ("columns", d * (d + 2 * d_kv))
        layer["W_1"] = ("columns", d * d_ff)
    else:
        layer |= {"W_Q": ("columns", d * d), "W_K": ("columns", d * d_kv), "W_V": ("columns", d * d_kv)}
        layer |= {"W_gate": ("columns", d * d_ff), "W_up": ("columns", d * d_ff)}
    layer["W_O"] = ("rows", d * d)
    layer["W_down" if cfg.mlp == "swiglu" else "W_2"] = ("rows", d_ff * d)
    if cfg.bias:  # Q, K, V and the first MLP layer's biases split with their columns; W_O's and W_2's not
        layer["biases of column-split layers"] = ("columns", d + 2 * d_kv + (2 if cfg.mlp == "swiglu" else 1) * d_ff)
        layer["biases of row-split layers"] = ("replicated", 2 * d)
    norm = 2 * d if cfg.norm == "layernorm" and cfg.bias else d  # gain (and bias)
    layer["norms (two per layer)"] = ("replicated", 2 * norm)

    pieces = {"token embedding": Piece("vocabulary", "first", V * d, V * d // tp)}
    if cfg.learned_positions:
        pieces["position embedding"] = Piece("replicated", "first", cfg.max_seq_len * d, cfg.max_seq_len * d)
    for name, (split, n) in layer.items():
        on_rank = n if split == "replicated" else n // tp
        pieces[name] = Piece(split, "every", L * n, L // pp * on_rank)
    pieces["final norm"] = Piece("replicated", "last", norm, norm)
    # A tied head is the embedding's matrix (counted once); over several stages the last holds a copy.
    head_total = 0 if cfg.tied_embeddings else V * d
    head_on_rank = 0 if cfg.tied_embeddings and pp == 1 else V * d // tp
    pieces["LM head"] = Piece("vocabulary", "last", head_total, head_on_rank)
    return pieces
