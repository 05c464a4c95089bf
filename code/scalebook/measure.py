"""Measured counterparts of the accounting formulas: count the bytes real tensors hold.

``tracemalloc`` does not see torch's allocations, and process RSS mixes in the interpreter and the
allocator's caches, so the book measures memory by walking the tensors themselves. A storage shared by
several tensors (a tied embedding, a view) is counted once.

Source: PyTorch documentation, ``torch.Tensor.untyped_storage``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by the storages behind ``tensors``; each storage counts once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class StateBytes:
    """Bytes held by the model states of one process."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """Count the bytes held right now by parameters, their ``.grad`` tensors and the optimizer state."""
    params = list(model.parameters())
    optimizer_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            # Adam's scalar step counter is a tensor too; it is bookkeeping, not per-parameter state.
            optimizer_tensors.extend(v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step")
    return StateBytes(
        params=tensor_bytes(params),
        grads=tensor_bytes(p.grad for p in params),
        optimizer=tensor_bytes(optimizer_tensors),
    )
