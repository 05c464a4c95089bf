"""Pipeline parallelism in closed form: the bubble, the activations in flight, the bytes between stages.

A model cut into P stages on P ranks processes a batch as M micro-batches. With forward and backward
times t_f and t_b per micro-batch on each rank (all ranks equal, communication free), the first rank
cannot start its first backward before the micro-batch has gone down and up the pipeline, and the last
rank waits for the first forward to arrive, so every rank idles (P - 1)(t_f + t_b) per step while it
computes for M (t_f + t_b):

    step time        T = (M + P - 1)(t_f + t_b)
    bubble fraction  (P - 1) / (M + P - 1)        idle share of the step, GPipe and 1F1B alike

Narayanan et al. state the bubble relative to the ideal compute time instead, (P - 1) / M. Interleaving
gives each rank v model chunks of 1/v the layers (virtual stages); the bubble shrinks by v:

    T = (M + (P - 1) / v)(t_f + t_b),   bubble fraction (P - 1) / (v M + P - 1),   overhead (P - 1) / (v M)

What the schedules differ in is memory: GPipe runs all M forwards before the first backward, so each
rank holds the activations of all M micro-batches; 1F1B starts backwards as soon as it can, so rank r
holds at most P - r (the first rank P). Megatron-LM's interleaved schedule runs
2 (P - r - 1) + (v - 1) P warm-up forwards (of one chunk each) before its first backward and then
alternates, so rank r holds at most min(2 (P - r - 1) + (v - 1) P + 1, v M) chunk activations.

Between neighbouring stages each micro-batch crosses once forward (its activations, b s h values) and
once backward (their gradient, the same shape); with v chunks per rank there are v P - 1 boundaries.

What a stage's GPU holds is its own model states (its layers' parameters, the embedding on the first
stage and the output layer on the last) plus the activations of its layers for the micro-batches it has
in flight. Under 1F1B stage r holds P - r of them, so with uneven stages the busiest GPU is not always the
first: ``stage_memory`` sums the two for every stage of a partition.

Source: Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", Sec. 2.2; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Sec. 2.2.1 (1F1B bubble and memory), Sec. 2.2.2 (interleaved schedule);
Megatron-LM ``schedules.py`` (warm-up counts); Grattafiori et al. 2024 (Llama 3), Sec. 3.3.2 (stage
balance with the embedding and the output layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

from scalebook.accounting import _checks
from scalebook.accounting.memory import activation_bytes, model_state_bytes
from scalebook.accounting.params import layer_matmul_weights, param_count
from scalebook.configs import ModelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def layout_problems(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[str]:
    """Everything wrong with a (schedule, P, M, v) layout, as sentences (empty when it can run)."""
    problems = _checks.one_of("schedule", schedule, SCHEDULES) + _checks.positive_int(
        pp=pp, microbatches=microbatches, virtual_stages=virtual_stages
    )
    if problems:
        return problems
    if schedule == "interleaved":
        if virtual_stages < 2:
            problems.append(
                f"the interleaved schedule needs virtual_stages >= 2 model chunks per rank, got {virtual_stages}; "
                "with one chunk per rank use schedule='1f1b'"
            )
        if microbatches % pp:
            fits = [m for m in range(pp, 4 * pp + 1, pp)]
            problems.append(
                f"the interleaved schedule sends micro-batches round the ranks in groups of pp={pp}, so microbatches "
                f"must be a multiple of {pp} (at least {pp}), got {microbatches}; try one of {fits}"
            )
    elif virtual_stages != 1:
        problems.append(
            f"virtual_stages={virtual_stages} needs schedule='interleaved'; {schedule!r} runs one stage per rank"
        )
    return problems


def bubble_fraction(pp: int, microbatches: int, *, virtual_stages: int = 1) -> float:
    """Share of a step each rank idles: (P - 1) / (v M + P - 1)."""
    _checks.require(_checks.positive_int(pp=pp, microbatches=microbatches, virtual_stages=virtual_stages))
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def bubble_overhead(pp: int, microbatches: int, *, virtual_stages: int = 1) -> float:
    """Idle time over ideal compute time, as Narayanan et al. state it: (P - 1) / (v M)."""
    _checks.require(_checks.positive_int(pp=pp, microbatches=microbatches, virtual_stages=virtual_stages))
    return (pp - 1) / (virtual_stages * microbatches)


def step_time(pp: int, microbatches: int, t_forward: float, t_backward: float, *, virtual_stages: int = 1) -> float:
    """Seconds per step, (M + (P - 1) / v)(t_f + t_b), for a rank's whole forward and backward per micro-batch."""
    _checks.require(
        _checks.positive_int(pp=pp, microbatches=microbatches, virtual_stages=virtual_stages),
        _checks.positive(t_forward=t_forward, t_backward=t_backward),
    )
    return (microbatches + (pp - 1) / virtual_stages) * (t_forward + t_backward)


def peak_in_flight(schedule: str, pp: int, microbatches: int, rank: int, *, virtual_stages: int = 1) -> int:
    """Most micro-batch activations rank ``rank`` holds at once (chunk activations for ``interleaved``).

    GPipe M; 1F1B min(P - rank, M); interleaved min(2 (P - rank - 1) + (v - 1) P + 1, v M).
    """
    _checks.require(layout_problems(schedule, pp, microbatches, virtual_stages))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp:
        raise ValueError(f"rank must be an integer in [0, {pp}), got {rank!r}")
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - rank, microbatches)
    warmup = 2 * (pp - rank - 1) + (virtual_stages - 1) * pp
    return min(warmup + 1, virtual_stages * microbatches)


def p2p_bytes_per_microbatch(micro_batch: int, seq_len: int, d_model: int, *, dtype_bytes: int = 2) -> int:
    """Bytes of one stage-to-stage message: the b x s x h activations (or their gradient)."""
    _checks.require(
        _checks.positive_int(micro_batch=micro_batch, seq_len=seq_len, d_model=d_model, dtype_bytes=dtype_bytes)
    )
    return micro_batch * seq_len * d_model * dtype_bytes


def p2p_bytes_per_step(pp: int, microbatches: int, message_bytes: int, *, rank: int, virtual_stages: int = 1) -> int:
    """Bytes rank ``rank`` sends per step: M messages forward from each of its stages but the last
    one of the model, and M backward from each but the first (stage c P + rank holds chunk c)."""
    _checks.require(
        _checks.positive_int(pp=pp, microbatches=microbatches, virtual_stages=virtual_stages),
        _checks.positive(message_bytes=message_bytes),
    )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp:
        raise ValueError(f"rank must be an integer in [0, {pp}), got {rank!r}")
    forward_senders = virtual_stages - (rank == pp - 1)
    backward_senders = virtual_stages - (rank == 0)
    return microbatches * (forward_senders + backward_senders) * message_bytes


def layer_costs(cfg: ModelConfig, *, by: str = "params", seq_len: int | None = None) -> list[float]:
    """Cost of each piece of a GPT-layout model in order: [embedding, layer 1, ..., layer L, head].

    ``by="params"``: parameters each piece stores. The head's entry is the output matrix V d plus the
    final norm even when it is tied to the embedding, because the last stage keeps its own copy of a
    tied matrix (Megatron-LM does the same and sums the two gradients). ``by="flops"``: training FLOPs
    per token at ``seq_len`` (3x the forward's 2 W + 4 s h per layer and 2 h V for the head; the
    embedding look-up is free).
    """
    _checks.require(_checks.model_config(cfg), _checks.one_of("by", by, ("params", "flops")))
    d, V, L = cfg.d_model, cfg.vocab_size, cfg.n_layers
    norm = 2 * d if cfg.norm == "layernorm" and cfg.bias else d
    if by == "params":
        attention_biases = 2 * d + 2 * cfg.d_kv
        mlp_biases = (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff + d
        layer = layer_matmul_weights(cfg) + 2 * norm + ((attention_biases + mlp_biases) if cfg.bias else 0)
        embedding = V * d + (cfg.max_seq_len * d if cfg.learned_positions else 0)
        return [float(embedding)] + [float(layer)] * L + [float(V * d + norm)]
    _checks.require(_checks.positive_int(seq_len=seq_len))
    layer = 3 * (2 * layer_matmul_weights(cfg) + 4 * seq_len * d)
    return [0.0] + [float(layer)] * L + [float(3 * 2 * d * V)]


def balanced_partition(costs: Sequence[float], n_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, that make the costliest stage as cheap as possible.

    ``costs`` is :func:`layer_costs`' list: the embedding's cost is added to the first stage, the head's
    to the last, and every stage gets at least one layer. Among equally good splits the one with the
    most even stages (least sum of squared stage costs) wins.
    """
    problems = _checks.positive_int(n_stages=n_stages)
    if len(costs) < 3 or any(isinstance(c, bool) or not isinstance(c, Real) or c < 0 for c in costs):
        problems.append("costs must be [embedding, layer 1, ..., layer L, head]: at least 3 numbers >= 0")
    _checks.require(problems)
    first, layers, last = costs[0], list(costs[1:-1]), costs[-1]
    if n_stages > len(layers):
        raise ValueError(f"{len(layers)} layers cannot fill {n_stages} stages with at least one layer each")
    prefix = [0.0]
    for c in layers:
        prefix.append(prefix[-1] + c)

    def stage_cost(start: int, stop: int, n_before: int) -> float:
        extra = (first if n_before == 0 else 0.0) + (last if stop == len(layers) else 0.0)
        return prefix[stop] - prefix[start] + extra

    # best[k][i]: (costliest stage, sum of squared stage costs) when layers [0, i) fill stages 0..k-1;
    # the second entry breaks ties towards evenly loaded stages.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (len(layers) + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (len(layers) + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n_stages + 1):
        for i in range(k, len(layers) + 1):
            for j in range(k - 1, i):
                cost = stage_cost(j, i, k - 1)
                candidate = (max(best[k - 1][j][0], cost), best[k - 1][j][1] + cost * cost)
                if candidate < best[k][i]:
                    best[k][i], cut[k][i] = candidate, j
    bounds, i = [], len(layers)
    for k in range(n_stages, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


@dataclass(frozen=True)
class StageMemory:
    """Bytes one pipeline stage's GPU holds: its model states and the activations of its micro-batches."""

    layers: range  # the model's layers this stage runs, 0-based
    in_flight: int  # micro-batches whose activations the stage holds at its peak
    states: int
    activations: int

    @property
    def total(self) -> int:
        return self.states + self.activations


def stage_memory(
    cfg: ModelConfig,
    partition: Sequence[range],
    *,
    seq_len: int,
    microbatches: int,
    schedule: str = "1f1b",
    micro_batch: int = 1,
    tp: int = 1,
    dp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    attention: str = "explicit",
    dropout: bool = True,
    zero_stage: int = 0,
    precision: str = "mixed",
    dtype_bytes: int = 2,
) -> list[StageMemory]:
    """Model states plus activations on each stage's GPU, for a partition of the layers (Adam).

    ``partition`` is :func:`balanced_partition`'s list of layer ranges. A stage's parameters are its
    pieces in :func:`layer_costs`, so the first stage holds the embedding and the last the output layer
    (its own copy of a tied one; one stage alone holds the model once). Its activations are
    :func:`scalebook.accounting.activation_bytes` per layer, times its layers, times
    :func:`peak_in_flight` micro-batches; as there, the embedding output and the logits are not counted.
    ``dtype_bytes`` is the activations' bytes per element (2 in 16-bit training, 4 in fp32).
    """
    _checks.require(
        _checks.model_config(cfg),
        _checks.one_of("schedule", schedule, ("gpipe", "1f1b")),
        _checks.positive_int(microbatches=microbatches),
    )
    L = cfg.n_layers
    if not partition or [i for r in partition for i in r] != list(range(L)) or any(len(r) == 0 for r in partition):
        raise ValueError(f"partition must split the {L} layers of {cfg.name} into contiguous, non-empty ranges "
                         f"in order, as balanced_partition returns them")  # fmt: skip
    pp = len(partition)
    per_layer = activation_bytes(
        cfg, seq_len=seq_len, micro_batch=micro_batch, tp=tp, sp=sp, recompute=recompute, attention=attention,
        dropout=dropout, dtype_bytes=dtype_bytes,
    ) // L  # fmt: skip
    costs = layer_costs(cfg, by="params")
    stages = []
    for rank, layers in enumerate(partition):
        if pp == 1:
            params = param_count(cfg)
        else:
            params = int(sum(costs[1 + i] for i in layers))
            params += int(costs[0]) if rank == 0 else 0
            params += int(costs[-1]) if rank == pp - 1 else 0
        states = model_state_bytes(params, zero_stage=zero_stage, dp=dp, tp=tp, precision=precision).total
        in_flight = peak_in_flight(schedule, pp, microbatches, rank)
        stages.append(StageMemory(layers, in_flight, states, per_layer * len(layers) * in_flight))
    return stages
