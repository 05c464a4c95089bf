"""Chapter 1's IsoFLOP ladder: tiny GPTs trained at a few fixed compute budgets, to read off the compute-optimal size.

:func:`isoflop_ladder` trains, for each budget C, a few sizes N for the number of steps that spends C = 6 N D
(a bigger model gets fewer tokens), each with its own cosine schedule ending at its last step, as Hoffmann et al.
train every IsoFLOP run, through the book's one training loop; it measures the held-out loss of each.
:func:`ladder_optima` reads each budget's best size from a parabola in ln N (Approach 2), with
:func:`scalebook.scaling.isoflop_minimum`.

Source: Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", Sec. 3.2 (IsoFLOP profiles);
the loop is :func:`scalebook.train.train`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from scalebook.measure import one_thread
from scalebook.model import GPT, GPTConfig
from scalebook.scaling import isoflop_minimum
from scalebook.train import TrainConfig, evaluate, train

__all__ = ["LadderRun", "isoflop_ladder", "ladder_model", "ladder_optima"]


@dataclass(frozen=True)
class LadderRun:
    """One run of the ladder: its budget, the model's width and size, what it trained on, its held-out loss."""

    budget: float  # the FLOPs asked for, 6 N D
    width: int
    params: int
    steps: int
    tokens: int
    val_loss: float

    @property
    def flops(self) -> float:
        """6 N D of the run as it ran: the budget up to rounding the steps to a whole number."""
        return 6 * self.params * self.tokens


def ladder_model(width: int, seq_len: int) -> GPT:
    """The ladder's GPT: one block of ``width`` (one head per 16 dimensions, at least one), bytes as tokens."""
    return GPT(GPTConfig(n_layer=1, n_embd=width, n_head=max(1, width // 16), block_size=seq_len, attn_impl="sdpa"))


def isoflop_ladder(
    train_tokens: torch.Tensor,
    val_tokens: torch.Tensor,
    plan: Mapping[float, Sequence[int]],
    *,
    batch_size: int = 4,
    seq_len: int = 64,
    lr: float = 1e-2,
    seed: int = 0,
) -> list[LadderRun]:
    """Train :func:`ladder_model` at each budget of ``plan`` (FLOPs -> widths) for round(C / (6 N tokens per
    step)) AdamW steps, warm-up a tenth of them and cosine decay to ``lr / 10``; return one :class:`LadderRun` each.

    Runs on one thread (restored afterwards): these models are too small for a second thread to pay, and one
    thread gives the same losses on any thread count.
    """
    if not plan or any(not widths for widths in plan.values()):
        raise ValueError("plan needs at least one budget, each with at least one width, e.g. {1e9: (4, 8, 12)}")
    runs = []
    with one_thread():
        for budget, widths in plan.items():
            for width in widths:
                torch.manual_seed(seed)
                model = ladder_model(width, seq_len)
                params = model.num_parameters()
                steps = max(1, round(budget / (6 * params * batch_size * seq_len)))
                cfg = TrainConfig(
                    steps=steps,
                    batch_size=batch_size,
                    seq_len=seq_len,
                    lr=lr,
                    min_lr=lr / 10,
                    warmup_steps=max(1, steps // 10),
                    seed=seed,
                    progress=False,
                )
                train(model, train_tokens, cfg)
                val_loss = evaluate(model, val_tokens, seq_len=seq_len, batch_size=64)
                runs.append(LadderRun(budget, width, params, steps, steps * cfg.tokens_per_step, val_loss))
    return runs


def ladder_optima(runs: Sequence[LadderRun]) -> dict[float, float]:
    """Budget -> the loss-minimizing parameter count of its IsoFLOP profile (vertex of the parabola in ln N)."""
    budgets = dict.fromkeys(run.budget for run in runs)
    optima = {}
    for budget in budgets:
        profile = [run for run in runs if run.budget == budget]
        optima[budget], _ = isoflop_minimum([run.params for run in profile], [run.val_loss for run in profile])
    return optima
