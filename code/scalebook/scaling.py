"""Scaling laws: how the loss falls with parameters N and training tokens D, and the compute-optimal split of C.

Hoffmann et al. (Chinchilla) model the final loss of a run as

    L(N, D) = E + A / N^alpha + B / D^beta                                      (their eq. 2)

and a run costs C = 6 N D FLOPs. Putting D = C / (6N) into L and setting dL/dN = 0 gives
alpha A / N^alpha = beta B / D^beta (at the optimum each term's elasticity is equal), that is

    N_opt(C) = G (C/6)^a,   D_opt(C) = (C/6)^b / G,   G = (alpha A / (beta B))^(1 / (alpha + beta)),
    a = beta / (alpha + beta),   b = alpha / (alpha + beta)                       (their eq. 4)

so tokens per parameter, D_opt / N_opt = (C/6)^(b - a) / G^2, hardly moves with C when alpha is close to beta.

The same optimum can be read off experiments without any law (their Approach 2, IsoFLOP profiles): train several
sizes at one budget, fit a parabola of the loss against ln N, take its vertex (:func:`isoflop_minimum`); then fit
N_opt = k C^a across budgets (:func:`fit_power_law`).

Source: Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", Sec. 3, Table 2 and App. D.2;
Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt" (the refit of Approach 3);
Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (N_opt proportional to C^0.73).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ParametricLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta, in nats per token, with N in parameters and D in tokens."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = ""

    def __post_init__(self):
        bad = [f"{name}={getattr(self, name)!r}" for name in ("A", "B", "alpha", "beta") if not getattr(self, name) > 0]
        if bad:
            raise ValueError(f"ParametricLaw needs A, B, alpha and beta > 0, got {', '.join(bad)}")

    def loss(self, params: float, tokens: float) -> float:
        """The predicted final loss of a model of ``params`` parameters trained on ``tokens`` tokens."""
        _check_positive(params=params, tokens=tokens)
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    @property
    def params_exponent(self) -> float:
        """a in N_opt proportional to C^a: beta / (alpha + beta)."""
        return self.beta / (self.alpha + self.beta)

    def compute_optimal(self, flops: float) -> tuple[float, float]:
        """(N_opt, D_opt): the split of ``flops`` = 6 N D that minimizes :meth:`loss` (Hoffmann et al. eq. 4)."""
        _check_positive(flops=flops)
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        params = g * (flops / 6) ** self.params_exponent
        return params, flops / (6 * params)

    def tokens_per_parameter(self, flops: float) -> float:
        """D_opt / N_opt at the budget ``flops``."""
        params, tokens = self.compute_optimal(flops)
        return tokens / params


#: Hoffmann et al. 2022, Approach 3 as printed in the paper (Sec. 3.3 and App. D.2, eq. 10): rounded constants,
#: which Besiroglu et al. 2024 show bias its predictions (the TeX source holds more digits).
HOFFMANN_2022 = ParametricLaw(
    E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, source="Hoffmann et al. 2022, Approach 3 (eq. 10)"
)
#: Besiroglu et al. 2024: Approach 3 refitted on the data they reconstructed from Hoffmann et al.'s figure.
BESIROGLU_2024 = ParametricLaw(
    E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658, source="Besiroglu et al. 2024, refit of Approach 3"
)

#: a in N_opt proportional to C^a, as published: Hoffmann et al. 2022, Table 2 (their three approaches, and Kaplan
#: et al. 2020's value as Hoffmann et al. quote it); Besiroglu et al. 2024 for their refit.
PUBLISHED_PARAMS_EXPONENTS = {
    "Hoffmann et al., Approach 1 (training-curve envelope)": 0.50,
    "Hoffmann et al., Approach 2 (IsoFLOP profiles)": 0.49,
    "Hoffmann et al., Approach 3 (parametric fit)": 0.46,
    "Besiroglu et al., refit of Approach 3": 0.5126,
    "Kaplan et al. 2020": 0.73,
}

#: Chinchilla (Hoffmann et al. 2022, Sec. 4): 70B parameters on 1.4T tokens, trained with Gopher's budget.
CHINCHILLA_PARAMS, CHINCHILLA_TOKENS = 70e9, 1.4e12
#: Gopher's (and so Chinchilla's) training compute as Hoffmann et al. state it (Sec. 3, Table 3), FLOPs.
GOPHER_FLOPS = 5.76e23


def isoflop_minimum(params: Sequence[float], losses: Sequence[float]) -> tuple[float, tuple[float, float, float]]:
    """The loss-minimizing size of one IsoFLOP profile: the vertex of a parabola fitted to loss against ln N.

    Returns (N_opt, (c2, c1, c0)) with loss = c2 (ln N)^2 + c1 ln N + c0. Needs three sizes or more, and a profile
    that curves upwards (c2 > 0): a budget whose sizes all sit on one side of its optimum has no vertex to read.
    """
    if len(params) != len(losses) or len(params) < 3:
        raise ValueError(f"need three or more (params, loss) pairs of equal length, got {len(params)}, {len(losses)}")
    _check_positive(**{f"params[{i}]": n for i, n in enumerate(params)})
    c2, c1, c0 = np.polyfit(np.log(np.asarray(params, dtype=float)), np.asarray(losses, dtype=float), 2)
    if not c2 > 0:
        raise ValueError(
            "the IsoFLOP profile does not curve upwards (no minimum): add sizes on the side of the optimum that is"
            " missing, larger if the loss still falls at the largest size, smaller if it still falls at the smallest"
        )
    return math.exp(-c1 / (2 * c2)), (float(c2), float(c1), float(c0))


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(exponent, coefficient) of y = coefficient * x^exponent, by least squares on ln y against ln x."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two or more (x, y) pairs of equal length, got {len(x)} and {len(y)}")
    _check_positive(**{f"x[{i}]": v for i, v in enumerate(x)}, **{f"y[{i}]": v for i, v in enumerate(y)})
    exponent, log_coefficient = np.polyfit(np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float)), 1)
    return float(exponent), math.exp(log_coefficient)


def _check_positive(**values: float) -> None:
    bad = [f"{name}={value!r}" for name, value in values.items() if not value > 0]
    if bad:
        raise ValueError(f"expected positive values, got {', '.join(bad)}")
