"""Sampling: greedy is argmax, top-k stays in the k best, seeds reproduce."""

import pytest
import torch

from scalebook.data import ByteTokenizer
from scalebook.generate import complete, generate
from scalebook.model import GPT, GPTConfig


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig.named("tiny", n_layer=2, block_size=16)).eval()


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


def test_context_longer_than_the_block_is_cropped(model):
    out = generate(model, torch.zeros(1, 20, dtype=torch.long), 3, temperature=0)
    assert out.shape == (1, 23)


def test_same_seed_same_text(model):
    a = complete(model, ByteTokenizer(), "abc", 20, seed=3)
    b = complete(model, ByteTokenizer(), "abc", 20, seed=3)
    assert a == b and a.startswith("abc")


@pytest.mark.parametrize("kwargs, fragment", [(dict(temperature=-1), "temperature"), (dict(top_k=0), "top_k")])
def test_bad_sampling_arguments_are_rejected(model, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        generate(model, torch.zeros(1, 1, dtype=torch.long), 1, **kwargs)
