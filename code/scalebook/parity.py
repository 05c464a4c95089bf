"""Loss parity across parallel layouts: do two runs that should be the same run actually agree?

A parallel layout (data, tensor, pipeline parallelism, any mix) changes where the numbers are computed,
not which numbers: from the same seed, on the same global batches, every layout should trace the loss
curve of the single-device run up to floating-point reordering. The check is therefore a comparison
of loss curves, step by step, against a reference curve,

    deviation_t = |loss_t - reference_t| / |reference_t|,

reporting for each layout the largest deviation, the first step whose deviation exceeds the tolerance
(where to start looking), and pass or fail. In fp32 on one machine, reordered sums perturb the fourth
to seventh significant digit, so a tolerance of 1e-4 separates rounding from bugs over a few dozen
steps; a bug that changes the gradient (a missing all-reduce, a wrong scale) typically shows from the
first optimizer step on, since step 0's loss is computed before any update.

Losses alone can miss a bug. Adam divides each update by the running root mean square of the gradients,
so a constant factor on every gradient (a sum over d data-parallel ranks where a mean was meant) cancels
out of the update, except against epsilon, and the loss curves stay within the tolerance. Compare the
global gradient norm of each step, before clipping and the optimizer, the same way: the factor d appears
in it at step 0.

Use it on your own runs from Python (:func:`compare_losses` takes ``{layout: [loss per step]}``) or from
the shell on files holding one loss per line or a JSON list::

    python -m scalebook.parity --tolerance 1e-4 single.txt dp4.txt dp2xtp2.json

Source: torchtitan documentation, "How to converge" (``docs/converging.md``): loss-curve parity of a
parallel layout against a baseline trained with the same seed and determinism settings.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class LayoutParity:
    """How one layout's loss curve compares with the reference curve."""

    layout: str
    max_deviation: float  # largest relative deviation over the compared steps
    worst_step: int
    first_divergent_step: int | None  # first step whose deviation exceeds the tolerance; None if none
    deviations: tuple[float, ...]

    @property
    def passed(self) -> bool:
        return self.first_divergent_step is None


@dataclass(frozen=True)
class ParityReport:
    """Every layout against the reference, at one tolerance."""

    reference: str
    tolerance: float
    layouts: tuple[LayoutParity, ...]
    quantity: str = "loss"  # what the curves hold, for the report's heading

    @property
    def passed(self) -> bool:
        return all(layout.passed for layout in self.layouts)

    def __getitem__(self, layout: str) -> LayoutParity:
        for parity in self.layouts:
            if parity.layout == layout:
                return parity
        raise KeyError(f"no layout {layout!r}; have {[p.layout for p in self.layouts]}")

    def rows(self) -> list[tuple[str, str, int, str, str]]:
        """(layout, max deviation, at step, first divergent step, verdict) for a table."""
        return [
            (
                p.layout,
                f"{p.max_deviation:.1e}",
                p.worst_step,
                "-" if p.first_divergent_step is None else str(p.first_divergent_step),
                "pass" if p.passed else "FAIL",
            )
            for p in self.layouts
        ]

    def __str__(self) -> str:
        """One line a layout. A layout within the tolerance says so without its deviation's digits, which are
        rounding and differ from one CPU to the next; a diverged one shows how far and where."""
        lines = [f"{self.quantity} parity against {self.reference!r}, relative tolerance {self.tolerance:g}:"]
        for parity, (layout, deviation, step, first, verdict) in zip(self.layouts, self.rows(), strict=True):
            if parity.passed:
                exact = "identical" if parity.max_deviation == 0 else f"max deviation < {self.tolerance:g}"
                lines.append(f"  {verdict:4}  {layout}: {exact} at every step")
            else:
                lines.append(f"  {verdict:4}  {layout}: max deviation {deviation} at step {step}, "
                             f"first exceeds the tolerance at step {first}")  # fmt: skip
        return "\n".join(lines)


def _check_curves(losses: dict[str, list[float]], reference: str | None, tolerance: float) -> str:
    problems = []
    if not isinstance(losses, dict) or len(losses) < 2:
        problems.append("pass at least two loss curves as {layout name: [loss of each step]}")
    else:
        lengths = {name: len(curve) for name, curve in losses.items()}
        if len(set(lengths.values())) != 1:
            problems.append(f"every curve must have the same number of steps, got {lengths}")
        if min(lengths.values()) < 1:
            problems.append("the curves are empty")
        bad = [name for name, curve in losses.items() if not all(math.isfinite(float(v)) for v in curve)]
        if bad:
            problems.append(f"curves {bad} contain NaN or infinite losses: that run already failed")
        if reference is not None and reference not in losses:
            problems.append(f"reference {reference!r} is not one of the curves {list(losses)}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        problems.append(f"tolerance must be a positive relative deviation such as 1e-4, got {tolerance!r}")
    if problems:
        raise ValueError("cannot compare loss curves: " + "; ".join(problems))
    return reference if reference is not None else next(iter(losses))


def compare_losses(
    losses: dict[str, list[float]],
    *,
    reference: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    quantity: str = "loss",
) -> ParityReport:
    """Compare every curve of ``losses`` with the ``reference`` curve (default: the first one).

    A layout fails when, at some step, ``|loss - reference| / |reference|`` exceeds ``tolerance``. Any
    per-step curve compares the same way; ``quantity`` names it in the report (``"gradient norm"`` for the
    norms of each step's gradient before clipping and the optimizer, the check that sees a wrong scale).
    """
    reference = _check_curves(losses, reference, tolerance)
    base = [float(v) for v in losses[reference]]
    layouts = []
    for name, curve in losses.items():
        if name == reference:
            continue
        deviations = tuple(abs(float(v) - b) / max(abs(b), 1e-12) for v, b in zip(curve, base, strict=True))
        worst = max(range(len(deviations)), key=deviations.__getitem__)
        first = next((t for t, d in enumerate(deviations) if d > tolerance), None)
        layouts.append(LayoutParity(name, deviations[worst], worst, first, deviations))
    return ParityReport(reference, float(tolerance), tuple(layouts), quantity)


def max_relative_difference(a: dict, b: dict) -> float:
    """Largest difference between two sets of named tensors (gradients, say), each tensor's relative to
    ``b``'s largest entry (``b`` is the reference).

    Per tensor, so that a wrong scale in a tensor of small gradients (a bias, a LayerNorm) is not hidden
    by the size of the others: ``max over names of max |a - b| / max |b|``.
    """
    if a.keys() != b.keys():
        raise ValueError(f"different names: {sorted(a.keys() ^ b.keys())}")
    worst = 0.0
    for name in a:
        x, y = a[name].double(), b[name].double()
        scale = y.abs().max().item()
        if scale == 0.0:
            raise ValueError(f"{name} of the reference is all zeros: nothing to compare relative to")
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def read_losses(path: str | Path) -> list[float]:
    """Losses from a file: a JSON list, or one number per line (blank lines ignored)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return [float(v) for v in json.loads(text)]
    return [float(line) for line in text.split() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    """Command line: compare loss files, print the report, exit with 1 if any layout fails."""
    parser = argparse.ArgumentParser(prog="python -m scalebook.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="loss files; the first is the reference")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="relative tolerance")
    args = parser.parse_args(argv)
    report = compare_losses({str(path): read_losses(path) for path in args.files}, tolerance=args.tolerance)
    print(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
