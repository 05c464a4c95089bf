"""Which optimizers a sharded optimizer may step: the elementwise ones, and a clear error for the others.

ZeRO-1 (:class:`~scalebook.parallel.zero.ZeroRedundancyOptimizer`) lays each parameter group end to end in a
flat buffer and gives each rank's optimizer a slice of it that cuts tensors anywhere; ZeRO-2/3
(:func:`~scalebook.parallel.fsdp.fully_shard`) give it rows [r k, (r + 1) k) of each parameter. Both train
exactly like one process only if the update of every element depends on that element's own gradient history
and on scalars (the learning rate, the step count): SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, ASGD, NAdam,
RAdam, RMSprop, Rprop. An optimizer that looks at a whole tensor computes another update on a piece of it, with
no error: Adafactor's second moment factored into row and column means, LAMB's and LARS's per-tensor trust
ratio, Muon's orthogonalisation of each matrix, LBFGS's line search over all parameters, a per-tensor norm.

So the wrappers refuse any other class, before it updates anything, unless the caller declares it elementwise
(a subclass of AdamW that logs, say: a subclass may change the update, so each class is declared by name):
``ZeroRedundancyOptimizer(..., elementwise=True)`` at construction, ``fully_shard(...,
elementwise_optimizers=[cls])`` at each ``step()`` of an optimizer holding its shards, before the update
(fully_shard never sees the optimizer; a step pre-hook of every optimizer,
``torch.optim.optimizer.register_optimizer_step_pre_hook``, does).

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

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

ELEMENTWISE = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
})  # fmt: skip

_ROW_SHARDS = "each rank's optimizer holds only rows [r k, (r + 1) k) of each parameter"
_hook = None


def check_elementwise(optimizer_class: type, *, shards: str, declare: str, declared: bool = False) -> None:
    """Refuse ``optimizer_class`` unless it is in ``ELEMENTWISE`` (that very class) or ``declared``.
    ``shards`` says how the wrapper cuts the parameters, ``declare`` how its caller declares a class
    elementwise: both go into the error."""
    if optimizer_class in ELEMENTWISE or declared:
        return
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    raise ValueError(
        f"{name} may not be elementwise, and {shards}: an optimizer that looks at a whole tensor (Adafactor's "
        "factored second moment, LAMB's or LARS's per-tensor trust ratio, Muon's orthogonalisation, LBFGS's line "
        "search, a per-tensor norm) would compute another update than on one process, with no error. Use an "
        f"elementwise optimizer ({', '.join(sorted(c.__name__ for c in ELEMENTWISE))}), or the unsharded DDP "
        "(scalebook.parallel.ddp), or, if every update of an element depends only on that element's gradients "
        f"and on scalars (a subclass of AdamW that changes nothing of the update, say), {declare}"
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


def _check_row_shards(optimizer, args, kwargs) -> None:
    """The step pre-hook of every optimizer (a look at each parameter's attributes, at every step)."""
    params = (p for group in optimizer.param_groups for p in group["params"])
    declared = next((p._elementwise_optimizers for p in params if hasattr(p, "_elementwise_optimizers")), None)
    if declared is not None:
        check_elementwise(type(optimizer), shards=_ROW_SHARDS, declared=type(optimizer) in declared,
                          declare="pass elementwise_optimizers=[its class] to fully_shard")  # fmt: skip
