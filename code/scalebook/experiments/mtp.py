"""Chapter 14's multi-token-prediction study: one tiny GPT trained with and without MTP modules.

:func:`compare_mtp` trains the same byte-level GPT (same initial weights, same batches, same steps) on the
embedded corpus with :class:`scalebook.mtp.MultiTokenPrediction` at each depth D asked for (D = 0: next-token
prediction only), through the book's one training loop, and measures the next-token loss on held-out text
every few steps: the main model alone, since the modules are dropped at inference.

Source: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 2.2; the loop is
:func:`scalebook.train.loop.training_steps`.
"""

from __future__ import annotations

import torch

from scalebook import data, measure
from scalebook.model import GPT, GPTConfig
from scalebook.mtp import MultiTokenPrediction
from scalebook.parallel.parallelize import ParallelModel
from scalebook.train import TrainConfig, evaluate, make_optimizer, training_steps

__all__ = ["compare_mtp", "study_config"]


def study_config(seq_len: int = 64) -> GPTConfig:
    """The study's GPT: 2 layers of width 64, 4 heads, bytes as tokens."""
    return GPTConfig(vocab_size=256, block_size=seq_len, n_layer=2, n_head=4, n_embd=64)


def compare_mtp(
    depths=(0, 1), *, weight: float = 0.3, steps: int = 200, eval_every: int = 25, batch_size: int = 16,
    seq_len: int = 64, lr: float = 3e-3, eval_windows: int = 256, seed: int = 0,
) -> dict[int, dict]:  # fmt: skip
    """Train :func:`study_config`'s GPT for ``steps`` AdamW steps at each MTP depth in ``depths`` (lambda =
    ``weight``), all from the same initial weights on the same batches.

    Returns per depth: ``steps`` and ``val_loss`` (next-token loss of the main model on the first
    ``eval_windows`` windows of the held-out tenth of the corpus, before training and every ``eval_every``
    steps), ``train_loss`` (the loss each step minimized: with MTP, main plus weighted MTP losses),
    ``extra_parameters`` (the modules') and ``seconds`` (wall-clock time of the training steps).
    """
    if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < seq_len for d in depths):
        raise ValueError(f"depths must be integers in [0, seq_len - 1 = {seq_len - 1}], got {depths!r}")
    if not 1 <= eval_every <= steps:
        raise ValueError(f"eval_every must be in [1, steps = {steps}], got {eval_every}")
    train_tokens, val_tokens = data.train_val_split(data.corpus_tokens())
    val_tokens = val_tokens[: eval_windows * seq_len + 1]
    cfg = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, min_lr=lr / 10, seed=seed,
                      progress=False)  # fmt: skip
    with measure.one_thread():  # matrices this small: bit-identical everywhere, and no threads waiting
        return {depth: _train(depth, weight, cfg, train_tokens, val_tokens, eval_every) for depth in depths}


def _train(depth, weight, cfg, train_tokens, val_tokens, eval_every) -> dict:
    torch.manual_seed(cfg.seed)
    gpt = GPT(study_config(cfg.seq_len))  # built first: every depth starts from the same GPT weights
    model = MultiTokenPrediction(gpt, depth, weight)
    one_process = ParallelModel(model, make_optimizer(model, cfg))
    generator = torch.Generator().manual_seed(cfg.seed)

    def val_loss() -> float:
        loss = evaluate(gpt, val_tokens, seq_len=cfg.seq_len, batch_size=64)  # the main model alone
        model.train()
        return loss

    history = {"steps": [0], "val_loss": [val_loss()], "train_loss": [], "seconds": 0.0}
    history["extra_parameters"] = model.num_parameters() - gpt.num_parameters()
    model.train()
    for record in training_steps(
        one_process, lambda: data.get_batch(train_tokens, cfg.batch_size, cfg.seq_len, generator), cfg
    ):
        history["seconds"] += record.step_time
        history["train_loss"].append(record.loss)
        if record.step % eval_every == 0 or record.step == cfg.steps:
            history["steps"].append(record.step)
            history["val_loss"].append(val_loss())
    return history
