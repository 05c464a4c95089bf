"""Which optimizers a sharded optimizer may step: the elementwise ones, and a clear error for the others.

ZeRO-1 (:class:`~scalebook.parallel.zero.ZeroRedundancyOptimizer`) lays each parameter group end to end in a
flat buffer and gives each rank's optimizer a slice of it that cuts tensors anywhere; ZeRO-2/3
(:func:`~scalebook.parallel.fsdp.fully_shard`) give it rows [r k, (r + 1) k) of each parameter. Both train
exactly like one process only if the update of every element depends on that element's own gradient history
and on scalars (the learning rate, the step count): SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, ASGD, NAdam,
RAdam, RMSprop, Rprop. An optimizer that looks at a whole tensor computes another update on a piece of it, with
no error: Adafactor's second moment factored into row and column means, LAMB's and LARS's per-tensor trust
ratio, Muon's orthogonalisation of each matrix, LBFGS's line search over all parameters, a per-tensor norm.

So the wrappers refuse any other class, before it updates anything. A subclass of an allowed class passes if it
keeps that class's update: its ``step`` and ``_init_group`` (where torch's optimizers create the per-element
state) are the allowed class's own; one that overrides either (an AdamW that logs its steps, say: the wrapper
cannot read what the override does) passes only if the caller declares it elementwise:
``ZeroRedundancyOptimizer(..., elementwise=True)`` at construction, ``fully_shard(...,
elementwise_optimizers=[cls])`` at each ``step()`` of an optimizer holding its shards, before the update
(fully_shard never sees the optimizer; a step pre-hook of every optimizer,
``torch.optim.optimizer.register_optimizer_step_pre_hook``, does; code that builds the optimizer itself can
refuse it at once with :func:`check_row_shard_optimizer`).

No setting of the classes allowed here makes them look beyond an element (read in torch 2.13's signatures:
momentum, dampening, nesterov, weight decay decoupled or not, amsgrad's running maximum, RMSprop's centred mean,
Rprop's etas and step sizes, ASGD's averaging, NAdam's momentum decay, ``foreach``, ``fused``, ``capturable``,
``differentiable``, ``maximize``), so none is refused; ``tests/test_elementwise.py`` fails if a torch adds one.

The other way is torch's ``ZeroRedundancyOptimizer``: it assigns whole tensors to ranks (greedily, the largest
first, to the least loaded rank), so that an optimizer looking at one tensor at a time is right, at the price of
uneven shards; one that looks across tensors (LBFGS, a global norm) is still wrong there.

Source: PyTorch documentation, ``torch.optim`` (each algorithm's update) and
``torch.distributed.optim.ZeroRedundancyOptimizer`` (its ``_partition_parameters``); Shazeer and Stern 2018,
"Adafactor"; You et al. 2020, "Large Batch Optimization for Deep Learning" (LAMB); Jordan et al. 2024, "Muon".
"""

from __future__ import annotations

import inspect

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

ELEMENTWISE = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
})  # fmt: skip

_ROW_SHARDS = "each rank's optimizer holds only rows [r k, (r + 1) k) of each parameter"
_hook = None


def keeps_an_elementwise_update(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` is in ``ELEMENTWISE`` or subclasses one without overriding ``step`` or
    ``_init_group``. Compared unwrapped: torch wraps ``step`` for its profiler, and on the first instance of a
    subclass stores that wrapper in the subclass itself, which is no override."""
    allowed = next((base for base in optimizer_class.__mro__ if base in ELEMENTWISE), None)
    return allowed is not None and all(
        _unwrapped(optimizer_class, method) is _unwrapped(allowed, method) for method in ("step", "_init_group")
    )


def _unwrapped(cls: type, method: str):
    function = getattr(cls, method, None)
    return function and inspect.unwrap(function)


def check_elementwise(optimizer_class: type, *, shards: str, declare: str, declared: bool = False) -> None:
    """Refuse ``optimizer_class`` unless :func:`keeps_an_elementwise_update` or ``declared``. ``shards`` says how
    the wrapper cuts the parameters, ``declare`` how its caller declares a class elementwise: both go into the
    error."""
    if declared or keeps_an_elementwise_update(optimizer_class):
        return
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    raise ValueError(
        f"{name} may not be elementwise, and {shards}: the update of an element may depend on other elements of "
        "the tensor, which this rank does not hold (Adafactor's factored second moment, LAMB's or LARS's "
        "per-tensor trust ratio, Muon's orthogonalisation, LBFGS's line search, a per-tensor norm), so it would "
        "compute another update than on one process, with no error. Use an elementwise optimizer "
        f"({', '.join(sorted(c.__name__ for c in ELEMENTWISE))}, or a subclass that overrides neither step nor "
        "_init_group), or the unsharded DDP (scalebook.parallel.ddp); for an optimizer that looks at one tensor at "
        "a time, torch's ZeroRedundancyOptimizer (whole tensors per rank), or torch's FSDP2 "
        "(torch.distributed.fsdp.fully_shard), whose DTensor shards reduce over the whole tensor where the "
        "optimizer's operations support DTensor. If every update of an element depends only on that element's "
        f"gradients and on scalars (a subclass of AdamW that only logs, say), {declare}"
    )


def guard_row_shards(params, declared) -> None:
    """Mark ``params`` as :func:`~scalebook.parallel.fsdp.fully_shard`'s row shards, with the optimizer classes
    ``declared`` elementwise for them; from now on the first ``step()`` of any optimizer holding one of them
    raises :func:`check_elementwise`'s error, before it updates anything, unless its class is allowed."""
    global _hook
    declared = tuple(declared)
    if not all(isinstance(c, type) and issubclass(c, torch.optim.Optimizer) for c in declared):
        raise ValueError(f"elementwise_optimizers must be torch.optim.Optimizer classes, got {declared!r}")
    for p in params:
        p._elementwise_optimizers = declared
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_row_shards)


def check_row_shard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse ``optimizer`` now, as its first ``step()`` would, if it holds row shards of
    :func:`~scalebook.parallel.fsdp.fully_shard` and its class is not allowed for them: for code that builds the
    optimizer and wants the error before the first forward."""
    _check_row_shards(optimizer, (), {})


def _check_row_shards(optimizer, args, kwargs) -> None:
    """The step pre-hook of every optimizer (a look at each parameter's attributes, at every step)."""
    params = (p for group in optimizer.param_groups for p in group["params"])
    declared = next((p._elementwise_optimizers for p in params if hasattr(p, "_elementwise_optimizers")), None)
    if declared is not None:
        check_elementwise(type(optimizer), shards=_ROW_SHARDS, declared=type(optimizer) in declared,
                          declare="pass elementwise_optimizers=[its class] to fully_shard")  # fmt: skip
