"""Token embeddings (a lookup is a one-hot matmul) and sentence embeddings from the packaged MiniLM,
checked against sentence-transformers."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from scalebook.embeddings import MiniLMEncoder, cosine_similarity_matrix, load_minilm, mean_pool, minilm_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCES = [
    "A man is playing a guitar.",
    "Someone strums a guitar on stage.",
    "The stock market fell sharply today.",
    "Shares dropped as investors panicked.",
    "It will rain heavily tomorrow.",
    "A storm is expected this weekend.",
]


def test_one_hot_matmul_equals_embedding_lookup_exactly():
    vocab, d, seq = 300, 24, 40
    embedding = torch.nn.Embedding(vocab, d)
    ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(0))
    ids[5] = ids[9]  # a repeated token: its gradient rows must add up in both forms
    one_hot = F.one_hot(ids, vocab).float()
    via_matmul = one_hot @ embedding.weight
    via_lookup = embedding(ids)
    # Each output is 1 * w plus (vocab - 1) terms 0 * w = 0, and adding exact zeros rounds nothing.
    assert torch.equal(via_matmul, via_lookup)
    upstream = torch.randn(seq, d, generator=torch.Generator().manual_seed(1))
    (grad_matmul,) = torch.autograd.grad((via_matmul * upstream).sum(), embedding.weight)
    (grad_lookup,) = torch.autograd.grad((via_lookup * upstream).sum(), embedding.weight)
    # A repeated token's gradient is a sum of two rows, possibly added in a different order: 1e-6.
    torch.testing.assert_close(grad_matmul, grad_lookup, atol=1e-6, rtol=0)


def test_one_hot_matmul_costs_2_t_v_d_flops_and_lookup_none():
    vocab, d, seq = 500, 32, 64
    embedding = torch.nn.Embedding(vocab, d)
    ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as matmul_counter:
        F.one_hot(ids, vocab).float() @ embedding.weight
    with FlopCounterMode(display=False) as lookup_counter:
        embedding(ids)
    assert matmul_counter.get_total_flops() == 2 * seq * vocab * d
    assert lookup_counter.get_total_flops() == 0


@pytest.fixture(scope="module")
def reference_encoder():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


def test_minilm_pooling_matches_sentence_transformers(reference_encoder):
    # Mixed lengths (padding), a text longer than the 256-token limit (truncation) and small batches.
    texts = SENTENCES + ["word " * 400, "Hi"]
    ours = load_minilm().encode(texts, batch_size=3)
    expected = reference_encoder.encode(texts, convert_to_tensor=True)
    assert ours.shape == expected.shape == (len(texts), 384)
    # Same weights, same ops; padding to different batch lengths changes float32 rounding (~1e-7).
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_embeddings_have_unit_norm():
    norms = load_minilm().encode(SENTENCES).norm(dim=1)
    torch.testing.assert_close(norms, torch.ones(len(SENTENCES)), atol=1e-6, rtol=0)


def test_related_sentences_are_more_similar_than_unrelated():
    similarity = cosine_similarity_matrix(load_minilm().encode(SENTENCES))
    pairs = [(0, 1), (2, 3), (4, 5)]  # guitar, markets, weather
    for a, b in pairs:
        unrelated = [similarity[a, j] for j in range(len(SENTENCES)) if j not in (a, b)]
        assert similarity[a, b] > max(unrelated) + 0.2, (a, b)


def test_mean_pool_averages_only_unmasked_tokens():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    expected = torch.stack([hidden[0, :2].mean(0), hidden[1].mean(0)])
    torch.testing.assert_close(mean_pool(hidden, mask), expected)


def test_cosine_similarity_matrix_matches_torch():
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(5, 8, generator=gen), torch.randn(3, 8, generator=gen)
    expected = F.cosine_similarity(a[:, None, :], b[None, :, :], dim=-1)
    torch.testing.assert_close(cosine_similarity_matrix(a, b), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: load_minilm().encode("a single string"),
        lambda: load_minilm().encode([]),
        lambda: load_minilm().encode(["fine", 3]),
        lambda: load_minilm().encode(["fine"], batch_size=0),
        lambda: mean_pool(torch.zeros(2, 4, 3), torch.ones(2, 5)),
        lambda: cosine_similarity_matrix(torch.zeros(2, 3), torch.zeros(2, 4)),
        lambda: MiniLMEncoder(path="/nonexistent"),
    ],
    ids=["str", "empty", "non-str", "batch 0", "mask shape", "widths", "no model"],
)
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()
