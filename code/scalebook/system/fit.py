"""Fit the system model's free parameters on published runs, and say how well it generalizes.

The parameters (:class:`scalebook.system.compute.SystemParams`) minimize the sum over runs of
``log(predicted / reported)^2`` of model TFLOP/s per GPU: a relative error, so a 100 TFLOP/s A100 run weighs as
much as a 400 TFLOP/s H100 one, and over- and under-prediction by the same factor cost the same. The search is
Nelder and Mead's simplex on the logits of the three fractions (so every candidate stays in (0, 1)), written out
here because the package runs without SciPy in the browser.

:func:`calibration_table` reports, for every run, the prediction with the parameters fitted on all runs and the
*leave-one-out* prediction, with parameters fitted on the other runs only: how far off the model is on a run it
has not seen.

Source: Nelder and Mead 1965, "A Simplex Method for Function Minimization", The Computer Journal 7(4);
Hastie, Tibshirani and Friedman 2009, "The Elements of Statistical Learning", Sec. 7.10 (cross-validation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scalebook.system.compute import SystemParams
from scalebook.system.predict import FITTED, predict

START = FITTED


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def nelder_mead(
    f: Callable[[list[float]], float],
    x0: Sequence[float],
    *,
    step: float = 0.5,
    tolerance: float = 1e-7,
    max_iterations: int = 400,
) -> list[float]:
    """Minimize ``f`` from ``x0`` by the Nelder-Mead simplex (reflection 1, expansion 2, contraction 1/2,
    shrink 1/2); stops when the simplex's values differ by less than ``tolerance``."""
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(max_iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / (len(simplex) - 1) for j in range(len(x0))]
        worst = simplex[-1]

        def toward(coefficient: float, centroid=centroid, worst=worst) -> list[float]:
            return [c + coefficient * (w - c) for c, w in zip(centroid, worst, strict=True)]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p, strict=True)] for p in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def predicted_tflops(run, params: SystemParams) -> float:
    """Model TFLOP/s per GPU that the model predicts for a :class:`scalebook.calibration.PublishedRun`."""
    return predict(
        run.model, run.cluster, run.layout, seq_len=run.seq_len, global_batch=run.global_batch, params=params
    ).model_tflops_per_gpu


def fit_params(runs: Sequence, start: SystemParams = START, *, step: float = 0.5) -> SystemParams:
    """The parameters that minimize the summed squared log error over ``runs`` (see the module docstring)."""

    def loss(x: list[float]) -> float:
        params = SystemParams(*(_sigmoid(v) for v in x))
        return sum(math.log(predicted_tflops(r, params) / r.model_tflops) ** 2 for r in runs)

    best = nelder_mead(loss, [_logit(p) for p in start.as_tuple()], step=step, tolerance=1e-6)
    return SystemParams(*(round(_sigmoid(v), 4) for v in best))


@dataclass(frozen=True)
class CalibrationRow:
    """One run: reported and predicted model TFLOP/s per GPU, and the relative errors in and out of sample."""

    name: str
    reported: float
    predicted: float
    leave_one_out: float

    @property
    def error(self) -> float:
        return self.predicted / self.reported - 1

    @property
    def leave_one_out_error(self) -> float:
        return self.leave_one_out / self.reported - 1


def calibration_table(
    runs: Sequence, params: SystemParams = FITTED, *, fitted: Sequence | None = None, leave_one_out: bool = True
) -> list[CalibrationRow]:
    """A row per run of ``runs``. ``fitted`` (default: all of ``runs``) are the runs the parameters were fitted
    on; a run among them is refitted without it for its leave-one-out prediction, a run outside them (held out)
    keeps its prediction, which is already out of sample."""
    fitted = list(runs if fitted is None else fitted)
    rows = []
    for run in runs:
        predicted = predicted_tflops(run, params)
        out = predicted
        if leave_one_out and run in fitted:
            out = predicted_tflops(run, fit_params([r for r in fitted if r is not run], start=params, step=0.2))
        rows.append(CalibrationRow(run.name, run.model_tflops, predicted, out))
    return rows
