"""The data pipeline: corpus loading, tokenization and (input, target) batches."""

import pytest
import torch

from scalebook import data


def test_default_corpus_is_the_embedded_pydoc_topics():
    text = data.default_corpus()
    assert 450_000 < len(text) < 500_000  # pydoc_data.topics is ~465 KB of English
    assert "The \"if\" statement" in text or "if_stmt" in text or "if" in text
    assert text == data.load_text(None)


def test_load_text_from_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.md").write_text("first", encoding="utf-8")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    assert data.load_text(tmp_path / "b.txt") == "second"
    assert data.load_text(tmp_path) == "first\n\nsecond"


def test_load_text_errors_say_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        data.load_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no .txt"):
        data.load_text(empty)


def test_byte_tokenizer_round_trips_unicode():
    tok = data.ByteTokenizer()
    text = "naïve café — 東京 🚀"
    ids = tok.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_targets_are_inputs_shifted_by_one():
    tokens = torch.arange(1000)
    x, y = data.get_batch(tokens, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y[:, -1], x[:, -1] + 1)


def test_ranks_split_the_global_batch_exactly():
    tokens = torch.arange(5000)
    full = next(data.random_batches(tokens, 8, 32, seed=3))
    parts = [next(data.random_batches(tokens, 2, 32, seed=3, rank=r, world_size=4)) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), full[1])


def test_same_seed_same_batches_different_seed_different_batches():
    tokens = torch.arange(5000)
    a = [next(data.random_batches(tokens, 4, 8, seed=1))[0] for _ in range(2)]
    b = next(data.random_batches(tokens, 4, 8, seed=2))[0]
    assert torch.equal(a[0], a[1])
    assert not torch.equal(a[0], b)


def test_sequential_batches_cover_the_stream_once():
    tokens = torch.arange(101)
    xs = torch.cat([x for x, _ in data.sequential_batches(tokens, 3, 10)])
    assert torch.equal(xs.flatten(), torch.arange(100))


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((torch.arange(10), 2, 10), "shorter than seq_len"),
        ((torch.arange(100), 0, 10), "must be positive"),
        ((torch.zeros(2, 50, dtype=torch.long), 2, 10), "1-D tensor"),
    ],
)
def test_bad_batch_arguments_are_rejected(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        next(data.random_batches(*args))


def test_bad_rank_is_rejected():
    with pytest.raises(ValueError, match="rank < world_size"):
        next(data.random_batches(torch.arange(100), 2, 10, rank=2, world_size=2))
