"""Tokens and sampling: the vocabulary-size trade-off (Chapter 2) and next-token distributions under
sampling settings (Chapter 5).

Source: matplotlib documentation; the book's style, :mod:`scalebook.plots.style`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from scalebook.plots.style import figure_and_axes


def vocab_tradeoff(
    vocab_sizes: Sequence[int],
    tokens_per_byte: dict[str, Sequence[float]],
    embedding_params: dict[str, Sequence[float]],
    *,
    reference_params: dict[str, float] | None = None,
    title: str = "",
):
    """Two panels against vocabulary size (log scale): tokens per byte of text (left) and embedding-table
    parameters (right, log scale), each a dict of labelled series; ``reference_params`` adds dashed
    horizontal lines, named in the legend, to the right panel."""
    fig, (ax_tokens, ax_params) = plt.subplots(1, 2, figsize=(9.0, 3.6))
    for label, values in tokens_per_byte.items():
        ax_tokens.plot(vocab_sizes, values, marker="o", label=label)
    ax_tokens.set_ylabel("tokens per byte of text")
    ax_tokens.set_ylim(0, None)
    for label, values in embedding_params.items():
        ax_params.plot(vocab_sizes, values, marker="o", label=label)
    for label, value in (reference_params or {}).items():
        ax_params.axhline(value, color="gray", linestyle="--", linewidth=1, label=label)
    ax_params.set_yscale("log")
    ax_params.set_ylabel("embedding parameters (V x h)")
    for ax in (ax_tokens, ax_params):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(vocab_sizes), [f"{v:,}" for v in vocab_sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("vocabulary size V")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def next_token_bars(
    distributions: dict[str, Sequence[float]], token_labels: Sequence[str], *, title: str = "", ax=None
):
    """Grouped bars: the probability of a few candidate next tokens (``token_labels``) under each of
    several sampling settings (``distributions[setting][i]`` is the probability of token ``i``)."""
    fig, ax = figure_and_axes(ax)
    n_settings = len(distributions)
    width = 0.8 / n_settings
    positions = range(len(token_labels))
    for i, (label, probs) in enumerate(distributions.items()):
        ax.bar([x + (i - (n_settings - 1) / 2) * width for x in positions], probs, width=width, label=label)
    ax.set_xticks(list(positions), token_labels)
    ax.set_xlabel("candidate next token")
    ax.set_ylabel("probability")
    ax.set_title(title)
    ax.legend(fontsize=9)
    return fig


def cumulative_mass(
    distributions: dict[str, Sequence[float]],
    *,
    p_levels: Sequence[float] = (),
    max_rank: int | None = None,
    title: str = "",
    ax=None,
):
    """Probability mass of the r most probable tokens against r, one curve per distribution.

    A dotted line at each top-p level ``p``: where a curve first reaches it is the size of that
    distribution's nucleus.
    """
    fig, ax = figure_and_axes(ax)
    for label, probs in distributions.items():
        ranked = sorted(probs, reverse=True)[:max_rank]
        mass, running = [], 0.0
        for p in ranked:
            running += p
            mass.append(running)
        ax.step(range(1, len(mass) + 1), mass, where="post", label=label)
    for level in p_levels:
        ax.axhline(level, color="grey", linestyle=":", linewidth=1)
        ax.text(
            1.0,
            level,
            f"p = {level:g}",
            transform=ax.get_yaxis_transform(),
            ha="right",
            va="bottom",
            fontsize=8,
            color="grey",
        )
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("number of most probable tokens kept")
    ax.set_ylabel("probability mass kept")
    ax.set_title(title)
    ax.legend(fontsize=9, loc="lower right")
    return fig
