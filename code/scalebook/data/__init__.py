"""Text in, (input, target) batches out: the data pipeline every chapter trains on.

The default corpus is embedded in Python itself: ``pydoc_data.topics``, the 465 KB of English that
``help()`` prints (the language reference's topics). It needs no download, so every chapter runs offline.
Any text file or folder of ``.txt``/``.md``/``.rst`` files can replace it: :func:`read_corpus` turns it into byte
tokens and refuses binary input with one message; :func:`check_corpus` runs the same checks, and the size check,
before any rank starts. Its ``encoding`` says how the bytes are text: ``"bytes"`` (the functions' default) trains
on the exact bytes, whatever they encode; a codec name (``"utf-8"``, the training command's default, or
``"latin-1"``...) decodes each file strictly, refusing the first byte that is not valid in it (naming the file and
the byte's offset), and trains on the UTF-8 bytes of the text, as the embedded corpus.

A corpus too large to hold in memory is tokenized once, ahead of training, into memory-mapped token shards:
``python -m scalebook.data prepare INPUT --tokenizer {bytes | BPE.json | HF_DIR} --out DIR``
(:mod:`scalebook.data.prepare`); ``--data DIR`` then trains on them (:mod:`scalebook.data.shards`), each rank
reading only its own rows. :func:`load_tokens` opens either kind of ``--data``.

Next-token prediction turns a token stream ``t_0 t_1 ... t_n`` into pairs: the model reads
``t_i .. t_{i+T-1}`` and must predict ``t_{i+1} .. t_{i+T}``, one target per position.

For data parallelism every rank draws the *same* global batch from the same seed and keeps only its
own rows, so N ranks together see exactly the batch a single process would (the book relies on this
to compare distributed training with single-process training step by step).

Source: Radford et al. 2019 (GPT-2) for the language-modelling objective.
"""

from __future__ import annotations

import codecs
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from scalebook.data.shards import TokenShards, is_prepared

TEXT_SUFFIXES = (".txt", ".md", ".rst")


def default_corpus() -> str:
    """The embedded English corpus: every topic of ``pydoc_data.topics``, in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@functools.cache
def corpus_tokens() -> torch.Tensor:
    """The embedded corpus, byte-tokenized once per process (every chapter experiment and lab trains on it)."""
    return tokenize(default_corpus())


_NO_DATA_HINT = (
    f"point --data at a text file, a folder of {'/'.join(TEXT_SUFFIXES)} files or a prepared folder, or leave --data "
    "out for the embedded corpus"
)
# The byte-level tokenizer's identity in a prepared index and in a checkpoint (see :func:`tokenizer_id`).
BYTES_TOKENIZER_ID = "bytes"
# Control codes that no text encoding uses for text: C0 except tab, LF, VT, FF, CR and ESC (terminal colours), and DEL.
# Every byte >= 0x80 is a letter or sign in some single-byte encoding (Latin-1, Windows-1252, KOI8-R...), so a byte
# that is not valid UTF-8 can still be text; these cannot.
_CONTROL_BYTES = bytes([*range(0x01, 0x09), *range(0x0E, 0x1B), *range(0x1C, 0x20), 0x7F])
MAX_CONTROL_SHARE = 0.01


def corpus_files(path: Path) -> list[Path]:
    """The files that make up the corpus at ``path``: the file itself, or a folder's text files in sorted order."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"data folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files; {_NO_DATA_HINT}")
        return files
    raise ValueError(f"data path {path} does not exist; {_NO_DATA_HINT}")


def _text_bytes(file: Path, encoding: str = "bytes") -> bytes:
    """A file's bytes, refused if unreadable or binary (the rule of :func:`corpus_bytes`), decoded by
    :func:`decode_text`."""
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise ValueError(
            f"cannot read data file {file} ({err.strerror}); make it readable or {_NO_DATA_HINT}"
        ) from None
    return decode_text(check_text(raw, file), file, encoding)


def check_encoding(encoding: str) -> str:
    """``encoding`` if it is ``"bytes"`` or a codec Python knows (``"latin-1"``, ``"cp1252"``...), else a ValueError."""
    if encoding != "bytes":
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise ValueError(
                f"--encoding {encoding} is not an encoding Python knows; give utf-8, latin-1, cp1252 (any of "
                "Python's codecs), or bytes to train on a file's exact bytes"
            ) from None
    return encoding


def codec_name(encoding: str) -> str:
    """The canonical name of a valid ``encoding`` (``"UTF8"`` and ``"utf_8"`` are ``"utf-8"``), or ``"bytes"``."""
    return encoding if encoding == "bytes" else codecs.lookup(encoding).name


def decode_text(raw: bytes, file: str | os.PathLike, encoding: str = "bytes") -> bytes:
    """The bytes the byte tokenizer trains on for ``raw``, the content of ``file``: ``raw`` itself for ``"bytes"``;
    else the UTF-8 bytes of ``raw`` decoded strictly from ``encoding``, a ValueError naming the file, the offset
    of its first byte that is not valid there, and the way out (``--encoding``)."""
    if check_encoding(encoding) == "bytes":
        return raw
    try:
        text = raw.decode(encoding)  # strict: nothing replaced, nothing dropped
    except UnicodeDecodeError as err:
        raise ValueError(
            f"data file {file} is not valid {encoding}: byte 0x{raw[err.start]:02X} at offset {err.start:,} "
            f"({err.reason}); if the file is in another encoding, name it: --encoding latin-1 (or cp1252, ...), "
            "or --encoding bytes to train on its exact bytes"
        ) from None
    return raw if codec_name(encoding) == "utf-8" else text.encode("utf-8")


def check_text(raw: bytes, file: str | os.PathLike) -> bytes:
    """``raw``, the bytes of ``file``, unless they are binary (the rule of :func:`corpus_bytes`): then a ValueError."""
    nul = raw.count(0)
    control = len(raw) - len(raw.translate(None, _CONTROL_BYTES))
    if nul or control > MAX_CONTROL_SHARE * len(raw):
        found = f"{nul:,} NUL bytes" if nul else f"{control:,} control codes"
        raise ValueError(
            f"data file {file} is binary, not text ({found} in {len(raw):,} bytes; UTF-16 text has NUL bytes too: "
            f"convert it to UTF-8); {_NO_DATA_HINT}"
        )
    return raw


def describe(path: str | os.PathLike | None) -> str:
    """How messages name ``--data``: ``data path PATH``, or ``the embedded corpus`` for ``None``."""
    return "the embedded corpus" if path is None else f"data path {path}"


def corpus_bytes(path: str | os.PathLike | None = None, encoding: str = "bytes") -> bytes:
    """The corpus at ``path`` as the bytes the byte tokenizer trains on (a folder's files joined by a blank line),
    each file decoded from ``encoding`` by :func:`decode_text` (``"bytes"``: its exact bytes).

    ``None`` is the embedded corpus in UTF-8. Raises one ValueError naming the path (or the folder's file) and what to
    change when it is missing, unreadable, a folder without text files, binary or empty.

    Binary means a NUL byte anywhere (UTF-16 text has them too), or more than ``MAX_CONTROL_SHARE`` (1 %) of the bytes
    are control codes that no text encoding uses for text (0x01-0x08, 0x0E-0x1A, 0x1C-0x1F, 0x7F). Bytes that are not
    valid UTF-8 are kept: each is a letter or sign in some single-byte encoding (Latin-1, Windows-1252...), and the
    byte tokenizer trains on them unchanged with ``encoding="bytes"``; any other ``encoding`` refuses them.
    """
    if path is None:
        return default_corpus().encode("utf-8")
    path = Path(path)
    raw = b"\n\n".join(_text_bytes(file, encoding) for file in corpus_files(path))
    if not raw:
        raise ValueError(f"data path {path} is empty; {_NO_DATA_HINT}")
    return raw


def read_corpus(path: str | os.PathLike | None = None, encoding: str = "bytes") -> torch.Tensor:
    """The corpus at ``path`` as byte-tokenizer ids (1-D int64). By default byte for byte: text that is not UTF-8
    (Latin-1 "é" is byte 0xE9) becomes token 233, nothing is replaced; with an ``encoding`` each file is decoded
    strictly (:func:`decode_text`). ``None`` gives ``tokenize(default_corpus())``."""
    return torch.frombuffer(bytearray(corpus_bytes(path, encoding)), dtype=torch.uint8).long()


def load_tokens(path: str | os.PathLike | None = None, encoding: str = "bytes") -> torch.Tensor | TokenShards:
    """The training tokens ``--data`` names: a prepared folder's ``train`` split memory-mapped
    (:class:`~scalebook.data.shards.TokenShards`, nothing read yet), else :func:`read_corpus` of the text."""
    return TokenShards(path, "train") if is_prepared(path) else read_corpus(path, encoding)


def tokenizer_id(path: str | os.PathLike | None = None) -> str:
    """The identity of the tokenizer that made the tokens ``--data`` names: a prepared folder's
    ``index["tokenizer"]["id"]``, else ``BYTES_TOKENIZER_ID`` (text is byte-tokenized). A resume compares it."""
    return TokenShards(path).tokenizer["id"] if is_prepared(path) else BYTES_TOKENIZER_ID


def check_corpus(
    path: str | os.PathLike | None, min_tokens: int, vocab_size: int | None = None, encoding: str = "bytes"
) -> None:
    """Raise one ValueError naming what to change unless ``path`` is a readable text corpus (valid in ``encoding``),
    or an intact prepared folder (index present, every shard of its size), of at least ``min_tokens`` tokens whose
    ids fit a model of ``vocab_size`` tokens; the check a launcher runs before any rank starts work."""
    if is_prepared(path):
        shards = TokenShards(path, "train")
        n_tokens = len(shards)
        kind = "byte tokens" if shards.tokenizer["kind"] == "bytes" else f"tokens of {shards.tokenizer['name']}"
        if vocab_size is not None and shards.vocab_size > vocab_size:
            raise ValueError(
                f"prepared data folder {path} holds ids of tokenizer {shards.tokenizer['name']!r}, a vocabulary "
                f"of {shards.vocab_size:,} tokens, more than the model's {vocab_size:,}; choose a --model whose "
                "vocabulary holds them, or prepare with a smaller tokenizer (--tokenizer bytes for 256)"
            )
    else:
        n_tokens, kind = len(corpus_bytes(path, encoding)), "byte tokens"
    if n_tokens < min_tokens:
        raise ValueError(
            f"{describe(path)} has {n_tokens:,} {kind}, fewer than the {min_tokens:,} this run needs; "
            "give more text, or a shorter --seq-len"
        )


def load_text(path: str | os.PathLike | None = None) -> str:
    """The corpus at ``path`` as text (``None`` gives :func:`default_corpus`); the checks of :func:`corpus_bytes`.

    Text that is not valid UTF-8 raises a ValueError instead of being altered: train on it with
    :func:`read_corpus`, which keeps its exact bytes.
    """
    if path is None:
        return default_corpus()
    raw = corpus_bytes(path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"data path {path} is not UTF-8 (byte 0x{raw[err.start]:02X} at offset {err.start:,}); read_corpus() "
            "trains on its exact bytes, or convert it to UTF-8 (iconv -t UTF-8) to read it as text"
        ) from None


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


def _check_batch_args(tokens, batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
    if isinstance(tokens, torch.Tensor) and tokens.dim() != 1:
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
    tokens: torch.Tensor | TokenShards,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of random windows: ``x`` is (batch_size, seq_len) and ``y`` is ``x`` shifted by one.

    The generator draws ``batch_size * world_size`` window starts (the global batch); this rank keeps
    rows ``[rank * batch_size, (rank + 1) * batch_size)``, and reads only their tokens: from memory-mapped
    :class:`~scalebook.data.shards.TokenShards`, only the pages those windows cover.
    """
    _check_batch_args(tokens, batch_size, seq_len, rank, world_size)
    starts = torch.randint(len(tokens) - seq_len, (batch_size * world_size,), generator=generator)
    starts = starts[rank * batch_size : (rank + 1) * batch_size]
    if isinstance(tokens, TokenShards):
        windows = tokens.windows(starts, seq_len + 1)
    else:
        windows = tokens[starts[:, None] + torch.arange(seq_len + 1)]  # (batch_size, seq_len + 1)
    return windows[:, :-1], windows[:, 1:]


def random_batches(
    tokens: torch.Tensor | TokenShards,
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
