"""Sampling: greedy is argmax, top-k and top-p stay inside their sets, temperature reshapes the softmax,
and decoding agrees with Hugging Face's ``generate`` and logits warpers."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from scalebook.data import ByteTokenizer
from scalebook.generate import complete, filter_logits, generate, logits_to_probs
from scalebook.model import GPT, GPTConfig

# Two float32 softmaxes of the same logits differ only in summation order (~1e-7 per entry).
PROB_ATOL = 1e-6


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig.named("tiny", n_layer=2, block_size=16)).eval()


@pytest.fixture(scope="module")
def sharp_model():
    """A random model with large weights: its greedy path wanders over many tokens instead of
    repeating one byte (a default-initialised model repeats its input, which would make a
    token-for-token comparison nearly vacuous)."""
    torch.manual_seed(0)
    sharp = GPT(GPTConfig.named("tiny", n_layer=2, n_embd=64, block_size=64)).eval()
    with torch.no_grad():
        for p in sharp.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return sharp


def hf_twin(ours):
    hf = ours.to_hf()
    # Our generate never stops early; HF would stop at the end-of-text id (the last byte here).
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = ours.config.vocab_size - 1
    return hf


def nucleus_by_hand(probs: list[float], p: float) -> set[int]:
    """The smallest set of tokens, most probable first, whose mass reaches p (float64 Python)."""
    kept, mass = set(), 0.0
    for token in sorted(range(len(probs)), key=lambda i: -probs[i]):
        kept.add(token)
        mass += probs[token]
        if mass >= p:
            break
    return kept


def test_greedy_picks_the_argmax_at_every_step(model):
    idx = torch.tensor([[1, 2, 3]])
    out = generate(model, idx, 5, temperature=0)
    for t in range(3, 8):
        with torch.no_grad():
            logits, _ = model(out[:, :t])
        assert out[0, t] == logits[0, -1].argmax()


def test_top_k_never_leaves_the_k_best(model):
    idx = torch.tensor([[7, 8]])
    with torch.no_grad():
        allowed = set(torch.topk(model(idx)[0][0, -1], 3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    firsts = {generate(model, idx, 1, temperature=2.0, top_k=3, generator=gen)[0, -1].item() for _ in range(200)}
    assert firsts <= allowed and len(firsts) > 1


def test_top_p_never_leaves_the_nucleus():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)) * 2
    probs = torch.softmax(logits.double(), dim=-1)[0].tolist()
    for p in (0.3, 0.6, 0.9):
        nucleus = nucleus_by_hand(probs, p)
        filtered = logits_to_probs(logits, top_p=p)[0]
        assert set(filtered.nonzero().flatten().tolist()) == nucleus
        draws = torch.multinomial(filtered, 2000, replacement=True, generator=torch.Generator().manual_seed(2))
        assert set(draws.tolist()) <= nucleus


def test_top_p_always_keeps_the_argmax():
    logits = torch.tensor([[4.0, 1.0, 0.5, 0.0]])  # the argmax alone holds 91 % of the mass
    for p in (1e-9, 0.5, 0.9):
        assert logits_to_probs(logits, top_p=p).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert logits_to_probs(logits, top_p=0.95)[0, 1] > 0  # 0.95 needs the second token too


def test_near_zero_temperature_equals_greedy(sharp_model):
    idx = torch.tensor([list(b"The for statement")])
    greedy = generate(sharp_model, idx, 30, temperature=0)
    cold = generate(sharp_model, idx, 30, temperature=1e-6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cold, greedy)


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.8])
def test_temperature_raises_probabilities_to_the_power_one_over_t(temperature):
    # softmax(z / T)_i = p_i^(1/T) / sum_j p_j^(1/T) with p = softmax(z): an identity, computed in float64.
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 3
    p = torch.softmax(logits.double(), dim=-1)
    expected = p ** (1 / temperature) / (p ** (1 / temperature)).sum(-1, keepdim=True)
    torch.testing.assert_close(logits_to_probs(logits, temperature).double(), expected, atol=PROB_ATOL, rtol=0)


def test_temperature_zero_is_a_one_hot_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert logits_to_probs(logits, 0).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 10, None), (0.7, None, 0.9), (1.3, 50, 0.8), (1.0, None, 0.5), (0.5, 3, 0.99), (2.0, 1000, 0.3)],
)
def test_filtered_distributions_match_hf_logits_warpers(temperature, top_k, top_p):
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(4)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    assert torch.equal(probs > 0, expected > 0), "the kept sets must be identical"
    torch.testing.assert_close(probs, expected, atol=PROB_ATOL, rtol=0)


def test_greedy_matches_hf_generate_token_for_token(sharp_model):
    idx = torch.tensor([list(b"The for statement")])
    n_new = 40
    with torch.no_grad():
        ours = generate(sharp_model, idx, n_new, temperature=0)
        logits, _ = sharp_model(ours[:, :-1])
        theirs = hf_twin(sharp_model).generate(
            idx, attention_mask=torch.ones_like(idx), do_sample=False, max_new_tokens=n_new
        )
    # Logits of the two implementations agree to ~1e-6; every argmax along the path must win by far more.
    top2 = logits[0, idx.size(1) - 1 :].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    assert len(set(ours[0, idx.size(1) :].tolist())) > 10, "the greedy path should not be one repeated token"
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.8, 20, None), (1.2, 50, 0.8)])
def test_sampling_matches_hf_generate_with_the_same_seed(sharp_model, temperature, top_k, top_p):
    # Both draw one torch.multinomial sample per step from torch's global generator, so with the same
    # seed and the same distribution (to ~1e-7) they must draw the same tokens.
    idx = torch.tensor([list(b"The for statement")])
    hf = hf_twin(sharp_model)
    torch.manual_seed(5)
    ours = generate(sharp_model, idx, 30, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.manual_seed(5)
    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), do_sample=True, max_new_tokens=30,
                         temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0)
    assert torch.equal(ours, theirs)


def test_filter_logits_keeps_ties_with_the_kth_logit():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, True, False]]


def test_context_longer_than_the_block_is_cropped(model):
    out = generate(model, torch.zeros(1, 20, dtype=torch.long), 3, temperature=0)
    assert out.shape == (1, 23)


def test_same_seed_same_text(model):
    a = complete(model, ByteTokenizer(), "abc", 20, seed=3, top_p=0.9)
    b = complete(model, ByteTokenizer(), "abc", 20, seed=3, top_p=0.9)
    assert a == b and a.startswith("abc")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
    ],
)
def test_bad_sampling_arguments_are_rejected(model, kwargs, fragment):
    kwargs = dict(max_new_tokens=1) | kwargs
    with pytest.raises(ValueError, match=fragment):
        generate(model, torch.zeros(1, 1, dtype=torch.long), **kwargs)


def test_every_bad_argument_is_named_in_one_error():
    with pytest.raises(ValueError, match="temperature.*top_k.*top_p"):
        logits_to_probs(torch.zeros(1, 4), temperature=-1, top_k=0, top_p=2.0)
