"""Byte-level BPE from scratch against Hugging Face ``tokenizers``, and its own invariants."""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode

from scalebook import data
from scalebook.tokenizer import BYTE_TO_CHAR, BPETokenizer, bytes_to_unicode, hf_merges, hf_reference

# Characters assigned in Python's Unicode database (14.0 for 3.11). Our regex module and HF's
# Oniguruma each carry their own, newer, Unicode tables; a code point assigned only in a later
# version (e.g. U+323B0, CJK Extension J, Unicode 17) is a letter to one and unassigned to the other,
# so the pre-tokenizers may split it differently. That is a table version, not a tokenizer, difference.
ASSIGNED_CHARACTERS = st.characters(exclude_categories=["Cn", "Cs"])


@pytest.fixture(scope="module")
def corpus_split():
    return data.train_val_split(data.default_corpus(), val_fraction=0.1)


@pytest.fixture(scope="module")
def trained_pair(corpus_split):
    train_text, _ = corpus_split
    return BPETokenizer.train(train_text, 4096), hf_reference(train_text, 4096)


def test_bytes_to_unicode_is_gpt2s_map():
    assert bytes_to_unicode() == hf_bytes_to_unicode()
    assert set(BYTE_TO_CHAR.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    # GPT-2's encoder.json: "!" is id 0, "Ġ" (the space) is id 220.
    assert BPETokenizer().encode("! ") == [0, 220]


def test_bpe_merges_match_hf_tokenizers(trained_pair):
    ours, hf = trained_pair
    assert ours.merge_strings() == hf_merges(hf)
    assert {ours.token_str(i): i for i in range(ours.vocab_size)} == hf.get_vocab()
    assert ours.vocab_size == hf.get_vocab_size() == 4096


def test_encodings_match_hf_tokenizers_on_held_out_text(trained_pair, corpus_split):
    ours, hf = trained_pair
    _, held_out = corpus_split
    assert ours.encode(held_out) == hf.encode(held_out).ids
    sample = "Tokenizers split 'indivisible' words: 12345 naïve cafés, 東京 and 🚀!\n\tdone."
    assert ours.encode(sample) == hf.encode(sample).ids
    assert ours.decode(ours.encode(sample)) == hf.decode(hf.encode(sample).ids) == sample


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    text=st.one_of(st.text(alphabet="ab \n", max_size=300), st.text(alphabet="aab 1.'s", max_size=300),
                   st.text(ASSIGNED_CHARACTERS, max_size=200)),
    vocab_size=st.integers(256, 330),
)
def test_merges_match_hf_tokenizers_on_tie_heavy_texts(text, vocab_size):
    # Small alphabets make many pairs equally frequent, so this exercises HF's tie-breaking rule.
    assert BPETokenizer.train(text, vocab_size).merge_strings() == hf_merges(hf_reference(text, vocab_size))


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.text(ASSIGNED_CHARACTERS))
def test_pretokenization_matches_hf_byte_level(text):
    hf_split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    ours = BPETokenizer().pretokenize(text)
    assert ["".join(BYTE_TO_CHAR[b] for b in piece.encode("utf-8")) for piece in ours] == [
        piece for piece, _ in hf_split]


def test_trains_the_textbook_example():
    # Gage's example as told on Wikipedia's "Byte pair encoding" page: aaabdaaabac -> ZabdZabac (Z = aa)
    # -> ZYdZYac (Y = ab) -> XdXac (X = ZY). At step 2, (aa, a) and (a, b) both occur twice; the
    # smaller id pair (a, b) wins, as on the page.
    tokenizer = BPETokenizer.train("aaabdaaabac", 259)
    assert tokenizer.merge_strings() == [("a", "a"), ("a", "b"), ("aa", "ab")]
    assert tokenizer.merge_counts == [4, 2, 2]
    encoded = [tokenizer.token_str(i) for i in tokenizer.encode("aaabdaaabac")]
    assert encoded == ["aaab", "d", "aaab", "a", "c"]


def test_truncating_the_merge_list_equals_training_to_the_smaller_size(corpus_split):
    train_text, _ = corpus_split
    large = BPETokenizer.train(train_text[:100_000], 1024)
    small = BPETokenizer.train(train_text[:100_000], 600)
    assert large.truncated(600).merges == small.merges
    assert large.truncated(600).merge_counts == small.merge_counts


def test_pure_bytes_vocabulary_is_one_token_per_byte():
    text = "naïve 東京 🚀\x00\x1f"
    assert len(BPETokenizer().encode(text)) == len(text.encode("utf-8"))


# A tokenizer whose merges join partial UTF-8 sequences (emoji, CJK, accents), so round trips must
# survive tokens that are not whole characters.
ROUND_TRIP_TOKENIZER = BPETokenizer.train(
    "naïve café 東京都 🚀🚀 🙂 ü\u0308 tab\there\r\n" * 20 + data.default_corpus()[:20_000], 400)


def test_round_trip_tokenizer_has_tokens_that_are_partial_characters():
    def is_utf8(token: bytes) -> bool:
        try:
            token.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    assert any(not is_utf8(token) for token in ROUND_TRIP_TOKENIZER.vocab[256:])


@settings(max_examples=1000, deadline=None)
@given(st.text())
def test_decode_inverts_encode_for_any_unicode(text):
    ids = ROUND_TRIP_TOKENIZER.encode(text)
    assert all(0 <= i < ROUND_TRIP_TOKENIZER.vocab_size for i in ids)
    assert ROUND_TRIP_TOKENIZER.decode(ids) == text


def test_merge_steps_end_at_the_encoding():
    tokenizer = ROUND_TRIP_TOKENIZER
    steps = tokenizer.merge_steps(" café")
    assert len(steps[0]) == len(" café".encode())
    assert all(len(after) < len(before) for before, after in pairwise(steps))
    assert steps[-1] == tokenizer.encode(" café")


def test_save_load_round_trip_is_atomic(tmp_path):
    path = tmp_path / "bpe.json"
    ROUND_TRIP_TOKENIZER.save(path)
    ROUND_TRIP_TOKENIZER.save(path)  # overwriting leaves no temporary files behind
    assert [p.name for p in tmp_path.iterdir()] == ["bpe.json"]
    loaded = BPETokenizer.load(path)
    assert loaded.merges == ROUND_TRIP_TOKENIZER.merges
    assert loaded.merge_counts == ROUND_TRIP_TOKENIZER.merge_counts
    assert loaded.pattern == ROUND_TRIP_TOKENIZER.pattern
    text = "Saved and loaded: 東京 🚀"
    assert loaded.encode(text) == ROUND_TRIP_TOKENIZER.encode(text)


def test_bad_input_raises_value_error_saying_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="at least 256"):
        BPETokenizer.train("some text", 255)
    with pytest.raises(ValueError, match="between 256 and 400"):
        ROUND_TRIP_TOKENIZER.truncated(401)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ROUND_TRIP_TOKENIZER.decode([0, 400])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ROUND_TRIP_TOKENIZER.decode([-1])
    with pytest.raises(ValueError, match="lone surrogate '\\\\ud800' at index 2"):
        ROUND_TRIP_TOKENIZER.encode("ab\ud800cd")
    with pytest.raises(ValueError, match="lone surrogate"):
        BPETokenizer.train("ab\udfffcd", 300)
    with pytest.raises(ValueError, match="does not exist yet"):
        BPETokenizer([(0, 256)])
    (tmp_path / "other.json").write_text('{"model": {}}', encoding="utf-8")
    with pytest.raises(ValueError, match="write it with BPETokenizer.save"):
        BPETokenizer.load(tmp_path / "other.json")
