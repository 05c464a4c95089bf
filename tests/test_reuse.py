"""scalebook.train.reuse: a kept run is loaded only when it is the very same run, and equals training it."""

import pytest
import torch

from scalebook import data
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig, reuse, train

MICRO = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
CFG = TrainConfig(steps=4, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1, progress=False)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALEBOOK_CACHE", str(tmp_path))
    return tmp_path / "runs"


@pytest.fixture(scope="module")
def tokens():
    return data.tokenize(data.default_corpus()[:20_000])


def fresh_model() -> GPT:
    torch.manual_seed(0)
    return GPT(MICRO)


def test_a_kept_run_loads_as_the_run_itself(tokens, capsys):
    kept = reuse.train_and_keep(fresh_model(), tokens, CFG)
    rng_after_training = torch.get_rng_state()

    trained = fresh_model()  # trained by the plain loop, independently of the cache
    expected = train(trained, tokens, CFG)
    torch.manual_seed(123)  # the loaded run must restore the random state training leaves behind
    loaded_model = fresh_model()
    loaded = reuse.reuse_or_train(loaded_model, tokens, CFG)

    assert "loaded" in capsys.readouterr().out
    assert loaded.losses == expected.losses == kept.losses
    assert loaded.lrs == expected.lrs
    assert loaded.optimizer is None
    for (name, a), b in zip(trained.state_dict().items(), loaded_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(torch.get_rng_state(), rng_after_training)
    assert loaded_model.training


@pytest.mark.parametrize("change", ["settings", "initial weights", "tokens"])
def test_anything_that_changes_the_run_trains_it_again(tokens, change, capsys):
    reuse.train_and_keep(fresh_model(), tokens, CFG)
    capsys.readouterr()
    seed, cfg, toks = 0, CFG, tokens
    if change == "settings":
        cfg = TrainConfig(**{**CFG.__dict__, "lr": 1e-3})
    elif change == "initial weights":
        seed = 1
    else:
        toks = tokens[1:]
    torch.manual_seed(seed)
    result = reuse.reuse_or_train(GPT(MICRO), toks, cfg)
    torch.manual_seed(seed)
    expected = train(GPT(MICRO), toks, cfg)
    assert "loaded" not in capsys.readouterr().out
    assert result.losses == expected.losses and result.optimizer is not None


def test_a_damaged_kept_run_is_trained_again_not_loaded(tokens, cache, capsys):
    expected = reuse.train_and_keep(fresh_model(), tokens, CFG)
    (kept,) = cache.glob("*.pt")
    kept.write_bytes(kept.read_bytes()[:1000])  # truncated, as by a full disk
    capsys.readouterr()
    result = reuse.reuse_or_train(fresh_model(), tokens, CFG)
    assert "loaded" not in capsys.readouterr().out
    assert result.losses == expected.losses and result.optimizer is not None
    assert len(list(cache.glob("*.pt"))) == 1 and not list(cache.glob(".*"))  # no temporary file left
