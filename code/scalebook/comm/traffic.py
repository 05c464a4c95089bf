"""Count what a rank communicates: every collective and point-to-point call, and the bytes it sends.

Inside ``with count_traffic() as traffic:`` the ``torch.distributed`` functions are wrapped so that each
call is recorded as a :class:`CommCall` before it runs (the call itself is unchanged, async or not). The
calls and their message sizes are always what the rank really issued; the bytes sent are of two kinds.

* **Counted at real sends.** ``send``/``isend`` (and the sends of ``batch_isend_irecv``) send the tensor's
  bytes, ``recv``/``irecv`` send nothing. A collective built from them, such as
  ``scalebook.comm.collectives.ring_all_reduce``, is therefore counted message by message, as it runs.
  All-to-all is counted from its tensors: every block but the rank's own must leave it, whatever the
  algorithm.
* **Charged per the algorithm.** A library ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather*`` or
  ``reduce_scatter*`` is one call whose internal messages are hidden, so it is charged the bytes that the
  bandwidth-optimal ring algorithm sends (:func:`scalebook.accounting.comm.bytes_sent_per_rank`, what NCCL
  does for large messages); ``gather`` and ``scatter`` are charged direct sends to or from the root. For
  these calls, comparing the bytes with the ring formula checks the calls and their sizes, not the
  algorithm the library ran.

Only calls made through the Python functions of ``torch.distributed`` are seen: torch's
``DistributedDataParallel`` issues its all-reduces from C++ (count them with a communication hook), and
DTensor uses functional collectives (count them with ``torch.distributed.tensor.debug.CommDebugMode``).

Source: PyTorch documentation, "Distributed communication package - torch.distributed".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from scalebook.accounting.comm import bytes_sent_per_rank
from scalebook.comm.intercept import listening, named_rank


@dataclass(frozen=True)
class CommCall:
    """One communication call as this rank issued it."""

    op: str  # the torch.distributed function name
    message_bytes: int  # the full logical message (see the module docstring)
    group_size: int
    bytes_sent: float  # by this rank: counted at real sends, or charged per the algorithm (module docstring)
    peer: int | None = None  # the other rank (global) of a point-to-point call, or a gather's/scatter's root


@dataclass
class Traffic:
    """The calls recorded on this rank, with totals by operation."""

    calls: list[CommCall] = field(default_factory=list)

    def of(self, *ops: str) -> list[CommCall]:
        """The calls whose ``op`` is one of ``ops`` (all calls when none is given)."""
        return [c for c in self.calls if not ops or c.op in ops]

    def count(self, *ops: str) -> int:
        return len(self.of(*ops))

    def bytes_sent(self, *ops: str) -> float:
        return sum(c.bytes_sent for c in self.of(*ops))

    def by_op(self) -> dict[str, tuple[int, float]]:
        """``{op: (calls, bytes sent)}`` in the order the operations first appeared."""
        calls = Counter(c.op for c in self.calls)
        return {op: (calls[op], self.bytes_sent(op)) for op in self._ops()}

    def message_bytes_by_op(self) -> dict[str, int]:
        """``{op: bytes}``: the sizes of the messages handed to each operation, added up, as recorded.

        Unlike ``bytes_sent`` of a library collective (the ring algorithm's formula applied to these
        sizes), these are what the calls were given.
        """
        return {op: sum(c.message_bytes for c in self.of(op)) for op in self._ops()}

    def _ops(self) -> list[str]:
        return list(dict.fromkeys(c.op for c in self.calls))

    def clear(self) -> None:
        self.calls.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


_P2P = {"send": True, "isend": True, "recv": False, "irecv": False}  # op -> does this rank send?


def _describe(op: str, a: dict) -> tuple[int, object, int | None, float | None]:
    """(message bytes, group, peer, exact bytes sent or None for "count it as the ring would")."""
    group = a.get("group")
    if op in _P2P:
        peer = named_rank(a, "dst" if _P2P[op] else "src")
        sent = float(_nbytes(a["tensor"])) if _P2P[op] else 0.0
        return _nbytes(a["tensor"]), group, peer, sent
    if op in ("all_reduce", "broadcast", "reduce"):
        return _nbytes(a["tensor"]), group, None, None
    if op in ("all_gather_into_tensor", "all_gather_single"):
        return _nbytes(a["output_tensor"]), group, None, None
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return _nbytes(a["input"]), group, None, None
    if op == "all_gather":
        return sum(map(_nbytes, a["tensor_list"])), group, None, None
    if op == "reduce_scatter":
        return sum(map(_nbytes, a["input_list"])), group, None, None
    me = dist.get_rank(group)
    if op == "all_to_all":
        inputs = a["input_tensor_list"]
        return sum(map(_nbytes, inputs)), group, None, float(sum(_nbytes(t) for i, t in enumerate(inputs) if i != me))
    if op == "all_to_all_single":
        inp, splits = a["input"], a.get("input_split_sizes")
        kept = splits[me] * (_nbytes(inp) // inp.shape[0]) if splits else _nbytes(inp) // _size(group)
        return _nbytes(inp), group, None, float(_nbytes(inp) - kept)
    if op == "gather":  # every rank but the destination sends its tensor
        root = named_rank(a, "dst", default_group_rank=0)
        is_root = dist.get_rank() == root
        return _nbytes(a["tensor"]) * _size(group), group, root, 0.0 if is_root else float(_nbytes(a["tensor"]))
    if op == "scatter":  # the source sends every other rank its piece
        root = named_rank(a, "src", default_group_rank=0)
        pieces = a.get("scatter_list") or []
        sent = sum(_nbytes(t) for i, t in enumerate(pieces) if i != me) if dist.get_rank() == root else 0
        return _nbytes(a["tensor"]) * _size(group), group, root, float(sent)
    return 0, group, None, 0.0  # barrier


_RING_OP = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
}


def _call(op: str, a: dict) -> list[CommCall]:
    """The calls one reported operation makes: one, or a batch's sends and receives."""
    if op == "batch_isend_irecv":
        calls = []
        for p, is_send in zip(a["p2p_op_list"], a["sends"], strict=True):
            sent = float(_nbytes(p.tensor)) if is_send else 0.0
            calls.append(CommCall("isend" if is_send else "irecv", _nbytes(p.tensor), _size(p.group), sent, p.peer))
        return calls
    message, group, peer, exact = _describe(op, a)
    n = _size(group)
    sent = exact if exact is not None else bytes_sent_per_rank(_RING_OP[op], message, n)
    return [CommCall(op, message, n, sent, peer)]


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Record this rank's communication calls while the block runs; yields the :class:`Traffic`."""
    traffic = Traffic()

    def record(op: str, arguments: dict) -> None:
        for call in _call(op, arguments):
            traffic.calls.append(call)  # one append per call: a caller may replace ``calls`` with a list that logs

    with listening(record):
        yield traffic
