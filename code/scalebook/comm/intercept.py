"""See every communication call a rank makes: wrap the ``torch.distributed`` functions and tell listeners.

While at least one listener is registered (:func:`listening`, or :func:`add_listener` for a whole process),
the point-to-point functions, the collectives and ``batch_isend_irecv`` of ``torch.distributed`` are
replaced, on both ``torch.distributed`` and ``torch.distributed.distributed_c10d`` (the package calls them
as ``dist.xxx``), by wrappers that call every listener with ``(op, arguments)`` before the real call runs
unchanged, async or not. ``arguments`` are the call's arguments by name, as passed (defaults left out).
A ``batch_isend_irecv`` is reported once, as ``("batch_isend_irecv", {"p2p_op_list": ops, "sends": [...]})``
with ``sends[i]`` true for a send; the ``isend``/``irecv`` calls it makes inside, like ``send`` calling
``isend`` in torch 2.13, are not reported again.

Two listeners use it: :func:`scalebook.comm.traffic.count_traffic` (bytes) and
:mod:`scalebook.comm.nccl_rules` (the order of calls NCCL would have to pair).

Source: PyTorch documentation, "Distributed communication package - torch.distributed".
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

P2P = ("send", "isend", "recv", "irecv")
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "gather", "scatter", "barrier",
)  # fmt: skip
WRAPPED = P2P + COLLECTIVES

Listener = Callable[[str, dict], None]

_lock = threading.Lock()
_listeners: list[Listener] = []
_originals: dict[str, Callable] = {}
_inside = threading.local()  # set while a reported call runs: what it calls itself is not reported again


def named_rank(arguments: dict, key: str, default_group_rank: int | None = None) -> int | None:
    """The global rank a call's arguments name by ``key`` (``"dst"``/``"src"``, already global) or by
    ``group_<key>`` (a rank of its ``group``); ``default_group_rank`` of the group when they name none."""
    group, rank = arguments.get("group"), arguments.get(key)
    group_rank = arguments.get("group_" + key, default_group_rank if rank is None else None)
    if rank is not None or group_rank is None or group is None:
        return rank if rank is not None else group_rank
    return dist.get_global_rank(group, group_rank)


def _tell(op: str, arguments: dict) -> None:
    for listener in list(_listeners):
        listener(op, arguments)


def _wrap(op: str, original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def reported(*args, **kwargs):
        if _listeners and not getattr(_inside, "busy", False):
            _tell(op, signature.bind(*args, **kwargs).arguments)
        return _call_quietly(original, *args, **kwargs)

    reported.__scalebook_original__ = original
    return reported


def _is_isend(fn) -> bool:
    """Whether a P2POp's ``op`` is ``isend``: the current one, or one it wraps or was wrapped from."""
    while fn is not None:
        if fn is c10d.isend or fn is _originals["isend"]:
            return True
        fn = getattr(fn, "__scalebook_original__", None)
    return False


def _batch_isend_irecv(p2p_op_list):
    # batch_isend_irecv tells sends from receives by identity with c10d.isend: keep them consistent.
    sends = [_is_isend(p.op) for p in p2p_op_list]
    for p, is_send in zip(p2p_op_list, sends, strict=True):
        p.op = c10d.isend if is_send else c10d.irecv
    if _listeners and not getattr(_inside, "busy", False):
        _tell("batch_isend_irecv", {"p2p_op_list": p2p_op_list, "sends": sends})
    return _call_quietly(_originals["batch_isend_irecv"], p2p_op_list)


def _call_quietly(original, *args, **kwargs):
    """Run a reported call without reporting the calls it makes itself."""
    outer = getattr(_inside, "busy", False)
    _inside.busy = True
    try:
        return original(*args, **kwargs)
    finally:
        _inside.busy = outer


def _install() -> None:
    for op in WRAPPED:
        if not hasattr(c10d, op):
            continue  # all_gather_single and reduce_scatter_single are new in torch 2.13
        _originals[op] = getattr(c10d, op)
        wrapped = _wrap(op, _originals[op])
        setattr(c10d, op, wrapped)
        setattr(dist, op, wrapped)
    _originals["batch_isend_irecv"] = c10d.batch_isend_irecv
    c10d.batch_isend_irecv = _batch_isend_irecv
    dist.batch_isend_irecv = _batch_isend_irecv


def _uninstall() -> None:
    for op, original in _originals.items():
        setattr(c10d, op, original)
        setattr(dist, op, original)
    _originals.clear()


def add_listener(listener: Listener) -> None:
    """Report every call from now on to ``listener`` (the first listener installs the wrappers)."""
    with _lock:
        if not _listeners:
            _install()
        _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    """Stop reporting to ``listener`` (the last one removed restores the ``torch.distributed`` functions)."""
    with _lock:
        _listeners.remove(listener)
        if not _listeners:
            _uninstall()


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Report every call made inside the block to ``listener``."""
    add_listener(listener)
    try:
        yield
    finally:
        remove_listener(listener)
