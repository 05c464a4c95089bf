"""The single-device training loop: it learns, it is deterministic, and its options are exact."""

import argparse
import math
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from scalebook import data, measure
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.dims import ParallelDims
from scalebook.parallel.parallelize import ParallelModel
from scalebook.train import TrainConfig, cli, evaluate, lr_at, make_optimizer, train
from scalebook.train.loop import training_steps

TOKENS = data.tokenize(data.default_corpus()[:200_000])
MICRO = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def fresh_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**MICRO.to_dict(), **overrides}))


def plain_pytorch_training(model, tokens, *, steps, batch_size, seq_len, micro_batches=1, warmup_steps, lr=3e-3,
                           min_lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), max_norm=1.0, seed=0):  # fmt: skip
    """The reference for scalebook's loop, written out with nothing of it: AdamW with weight decay on matrices only,
    linear warm-up then cosine decay to ``min_lr`` at the last step, each step's ``batch_size`` sequences drawn
    by ``data.get_batch`` from a generator seeded ``seed`` (what the loop's callers draw), the gradient of their
    mean loss (accumulated over ``micro_batches`` equal chunks, the textbook way, or one forward), then
    ``torch.nn.utils.clip_grad_norm_`` and ``optimizer.step()``. Returns each step's (loss, gradient norm)."""
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=lr, betas=betas)  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    model.train()
    records = []
    for step in range(steps):
        if step < warmup_steps:
            step_lr = lr * (step + 1) / warmup_steps
        else:
            progress = (step - warmup_steps) / max(1, steps - 1 - warmup_steps)
            step_lr = min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        optimizer.zero_grad()
        x, y = data.get_batch(tokens, batch_size, seq_len, generator)
        loss = 0.0
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            micro_loss = model(xm, ym)[1]
            (micro_loss / micro_batches).backward()
            loss += micro_loss.item() / micro_batches
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        records.append((loss, norm.item()))
    return records


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
    """scalebook's loop (``training_steps`` on a one-process ``ParallelModel`` of 2 micro-batches of 4) leaves the
    gradient of one batch of 8, and its SGD step is the step plain PyTorch takes from that batch."""
    x, y = next(data.random_batches(TOKENS, 8, 32, seed=0))
    cfg = TrainConfig(steps=1, batch_size=4, grad_accum=2, seq_len=32, lr=0.1, min_lr=0.1, warmup_steps=0,
                      grad_clip=None, progress=False)  # fmt: skip
    ours = fresh_model()
    sgd = torch.optim.SGD(ours.parameters(), lr=0.1)
    loop = training_steps(ParallelModel(ours, sgd, ParallelDims(1, micro_batches=2)), lambda: (x, y), cfg)
    record = next(loop)  # one step; its gradients stay in .grad until the next step zeroes them
    # The reference: plain PyTorch, one forward and backward of all 8 sequences, one SGD step at lr 0.1.
    big = fresh_model()
    big_loss = big(x, y)[1]
    big_loss.backward()
    big_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in big.parameters()]))
    torch.optim.SGD(big.parameters(), lr=0.1).step()
    # Same math, different summation order: float32 rounding only (~1e-7 relative). A micro-batch loss not divided
    # by the 2 micro-batches doubles every gradient, and the step with it.
    assert record.loss == pytest.approx(big_loss.item(), rel=1e-6)
    assert record.grad_norm == pytest.approx(big_norm.item(), rel=1e-5)
    for (name, a), b in zip(big.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-7, rtol=1e-5, msg=name)
        torch.testing.assert_close(b, a, atol=1e-7, rtol=1e-5, msg=name)  # after the step: w - 0.1 g


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
    # By hand: the (1000 - 1) // 32 = 31 whole windows of 32 next-token pairs, every token's cross-entropy, mean.
    x = torch.stack([val[32 * i : 32 * i + 32] for i in range(31)])
    y = torch.stack([val[32 * i + 1 : 32 * i + 33] for i in range(31)])
    model.eval()
    with torch.no_grad():
        per_token = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="none")
    expected = per_token.double().mean().item()
    # In batches of 5, the last holds 1 window: a mean of the 7 batch means would weigh it 31/7 times too much
    # (0.0024 apart here, 0.04 % of the loss). float32 sums of 992 losses in another order: ~1e-7 relative; 1e-6
    # stated, 400 times closer than that mistake.
    batch_means = per_token.view(31, 32).mean(1).split(5)
    assert abs(sum(m.mean().item() for m in batch_means) / 7 - expected) > 5e-4
    assert evaluate(model, val, seq_len=32, batch_size=5) == pytest.approx(expected, rel=1e-6)
    assert evaluate(model, val, seq_len=32, batch_size=5, max_batches=2) == pytest.approx(
        per_token[: 2 * 5 * 32].double().mean().item(), rel=1e-6)  # fmt: skip


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


def test_the_command_line_trains_like_a_plain_pytorch_loop():
    """``python -m scalebook.train`` on one process (2 micro-batches of 2 per step, clipping at 1.0, warm-up, AdamW)
    gives the losses and gradient norms of plain PyTorch on the same model, weights and data: one forward of the 4
    sequences, ``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW`` (:func:`plain_pytorch_training`). And
    ``train()`` is the same loop (``training_steps``): bit-identical losses."""
    argv = ["--steps", "3", "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32", "--warmup-steps", "1"]
    args = argparse.Namespace(**{**vars(cli.build_parser().parse_args(argv)), "no_progress": True})
    from_the_command_line = [(record.loss, record.grad_norm) for record in cli.run(args)]
    tokens = data.tokenize(data.load_text())
    torch.manual_seed(0)
    reference = plain_pytorch_training(GPT(GPTConfig.named("tiny")), tokens, steps=3, batch_size=4, seq_len=32,
                                       warmup_steps=1)  # fmt: skip
    assert min(norm for _, norm in reference) > 1.0  # clipping at 1.0 acts on every step
    # One forward of 4 sequences against two of 2, torch's AdamW against the loop's: float32 summation order only,
    # ~1e-7 relative, grown by 3 Adam steps; checked at 1e-6 (loss) and 1e-5 (norm). A gradient off by a factor
    # (a missing 1/2 over the micro-batches) shows in the norm from step 1; a wrong clip or lr in the losses after.
    assert len(from_the_command_line) == len(reference) == 3
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(from_the_command_line, reference, strict=True)):
        assert norm == pytest.approx(ref_norm, rel=1e-5), ("grad norm", step + 1)
        assert loss == pytest.approx(ref_loss, rel=1e-6), ("loss", step + 1)
    assert reference[-1][0] < reference[0][0] - 0.1  # it learns, so the steps matter
    torch.manual_seed(0)
    cfg = TrainConfig(steps=3, batch_size=2, grad_accum=2, seq_len=32, warmup_steps=1, progress=False)
    assert train(GPT(GPTConfig.named("tiny")), tokens, cfg).losses == [loss for loss, _ in from_the_command_line]


def test_parallel_model_clips_like_torch_clip_grad_norm():
    """``ParallelModel.clip_grad_norm_`` on one process (what every layout's reference run uses) against
    ``torch.nn.utils.clip_grad_norm_``: the same norm before clipping and the same clipped gradients, the tied
    embedding counted once; and gradients left alone when the norm is below ``max_norm``."""
    x, y = next(data.random_batches(TOKENS, 4, 32, seed=0))
    for scale in (0.25, 4.0):  # max_norm a quarter of the norm (clips), and four times it (does not)
        ours, theirs = fresh_model(), fresh_model()
        for model in (ours, theirs):
            model(x, y)[1].backward()
        unclipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in theirs.parameters()]))
        max_norm = scale * unclipped.item()
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
        got = ParallelModel(ours, torch.optim.SGD(ours.parameters(), lr=0.1)).clip_grad_norm_(max_norm)
        # Identical gradients, norms summed in the same float32 order: equal to ~1e-7; 1e-6 stated.
        assert got.item() == pytest.approx(expected.item(), rel=1e-6)
        for (name, a), b in zip(theirs.named_parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=0, msg=name)
        clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours.parameters()]))
        assert clipped.item() == pytest.approx(min(max_norm, unclipped.item()), rel=1e-5)
