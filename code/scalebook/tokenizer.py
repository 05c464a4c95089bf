"""Byte-level byte-pair encoding (BPE), from scratch: train, encode, decode, save, load.

Text is first split into *pre-tokens* by GPT-2's regular expression (letters, numbers, other symbols,
each optionally led by one space, and runs of whitespace), so that no token ever spans a word
boundary. Each pre-token becomes its UTF-8 bytes: the 256 byte values are the initial vocabulary,
so every string is encodable and nothing is ever unknown. Training then repeats one step until the
vocabulary is full:

    count every adjacent pair (a, b) of tokens, weighted by how often its pre-token occurs;
    take the most frequent pair, add the token ab, and replace every (a, b) by ab.

Ties between pairs of equal count go to the smaller pair of ids (a first, then b), which is the
order Hugging Face's ``BpeTrainer`` pops them from its priority queue; with the same id numbering
this makes our merge list identical to theirs. Ids follow GPT-2: the 256 byte tokens are numbered
in the order of GPT-2's printable stand-ins (``bytes_to_unicode``: '!' is 0, the space 'Ġ' is 220),
and merge r creates token 256 + r.

Encoding a pre-token applies the learned merges in the order they were learned: repeatedly merge
the adjacent pair of lowest rank until no pair is in the merge table. Decoding concatenates the
tokens' bytes and decodes UTF-8.

Training frameworks then round the vocabulary up with unused ids (:func:`padded_vocab_size`): nanoGPT
pads GPT-2's 50,257 to 50,304, a multiple of 64, so the LM head's matrix multiplies have aligned shapes;
Megatron-LM pads to a multiple of 128 t so that each of t tensor-parallel ranks holds an equal slice of
the vocabulary that is itself a multiple of 128.

Source: Sennrich, Haddow & Birch 2016, "Neural Machine Translation of Rare Words with Subword
Units" (BPE for text); Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"
(byte-level BPE, the pre-tokenization regex and ``bytes_to_unicode``); Hugging Face tokenizers,
``tokenizers/src/models/bpe/trainer.rs`` (tie-breaking); nanoGPT's ``model.py`` (``vocab_size = 50304``)
and Megatron-LM's ``_vocab_size_with_padding`` (padding).
"""

from __future__ import annotations

import heapq
import json
import os
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path

import regex

# GPT-2's pre-tokenizer: contractions, an optional space plus letters / numbers / other symbols, then
# whitespace (a run of spaces before a word leaves its last space to that word).
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

FILE_FORMAT = "scalebook-byte-level-bpe"
FILE_VERSION = 1


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, so that tokens can be shown and stored as text.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, ...) are shifted to
    code points 256 and up, in byte order: the space 0x20 becomes 'Ġ' (U+0120), the newline 'Ċ'.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    byte_values, code_points = list(printable), list(printable)
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            code_points.append(256 + len(code_points) - len(printable))
    return {b: chr(c) for b, c in zip(byte_values, code_points, strict=True)}


BYTE_TO_CHAR = bytes_to_unicode()
# Token id i < 256 is the byte whose stand-in is the i-th smallest code point (GPT-2's and HF's order).
BASE_BYTES = tuple(sorted(BYTE_TO_CHAR, key=lambda b: BYTE_TO_CHAR[b]))
BYTE_TO_ID = {b: i for i, b in enumerate(BASE_BYTES)}
N_BYTES = 256


def merge_pair(ids: Sequence[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of ``pair`` in ``ids`` by ``new_id``, scanning left to right (so 'aaa'
    with pair (a, a) becomes [aa, a])."""
    first, second = pair
    merged, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == first and ids[i + 1] == second:
            merged.append(new_id)
            i += 2
        else:
            merged.append(ids[i])
            i += 1
    return merged


def _pairs(ids: Sequence[int]) -> Iterable[tuple[int, int]]:
    return pairwise(ids)


def _check_utf8_encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"text has a lone surrogate {text[error.start]!r} at index {error.start}, which UTF-8 cannot "
            "encode; remove it, or decode your bytes with errors='replace'"
        ) from error


def _check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < N_BYTES:
        raise ValueError(f"vocab_size must be an integer of at least {N_BYTES} (one token per byte value), "
                         f"got {vocab_size!r}")


def padded_vocab_size(vocab_size: int, multiple: int = 64, tp: int = 1) -> int:
    """The smallest multiple of ``multiple * tp`` that holds ``vocab_size`` tokens: the vocabulary the
    embedding and the LM head are built with; the extra ids are never produced by the tokenizer.

    ``padded_vocab_size(50257)`` is nanoGPT's 50,304 (a multiple of 64). Megatron-LM's rule is
    ``padded_vocab_size(V, make_vocab_size_divisible_by, tensor_model_parallel_size)`` (its default
    ``make_vocab_size_divisible_by`` is 128): with ``tp`` ranks each rank's slice of the vocabulary,
    ``padded / tp`` rows, is then a multiple of ``multiple``. GPT-2's vocabulary becomes 50,304 at
    t = 1 and 51,200 at t = 8.
    """
    for name, value in (("vocab_size", vocab_size), ("multiple", multiple), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"padded_vocab_size needs {name} to be a positive integer, got {value!r}")
    step = multiple * tp
    return -(-vocab_size // step) * step


def train_merges(word_counts: dict[str, int], vocab_size: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Learn ``vocab_size - 256`` merges from pre-token counts (fewer if the pairs run out); return the
    merges and, for each, how often its pair occurred when it was chosen.

    The text is never touched again after counting: each distinct pre-token is one row of a word
    table, weighted by its count. After a merge only the rows that contained the pair are rewritten,
    and only their pairs' counts change. A max-heap of (count, pair) entries finds the next merge;
    entries whose count went stale are corrected when they reach the top (counts only fall, except
    for pairs containing the new token, which are pushed fresh).
    """
    _check_vocab_size(vocab_size)
    words = [[BYTE_TO_ID[b] for b in word.encode("utf-8")] for word in word_counts]
    counts = list(word_counts.values())
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    rows_with_pair: dict[tuple[int, int], set[int]] = defaultdict(set)
    for row, (ids, count) in enumerate(zip(words, counts, strict=True)):
        for pair in _pairs(ids):
            pair_counts[pair] += count
            rows_with_pair[pair].add(row)
    # heapq is a min-heap: (-count, pair) pops the highest count, then the smallest pair, like HF.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[int, int]] = []
    merge_counts: list[int] = []
    while N_BYTES + len(merges) < vocab_size and heap:
        negative_count, pair = heapq.heappop(heap)
        count = pair_counts.get(pair, 0)
        if -negative_count != count:
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        new_id = N_BYTES + len(merges)
        merges.append(pair)
        merge_counts.append(count)
        changes: dict[tuple[int, int], int] = defaultdict(int)
        for row in rows_with_pair.pop(pair):
            ids = words[row]
            merged = merge_pair(ids, pair, new_id)
            if len(merged) == len(ids):
                continue
            for old in _pairs(ids):
                changes[old] -= counts[row]
            for new in _pairs(merged):
                changes[new] += counts[row]
                rows_with_pair[new].add(row)
            words[row] = merged
        for changed, delta in changes.items():
            if delta:
                pair_counts[changed] += delta
                if delta > 0:  # only pairs that contain new_id grow, and they are not in the heap yet
                    heapq.heappush(heap, (-pair_counts[changed], changed))
                elif pair_counts[changed] == 0:
                    del pair_counts[changed]
    return merges, merge_counts


class BPETokenizer:
    """A byte-level BPE tokenizer: ``merges[r] = (a, b)`` means token ``256 + r`` is ``a`` then ``b``.

    Train one with :meth:`train`; ``encode`` maps a str to ids and ``decode`` maps ids back, and
    ``decode(encode(text)) == text`` for every str that UTF-8 can encode. ``merge_counts[r]``, when
    known, is how often merge r's pair occurred in the training text at the moment it was chosen.
    """

    def __init__(
        self,
        merges: Iterable[tuple[int, int]] = (),
        pattern: str = GPT2_SPLIT_PATTERN,
        merge_counts: Sequence[int] | None = None,
    ):
        self.merges = [(int(a), int(b)) for a, b in merges]
        if merge_counts is not None and len(merge_counts) != len(self.merges):
            raise ValueError(
                f"got {len(merge_counts)} merge counts for {len(self.merges)} merges; pass one per merge"
            )
        self.merge_counts = None if merge_counts is None else [int(c) for c in merge_counts]
        vocab = [bytes([b]) for b in BASE_BYTES]
        for rank, (a, b) in enumerate(self.merges):
            if not (0 <= a < len(vocab) and 0 <= b < len(vocab)):
                raise ValueError(
                    f"merge {rank} = ({a}, {b}) uses a token that does not exist yet "
                    f"(ids 0..{len(vocab) - 1}); each merge may only combine bytes and tokens made by "
                    "earlier merges"
                )
            vocab.append(vocab[a] + vocab[b])
        self.vocab: list[bytes] = vocab
        self.pattern = pattern
        self._splitter = regex.compile(pattern)
        self._ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def train(cls, text: str, vocab_size: int, *, pattern: str = GPT2_SPLIT_PATTERN) -> BPETokenizer:
        """Learn merges on ``text`` until the vocabulary holds ``vocab_size`` tokens (256 bytes + merges)."""
        _check_vocab_size(vocab_size)
        _check_utf8_encodable(text)
        word_counts = Counter(regex.findall(pattern, text))
        merges, merge_counts = train_merges(word_counts, vocab_size)
        return cls(merges, pattern, merge_counts)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def truncated(self, vocab_size: int) -> BPETokenizer:
        """The tokenizer with only the first ``vocab_size - 256`` merges: identical to training to that
        size, because each merge depends only on the merges before it."""
        if not N_BYTES <= vocab_size <= self.vocab_size:
            raise ValueError(
                f"vocab_size must be between {N_BYTES} and {self.vocab_size}, got {vocab_size}"
            )
        n_merges = vocab_size - N_BYTES
        counts = None if self.merge_counts is None else self.merge_counts[:n_merges]
        return type(self)(self.merges[:n_merges], self.pattern, counts)

    def pretokenize(self, text: str) -> list[str]:
        """The pieces BPE works on: no token crosses a boundary between them."""
        return self._splitter.findall(text)

    def merge_steps(self, piece: str) -> list[list[int]]:
        """How one pre-token is encoded: its byte ids, then the ids after each merge, lowest rank first."""
        ids = [BYTE_TO_ID[b] for b in piece.encode("utf-8")]
        steps = [ids]
        while len(ids) >= 2:
            best = min(_pairs(ids), key=lambda pair: self._ranks.get(pair, len(self.merges)))
            if best not in self._ranks:
                break
            ids = merge_pair(ids, best, N_BYTES + self._ranks[best])
            steps.append(ids)
        return steps

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; each distinct pre-token is merged once and then cached."""
        _check_utf8_encodable(text)
        ids: list[int] = []
        for piece in self._splitter.findall(text):
            piece_ids = self._cache.get(piece)
            if piece_ids is None:
                piece_ids = self._cache[piece] = self.merge_steps(piece)[-1]
            ids.extend(piece_ids)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; a byte sequence that is not valid UTF-8 decodes to U+FFFD, as in HF."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        """A token as GPT-2 and HF print it: each byte as its printable stand-in (a space shows as 'Ġ')."""
        return "".join(BYTE_TO_CHAR[b] for b in self.vocab[token_id])

    def merge_strings(self) -> list[tuple[str, str]]:
        """The merge list as pairs of printable token strings, the form HF's tokenizer JSON stores."""
        return [(self.token_str(a), self.token_str(b)) for a, b in self.merges]

    def save(self, path: str | os.PathLike) -> None:
        """Write the merges as JSON (pairs of printable token strings, as in HF's tokenizer.json).

        The file is written to a temporary name in the same folder and then renamed over ``path``, so a
        crash never leaves a half-written tokenizer behind.
        """
        path = Path(path)
        state = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "pattern": self.pattern,
            "merges": [[self.token_str(a), self.token_str(b)] for a, b in self.merges],
            "merge_counts": self.merge_counts,
        }
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                json.dump(state, f, ensure_ascii=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPETokenizer:
        """Read a tokenizer written by :meth:`save`."""
        state = json.loads(Path(path).read_text(encoding="utf-8"))
        if state.get("format") != FILE_FORMAT or state.get("version") != FILE_VERSION:
            raise ValueError(
                f"{path} is not a {FILE_FORMAT} file of version {FILE_VERSION}; "
                "write it with BPETokenizer.save"
            )
        ids = {BYTE_TO_CHAR[b]: i for i, b in enumerate(BASE_BYTES)}
        merges = []
        for rank, (left, right) in enumerate(state["merges"]):
            if left not in ids or right not in ids:
                raise ValueError(
                    f"merge {rank} of {path} uses a token ({left!r} or {right!r}) not made before it"
                )
            merges.append((ids[left], ids[right]))
            ids.setdefault(left + right, N_BYTES + rank)
        return cls(merges, state["pattern"], state.get("merge_counts"))


def hf_reference(text: str, vocab_size: int):
    """Hugging Face's byte-level BPE trained with our settings (GPT-2 regex, all 256 bytes, no special
    tokens): the reference the tests, the chapter and the benchmark compare :class:`BPETokenizer` with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def hf_merges(tokenizer) -> list[tuple[str, str]]:
    """The merge list of a trained HF ``tokenizers.Tokenizer`` with a BPE model, as string pairs."""
    return [tuple(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]]
