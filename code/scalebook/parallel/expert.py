"""Expert parallelism: the experts of a mixture-of-experts layer dealt out to ranks, tokens moved by all-to-all.

The layer itself (routing, capacity, dispatch and combine, load balancing) is the model's, :mod:`scalebook.moe`,
whose names are re-exported here. Expert parallelism puts E / ep experts on each of ep ranks. Each rank routes
its own tokens (a group, with its own capacity, is one rank's tokens), packs them into an (E, C, d) buffer in
expert order, and one ``all_to_all_single`` sends every expert's slice to the rank that holds it; the experts
run on what arrived, a second all-to-all sends the results back, and each rank combines them with its gates.
Both all-to-alls are their own transposes, so the backward pass is the same two exchanges in reverse.

In a training run (``ep`` divides ``dp``: the ep ranks of a group are data-parallel ranks with different
tokens; every rank's loss is the mean over its own tokens, as in data parallelism):

1. Build the same GPT on every rank (same seed), then ``apply_expert_parallel(model, ep_group)``.
2. Non-expert parameters (attention, router, embeddings, norms) are replicated: the data-parallel
   wrapper averages their gradients over dp (over dp x cp under context parallelism), as for a dense
   model. It must leave :func:`expert_parameters` out (neither broadcast nor all-reduce them over dp):
   the ranks of an ep group hold different experts of the same shapes.
3. After backward, :func:`reduce_expert_gradients` ``(model, group)``: an expert's gradient already holds
   the sum over the ep group's losses (the backward all-to-all brought every rank's share home), so it
   divides by ep and averages over ``group``, the ranks that hold the same experts: those with the same
   ep index (dp index mod ep) in the other dp / ep blocks, times every cp rank, at this rank's pp and tp
   coordinates ((dp / ep) * cp ranks). With dp == ep and cp == 1 pass ``None``: dividing is all.
4. :func:`full_state_dict` gathers the experts back into the single-process names (checkpoints, export).

Source: Lepikhin et al. 2021, "GShard: Scaling Giant Models with Conditional Computation and Automatic
Sharding", Sec. 2.2 (the all-to-all dispatch); torchtitan ``torchtitan/distributed/expert_parallel.py``
(experts sharded over data-parallel ranks, their gradients divided, not averaged).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scalebook.moe import (  # noqa: F401  (the layer's names, re-exported: chapters import them from here)
    Expert,
    MoE,
    MoEConfig,
    Routing,
    aux_loss,
    combine,
    dispatch,
    expert_capacity,
    moe_mlp,
    route,
)

__all__ = [
    "ExpertParallelMoE",
    "apply_expert_parallel",
    "expert_parameters",
    "reduce_expert_gradients",
    "full_state_dict",
    "full_gradients",
]


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)  # x may be a view (a transpose)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """Send row block i of ``x`` to rank i of ``group`` and receive rank i's block in its place (autograd-aware)."""
    return _AllToAll.apply(x, group)


def validate_expert_parallel(n_experts: int, ep: int) -> None:
    """Raise one ValueError if ``n_experts`` experts cannot be dealt out evenly to ``ep`` ranks."""
    if n_experts % ep:
        divisors = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        raise ValueError(
            f"n_experts ({n_experts}) must be divisible by the expert-parallel size ep ({ep}); "
            f"use ep in {divisors} or change n_experts"
        )


class ExpertParallelMoE(MoE):
    """This rank's part of a :class:`~scalebook.moe.MoE`: the whole router, and experts [r E/ep, (r+1) E/ep) of
    ``group``.

    ``forward(x)`` routes this rank's tokens, sends every expert's slice of the (E, C, d) buffer to the
    rank holding it (all-to-all), runs the local experts on what arrived from every rank, and sends the
    results back. Every rank of ``group`` must pass the same number of tokens (the buffers' shapes must
    agree). Build it with :meth:`from_moe`; after backward see :func:`reduce_expert_gradients`.
    """

    def __init__(self, config: MoEConfig, group=None):
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        validate_expert_parallel(config.n_experts, ep)
        super().__init__(config, local_experts=config.n_experts // ep)
        self.group, self.ep, self.rank = group, ep, rank
        self.local = config.n_experts // ep
        self.first_expert = rank * self.local

    @classmethod
    def from_moe(cls, moe: MoE, group=None) -> ExpertParallelMoE:
        """Copy the router, the selection bias and this rank's experts from an unsharded :class:`~scalebook.moe.MoE`."""
        with torch.device(moe.router.weight.device):  # built where the MoE is, not on the CPU and then copied
            ep_moe = cls(moe.config, group).to(moe.router.weight.dtype)
        ep_moe.load_state_dict(_local_experts(moe.state_dict(), ep_moe.first_expert, ep_moe.local))
        ep_moe.balance_by_bias = moe.balance_by_bias
        ep_moe.train(moe.training)
        return ep_moe

    def run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        E, C, d = buffer.shape  # experts in owner-rank order: rank i holds rows [i E/ep, (i+1) E/ep)
        received = all_to_all(buffer, self.group).view(self.ep, self.local, C, d)  # [source rank, my expert]
        outputs = torch.stack([expert(received[:, j]) for j, expert in enumerate(self.experts)], dim=1)
        return all_to_all(outputs.reshape(E, C, d), self.group)


def _expert_index(name: str) -> tuple[str, int, str] | None:
    """``"blocks.0.mlp.experts.5.c_fc.weight"`` -> ``("blocks.0.mlp.experts.", 5, ".c_fc.weight")``."""
    head, found, tail = name.rpartition("experts.")
    if not found:
        return None
    index, _, rest = tail.partition(".")
    return (head + found, int(index), "." + rest) if index.isdigit() else None


def _local_experts(state: dict, first: int, local: int) -> dict:
    """An unsharded MoE's state with only experts [first, first + local), renumbered from 0."""
    kept = {}
    for name, value in state.items():
        parts = _expert_index(name)
        if parts is None:
            kept[name] = value
        elif first <= parts[1] < first + local:
            kept[f"{parts[0]}{parts[1] - first}{parts[2]}"] = value
    return kept


def _expert_parallel_layers(model: nn.Module) -> list[ExpertParallelMoE]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


def apply_expert_parallel(model: nn.Module, group=None) -> nn.Module:
    """Make every :class:`~scalebook.moe.MoE` of ``model`` expert-parallel over ``group``, in place; returns ``model``.

    Each rank keeps the router and n_experts / ep of the experts, copied from the full layer, so every
    rank of ``group`` must have built the same model (same seed). Raises a ValueError, before changing
    anything, if the model has no MoE layer or ep does not divide its number of experts.
    """
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if type(child) is MoE]  # fmt: skip
    if not layers:
        raise ValueError("the model has no mixture-of-experts layer: build it with GPTConfig(n_experts=...)")
    ep = dist.get_world_size(group)
    for n_experts in sorted({moe.config.n_experts for _, _, moe in layers}):
        validate_expert_parallel(n_experts, ep)
    for parent, name, moe in layers:
        setattr(parent, name, ExpertParallelMoE.from_moe(moe, group))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters expert parallelism shards (every :class:`ExpertParallelMoE`'s experts): what the
    data-parallel wrapper must leave to :func:`reduce_expert_gradients`. Empty before
    :func:`apply_expert_parallel`."""
    return [p for layer in _expert_parallel_layers(model) for p in layer.experts.parameters()]


def reduce_expert_gradients(model: nn.Module, group=None) -> None:
    """After backward: make the experts' gradients those of the run's global mean loss (a collective).

    Every rank's loss is the mean over its own tokens, so the global loss is the mean of all ranks' losses.
    An expert's gradient already holds the sum over its ep group's losses, the backward all-to-all having
    brought every rank's share home: it is divided by ep (torchtitan's ``gradient_divide_factor``), then
    averaged over ``group``: the ranks that hold the same experts ((dp / ep) * cp of them, see the module
    docstring), None when there is none. The router and every other replicated parameter are averaged by
    the data-parallel wrapper, as in a dense model.
    """
    grads = [p.grad for p in expert_parameters(model) if p.grad is not None]
    if not grads:
        return
    ep = _expert_parallel_layers(model)[0].ep
    replicas = 1 if group is None else dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(ep * replicas)
    if replicas > 1:
        dist.all_reduce(flat, group=group)
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(reduced.view_as(grad))


def _gather_experts(named: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Every expert tensor of ``named`` gathered from the ranks of its layer's group, under the unsharded
    name; other entries as they are. A collective: every rank calls it with the same names."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, ExpertParallelMoE)}
    full = {}
    for name, value in named.items():
        parts = _expert_index(name)
        layer = layers.get(parts[0][: -len("experts.")].removesuffix(".")) if parts else None
        if layer is None:
            full[name] = value.detach()
            continue
        pieces = [torch.empty_like(value) for _ in range(layer.ep)]
        dist.all_gather(pieces, value.detach().contiguous(), group=layer.group)
        for rank, piece in enumerate(pieces):
            full[f"{parts[0]}{rank * layer.local + parts[1]}{parts[2]}"] = piece
    return full


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict`` (single-process names and values), gathered from a model made
    expert-parallel by :func:`apply_expert_parallel`: a collective over each layer's group, every rank gets it."""
    return _gather_experts(model.state_dict(), model)


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its unsharded name (a tied weight once); a collective, as
    :func:`full_state_dict`. Call it after :func:`reduce_expert_gradients`."""
    return _gather_experts({name: p.grad for name, p in model.named_parameters() if p.grad is not None}, model)


def dispatch_bytes_per_rank(tokens: int, config: MoEConfig, ep: int, *, dtype_bytes: int = 4) -> float:
    """Bytes one rank sends in one all-to-all of the (E, C, d) buffer: all but its own 1/ep share."""
    capacity = expert_capacity(tokens, config.n_experts, config.top_k, config.capacity_factor)
    return (ep - 1) / ep * config.n_experts * capacity * config.d_model * dtype_bytes
