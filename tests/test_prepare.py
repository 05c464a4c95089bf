"""``python -m scalebook.data prepare`` and training on its memory-mapped token shards.

The claims: a prepare gives exactly the tokens of encoding the whole input (byte-level: the bytes
``--data FILE`` trains on; the book's BPE and a Hugging Face tokenizer: their own ``encode``), split as
``train_val_split`` splits; training on the shards gives exactly the losses of training on the text; each rank
reads only its own rows; and every bad input is refused with one message before any work.
"""

import json

import numpy as np
import pytest
import torch

from scalebook import data
from scalebook.data import prepare as prep
from scalebook.data.shards import TokenShards, dtype_for, sha256_of
from scalebook.tokenizer import BPETokenizer, hf_reference
from scalebook.train import cli

TEXT = data.default_corpus()


@pytest.fixture(scope="module")
def corpus_folder(tmp_path_factory):
    """Three text files of the embedded corpus (one of them empty) and a file that is not text, skipped."""
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.txt").write_text(TEXT[:20_000], encoding="utf-8")
    (folder / "b.md").write_bytes("Le café où l'on a déjà mangé.\n".encode("latin-1") * 30)  # not UTF-8: kept
    (folder / "c.rst").write_text("", encoding="utf-8")
    (folder / "d.txt").write_text(TEXT[20_000:50_000], encoding="utf-8")
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A Hugging Face tokenizer folder trained here (no download): byte-level BPE of 400 tokens plus an EOS."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("hf-tokenizer")
    trained = hf_reference(TEXT[:50_000], 400)
    PreTrainedTokenizerFast(tokenizer_object=trained, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def test_bytes_prepare_in_two_workers_gives_read_corpus_tokens_split_like_train_val_split(corpus_folder, tmp_path):
    # Small pieces and shards, so that pieces are cut inside files and windows cross shard boundaries.
    index = prep.prepare(corpus_folder, "bytes", tmp_path / "out", workers=2, val_fraction=0.05, shard_tokens=7_000,
                         chunk_bytes=3_000)  # fmt: skip
    train, val = data.train_val_split(data.read_corpus(corpus_folder), 0.05)
    shards, held_out = TokenShards(tmp_path / "out", "train"), TokenShards(tmp_path / "out", "val")
    assert torch.equal(shards.tokens(), train) and torch.equal(held_out.tokens(), val)
    assert index["dtype"] == "uint8" and index["vocab_size"] == 256 and index["tokenizer"]["id"] == "bytes"
    assert len(index["splits"]["train"]["shards"]) == -(-len(train) // 7_000)
    for split in index["splits"].values():
        for shard in split["shards"]:  # each shard's recorded size and hash are its file's
            path = tmp_path / "out" / shard["file"]
            assert path.stat().st_size == shard["bytes"] == shard["tokens"] and sha256_of(path) == shard["sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the temporary folder was renamed


def test_book_bpe_pieces_encode_to_the_tokens_of_the_whole_text(tmp_path):
    bpe = BPETokenizer.train(TEXT[:30_000], 300)
    bpe.save(tmp_path / "bpe.json")
    text = TEXT[100_000:140_000]
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    index = prep.prepare(tmp_path / "in.txt", tmp_path / "bpe.json", tmp_path / "out", val_fraction=0.0,
                         chunk_bytes=2_000)  # 20 pieces, cut after newlines  # fmt: skip
    assert TokenShards(tmp_path / "out").tokens().tolist() == bpe.encode(text)
    assert index["dtype"] == "uint16" and index["vocab_size"] == 300 and index["splits"]["val"]["shards"] == []
    assert index["tokenizer"]["id"].startswith("sha256:") and index["tokenizer"]["kind"] == "bpe"


def test_hf_tokenizer_on_a_saved_dataset_joins_rows_with_eos(hf_tokenizer_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    rows = [TEXT[i * 3_000 : (i + 1) * 3_000] for i in range(5)]
    Dataset.from_dict({"body": rows, "id": list(range(5))}).save_to_disk(tmp_path / "ds")
    index = prep.prepare(tmp_path / "ds", hf_tokenizer_dir, tmp_path / "out", text_column="body", val_fraction=0.0)
    tok = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    expected = []
    for i, row in enumerate(rows):
        expected += ([tok.eos_token_id] if i else []) + tok.encode(row, add_special_tokens=False)
    assert TokenShards(tmp_path / "out").tokens().tolist() == expected
    assert index["vocab_size"] == len(tok) == 401 and index["dtype"] == "uint16" and index["separator"] == [400]
    with pytest.raises(ValueError, match=r"has no column 'text' \(its columns: body, id\); pass --text-column"):
        prep.prepare(tmp_path / "ds", hf_tokenizer_dir, tmp_path / "other")


def test_tokenizer_identity_is_the_hash_of_its_files_and_the_same_for_every_prepare(hf_tokenizer_dir, tmp_path):
    (tmp_path / "in.txt").write_text(TEXT[:5_000], encoding="utf-8")
    for name in ("one", "two"):
        prep.prepare(tmp_path / "in.txt", hf_tokenizer_dir, tmp_path / name)
    prep.prepare(tmp_path / "in.txt", "bytes", tmp_path / "bytes")
    ids = {name: data.tokenizer_id(tmp_path / name) for name in ("one", "two", "bytes")}
    assert ids["one"] == ids["two"] == prep.load_tokenizer(hf_tokenizer_dir).id != ids["bytes"] == "bytes"
    assert data.tokenizer_id(tmp_path / "in.txt") == data.tokenizer_id(None) == "bytes"  # text trains on bytes


def test_bad_prepare_input_is_refused_before_any_work(hf_tokenizer_dir, tmp_path):
    (tmp_path / "in.txt").write_text("text", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    (tmp_path / "exists").mkdir()
    (tmp_path / "bpe.json").write_text("{}", encoding="utf-8")
    cases = [
        (("in.txt", "bytes", "exists"), {}, "--out .*exists already exists; remove it or choose another --out"),
        (("in.txt", "missing", "out"), {}, "--tokenizer .*missing does not exist; give bytes, a BPE file"),
        (("in.txt", "bpe.json", "out"), {}, "is not a scalebook-byte-level-bpe file"),
        (("in.txt", hf_tokenizer_dir, "out"), {"dtype": "uint8"}, "401 tokens is too large for uint8 .*; use uint16"),
        (("in.txt", "bytes", "out"), {"val_fraction": 1.0}, r"--val-fraction must be in \[0, 1\)"),
        (("nothing.txt", "bytes", "out"), {}, "INPUT .*nothing.txt does not exist; give a text file, a folder of"),
        (("latin1.txt", hf_tokenizer_dir, "out"), {}, "latin1.txt is not UTF-8 .*prepare with --tokenizer bytes"),
    ]
    for (source, tokenizer, out), options, message in cases:
        tokenizer = tokenizer if tokenizer in ("bytes", hf_tokenizer_dir) else tmp_path / tokenizer
        with pytest.raises(ValueError, match=message):
            prep.prepare(tmp_path / source, tokenizer, tmp_path / out, **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe.json", "exists", "in.txt", "latin1.txt"]


def test_an_interrupted_prepare_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text(TEXT[:10_000], encoding="utf-8")

    def interrupted(*args):
        raise KeyboardInterrupt  # as Ctrl-C between the last shard and the index

    monkeypatch.setattr(prep, "_split_off_val", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(tmp_path / "in.txt", "bytes", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]  # no --out, no temporary folder


def test_the_command_line_prepares_and_reports_errors_with_exit_code_2(tmp_path, capsys):
    from scalebook.data.__main__ import main

    (tmp_path / "in.txt").write_text("text\n" * 1_000, encoding="utf-8")  # 5,000 bytes
    argv = ["prepare", str(tmp_path / "in.txt"), "--tokenizer", "bytes", "--out", str(tmp_path / "out")]
    assert main([*argv, "--workers", "1", "--no-progress"]) == 0
    assert "train 4,950 tokens, val 50 tokens (uint8, tokenizer bytes)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and "already exists" in capsys.readouterr().err


@pytest.fixture()
def prepared(tmp_path):
    """The first 60 KB of the embedded corpus as a text file, and prepared byte-level in shards of 10,000 tokens."""
    (tmp_path / "in.txt").write_text(TEXT[:60_000], encoding="utf-8")
    prep.prepare(tmp_path / "in.txt", "bytes", tmp_path / "shards", val_fraction=0.0, shard_tokens=10_000)
    return tmp_path / "in.txt", tmp_path / "shards"


SHORT_RUN = ["--steps", "3", "--seq-len", "32", "--micro-batch", "2", "--global-batch", "4", "--no-progress"]


def test_training_on_the_shards_gives_exactly_the_losses_of_the_text_file(prepared):
    text_file, shards = prepared
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launcher's ranks: fast and bit-identical run to run
    try:
        runs = [
            cli.run(cli.build_parser().parse_args(["--data", str(path), *SHORT_RUN])) for path in (text_file, shards)
        ]
    finally:
        torch.set_num_threads(threads)
    # Same token stream, same generator: the same windows, so the same floats (no tolerance).
    assert [r.loss for r in runs[0]] == [r.loss for r in runs[1]] and len(runs[1]) == 3


def test_each_rank_reads_only_its_rows_of_the_global_batch(prepared):
    text_file, shards = prepared
    tokens, mapped = data.read_corpus(text_file), data.load_tokens(shards)
    assert isinstance(mapped, TokenShards) and len(mapped) == len(tokens)
    whole = data.get_batch(tokens, 8, 64, torch.Generator().manual_seed(5))
    for rank in range(2):
        mapped.tokens_read = 0
        x, y = data.get_batch(mapped, 4, 64, torch.Generator().manual_seed(5), rank=rank, world_size=2)
        rows = slice(rank * 4, (rank + 1) * 4)
        assert torch.equal(x, whole[0][rows]) and torch.equal(y, whole[1][rows])
        assert mapped.tokens_read == 4 * 65  # its 4 windows of seq_len + 1 tokens, not the global batch's 8


def test_bad_shards_are_refused_by_the_preflight_with_one_message(prepared, hf_tokenizer_dir, tmp_path, capsys):
    text_file, shards = prepared
    prep.prepare(text_file, hf_tokenizer_dir, tmp_path / "hf", val_fraction=0.0)
    no_index, truncated = tmp_path / "no-index", tmp_path / "truncated"
    for copy in (no_index, truncated):
        prep.prepare(text_file, "bytes", copy, val_fraction=0.0, shard_tokens=10_000)
    (no_index / "index.json").unlink()
    with open(truncated / "train_000002.bin", "r+b") as f:
        f.truncate(9_000)
    cases = {
        no_index: "has token shards but no index.json (an interrupted prepare, or the index was deleted); run",
        truncated: "train_000002.bin is truncated: 9,000 bytes, the index says 10,000 uint8 tokens = 10,000 bytes",
        tmp_path / "hf": "holds ids of tokenizer 'hf-tokenizer0', a vocabulary of 401 tokens, more than the model's",
    }
    for folder, message in cases.items():
        with pytest.raises(SystemExit) as exited:
            cli.main(["--data", str(folder), "--steps", "1", "--no-progress"])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"--data: {'token shard' if folder == truncated else 'prepared data'}" in err
        assert message in err and err.count("--data:") == 1
    n_tokens = len(TokenShards(shards))
    with pytest.raises(ValueError, match=f"has {n_tokens:,} byte tokens, fewer than the {n_tokens + 1:,} this run"):
        data.check_corpus(shards, min_tokens=n_tokens + 1)


def test_a_flipped_byte_is_found_by_verify(prepared):
    _, shards = prepared
    with open(shards / "train_000001.bin", "r+b") as f:
        f.seek(5)
        f.write(b"#")
    TokenShards(shards)  # sizes are intact: opening is cheap and does not read the shards
    with pytest.raises(ValueError, match="train_000001.bin does not match its SHA-256 in the index"):
        TokenShards(shards, verify=True)


def test_vocabulary_too_large_for_the_dtype_in_an_index_is_refused(prepared):
    _, shards = prepared
    index = json.loads((shards / "index.json").read_text())
    (shards / "index.json").write_text(json.dumps({**index, "vocab_size": 70_000, "dtype": "uint16"}))
    with pytest.raises(ValueError, match="70,000 tokens is too large for uint16 .ids up to 65,535.; use uint32"):
        TokenShards(shards)
    assert np.iinfo(dtype_for(70_000)).max == 2**32 - 1 and dtype_for(256) == "uint8"


def test_workers_that_cannot_start_raise_instead_of_hanging(tmp_path):
    from concurrent.futures.process import BrokenProcessPool

    pieces = iter([(("in.txt", [b"text"], False), 4)])
    # Each worker loads the tokenizer when it starts; this one is missing, so none starts (a Pool would retry forever).
    with pytest.raises(BrokenProcessPool):
        list(prep._encoded(pieces, 2, str(tmp_path / "missing.json"), "uint16"))


def test_a_saved_dataset_dict_prepares_its_train_split(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"train": ["first row", "second row"], "test": ["held out"]}
    DatasetDict({name: Dataset.from_dict({"text": texts}) for name, texts in rows.items()}).save_to_disk(tmp_path / "d")
    prep.prepare(tmp_path / "d", "bytes", tmp_path / "out", val_fraction=0.0)
    assert bytes(TokenShards(tmp_path / "out").tokens().tolist()) == b"first row\n\nsecond row"  # rows joined as files
