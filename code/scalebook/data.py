"""Text in, (input, target) batches out: the data pipeline every chapter trains on.

The default corpus is embedded in Python itself: ``pydoc_data.topics``, the 465 KB of English that
``help()`` prints (the language reference's topics). It needs no download, so every chapter runs offline.
Any text file or folder of ``.txt``/``.md`` files can replace it.

Next-token prediction turns a token stream ``t_0 t_1 ... t_n`` into pairs: the model reads
``t_i .. t_{i+T-1}`` and must predict ``t_{i+1} .. t_{i+T}``, one target per position.

For data parallelism every rank draws the *same* global batch from the same seed and keeps only its
own rows, so N ranks together see exactly the batch a single process would (the book relies on this
to compare distributed training with single-process training step by step).

Source: Radford et al. 2019 (GPT-2) for the language-modelling objective.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import torch

TEXT_SUFFIXES = (".txt", ".md", ".rst")


def default_corpus() -> str:
    """The embedded English corpus: every topic of ``pydoc_data.topics``, in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@functools.cache
def corpus_tokens() -> torch.Tensor:
    """The embedded corpus, byte-tokenized once per process (every chapter experiment and lab trains on it)."""
    return tokenize(default_corpus())


def load_text(path: str | os.PathLike | None = None) -> str:
    """Read the training text: ``None`` gives :func:`default_corpus`; a file is read as UTF-8;
    a folder contributes every ``.txt``/``.md``/``.rst`` file under it, in sorted path order."""
    if path is None:
        return default_corpus()
    path = Path(path)
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ValueError(
                f"no {'/'.join(TEXT_SUFFIXES)} files under {path}; point at a text file or a folder of them"
            )
        return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    raise ValueError(
        f"data path {path} does not exist; pass a text file, a folder of text files, or None for the default corpus"
    )


class ByteTokenizer:
    """The simplest lossless tokenizer: one token per UTF-8 byte (vocabulary 256).

    Chapter 2 replaces it with byte-level BPE; this one needs no training, so chapter 1 can start at once.
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def tokenize(text: str, tokenizer=None) -> torch.Tensor:
    """Encode text into a 1-D ``torch.long`` tensor of token ids (byte-level unless a tokenizer is given)."""
    tokenizer = tokenizer or ByteTokenizer()
    return torch.tensor(tokenizer.encode(text), dtype=torch.long)


def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream into a leading training part and a trailing held-out part."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _check_batch_args(tokens: torch.Tensor, batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the token stream ({len(tokens)} tokens) is shorter than seq_len + 1 = {seq_len + 1}; "
            "use a shorter seq_len or more text"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def get_batch(
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of random windows: ``x`` is (batch_size, seq_len) and ``y`` is ``x`` shifted by one.

    The generator draws ``batch_size * world_size`` window starts (the global batch); this rank keeps
    rows ``[rank * batch_size, (rank + 1) * batch_size)``.
    """
    _check_batch_args(tokens, batch_size, seq_len, rank, world_size)
    starts = torch.randint(len(tokens) - seq_len, (batch_size * world_size,), generator=generator)
    starts = starts[rank * batch_size : (rank + 1) * batch_size]
    offsets = torch.arange(seq_len + 1)
    windows = tokens[starts[:, None] + offsets]  # (batch_size, seq_len + 1)
    return windows[:, :-1], windows[:, 1:]


def random_batches(
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    *,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless, reproducible stream of :func:`get_batch` batches (same seed, same batches)."""
    _check_batch_args(tokens, batch_size, seq_len, rank, world_size)
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield get_batch(tokens, batch_size, seq_len, generator, rank=rank, world_size=world_size)


def sequential_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows in order, for evaluation; the final partial batch is kept, a partial window is not."""
    _check_batch_args(tokens, batch_size, seq_len, 0, 1)
    n_windows = (len(tokens) - 1) // seq_len
    usable = tokens[: n_windows * seq_len + 1]
    x = usable[:-1].view(n_windows, seq_len)
    y = usable[1:].view(n_windows, seq_len)
    for i in range(0, n_windows, batch_size):
        yield x[i : i + batch_size], y[i : i + batch_size]
