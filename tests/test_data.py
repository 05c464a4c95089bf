"""The data pipeline: corpus loading, tokenization and (input, target) batches."""

import pytest
import torch

from scalebook import data


def test_default_corpus_is_the_embedded_pydoc_topics():
    text = data.default_corpus()
    assert 450_000 < len(text) < 500_000  # pydoc_data.topics is ~465 KB of English
    assert 'The "if" statement' in text or "if_stmt" in text or "if" in text
    assert text == data.load_text(None)


def test_load_text_from_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.md").write_text("first", encoding="utf-8")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    assert data.load_text(tmp_path / "b.txt") == "second"
    assert data.load_text(tmp_path) == "first\n\nsecond"


def test_read_corpus_of_nothing_is_the_embedded_corpus_tokens():
    tokens = data.read_corpus(None)
    assert tokens.dtype == torch.long
    assert torch.equal(tokens, data.tokenize(data.load_text(None)))


def test_read_corpus_of_a_folder_is_its_text_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.md").write_text("first", encoding="utf-8")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")  # not a text suffix: not read, so not refused
    assert data.read_corpus(tmp_path).tolist() == list(b"first\n\nsecond")


def test_latin1_text_trains_on_its_exact_bytes(tmp_path):
    # The issue: errors="replace" turned Latin-1 "é" into U+FFFD (3 bytes) without a word.
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Le café où l'on a déjà mangé.\n".encode("latin-1") * 50)
    tokens = data.read_corpus(latin1)
    assert tokens.tolist() == list(latin1.read_bytes())
    assert tokens[6].item() == 0xE9 == 233  # "Le caf" + "é": the byte itself, one token
    data.check_corpus(latin1, min_tokens=len(tokens))  # text, large enough: no error
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 \(byte 0xE9 at offset 6\); read_corpus\(\) trains"):
        data.load_text(latin1)  # text is never altered: load_text refuses what it cannot decode


def test_utf8_with_a_few_bad_bytes_is_text_and_kept_byte_exact(tmp_path):
    damaged = tmp_path / "damaged.txt"
    damaged.write_bytes(data.default_corpus()[:5000].encode("utf-8") + b"\xff\xfe truncated \xe2\x82")
    assert data.read_corpus(damaged).tolist() == list(damaged.read_bytes())


def test_bin_ls_is_refused_as_binary_with_one_message():
    # The issue: --data /bin/ls trained on it (17.5 % U+FFFD).
    with pytest.raises(ValueError) as refused:
        data.read_corpus("/bin/ls")
    message = str(refused.value)
    assert message.startswith("data file /bin/ls is binary, not text (") and " NUL bytes in " in message
    assert "leave --data out for the embedded corpus" in message
    with pytest.raises(ValueError, match="/bin/ls is binary"):
        data.check_corpus("/bin/ls", min_tokens=1)


def test_the_training_command_refuses_bin_ls_before_any_work(capsys):
    from scalebook.train import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["--strategy", "single", "--data", "/bin/ls"])
    assert exited.value.code == 2  # argparse's code: nothing was built or trained
    assert "--data: data file /bin/ls is binary, not text (" in capsys.readouterr().err


def test_the_training_command_trains_on_latin1_bytes_unchanged_with_encoding_bytes(tmp_path, monkeypatch):
    # Text is decoded as strict UTF-8 by default (issue 37: Latin-1 is refused with the way out); --encoding bytes
    # asks for the file's exact bytes.
    from scalebook.train import cli

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Le café où l'on a déjà mangé, près de la forêt.\n".encode("latin-1") * 40)
    sampled, get_batch = [], data.get_batch

    def recording_get_batch(tokens, *args, **kwargs):
        sampled.append(tokens)
        return get_batch(tokens, *args, **kwargs)

    monkeypatch.setattr(data, "get_batch", recording_get_batch)
    args = ["--strategy", "single", "--data", str(latin1), "--encoding", "bytes", "--steps", "2", "--seq-len", "16",
            "--micro-batch", "2", "--global-batch", "2", "--no-progress"]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launcher's ranks: 0.03 s a step here, against seconds on a loaded machine
    try:
        assert cli.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    # Every batch of the run was drawn from the file's exact bytes: "é" is token 233, no U+FFFD (239 191 189).
    assert sampled and all(tokens.tolist() == list(latin1.read_bytes()) for tokens in sampled)


@pytest.mark.parametrize(
    "content, binary",
    [
        (b"plain text\x00with one NUL", True),  # NUL: binary whatever the rest (UTF-16 text too)
        ("héllo".encode("utf-16"), True),
        (bytes(range(1, 9)) * 10 + b"a" * 200, True),  # 80 control codes in 280 bytes: over 1 %
        (b"\x1b[31mred\x1b[0m log line\tand\ttabs\r\n\x0c" * 20, False),  # ESC, tab, CR, FF are text
        (b"a" * 1000 + b"\x07" * 10, False),  # 10 control codes in 1,010 bytes: under 1 %, a stray bell is kept
    ],
)
def test_binary_rule_nul_or_over_one_percent_control_codes(tmp_path, content, binary):
    file = tmp_path / "input.txt"
    file.write_bytes(content)
    if binary:
        with pytest.raises(ValueError, match="input.txt is binary, not text"):
            data.read_corpus(file)
    else:
        assert data.read_corpus(file).tolist() == list(content)


def test_a_binary_file_in_a_folder_is_named(tmp_path):
    (tmp_path / "a.txt").write_text("fine", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match=r"data file \S+b\.txt is binary"):
        data.read_corpus(tmp_path)


def test_corpus_errors_name_the_path_and_what_to_change(tmp_path, monkeypatch):
    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "small.txt").write_text("tiny", encoding="utf-8")
    cases = {
        tmp_path / "missing.txt": "missing.txt does not exist; point --data at a text file",
        empty_folder: "empty holds no .txt/.md/.rst files; point --data",
        tmp_path / "empty.txt": "empty.txt is empty; point --data",
    }
    for path, fragment in cases.items():
        with pytest.raises(ValueError, match=fragment) as refused:
            data.check_corpus(path, min_tokens=1)
        assert "None" not in str(refused.value)  # a command-line user cannot pass None
    with pytest.raises(ValueError, match="small.txt has 4 byte tokens, fewer than the 1,025 this run needs"):
        data.check_corpus(tmp_path / "small.txt", min_tokens=1025)

    # Root reads every file whatever its mode, so unreadability is simulated where the read happens.
    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(tmp_path), "read_bytes", denied)
    with pytest.raises(ValueError, match=r"cannot read data file \S+small.txt \(Permission denied\); make it"):
        data.read_corpus(tmp_path / "small.txt")


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
