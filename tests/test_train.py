"""The single-device training loop: it learns, it is deterministic, and its options are exact."""

import argparse
import math
from itertools import pairwise

import pytest
import torch

from scalebook import data, measure
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig, cli, evaluate, lr_at, make_optimizer, train

TOKENS = data.tokenize(data.default_corpus()[:200_000])
MICRO = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def fresh_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**MICRO.to_dict(), **overrides}))


def test_loss_falls_on_the_embedded_corpus():
    model = fresh_model()
    result = train(model, TOKENS, TrainConfig(steps=60, batch_size=8, seq_len=32, progress=False))
    # An untrained model predicts ~uniformly over 256 bytes: loss ln(256) = 5.55. After 60 steps a
    # model this size has learned byte frequencies and common digrams (< 3.2 nats); we ask for 1 nat less.
    assert abs(result.losses[0] - math.log(256)) < 0.1
    assert result.losses[-1] < result.losses[0] - 1.0


def test_training_is_deterministic_under_a_seed():
    runs = []
    for _ in range(2):
        model = fresh_model()
        runs.append(train(model, TOKENS, TrainConfig(steps=5, batch_size=4, seq_len=32, progress=False)).losses)
    assert runs[0] == runs[1]


def test_gradient_accumulation_equals_one_large_batch():
    """Two micro-batches of 4 with accumulation give the gradient of one batch of 8."""
    torch.manual_seed(0)
    x, y = next(data.random_batches(TOKENS, 8, 32, seed=0))
    big = fresh_model()
    big(x, y)[1].backward()
    acc = fresh_model()
    for i in range(2):
        (acc(x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])[1] / 2).backward()
    for (name, a), b in zip(big.named_parameters(), acc.parameters(), strict=True):
        # Same math, different summation order: float32 rounding only.
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-5, msg=name)


def test_train_with_accumulation_matches_train_without():
    a, b = fresh_model(), fresh_model()
    la = train(a, TOKENS, TrainConfig(steps=3, batch_size=8, grad_accum=1, seq_len=32, progress=False)).losses
    lb = train(b, TOKENS, TrainConfig(steps=3, batch_size=4, grad_accum=2, seq_len=32, progress=False)).losses
    # Same data per step, same gradient up to float32 summation order; three Adam steps amplify
    # that rounding to ~1e-6 in the loss.
    assert la == pytest.approx(lb, abs=1e-5)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=0)


def test_bf16_autocast_trains_close_to_fp32():
    a, b = fresh_model(), fresh_model()
    cfg = dict(steps=20, batch_size=8, seq_len=32, progress=False)
    fp32 = train(a, TOKENS, TrainConfig(**cfg)).losses
    bf16 = train(b, TOKENS, TrainConfig(precision="bf16", **cfg)).losses
    # bf16 keeps 8 mantissa bits (relative error ~4e-3 per op); after 20 steps the loss curves agree
    # to a few percent, far closer than the ~2 nats the loss moves.
    assert abs(bf16[-1] - fp32[-1]) / fp32[-1] < 0.05
    assert bf16 != fp32


def test_activation_checkpointing_does_not_change_the_losses():
    a, b = fresh_model(), fresh_model()
    cfg = dict(steps=4, batch_size=4, seq_len=32, progress=False)
    plain = train(a, TOKENS, TrainConfig(**cfg)).losses
    ckpt = train(b, TOKENS, TrainConfig(activation_checkpointing=True, **cfg)).losses
    assert plain == ckpt


def test_learning_rate_schedule_warms_up_then_decays_to_min():
    cfg = TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(x >= y for x, y in pairwise(lrs))


def test_adam_state_bytes_after_one_step():
    model = fresh_model()
    opt = make_optimizer(model, TrainConfig())
    train(model, TOKENS, TrainConfig(steps=1, batch_size=2, seq_len=32, progress=False), optimizer=opt)
    n = model.num_parameters()
    held = measure.model_state_bytes(model, opt)
    # fp32 training with Adam: 4 bytes of weights, 4 of gradients, 8 of moments per parameter.
    assert (held.params, held.grads, held.optimizer) == (4 * n, 4 * n, 8 * n)


def test_evaluate_is_the_mean_token_loss():
    model = fresh_model()
    val = TOKENS[:1000]
    loss = evaluate(model, val, seq_len=32, batch_size=4)
    assert abs(loss - math.log(256)) < 0.1


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(steps=0), "steps must be >= 1"),
        (dict(precision="fp8"), "precision must be one of"),
        (dict(lr=1e-4, min_lr=1e-3), "min_lr <= lr"),
    ],
)
def test_bad_train_config_is_rejected(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        TrainConfig(**kwargs)


def test_sequence_longer_than_the_model_is_rejected_before_training():
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        train(fresh_model(), TOKENS, TrainConfig(seq_len=64, progress=False))


def test_the_command_line_runs_this_very_loop():
    """``python -m scalebook.train`` on one process and ``train()`` are one loop (``training_steps``): the same
    model, data and settings give bit-identical losses, micro-batches and clipping included."""
    argv = ["--steps", "3", "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32", "--warmup-steps", "1"]
    args = argparse.Namespace(**{**vars(cli.build_parser().parse_args(argv)), "no_progress": True})
    from_the_command_line = [record.loss for record in cli.run(args)]
    torch.manual_seed(0)
    model = GPT(GPTConfig.named("tiny"))
    cfg = TrainConfig(steps=3, batch_size=2, grad_accum=2, seq_len=32, warmup_steps=1, progress=False)
    assert train(model, data.tokenize(data.load_text()), cfg).losses == from_the_command_line
