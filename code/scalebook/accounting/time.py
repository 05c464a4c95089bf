"""Utilization and wall-clock time: MFU, training days, and the devices a deadline needs.

Model FLOPs utilization is the share of the devices' peak that goes into the model's own arithmetic:

    MFU = model FLOPs per token * tokens per second / (n_devices * peak FLOP/s)

with model FLOPs from :mod:`scalebook.accounting.flops`, recomputation excluded (a mixture of experts'
from its active parameters, 6 N_active). Turned around:

    days    = F / (n_devices * peak * MFU) / 86400
    devices = ceil(F / (days * 86400 * peak * MFU))

With ``recompute=True``, F includes the recomputed forward pass (8 N D) and the utilization to pass is
the hardware FLOPs utilization (HFU), as in Narayanan et al.'s training-time estimate 8 T P / (n X).

Source: Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", Appendix B (MFU and
HFU); Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 5.1.
"""

from __future__ import annotations

import math

from scalebook.accounting import _checks
from scalebook.accounting.flops import flops_per_token
from scalebook.configs import ModelConfig

SECONDS_PER_DAY = 86_400


def _utilization(mfu: float) -> list[str]:
    problems = _checks.positive(mfu=mfu)
    if not problems and mfu > 1:
        problems = [f"mfu is a fraction of peak, at most 1, got {mfu!r}"]
    return problems


def mfu(
    model: ModelConfig | float,
    tokens_per_second: float,
    n_devices: int,
    peak_flops: float,
    *,
    seq_len: int | None = None,
) -> float:
    """Model FLOPs utilization of a run that trains ``tokens_per_second`` on ``n_devices`` devices."""
    _checks.require(
        _checks.positive(tokens_per_second=tokens_per_second, peak_flops=peak_flops),
        _checks.positive_int(n_devices=n_devices),
    )
    return flops_per_token(model, seq_len=seq_len) * tokens_per_second / (n_devices * peak_flops)


def training_days(
    model: ModelConfig | float,
    tokens: float,
    n_devices: int,
    peak_flops: float,
    mfu: float,
    *,
    seq_len: int | None = None,
    recompute: bool = False,
) -> float:
    """Days to train on ``tokens`` tokens with ``n_devices`` devices running at ``mfu`` of ``peak_flops``."""
    _checks.require(
        _checks.positive(tokens=tokens, peak_flops=peak_flops),
        _checks.positive_int(n_devices=n_devices),
        _utilization(mfu),
    )
    flops = tokens * flops_per_token(model, seq_len=seq_len, recompute=recompute)
    return flops / (n_devices * peak_flops * mfu) / SECONDS_PER_DAY


def devices_needed(
    model: ModelConfig | float,
    tokens: float,
    days: float,
    peak_flops: float,
    mfu: float,
    *,
    seq_len: int | None = None,
    recompute: bool = False,
) -> int:
    """Fewest devices that train on ``tokens`` tokens within ``days`` days at ``mfu`` of ``peak_flops``."""
    _checks.require(_checks.positive(tokens=tokens, days=days, peak_flops=peak_flops), _utilization(mfu))
    flops = tokens * flops_per_token(model, seq_len=seq_len, recompute=recompute)
    devices = flops / (days * SECONDS_PER_DAY * peak_flops * mfu)
    # Float division can land a hair above a whole number of devices; do not round that up.
    return math.ceil(devices * (1 - 1e-12))
