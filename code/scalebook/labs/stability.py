"""Lab 8, loss spikes: a learning rate raised too far makes the loss jump; a running-median detector finds the
jump, and the usual remedies (a lower learning rate, rewinding to a checkpoint, z-loss, QK-norm) are each
tried on the same seeded run.

The spike is planted: after ``calm_steps`` at a sound learning rate the run switches to one ``spike_lr``
(the too-high peak of a schedule, or a resumed run given the wrong value). :func:`find_spikes` flags a step
whose loss exceeds the median of the steps before it by ``k`` median absolute deviations (and by
``min_jump`` nats, so that batch-to-batch noise never counts). Two diagnostics say where the growth is: the
largest attention logit ``|q.k|/sqrt(d_head)`` of any head, and the mean log-normalizer ``log Z`` of the
output softmax.

- **z-loss** adds ``coefficient * mean(log Z)^2`` to the loss (PaLM uses 1e-4), pulling ``log Z`` to 0 so the
  output logits cannot drift as a whole.
- **QK-norm** applies a LayerNorm to every head's queries and keys before their dot product, so an attention
  logit is bounded by the two LayerNorms' gains times ``sqrt(d_head)`` instead of growing with the weights.
- **Rewind** keeps a checkpoint every few steps; when the detector fires it restores the last one, skips the
  batches from there to the spike, and multiplies the learning rate by ``rewind_lr_factor`` (1: rewind and
  skip only).

Source: Chowdhery et al. 2022, "PaLM", Sec. 5 (z-loss, rewinding and skipping batches around spikes);
Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters" (QK-norm against attention-logit
growth); Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities";
Zhang et al. 2022, "OPT" logbook (restarts from checkpoints with a lower learning rate).
"""

from __future__ import annotations

import copy
import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from scalebook.data import corpus_tokens, get_batch
from scalebook.labs.checks import check_variants
from scalebook.measure import one_thread
from scalebook.model import GPT, GPTConfig

STABILITY_VARIANTS = (
    "broken: learning rate raised too far",
    "fixed: lower learning rate",
    "fixed: rewind, skip and lower the learning rate",
    "rewind and skip only",
    "z-loss",
    "QK-norm",
)
# A small, fast GPT: two layers of width 64, two heads of 32 dimensions.
STABILITY_CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


class ProbedAttention(nn.Module):
    """Causal attention softmax(Q K^T / sqrt(d_head) + M) V that records its largest ``|logit|``, with optional
    QK-norm (a LayerNorm over each head's queries and one over its keys, applied before the product).

    Plugs into :class:`scalebook.model.CausalSelfAttention`'s ``core_attention`` hook, so the model itself
    is unchanged (:func:`add_probed_attention`).
    """

    def __init__(self, head_dim: int, qk_norm: bool = False):
        super().__init__()
        self.q_norm = nn.LayerNorm(head_dim) if qk_norm else None
        self.k_norm = nn.LayerNorm(head_dim) if qk_norm else None
        self.max_logit = 0.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        self.max_logit = scores.detach().abs().max().item()
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def add_probed_attention(model: GPT, qk_norm: bool = False) -> list[ProbedAttention]:
    """Give every block of ``model`` a :class:`ProbedAttention` (with QK-norm if asked); returns them."""
    probes = [ProbedAttention(model.config.head_dim, qk_norm) for _ in model.blocks]
    for block, probe in zip(model.blocks, probes, strict=True):
        block.attn.core_attention = probe
    return probes


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """PaLM's auxiliary loss: the mean over positions of ``(log Z)^2``, ``log Z = logsumexp`` of the logits."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def find_spikes(losses, *, window: int = 8, k: float = 6.0, min_jump: float = 1.0) -> list[int]:
    """Steps whose loss exceeds the median of the ``window`` steps before it by more than
    ``max(k * MAD, min_jump)`` (MAD: median absolute deviation of that window). The first ``window``
    steps are never flagged: there is no history to compare with yet.
    """
    if window < 2 or k <= 0 or min_jump < 0:
        raise ValueError(f"need window >= 2, k > 0 and min_jump >= 0, got {window}, {k}, {min_jump}")
    spikes = []
    for t in range(window, len(losses)):
        if _is_spike(losses[t - window : t], losses[t], k, min_jump):
            spikes.append(t)
    return spikes


def _is_spike(history, loss: float, k: float, min_jump: float) -> bool:
    median = statistics.median(history)
    mad = statistics.median(abs(x - median) for x in history)
    return not math.isfinite(loss) or loss > median + max(k * mad, min_jump)


def train_through_spike(
    variant: str = STABILITY_VARIANTS[0],
    *,
    steps: int = 28,
    calm_steps: int = 12,
    lr: float = 3e-3,
    spike_lr: float = 0.1,
    lower_lr: float = 5e-3,
    z_loss_coefficient: float = 1e-4,
    checkpoint_every: int = 4,
    rewind_lr_factor: float = 0.05,
    max_rewinds: int = 3,
    batch_size: int = 16,
    seed: int = 0,
    window: int = 8,
    k: float = 6.0,
    min_jump: float = 1.0,
) -> dict:
    """Train ``STABILITY_CONFIG`` with AdamW for ``steps`` steps: ``lr`` for ``calm_steps``, then
    ``spike_lr`` (``lower_lr`` for the lower-learning-rate fix), with one of ``STABILITY_VARIANTS``.

    Returns per kept step ``losses`` (the cross-entropy, without z-loss), ``max_attention_logit`` and
    ``log_z``; ``spikes`` (:func:`find_spikes` on the kept losses) and ``rewinds`` (the steps at which the
    on-line detector fired and the run went back to a checkpoint; after ``max_rewinds`` it gives up and trains
    on, as an operator would stop rewinding a run whose spikes come back).
    """
    (variant,) = check_variants([variant], STABILITY_VARIANTS)
    with one_thread():  # the same results on a 1- and a 2-core machine
        rewinding = "rewind" in variant
        torch.manual_seed(seed)
        model = GPT(STABILITY_CONFIG)
        probes = add_probed_attention(model, qk_norm=variant == "QK-norm")
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        high_lr = lower_lr if variant == "fixed: lower learning rate" else spike_lr
        generator = torch.Generator().manual_seed(seed)
        seq_len = STABILITY_CONFIG.block_size
        batches = [get_batch(corpus_tokens(), batch_size, seq_len, generator) for _ in range(2 * steps)]
        kept = {"losses": [], "max_attention_logit": [], "log_z": []}
        rewinds, lr_scale, next_batch, checkpoint = [], 1.0, 0, None
        while len(kept["losses"]) < steps:
            step = len(kept["losses"])
            if rewinding and step % checkpoint_every == 0:
                checkpoint = (step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
            for group in optimizer.param_groups:
                group["lr"] = (lr if step < calm_steps else high_lr) * lr_scale
            x, y = batches[next_batch]
            next_batch += 1
            logits, loss = model(x, y)
            log_z = torch.logsumexp(logits.detach().float(), dim=-1).mean().item()
            watching = rewinding and len(rewinds) < max_rewinds and step >= window
            if watching and _is_spike(kept["losses"][-window:], loss.item(), k, min_jump):
                rewinds.append(step)  # restore the checkpoint, skip the batches it had seen up to the spike
                back, model_state, optimizer_state = checkpoint
                model.load_state_dict(model_state)
                optimizer.load_state_dict(optimizer_state)
                for series in kept.values():
                    del series[back:]
                lr_scale *= 1.0 if variant == "rewind and skip only" else rewind_lr_factor
                continue
            total = loss + z_loss_coefficient * z_loss(logits) if variant == "z-loss" else loss
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
            kept["losses"].append(loss.item())
            kept["max_attention_logit"].append(max(p.max_logit for p in probes))
            kept["log_z"].append(log_z)
        spikes = find_spikes(kept["losses"], window=window, k=k, min_jump=min_jump)
        return {**kept, "spikes": spikes, "rewinds": rewinds}


def stability_lab(variants=STABILITY_VARIANTS, **kwargs) -> dict:
    """:func:`train_through_spike` for each of ``variants`` (same seed, same batches); ``{variant: result}``."""
    variants = check_variants(variants, STABILITY_VARIANTS)
    return {variant: train_through_spike(variant, **kwargs) for variant in variants}

