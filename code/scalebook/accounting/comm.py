"""Communication volume and time: how many bytes each rank sends, and how long that takes.

Message sizes are the full logical tensor ``M`` in bytes (the gradient buffer of an all-reduce, the
gathered output of an all-gather, the input of a reduce-scatter). With ``n`` ranks, the bandwidth-optimal
ring algorithms (what NCCL uses for large messages) send, per rank,

    all-reduce                  2 (n-1)/n M     (a reduce-scatter, then an all-gather)
    reduce-scatter, all-gather    (n-1)/n M
    all-to-all                    (n-1)/n M     (every rank keeps 1/n of its own data)
    broadcast, reduce             (n-1)/n M     (pipelined chain, averaged over ranks)

while the naive all-reduce (every rank sends its whole tensor to every peer) sends (n-1) M, and a binary
tree (reduce to a root, broadcast back) moves the same total bytes as the ring but in 2 ceil(log2 n)
rounds of the whole message.

A parameter server (one of the n ranks holds the parameters and the optimizer; the others push their
gradients to it and pull the new parameters) concentrates the traffic on the server instead:

    server   receives (n-1) M, sends (n-1) M
    worker   sends M, receives M

All ranks together send 2 (n-1) M, what a ring all-reduce sends, but half of it leaves one rank.

Time follows the alpha-beta (latency-bandwidth) model: a message of m bytes over one link costs
alpha + m / B. A ring step moves M/n bytes, so

    T_all-reduce(ring)  = 2 (n-1) (alpha + M / (n B))
    T_RS = T_AG (ring)  =   (n-1) (alpha + M / (n B))
    T_all-reduce(tree)  = 2 ceil(log2 n) (alpha + M / B)
    T_all-reduce(naive) =   (n-1) (alpha + M / B)
    T_parameter-server  =  2 (alpha + (n-1) M / B)   (push, then pull, through the server's link)

Benchmarks report a collective's speed the way NVIDIA's nccl-tests do: the *algorithm bandwidth*
``algbw = M / T`` and the *bus bandwidth* ``busbw = algbw * factor``, with the factor chosen so that busbw
is the rate at which each rank's link moves data in a point-to-point (ring) implementation, comparable
with the link's datasheet whatever ``n`` is:

    all-reduce                                   2 (n-1)/n
    reduce-scatter, all-gather, all-to-all,
    gather, scatter                                (n-1)/n
    broadcast, reduce, send/recv                   1          (all the data leaves or reaches one rank)

Per training step, data parallelism all-reduces the gradients once (DDP, ZeRO-1/2 send the same
volume as a reduce-scatter of gradients plus an all-gather of parameters); ZeRO-3 gathers the
parameters twice (forward and backward) and reduce-scatters the gradients: 3 (n-1)/n Psi bytes.
Tensor parallelism all-reduces the layer's s b h activations twice in the forward and twice in the
backward of each layer; sequence parallelism replaces each all-reduce by a reduce-scatter and an
all-gather of the same total volume, and (as Megatron-LM does) re-gathers the sequence-sharded inputs
of two linear layers in the backward instead of keeping them: two more all-gathers per layer.

Source: Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication
Operations in MPICH" (alpha-beta costs); Li et al. 2014, "Scaling Distributed Machine Learning with the
Parameter Server" (push and pull); Rajbhandari et al. 2020 (ZeRO, Sec. 7); Shoeybi et al. 2019
(Megatron-LM) and Korthikanti et al. 2022 (sequence parallelism); NVIDIA nccl-tests, ``doc/PERFORMANCE.md`` and
``src/*.cu`` (``*GetBw``: algorithm and bus bandwidth).
"""

from __future__ import annotations

import math

from scalebook.accounting import _checks
from scalebook.accounting.params import params_of
from scalebook.configs import ModelConfig

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
ALL_REDUCE_ALGORITHMS = ("ring", "tree", "naive")
# nccl-tests' correction from algbw to busbw, as a function of n (src/<op>.cu, *GetBw).
BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


def _collective_args(op: str, message_bytes: float, n: int, algorithm: str) -> list[str]:
    problems = _checks.one_of("op", op, COLLECTIVES) + _checks.positive_int(n=n)
    if isinstance(message_bytes, bool) or not isinstance(message_bytes, (int, float)) or message_bytes < 0:
        problems.append(f"message_bytes must be a number >= 0, got {message_bytes!r}")
    if algorithm != "ring" and op != "all_reduce":
        problems.append(f"only all_reduce has a {algorithm!r} variant here; use algorithm='ring' for {op}")
    return problems + _checks.one_of("algorithm", algorithm, ALL_REDUCE_ALGORITHMS)


def bytes_sent_per_rank(op: str, message_bytes: float, n: int, *, algorithm: str = "ring") -> float:
    """Bytes one rank sends (averaged over ranks) to run ``op`` on an ``M``-byte message over ``n`` ranks."""
    _checks.require(_collective_args(op, message_bytes, n, algorithm))
    if op == "all_reduce" and algorithm == "naive":
        return (n - 1) * message_bytes
    factor = 2 if op == "all_reduce" else 1  # the tree moves as many bytes as the ring, in fewer rounds
    return factor * (n - 1) * message_bytes / n


def alpha_beta_time(
    op: str, message_bytes: float, n: int, *, alpha: float, bandwidth: float, algorithm: str = "ring"
) -> float:
    """Seconds for ``op`` on an ``M``-byte message over ``n`` ranks: latency ``alpha`` (s), link ``bandwidth`` (B/s)."""
    _checks.require(_collective_args(op, message_bytes, n, algorithm), _checks.positive(bandwidth=bandwidth))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        raise ValueError(f"alpha must be a latency in seconds >= 0, got {alpha!r}")
    if n == 1:
        return 0.0
    if op == "all_reduce" and algorithm == "naive":
        return (n - 1) * (alpha + message_bytes / bandwidth)
    if op == "all_reduce" and algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + message_bytes / bandwidth)
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * (alpha + message_bytes / (n * bandwidth))


def ring_latency(op: str, n: int, *, per_node: int, intra_alpha: float, inter_alpha: float) -> float:
    """Seconds of latency of a ring ``op`` over ``n`` ranks placed ``per_node`` to a node, consecutively.

    A ring over r = ceil(n / per_node) nodes has ``steps`` = 2 (n - 1) (all-reduce) or n - 1 steps, of which
    only 2 (r - 1) or r - 1 cross the network: a chunk pays ``inter_alpha`` at those and ``intra_alpha`` at
    the others, as NCCL's tuning model counts a ring's latency. With one node every step is inside it."""
    _checks.require(_collective_args(op, 0, n, "ring"), _checks.positive_int(per_node=per_node),
                    _checks.nonnegative(intra_alpha=intra_alpha, inter_alpha=inter_alpha))  # fmt: skip
    steps, network = ring_steps(op, n, per_node)
    return (steps - network) * intra_alpha + network * inter_alpha


def ring_steps(op: str, n: int, per_node: int) -> tuple[int, int]:
    """(steps, steps that cross the network) of a ring ``op`` over ``n`` ranks, ``per_node`` to a node: 2 (n - 1)
    and 2 (r - 1) for an all-reduce over r = ceil(n / per_node) nodes, n - 1 and r - 1 otherwise. Unchecked
    (the system model calls it for every candidate layout); :func:`ring_latency` checks its inputs."""
    nodes = -(-n // per_node)
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (nodes - 1)
    return n - 1, nodes - 1


def parameter_server_bytes_per_step(message_bytes: float, n: int) -> dict[str, float]:
    """Bytes the server and each worker send and receive in one synchronous parameter-server step on ``n``
    ranks, the server being one of them (it computes a gradient too), for an ``M``-byte gradient:
    ``{"server_sent", "server_received", "worker_sent", "worker_received"}``.

        server   receives (n-1) M   (a gradient from each worker),  sends (n-1) M   (the new parameters to each)
        worker   sends M,                                            receives M

    The parameters the server sends are as many bytes as the gradients when both have one width. With
    ``n = 1`` nothing moves. All ranks together send 2 (n-1) M, as many bytes as a ring all-reduce
    (n x 2 (n-1)/n M), but half of them leave the server: its load is n/2 times a ring rank's.
    """
    _checks.require(_collective_args("all_reduce", message_bytes, n, "ring"))
    worker = message_bytes if n > 1 else 0.0
    server = (n - 1) * message_bytes
    return {"server_sent": server, "server_received": server, "worker_sent": worker, "worker_received": worker}


def parameter_server_time(message_bytes: float, n: int, *, alpha: float, bandwidth: float) -> float:
    """Seconds for a parameter server's push and pull of an ``M``-byte gradient on ``n`` ranks, by the
    alpha-beta model with the server's link as the bottleneck:

        T = 2 (alpha + (n-1) M / B)

    The n-1 workers push at once, but the server's link takes in (n-1) M at ``bandwidth`` B; the pull sends
    as much out. Against the ring all-reduce's 2 (n-1) (alpha + M / (n B)) the bandwidth term is n times
    larger, the latency term n-1 times smaller. The optimizer step between push and pull is not counted.
    """
    _checks.require(_collective_args("all_reduce", message_bytes, n, "ring"), _checks.positive(bandwidth=bandwidth))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        raise ValueError(f"alpha must be a latency in seconds >= 0, got {alpha!r}")
    if n == 1:
        return 0.0
    return 2 * (alpha + (n - 1) * message_bytes / bandwidth)


def data_parallel_bytes_per_step(
    model: ModelConfig | float, dp: int, *, zero_stage: int = 0, grad_bytes: int = 4, param_bytes: int = 4
) -> float:
    """Bytes each data-parallel rank sends per optimizer step (``model``: a ModelConfig or a count).

    Stage 0 (DDP) all-reduces the gradients; stages 1 and 2 reduce-scatter the gradients and all-gather
    the updated parameters (the same volume when both have the same width); stage 3 all-gathers the
    parameters in the forward and again in the backward, and reduce-scatters the gradients.
    """
    _checks.require(
        _checks.model_or_count(model),
        _checks.positive_int(dp=dp, grad_bytes=grad_bytes, param_bytes=param_bytes),
        _checks.one_of("zero_stage", zero_stage, (0, 1, 2, 3)),
    )
    psi = params_of(model)
    gather_rounds = {0: 0, 1: 1, 2: 1, 3: 2}[zero_stage]
    if zero_stage == 0:
        return bytes_sent_per_rank("all_reduce", psi * grad_bytes, dp)
    return bytes_sent_per_rank("reduce_scatter", psi * grad_bytes, dp) + gather_rounds * bytes_sent_per_rank(
        "all_gather", psi * param_bytes, dp
    )


def tensor_parallel_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    tp: int,
    *,
    sp: bool = False,
    dtype_bytes: int = 2,
    regather_inputs: bool = True,
) -> dict[str, float]:
    """Bytes each tensor-parallel rank sends in one Transformer layer, ``{"forward": ..., "backward": ...}``.

    Without SP: one all-reduce of the s b h activations after attention and one after the MLP in the
    forward, and their conjugates (before the QKV and the first MLP layer) in the backward. With SP each
    all-reduce becomes an all-gather before the block and a reduce-scatter after it: the same bytes, but
    the LayerNorm/dropout regions hold s/t tokens. The two linear layers after an all-gather then keep
    only their s/t-token shard for the backward pass and all-gather it again there (Megatron-LM, and
    Korthikanti et al. Sec. 4.2.2): two more all-gathers in the backward. ``regather_inputs=False``
    describes an implementation that saves the gathered input instead (more memory, no extra bytes).
    """
    _checks.require(
        _checks.positive_int(seq_len=seq_len, micro_batch=micro_batch, d_model=d_model, tp=tp,
                             dtype_bytes=dtype_bytes),
        _checks.one_of("sp", sp, (False, True)),
        _checks.one_of("regather_inputs", regather_inputs, (False, True)),
    )  # fmt: skip
    message = seq_len * micro_batch * d_model * dtype_bytes
    if not sp:
        per_pass = 2 * bytes_sent_per_rank("all_reduce", message, tp)
        return {"forward": per_pass, "backward": per_pass}
    all_gather = bytes_sent_per_rank("all_gather", message, tp)
    forward = 2 * (all_gather + bytes_sent_per_rank("reduce_scatter", message, tp))
    return {"forward": forward, "backward": forward + (2 * all_gather if regather_inputs else 0)}


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``op`` on ``n`` ranks (``busbw = algbw * factor``).

    It is the share of the message ``M`` that each rank's link must carry in a point-to-point implementation
    (for an all-reduce the ring's ``2 (n-1)/n``, :func:`bytes_sent_per_rank`), or 1 where all the data leaves
    or reaches one root. With in-network reduction (NVLink SHARP, InfiniBand SHARP) the switch adds, the
    ranks send less, and a busbw computed with this factor can exceed the link's bandwidth.
    """
    _checks.require(_checks.one_of("op", op, tuple(BUSBW_FACTORS)), _checks.positive_int(n=n))
    return BUSBW_FACTORS[op](n)


def _bandwidth_args(message_bytes: float, seconds: float) -> list[str]:
    problems = _checks.positive(seconds=seconds)
    if isinstance(message_bytes, bool) or not isinstance(message_bytes, (int, float)) or message_bytes < 0:
        problems.append(f"message_bytes must be a number >= 0, got {message_bytes!r}")
    return problems


def algbw(message_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth, bytes per second: the message size over the time of the collective, ``M / T``."""
    _checks.require(_bandwidth_args(message_bytes, seconds))
    return message_bytes / seconds


def busbw(op: str, message_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth, bytes per second: ``algbw * busbw_factor(op, n)`` (nccl-tests' ``busbw`` column)."""
    _checks.require(_bandwidth_args(message_bytes, seconds))
    return algbw(message_bytes, seconds) * busbw_factor(op, n)


def seconds_at_busbw(op: str, message_bytes: float, n: int, bus_bandwidth: float) -> float:
    """Seconds for ``op`` on an ``M``-byte message over ``n`` ranks at a measured or reported bus bandwidth.

    The inverse of :func:`busbw`: ``T = M * busbw_factor(op, n) / busbw``, which is how a benchmark's busbw
    predicts a training run's communication time on the same system.
    """
    _checks.require(_bandwidth_args(message_bytes, 1.0), _checks.positive(bus_bandwidth=bus_bandwidth))
    return message_bytes * busbw_factor(op, n) / bus_bandwidth
