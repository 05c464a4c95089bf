"""Token shards on disk: the index a prepare writes, and the memory-mapped token stream training reads.

A prepared corpus is a folder: ``index.json`` and flat binary shard files (``train_000000.bin``,
``val_000000.bin``...), each a run of token ids as little-endian unsigned integers with no header, in the
smallest of uint8 / uint16 / uint32 that holds every id of the vocabulary (:func:`dtype_for`: a byte-level
corpus is as large as its text, GPT-2's 50,257 tokens fit uint16, Llama 3's 128,256 need uint32). The index
records the dtype, the vocabulary size, the tokenizer's identity (a SHA-256 of its files, or of its
vocabulary), and each shard's token count, size and SHA-256.

Why ``np.memmap`` and not Arrow (``datasets``). Training reads random windows of ``seq_len + 1`` consecutive
tokens that ignore document boundaries. In a flat file a window is one slice at ``start * itemsize``: the
operating system pages in the few kilobytes it covers, and nothing else, so a rank's memory does not grow
with the corpus (15 T tokens in uint32 are 60 TB; no rank could hold them). Arrow stores a corpus as rows of
documents (a list column with offsets): a window that crosses documents is a gather and a concatenation,
the reader needs ``datasets`` and ``pyarrow``, and a truncated file is not recognisable from its size. The
flat format is nanoGPT's; Arrow remains an input format (:mod:`scalebook.data.prepare` reads a ``datasets``
dataset saved on disk).

Each rank opens the shards, draws the same global batch of window starts as every other rank (the seeded
generator of :func:`scalebook.data.get_batch`) and reads only its own rows, so N ranks together read one
batch, and a prepared byte-level corpus gives exactly the batches of its text file.

Source: nanoGPT ``data/openwebtext/prepare.py`` and ``train.py`` (``get_batch`` on ``np.memmap``);
NumPy documentation, "numpy.memmap".
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

INDEX_NAME = "index.json"
FORMAT = "scalebook-token-shards"
VERSION = 1
DTYPES = ("uint8", "uint16", "uint32")
SHARD_SUFFIX = ".bin"
_PREPARE_HINT = "run `python -m scalebook.data prepare INPUT --tokenizer ... --out DIR` again"


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned dtype of ``DTYPES`` that holds every id ``0 .. vocab_size - 1``."""
    for dtype in DTYPES:
        if vocab_size <= np.iinfo(dtype).max + 1:
            return dtype
    raise ValueError(f"a vocabulary of {vocab_size:,} tokens does not fit uint32; no tokenizer has one that large")


def check_dtype(dtype: str, vocab_size: int) -> None:
    """Raise a ValueError naming what to change unless ``dtype`` (one of ``DTYPES``) holds ids below ``vocab_size``."""
    if dtype not in DTYPES:
        raise ValueError(f"token dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(
            f"a vocabulary of {vocab_size:,} tokens is too large for {dtype} (ids up to {np.iinfo(dtype).max:,}); "
            f"use {dtype_for(vocab_size)}"
        )


def sha256_of(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (read in blocks, not whole)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_prepared(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a folder that a prepare wrote (or began to write: ``train_*.bin`` shards, no index)."""
    if path is None or not Path(path).is_dir():
        return False
    path = Path(path)
    return (path / INDEX_NAME).exists() or any(path.glob(f"train_*{SHARD_SUFFIX}"))


def read_index(root: str | os.PathLike) -> dict:
    """The index of the prepared folder ``root``, or one ValueError: missing, unreadable or of another format."""
    root = Path(root)
    index_path = root / INDEX_NAME
    if not index_path.exists():
        raise ValueError(
            f"prepared data folder {root} has token shards but no {INDEX_NAME} (an interrupted prepare, or the index "
            f"was deleted); {_PREPARE_HINT}"
        )
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {index_path} ({err}); {_PREPARE_HINT}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{index_path} is not a {FORMAT} index of version {VERSION}; {_PREPARE_HINT}")
    check_dtype(index["dtype"], index["vocab_size"])
    return index


class TokenShards:
    """One split of a prepared corpus as a single 1-D token stream, memory-mapped: opening it reads only the index.

    ``len(shards)`` is the split's token count; :meth:`read` returns tokens ``start .. stop - 1`` (crossing shard
    boundaries) and :meth:`windows` the rows of a batch, as ``torch.long``; ``tokens_read`` counts what was read.
    Opening checks that every shard exists and has exactly the size the index gives (a truncated shard is
    refused); ``verify=True`` also checks each shard's SHA-256 (reads every byte).
    """

    def __init__(self, root: str | os.PathLike, split: str = "train", *, verify: bool = False):
        self.root = Path(root)
        self.index = read_index(self.root)
        if split not in self.index["splits"] or not self.index["splits"][split]["tokens"]:
            raise ValueError(f"prepared data folder {self.root} has no {split!r} tokens; {_PREPARE_HINT}")
        self.split = split
        self.dtype = np.dtype(self.index["dtype"])
        self.vocab_size = int(self.index["vocab_size"])
        self.tokenizer = self.index["tokenizer"]
        self._maps, self._begins = [], []
        total = 0
        for shard in self.index["splits"][split]["shards"]:
            self._check_shard(shard, verify)
            self._maps.append(np.memmap(self.root / shard["file"], dtype=self.dtype, mode="r"))
            self._begins.append(total)
            total += shard["tokens"]
        self._len = total
        self.tokens_read = 0

    def _check_shard(self, shard: dict, verify: bool) -> None:
        path = self.root / shard["file"]
        expected = shard["tokens"] * self.dtype.itemsize
        if not path.is_file():
            raise ValueError(f"token shard {path} is missing (the index lists it); {_PREPARE_HINT}")
        size = path.stat().st_size
        if size != expected:
            raise ValueError(
                f"token shard {path} is {'truncated' if size < expected else 'longer than its index says'}: "
                f"{size:,} bytes, the index says {shard['tokens']:,} {self.dtype.name} tokens = {expected:,} bytes; "
                f"{_PREPARE_HINT}"
            )
        if verify and sha256_of(path) != shard["sha256"]:
            raise ValueError(f"token shard {path} does not match its SHA-256 in the index (corrupt); {_PREPARE_HINT}")

    def __len__(self) -> int:
        return self._len

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start .. stop - 1`` of the split (in the shards' dtype); only their pages are read from disk."""
        if not 0 <= start <= stop <= self._len:
            raise IndexError(f"tokens {start}..{stop} are outside the split's 0..{self._len}")
        self.tokens_read += stop - start
        parts = []
        shard = bisect.bisect_right(self._begins, start) - 1
        while start < stop:
            begin = self._begins[shard]
            end = begin + len(self._maps[shard])
            parts.append(self._maps[shard][start - begin : min(stop, end) - begin])
            start, shard = end, shard + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """The ``length`` tokens from each of ``starts``, as a (len(starts), length) ``torch.long`` tensor."""
        rows = [self.read(start, start + length) for start in starts.tolist()]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def tokens(self) -> torch.Tensor:
        """The whole split in memory as ``torch.long`` (for evaluation on a small split; training uses windows)."""
        return torch.from_numpy(self.read(0, self._len).astype(np.int64))
