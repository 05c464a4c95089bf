"""Rank parallel layouts by the system model's predicted step time (what ``planner.plan`` runs for each ZeRO stage).

Every ``tp pp cp dp`` that multiplies to the cluster's GPUs (powers of two, ``tp`` within an NVLink domain,
``pp`` at most the layers) is combined with the virtual stages, micro-batch sizes and recomputation policies
given; every other choice comes from ``base``. Layouts that cannot run are counted by reason; the others are
predicted (:func:`scalebook.system.predict.predict`) and sorted by step time, those that do not fit in memory
kept apart unless ``fits_only=False``.

Source: Narayanan et al. 2021, Sec. 3 (the search space); Grattafiori et al. 2024, Sec. 3.3.2.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from scalebook.configs import ModelConfig
from scalebook.system.hardware import Cluster
from scalebook.system.layout import TrainingLayout
from scalebook.system.predict import FITTED, Prediction, predict


@dataclass
class Ranking:
    """Predicted layouts, fastest first, and how many candidates were rejected for each reason."""

    ranked: list[tuple[TrainingLayout, Prediction]]
    rejected: Counter = field(default_factory=Counter)

    def best_matching(self, **fields) -> tuple[TrainingLayout, Prediction]:
        """The fastest ranked layout whose attributes equal ``fields`` (e.g. ``tp=8, pp=16, cp=1``)."""
        for layout, prediction in self.ranked:
            if all(getattr(layout, k) == v for k, v in fields.items()):
                return layout, prediction
        raise ValueError(f"no ranked layout has {fields}")


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def rank_layouts(model: ModelConfig, cluster: Cluster, *, seq_len: int, global_batch: int,
                 base: TrainingLayout | None = None, virtual_stages=(1, 2, 4), micro_batches=(1, 2),
                 recomputes=("selective", "full"), fits_only: bool = True, params=FITTED) -> Ranking:
    """Predict every candidate layout (see the module docstring) and rank them by step time."""
    base = base or TrainingLayout(tp=1, pp=1, dp=1)
    ranking = Ranking([])
    gpus = cluster.gpus
    for tp in _powers_of_two(min(cluster.domain, gpus)):
        for pp in _powers_of_two(min(model.n_layers, gpus // tp)):
            for cp in _powers_of_two(gpus // (tp * pp)):
                for v in virtual_stages if pp > 1 else (1,):
                    for mb in micro_batches:
                        for recompute in recomputes:
                            layout = replace(base, tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp), virtual_stages=v,
                                             micro_batch=mb, recompute=recompute,
                                             schedule="interleaved" if v > 1 else "1f1b")
                            try:
                                prediction = predict(model, cluster, layout, seq_len=seq_len,
                                                     global_batch=global_batch, params=params)
                            except ValueError as error:
                                reason = str(error).split(": ", 1)[-1]  # without its "cannot ...:" prefix
                                ranking.rejected[reason.split(";")[0]] += 1
                                continue
                            if fits_only and not prediction.feasible:
                                ranking.rejected["does not fit in memory"] += 1
                                continue
                            ranking.ranked.append((layout, prediction))
    # Step times equal to a nanosecond are a tie, broken by the layout's label: the order must not hang on the
    # last bits of a float, which differ between CPython and the calculators' Pyodide (WebAssembly's libm).
    ranking.ranked.sort(key=lambda pair: (round(pair[1].step_time, 9), pair[0].label()))
    return ranking
