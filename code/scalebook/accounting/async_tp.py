"""Async tensor parallelism in closed form: how much of a layer's communication can hide under its matmuls.

Under sequence parallelism every column-parallel matmul waits for an all-gather of the sequence and every
row-parallel matmul is followed by a reduce-scatter; nothing else runs meanwhile, because the matmul needs
the gathered tokens, and the next layer the reduced ones. Wang et al. decompose such a collective and its
matmul into pieces: the all-gather over ``t`` ranks is ``t - 1`` steps that each bring one rank's ``s/t``
tokens, and the matmul splits by the same tokens, so the piece of the tokens already here is multiplied
while the next shard travels. A reduce-scatter splits the same way: the partial product of one chunk of
tokens travels on while the next chunk's is computed. PyTorch ships this as async tensor parallelism
(``torch._inductor``'s micro-pipelining of ``fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter``).

For a matmul that takes ``c`` seconds on one rank, cut into ``t`` pieces of ``c/t``, whose collective moves
``t - 1`` messages of ``M/t`` bytes, each costing ``tau = alpha + M / (t B)`` in the alpha-beta model:

    one after the other    T = c + (t - 1) tau
    decomposed             T = c/t + (t - 1) max(c/t, tau)      (the first piece is this rank's own tokens)
    still exposed          (t - 1) max(0, tau - c/t)

A decomposition whose first piece must arrive before any compute can start pays one ``tau`` more
(``first_piece_local=False``). The bandwidth term of ``tau`` and the piece ``c/t`` both scale with the
tokens, so their ratio does not depend on ``s``. Every message is ``h`` wide, so a matmul whose weight matrix
is ``h x k`` (``k`` its other side, all ranks together: a column-parallel layer's outputs, a row-parallel
layer's inputs) hides its transfers when ``k >= e t F / (2 B)`` (:func:`critical_width`, ``e`` bytes per
element, ``F`` the FLOP/s achieved); only the latency ``alpha`` makes short sequences expose more.

Per layer, under sequence parallelism with Megatron-LM's re-gathered inputs
(:func:`scalebook.accounting.comm.tensor_parallel_bytes_per_layer`), ten collectives of ``M = s b h``
elements each border the matmuls that consume or produce their tensor (:func:`layer_collective_matmuls`):

    forward    all-gather -> QKV;  attention output -> reduce-scatter;  all-gather -> MLP in;  MLP out -> reduce-scatter
    backward   all-gather of the output gradient -> input and weight gradients of the output projection and of MLP out
               input gradients of QKV and of MLP in -> reduce-scatter
               all-gather of the saved input (the re-gather) -> weight gradients of QKV and of MLP in

Every matmul of the layer is in one pair; only attention's ``4 s h`` FLOPs per token (scores and their
product with V) are not.

Source: Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition in Large Deep
Learning Models" (ASPLOS 2023); PyTorch 2024, "[Distributed w/ TorchTitan] Introducing Async Tensor
Parallelism in PyTorch" (micro-pipelining in ``torch._inductor``); Korthikanti et al. 2022 (sequence
parallelism); Hockney 1994 (alpha-beta model).
"""

from __future__ import annotations

from dataclasses import dataclass

from scalebook.accounting import _checks
from scalebook.accounting.comm import alpha_beta_time
from scalebook.accounting.params import layer_matmul_weights
from scalebook.configs import ModelConfig


def _number(name: str, value, *, least: float = 0.0) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= least:
        return [f"{name} must be a number >= {least}, got {value!r}"]
    return []


def chunked_overlap_time(compute: float, transfer: float, pieces: int, *, first_piece_local: bool = True) -> float:
    """Seconds for a matmul of ``compute`` seconds cut into ``pieces``, each piece's input (or output) moving in
    a transfer of ``transfer`` seconds that overlaps the neighbouring piece's matmul.

    ``first_piece_local=True`` (an all-gather's own shard, a reduce-scatter's own chunk): ``pieces - 1``
    transfers, ``c + (pieces - 1) max(c, tau)`` with ``c = compute / pieces``. Otherwise every piece must
    arrive first: ``tau + c + (pieces - 1) max(c, tau)``.
    """
    _checks.require(
        _number("compute", compute), _number("transfer", transfer), _checks.positive_int(pieces=pieces),
        _checks.one_of("first_piece_local", first_piece_local, (False, True)),
    )  # fmt: skip
    piece = compute / pieces
    return (0.0 if first_piece_local else transfer) + piece + (pieces - 1) * max(piece, transfer)


def decomposed_transfers(message_bytes: float, tp: int) -> list[float]:
    """Bytes of each step of a decomposed all-gather or reduce-scatter of an ``M``-byte message over ``tp``
    ranks: ``tp - 1`` messages of ``M / tp``, which add up to the ring's ``(tp - 1) / tp M``."""
    _checks.require(_number("message_bytes", message_bytes), _checks.positive_int(tp=tp))
    return [message_bytes / tp] * (tp - 1)


def critical_width(tp: int, *, flops: float, bandwidth: float, dtype_bytes: int = 2) -> float:
    """The side ``k`` of an ``h x k`` weight matrix (all ranks together) above which a matmul's pieces outlast
    their transfers of ``h``-wide tokens, ``e t F / (2 B)``: the bandwidth term only, for ``flops`` FLOP/s
    achieved per GPU and a link of ``bandwidth`` B/s."""
    _checks.require(
        _checks.positive_int(tp=tp, dtype_bytes=dtype_bytes), _checks.positive(flops=flops, bandwidth=bandwidth)
    )
    return dtype_bytes * tp * flops / (2 * bandwidth)


@dataclass(frozen=True)
class CollectiveMatmul:
    """One collective of a layer and the matmul FLOPs (on one rank) that consume or produce its tensor."""

    name: str
    op: str  # "all_gather" or "reduce_scatter"
    flops: float
    message_bytes: float


def _checked_layer(cfg: ModelConfig, tp: int, seq_len: int, micro_batch: int, dtype_bytes: int) -> None:
    _checks.require(
        _checks.model_config(cfg),
        _checks.positive_int(tp=tp, seq_len=seq_len, micro_batch=micro_batch, dtype_bytes=dtype_bytes),
    )
    if cfg.latent_attention is not None or cfg.is_moe:
        raise ValueError(f"{cfg.name!r} has latent attention or experts; the count covers dense layers with "
                         "(grouped-query) attention")  # fmt: skip
    if seq_len % tp:
        raise ValueError(f"sequence parallelism splits the sequence over tp ranks: seq_len ({seq_len}) must be "
                         f"divisible by tp ({tp})")  # fmt: skip


def layer_collective_matmuls(
    cfg: ModelConfig, tp: int, *, seq_len: int, micro_batch: int, dtype_bytes: int = 2
) -> list[CollectiveMatmul]:
    """The ten collectives of one sequence-parallel layer (forward and backward) with their matmuls' FLOPs.

    Weights of the full layer: QKV ``h (h + 2 d_kv)``, output projection ``h^2``, MLP in ``h d_ff`` (twice that
    for SwiGLU's gate and up), MLP out ``d_ff h``; a rank multiplies ``s b`` tokens by ``1/t`` of each, 2 FLOPs
    per weight and token, once forward and twice backward (input and weight gradients).
    """
    _checked_layer(cfg, tp, seq_len, micro_batch, dtype_bytes)
    h, tokens = cfg.d_model, seq_len * micro_batch
    weights = {
        "QKV": h * (h + 2 * cfg.d_kv),
        "attention output": h * h,
        "MLP in": (2 if cfg.mlp == "swiglu" else 1) * h * cfg.d_ff,
        "MLP out": cfg.d_ff * h,
    }
    matmul = {name: 2 * tokens * w / tp for name, w in weights.items()}  # one pass, one rank
    m = tokens * h * dtype_bytes
    ag, rs = "all_gather", "reduce_scatter"
    return [
        CollectiveMatmul("forward: all-gather, then QKV", ag, matmul["QKV"], m),
        CollectiveMatmul("forward: attention output, then reduce-scatter", rs, matmul["attention output"], m),
        CollectiveMatmul("forward: all-gather, then MLP in", ag, matmul["MLP in"], m),
        CollectiveMatmul("forward: MLP out, then reduce-scatter", rs, matmul["MLP out"], m),
        CollectiveMatmul("backward: all-gather, then MLP out's gradients", ag, 2 * matmul["MLP out"], m),
        CollectiveMatmul(
            "backward: all-gather, then attention output's gradients", ag, 2 * matmul["attention output"], m
        ),
        CollectiveMatmul("backward: MLP in's input gradient, then reduce-scatter", rs, matmul["MLP in"], m),
        CollectiveMatmul("backward: QKV's input gradient, then reduce-scatter", rs, matmul["QKV"], m),
        CollectiveMatmul("backward: re-gather, then MLP in's weight gradient", ag, matmul["MLP in"], m),
        CollectiveMatmul("backward: re-gather, then QKV's weight gradient", ag, matmul["QKV"], m),
    ]


@dataclass(frozen=True)
class OverlapTimes:
    """Seconds one layer spends per micro-batch (forward + backward) on one rank, with and without the overlap."""

    compute: float
    communication: float  # the ten collectives back to back
    exposed: float  # what the decomposed collectives leave uncovered

    @property
    def serial(self) -> float:
        """Compute, then communication: ``compute + communication``."""
        return self.compute + self.communication

    @property
    def overlapped(self) -> float:
        """With every collective decomposed: ``compute + exposed``."""
        return self.compute + self.exposed

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication the decomposition hides (1 when there is none)."""
        return 1.0 - self.exposed / self.communication if self.communication else 1.0


def async_tp_layer_times(
    cfg: ModelConfig,
    tp: int,
    *,
    seq_len: int,
    micro_batch: int,
    peak_flops: float,
    mfu: float,
    bandwidth: float,
    alpha: float,
    dtype_bytes: int = 2,
) -> OverlapTimes:
    """One sequence-parallel layer's compute, its communication back to back, and what stays exposed when
    every collective is decomposed into ``tp`` pieces (:func:`chunked_overlap_time` per pair of
    :func:`layer_collective_matmuls`).

    Compute is the layer's training FLOPs, ``3 (2 W + 4 s h)`` per token over ``tp`` ranks at ``mfu`` of
    ``peak_flops`` (the pieces are assumed to run as fast as the whole matmul). Each collective is ``tp - 1``
    steps of ``alpha + M / (tp B)`` on a link of ``bandwidth`` B/s per direction.
    """
    _checked_layer(cfg, tp, seq_len, micro_batch, dtype_bytes)
    _checks.require(_checks.positive(peak_flops=peak_flops, bandwidth=bandwidth), _number("alpha", alpha))
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ValueError(f"mfu must be a fraction in (0, 1], got {mfu!r}")
    achieved, tokens = peak_flops * mfu, seq_len * micro_batch
    compute = tokens * 3 * (2 * layer_matmul_weights(cfg) + 4 * seq_len * cfg.d_model) / (tp * achieved)
    communication = exposed = 0.0
    for pair in layer_collective_matmuls(cfg, tp, seq_len=seq_len, micro_batch=micro_batch, dtype_bytes=dtype_bytes):
        serial = alpha_beta_time(pair.op, pair.message_bytes, tp, alpha=alpha, bandwidth=bandwidth)
        step = serial / (tp - 1) if tp > 1 else 0.0  # one ring step: alpha + M / (tp B)
        matmul = pair.flops / achieved
        communication += serial
        exposed += max(0.0, chunked_overlap_time(matmul, step, tp) - matmul)  # (t - 1) max(0, tau - c/t)
    return OverlapTimes(compute=compute, communication=communication, exposed=exposed)
