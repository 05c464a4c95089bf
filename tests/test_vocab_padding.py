"""tokenizer.padded_vocab_size against vocabulary sizes worked out by hand and published in code."""

import pytest

from scalebook.tokenizer import padded_vocab_size


def test_gpt2_vocabulary_padded_like_nanogpt():
    # nanoGPT's GPTConfig: vocab_size = 50304, "GPT-2 vocab_size of 50257, padded up to nearest multiple
    # of 64"; by hand 50257 / 64 = 785.3, and 786 * 64 = 50,304.
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(50257, 64) == 786 * 64


@pytest.mark.parametrize(
    ("vocab", "divisible_by", "tp", "expected"),
    [
        # Megatron-LM: multiple = make_vocab_size_divisible_by (default 128) * tensor_model_parallel_size.
        (50257, 128, 1, 393 * 128),  # 50257 / 128 = 392.6 -> 50,304
        (50257, 128, 2, 197 * 256),  # 50257 / 256 = 196.3 -> 50,432
        (50257, 128, 8, 50 * 1024),  # 50257 / 1024 = 49.1 -> 51,200 (Ch. 1's Megatron 145.6B row)
        (128256, 128, 1, 128256),  # Llama 3's 128,256 = 1002 * 128 is already aligned
        (128256, 128, 8, 126 * 1024),  # 128256 / 1024 = 125.25 -> 129,024
        (256, 64, 1, 256),  # exact multiples stay
        (1, 128, 4, 512),
    ],
)
def test_megatron_rule_is_divisible_by_times_tp(vocab, divisible_by, tp, expected):
    padded = padded_vocab_size(vocab, divisible_by, tp)
    assert padded == expected
    # each of the tp ranks then holds a slice that is a multiple of divisible_by, and less than one
    # step of padding was added
    assert (padded // tp) % divisible_by == 0 and 0 <= padded - vocab < divisible_by * tp


@pytest.mark.parametrize("bad", [dict(vocab_size=0), dict(multiple=0), dict(tp=-2), dict(tp=1.5), dict(multiple=True)])
def test_bad_input_names_the_argument(bad):
    args = dict(vocab_size=50257, multiple=64, tp=1) | bad
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        padded_vocab_size(**args)
