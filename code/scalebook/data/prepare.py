"""Tokenize a corpus once, in parallel, into the memory-mapped token shards that training reads.

``python -m scalebook.data prepare INPUT --tokenizer {bytes | BPE.json | HF_DIR} --out DIR`` reads INPUT (a text
file, a folder of ``.txt``/``.md``/``.rst`` files, or a Hugging Face ``datasets`` dataset saved with
``save_to_disk`` and its ``--text-column``), encodes it with worker processes, and writes flat token shards and
``index.json`` (:mod:`scalebook.data.shards` says why flat files and ``np.memmap``).

- Tokenizers (:func:`load_tokenizer`): ``bytes`` (one token per byte, the book's default; a text file prepared
  with it gives exactly the tokens of ``--data FILE``), a file written by
  :meth:`scalebook.tokenizer.BPETokenizer.save` (Chapter 2's byte-level BPE), or a folder that
  ``transformers.AutoTokenizer.from_pretrained`` loads (``save_pretrained``'s output; nothing is downloaded).
- Documents (the files of a folder, the rows of a dataset) are joined by the tokenizer's separator: its
  end-of-text token when it has one, else the tokens of a blank line (``"\\n\\n"``, as
  :func:`scalebook.data.read_corpus` joins a folder's files). A large file is cut into pieces of about
  ``chunk_bytes`` after a newline that a non-space character follows; no GPT-2-style pre-token spans such a cut,
  so the pieces encode to the tokens of the whole file (the tests check it for the book's BPE).
- The pieces are encoded in ``workers`` processes, in order, at most two per worker in flight (memory stays
  bounded whatever the corpus size); a tqdm bar on stderr counts the input bytes (a dataset's rows).
- The last ``val_fraction`` of the tokens is the ``val`` split, as :func:`scalebook.data.train_val_split` cuts it.
- Atomic: everything is written into a hidden temporary folder beside ``--out``, the index last, and renamed to
  ``--out`` at the end; an interrupted prepare leaves no folder that looks complete.

Source: nanoGPT ``data/openwebtext/prepare.py`` (tokenize once with worker processes into a flat uint16 file);
Hugging Face documentation, "datasets: Save and load" and "AutoTokenizer".
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from scalebook.data import BYTES_TOKENIZER_ID, check_text, corpus_files
from scalebook.data.shards import FORMAT, INDEX_NAME, SHARD_SUFFIX, VERSION, check_dtype, dtype_for, sha256_of

CHUNK_BYTES = 1 << 20  # 1 MiB of text per piece a worker encodes (HF keeps ~200 bytes per token while encoding)
SHARD_TOKENS = 100_000_000  # tokens per shard file, as nanoGPT's FineWeb shards
DATASET_ROWS = 256  # dataset rows per piece
# The files of a Hugging Face tokenizer folder that define it: their SHA-256 is the tokenizer's identity.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")  # fmt: skip
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class ByteLevel:
    """One token per byte (vocabulary 256): a text file's exact bytes, whatever its encoding."""

    kind, name, vocab_size, id = "bytes", "bytes", 256, BYTES_TOKENIZER_ID
    separator = list(b"\n\n")

    def encode(self, doc: bytes | str) -> np.ndarray:
        return np.frombuffer(doc.encode("utf-8") if isinstance(doc, str) else doc, dtype=np.uint8)


class BookBPE:
    """Chapter 2's byte-level BPE, read from a file that :meth:`~scalebook.tokenizer.BPETokenizer.save` wrote;
    its identity is the SHA-256 of its pattern and merges."""

    kind = "bpe"

    def __init__(self, path: Path):
        from scalebook.tokenizer import BPETokenizer

        self.bpe = BPETokenizer.load(path)
        self.name, self.vocab_size = path.name, self.bpe.vocab_size
        state = json.dumps({"pattern": self.bpe.pattern, "merges": self.bpe.merge_strings()}, ensure_ascii=False)
        self.id = "sha256:" + hashlib.sha256(state.encode("utf-8")).hexdigest()
        self.separator = self.bpe.encode("\n\n")

    def encode(self, text: str) -> list[int]:
        return self.bpe.encode(text)


class HuggingFace:
    """Any tokenizer folder ``AutoTokenizer.from_pretrained`` reads (offline); its identity is the SHA-256 of the
    ``HF_TOKENIZER_FILES`` it holds, its separator the end-of-text token when it has one."""

    kind = "hf"

    def __init__(self, folder: Path):
        digest = hashlib.sha256()
        files = [folder / name for name in HF_TOKENIZER_FILES if (folder / name).is_file()]
        if not files:
            raise ValueError(f"--tokenizer {folder} holds none of {', '.join(HF_TOKENIZER_FILES)}; give a folder "
                             "written by a tokenizer's save_pretrained(), a BPE file, or bytes")  # fmt: skip
        for file in files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as err:
            raise ValueError(f"--tokenizer {folder}: AutoTokenizer cannot load it ({err})") from None
        self.name, self.vocab_size, self.id = folder.name, len(self.tok), "sha256:" + digest.hexdigest()
        eos = self.tok.eos_token_id
        self.separator = [eos] if eos is not None else self.encode("\n\n")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False, verbose=False)


def load_tokenizer(spec: str | os.PathLike):
    """``"bytes"``, a BPE file of :meth:`~scalebook.tokenizer.BPETokenizer.save`, or a Hugging Face tokenizer folder;
    each has ``kind``, ``name``, ``id``, ``vocab_size``, ``separator`` and ``encode(text)``."""
    if str(spec) == "bytes":
        return ByteLevel()
    path = Path(spec)
    if path.is_dir():
        return HuggingFace(path)
    if path.is_file():
        return BookBPE(path)
    raise ValueError(f"--tokenizer {spec} does not exist; give bytes, a BPE file (BPETokenizer.save) or a Hugging "
                     "Face tokenizer folder (save_pretrained)")  # fmt: skip


# ----- the input, as pieces: (name, documents, continues the previous piece's last document) -------------------


def _safe_cut(data: bytes) -> int:
    """The last offset in ``data`` right after a newline that a non-space byte follows (0: none)."""
    end = len(data) - 1
    while (i := data.rfind(b"\n", 0, end)) >= 0:
        if not data[i + 1 : i + 2].isspace():
            return i + 1
        end = i
    return 0


def _file_pieces(file: Path, chunk_bytes: int):
    """A text file as ``(piece, size)`` pieces of about ``chunk_bytes``, cut by :func:`_safe_cut` (at least one)."""
    with open(file, "rb") as f:
        carry, first = b"", True
        while block := f.read(chunk_bytes):
            data = carry + block
            cut = _safe_cut(data)
            if cut:
                yield (str(file), [data[:cut]], not first), cut
                carry, first = data[cut:], False
            else:
                carry = data
        if carry or first:
            yield (str(file), [carry], not first), len(carry)


def _dataset_pieces(dataset, name: str):
    for batch in dataset.iter(batch_size=DATASET_ROWS):
        texts = next(iter(batch.values()))
        yield (name, texts, False), len(texts)


def input_pieces(source: str | os.PathLike, *, text_column: str = "text", chunk_bytes: int = CHUNK_BYTES):
    """``(total, unit, pieces)``: the size of ``source`` (bytes of text, or a dataset's rows) and an iterator of
    ``(piece, size)``; a piece is ``(name, documents, continues)``. Raises one ValueError for a bad ``source``."""
    path = Path(source)
    if not path.exists():
        raise ValueError(f"INPUT {path} does not exist; give a text file, a folder of .txt/.md/.rst files or a "
                         "datasets folder written by save_to_disk")  # fmt: skip
    if path.is_dir() and any((path / marker).exists() for marker in _DATASET_MARKERS):
        from datasets import Dataset, load_from_disk

        dataset = load_from_disk(str(path))
        if not isinstance(dataset, Dataset):
            dataset = dataset.get("train") if "train" in dataset else None
            if dataset is None:
                raise ValueError(f"{path} is a DatasetDict without a 'train' split; save the split to prepare")
        if text_column not in dataset.column_names:
            raise ValueError(f"dataset {path} has no column {text_column!r} (its columns: "
                             f"{', '.join(dataset.column_names)}); pass --text-column")  # fmt: skip
        dataset = dataset.select_columns([text_column])
        return len(dataset), "doc", _dataset_pieces(dataset, str(path))
    files = corpus_files(path)
    pieces = (piece for file in files for piece in _file_pieces(file, chunk_bytes))
    return sum(file.stat().st_size for file in files), "B", pieces


# ----- the workers --------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer_spec: str, dtype: str) -> None:
    _WORKER.update(tokenizer=load_tokenizer(tokenizer_spec), dtype=np.dtype(dtype))


def _encode_piece(piece) -> np.ndarray:
    """A piece's tokens in the shards' dtype: its documents encoded and joined by the separator."""
    name, documents, _ = piece
    tokenizer, dtype = _WORKER["tokenizer"], _WORKER["dtype"]
    parts = []
    for i, doc in enumerate(documents):
        if isinstance(doc, bytes):
            check_text(doc, name)
            if tokenizer.kind != "bytes":
                try:
                    doc = doc.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{name} is not UTF-8 (byte 0x{doc[err.start]:02X}); convert it to UTF-8, or "
                                     "prepare with --tokenizer bytes, which keeps any bytes") from None  # fmt: skip
        if i:
            parts.append(np.asarray(tokenizer.separator, dtype=dtype))
        parts.append(np.asarray(tokenizer.encode(doc)))
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype)
    if tokens.size and int(tokens.max()) >= tokenizer.vocab_size:
        raise ValueError(f"{name}: tokenizer {tokenizer.name} gave id {int(tokens.max())} outside its vocabulary of "
                         f"{tokenizer.vocab_size}")  # fmt: skip
    return tokens.astype(dtype, copy=False)


def _encoded(pieces, workers: int, tokenizer_spec: str, dtype: str):
    """``(tokens, size, continues)`` of each piece, in input order; encoded in ``workers`` spawned processes with
    at most two pieces per worker in flight, or in this process when ``workers`` is 1. A worker's error is raised
    here; a worker that dies (or cannot start) raises ``BrokenProcessPool`` instead of hanging, as a
    ``multiprocessing.Pool`` would."""
    if workers == 1:
        _init_worker(tokenizer_spec, dtype)
        for piece, size in pieces:
            yield _encode_piece(piece), size, piece[2]
        return
    pool = ProcessPoolExecutor(workers, mp.get_context("spawn"), _init_worker, (tokenizer_spec, dtype))
    try:
        in_flight = deque()
        for piece, size in pieces:
            in_flight.append((pool.submit(_encode_piece, piece), size, piece[2]))
            if len(in_flight) >= 2 * workers:
                future, size, continues = in_flight.popleft()
                yield future.result(), size, continues
        while in_flight:
            future, size, continues = in_flight.popleft()
            yield future.result(), size, continues
    finally:
        pool.shutdown(cancel_futures=True)


# ----- the output ---------------------------------------------------------------------------------------------


class _ShardWriter:
    """Appends tokens to ``train_000000.bin``, ``train_000001.bin``... of at most ``shard_tokens`` tokens each,
    hashing as it writes."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.file = self.digest = None

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self.file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, tokens = tokens[:room], tokens[room:]
            data = part.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self.file.write(data)
            self.digest.update(data)
            self.shards[-1]["tokens"] += part.size

    def _next_shard(self) -> None:
        self._close_shard()
        name = f"train_{len(self.shards):06d}{SHARD_SUFFIX}"
        self.file, self.digest = open(self.folder / name, "wb"), hashlib.sha256()  # noqa: SIM115
        self.shards.append({"file": name, "tokens": 0})

    def _close_shard(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            shard = self.shards[-1]
            shard.update(bytes=shard["tokens"] * self.dtype.itemsize, sha256=self.digest.hexdigest())
            self.file = None

    def close(self) -> list[dict]:
        self._close_shard()
        return self.shards


def _split_off_val(folder: Path, shards: list[dict], n_val: int, itemsize: int) -> list[dict]:
    """Move the last ``n_val`` tokens of ``shards`` (edited in place) into ``val_000000.bin``...: whole shards
    are renamed, a partial one is copied out and truncated. Returns the val shards."""
    val = []
    while n_val:
        last = shards[-1]
        if last["tokens"] <= n_val:
            val.insert(0, shards.pop())
            n_val -= last["tokens"]
            continue
        keep = last["tokens"] - n_val
        source, tail = folder / last["file"], folder / f"tail{SHARD_SUFFIX}"
        with open(source, "rb") as src, open(tail, "wb") as dst:
            src.seek(keep * itemsize)
            shutil.copyfileobj(src, dst)
        os.truncate(source, keep * itemsize)
        last.update(tokens=keep, bytes=keep * itemsize, sha256=sha256_of(source))
        val.insert(0, {"file": tail.name, "tokens": n_val, "bytes": n_val * itemsize, "sha256": sha256_of(tail)})
        n_val = 0
    for i, shard in enumerate(val):
        name = f"val_{i:06d}{SHARD_SUFFIX}"
        os.rename(folder / shard["file"], folder / name)
        shard["file"] = name
    return val


def _check_arguments(out: Path, workers: int, val_fraction: float, shard_tokens: int, chunk_bytes: int) -> None:
    if out.exists():
        raise ValueError(f"--out {out} already exists; remove it or choose another --out (a prepare never overwrites)")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1 or chunk_bytes < 1:
        raise ValueError(f"--shard-tokens and chunk_bytes must be >= 1, got {shard_tokens} and {chunk_bytes}")


def prepare(
    source: str | os.PathLike,
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    *,
    workers: int = 1,
    val_fraction: float = 0.01,
    text_column: str = "text",
    dtype: str = "auto",
    shard_tokens: int = SHARD_TOKENS,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool = False,
) -> dict:
    """Tokenize ``source`` with ``tokenizer`` into token shards and ``index.json`` in the new folder ``out``; return
    the index. ``dtype`` ``"auto"`` is the smallest that holds the vocabulary
    (:func:`~scalebook.data.shards.dtype_for`). Every bad argument raises one ValueError before any work; a failure
    midway removes what was written."""
    from tqdm.auto import tqdm

    out = Path(out)
    _check_arguments(out, workers, val_fraction, shard_tokens, chunk_bytes)
    spec = load_tokenizer(tokenizer)
    dtype = dtype_for(spec.vocab_size) if dtype == "auto" else dtype
    check_dtype(dtype, spec.vocab_size)
    total, unit, pieces = input_pieces(source, text_column=text_column, chunk_bytes=chunk_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        writer, separator = _ShardWriter(partial, dtype, shard_tokens), np.asarray(spec.separator)
        bar = tqdm(total=total, unit=unit, unit_scale=True, desc=f"prepare ({spec.name})", file=sys.stderr,
                   disable=not progress)  # fmt: skip
        with bar:
            for i, (tokens, size, continues) in enumerate(_encoded(pieces, workers, str(tokenizer), dtype)):
                if i and not continues:
                    writer.write(separator)
                writer.write(tokens)
                bar.update(size)
        train = writer.close()
        n_tokens = sum(shard["tokens"] for shard in train)
        n_val = max(1, int(n_tokens * val_fraction)) if val_fraction else 0
        if n_tokens - n_val < 1:
            raise ValueError(f"{source} gave {n_tokens} tokens: too few to split off --val-fraction {val_fraction}")
        val = _split_off_val(partial, train, n_val, np.dtype(dtype).itemsize)
        index = {"format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": spec.vocab_size,
                 "tokenizer": {"kind": spec.kind, "name": spec.name, "id": spec.id}, "separator": spec.separator,
                 "input": {"path": str(source), "size": total, "unit": unit},
                 "splits": {"train": {"tokens": n_tokens - n_val, "shards": train},
                            "val": {"tokens": n_val, "shards": val}}}  # fmt: skip
        _write_json(partial / INDEX_NAME, index)
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return index


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
