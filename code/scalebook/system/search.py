"""Rank parallel layouts by the system model's predicted step time (what ``planner.plan`` runs for each ZeRO stage).

Every ``tp pp cp`` (powers of two, ``tp`` at most the cluster's NVLink domain, ``Cluster.domain``: 8 GPUs on an
HGX board, 72 in a GB200 NVL72 rack; ``pp`` at most the layers) whose product divides the cluster's GPUs, with
``dp`` the rest, is combined with the expert-parallel degrees of a mixture of experts (``ep`` dividing the experts
and ``dp cp``; 1 for a dense model), the virtual stages, micro-batch sizes and recomputation policies given; every
other choice comes from ``base`` (a ``gpipe`` or ``dualpipe`` schedule in ``base`` is kept, without virtual
stages). Layouts that cannot run are counted by reason; the others are predicted
(:func:`scalebook.system.predict.predict`) and sorted by step time, those that do not fit in memory kept apart
unless ``fits_only=False``.

Source: Narayanan et al. 2021, Sec. 3 (the search space); Grattafiori et al. 2024, Sec. 3.3.2; DeepSeek-AI
2024, Sec. 3.2 (expert parallelism inside the data-parallel ranks).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import product

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


def _rank_one(ranking: Ranking, model, cluster, layout, seq_len, global_batch, params, fits_only) -> None:
    """Predict ``layout`` into ``ranking``, or count why it was rejected."""
    try:
        prediction = predict(model, cluster, layout, seq_len=seq_len, global_batch=global_batch, params=params)
    except ValueError as error:
        reason = str(error).split(": ", 1)[-1]  # without its "cannot ...:" prefix
        ranking.rejected[reason.split(";")[0]] += 1
        return
    if fits_only and not prediction.feasible:
        ranking.rejected["does not fit in memory"] += 1
        return
    ranking.ranked.append((layout, prediction))


def _expert_degrees(model: ModelConfig, replicas: int, choices) -> list[int]:
    """Expert-parallel degrees to try: 1 for a dense model; for a mixture of experts the ``choices`` (every power
    of two by default) that divide both the experts and the ``dp cp`` ranks the experts are spread over."""
    if not model.is_moe:
        return [1]
    candidates = _powers_of_two(model.n_experts) if choices is None else choices
    return [ep for ep in candidates if not model.n_experts % ep and not replicas % ep]


def rank_layouts(model: ModelConfig, cluster: Cluster, *, seq_len: int, global_batch: int,
                 base: TrainingLayout | None = None, virtual_stages=(1, 2, 4), micro_batches=(1, 2),
                 recomputes=("selective", "full"), expert_parallel=None, fits_only: bool = True,
                 params=FITTED) -> Ranking:
    """Predict every candidate layout (see the module docstring) and rank them by step time."""
    base = base or TrainingLayout(tp=1, pp=1, dp=1)
    ranking = Ranking([])
    gpus = cluster.gpus
    fixed_schedule = base.schedule in ("gpipe", "dualpipe")  # kept as given, without virtual stages
    for tp in _powers_of_two(min(cluster.domain, gpus)):
        for pp in _powers_of_two(min(model.n_layers, gpus // tp)):
            for cp in _powers_of_two(gpus // (tp * pp)):
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                stages = virtual_stages if pp > 1 and not fixed_schedule else (1,)
                eps = _expert_degrees(model, dp * cp, expert_parallel)
                for ep, v, mb, recompute in product(eps, stages, micro_batches, recomputes):
                    schedule = base.schedule if fixed_schedule else "interleaved" if v > 1 else "1f1b"
                    layout = replace(base, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, virtual_stages=v, micro_batch=mb,
                                     recompute=recompute, schedule=schedule)  # fmt: skip
                    _rank_one(ranking, model, cluster, layout, seq_len, global_batch, params, fits_only)
    # Step times equal to a nanosecond are a tie, broken by the layout's label: the order must not hang on the
    # last bits of a float, which differ between CPython and the calculators' Pyodide (WebAssembly's libm).
    ranking.ranked.sort(key=lambda pair: (round(pair[1].step_time, 9), pair[0].label()))
    return ranking
