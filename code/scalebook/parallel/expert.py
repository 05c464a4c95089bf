"""Mixture of experts and expert parallelism: top-k routing, capacity, all-to-all dispatch, load balancing.

A mixture-of-experts (MoE) MLP holds E expert MLPs and a router, a linear map from a token's hidden
state to E scores. Each token goes to the k experts with the highest softmax probability and its output
is the sum of their outputs weighted by those probabilities (the gates). Experts have a **capacity**,

    C = ceil(capacity_factor * k * tokens / E)          tokens per expert per group,

so that every expert's work has a fixed shape; the tokens an expert receives beyond C are **dropped**
(they contribute nothing, and the residual connection carries them past the layer). As in GShard the
batch is split into ``groups`` and the capacity holds per group; under expert parallelism a group is
one rank's tokens. ``capacity_factor=None`` gives every expert room for all the group's tokens: nothing
is dropped, so how the tokens are grouped (over ranks) cannot change the result. The GPT's MoE option
(``GPTConfig(n_experts=...)``, :func:`moe_mlp`) is dropless unless ``expert_capacity_factor`` is set.

Expert parallelism puts E / ep experts on each of ep ranks. Each rank routes its own tokens, packs
them into an (E, C, d) buffer in expert order, and one ``all_to_all_single`` sends every expert's slice
to the rank that holds it; the experts run on what arrived, a second all-to-all sends the results back,
and each rank combines them with its gates. Both all-to-alls are their own transposes, so the backward
pass is the same two exchanges in reverse.

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

Load balance. Left alone, a router tends to favour a few experts. Switch Transformer and GShard add an
auxiliary loss ``alpha * E * sum_e f_e P_e`` (f_e the share of assignments expert e received, P_e its
mean router probability), minimal when both are uniform. DeepSeek-V3 instead adds a per-expert bias to
the scores used to *select* experts (not to the gates), and after every step raises the bias of
under-loaded experts and lowers that of over-loaded ones by a fixed step ``gamma``: no extra loss
term pulls on the model's weights.

Source: Lepikhin et al. 2021, "GShard: Scaling Giant Models with Conditional Computation and Automatic
Sharding", Sec. 2.2; Fedus, Zoph and Shazeer 2022, "Switch Transformers", Sec. 2.2 (capacity factor,
auxiliary loss); Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts";
DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 2.1.2; torchtitan ``torchtitan/distributed/
expert_parallel.py`` (experts sharded over data-parallel ranks, their gradients divided, not averaged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MoEConfig",
    "MoE",
    "ExpertParallelMoE",
    "moe_mlp",
    "apply_expert_parallel",
    "expert_parameters",
    "reduce_expert_gradients",
    "full_state_dict",
    "full_gradients",
]


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of a :class:`MoE` layer."""

    d_model: int = 64
    d_ff: int = 128
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = 1.25  # None: dropless, every expert has room for the whole group
    aux_loss_weight: float = 0.1  # alpha of the Switch/GShard auxiliary loss
    bias_update: float = 0.01  # gamma of the auxiliary-loss-free bias update
    mlp_bias: bool = True  # biases in the experts' linear layers
    dropout: float = 0.0  # on the layer's output, as the dense MLP's

    def __post_init__(self):
        problems = []
        for name in ("d_model", "d_ff", "n_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.top_k > self.n_experts:
            problems.append(f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            problems.append(f"capacity_factor must be > 0 (or None: no dropping), got {self.capacity_factor!r}")
        if problems:
            raise ValueError("invalid MoEConfig: " + "; ".join(problems))


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """C = ceil(capacity_factor * k * tokens / E): slots per expert for ``tokens`` tokens of one group.
    Without a capacity factor C = tokens: a token picks k distinct experts, so no expert gets more."""
    if capacity_factor is None:
        return tokens
    return math.ceil(capacity_factor * top_k * tokens / n_experts)


@dataclass
class Routing:
    """Where one group's tokens go: for each (token, choice) its expert, gate and slot (-1: dropped)."""

    experts: torch.Tensor  # (n, k) expert ids
    gates: torch.Tensor  # (n, k) router probabilities of those experts (differentiable)
    slots: torch.Tensor  # (n, k) position in the expert's buffer, -1 if over capacity
    probs: torch.Tensor  # (n, E) router softmax, for the auxiliary loss
    load: torch.Tensor  # (E,) assignments each expert received before dropping
    capacity: int


def route(hidden: torch.Tensor, router: nn.Linear, config: MoEConfig, bias: torch.Tensor | None = None) -> Routing:
    """Top-k routing of ``hidden`` ((n, d): one group's tokens) with capacity and dropping.

    ``bias`` (E,), if given, is added to the probabilities only to choose the experts (DeepSeek-V3's
    auxiliary-loss-free balancing); the gates stay the unbiased probabilities. Slots are given in
    token order, first choices of all tokens before second choices (GShard), so a token's first choice
    is the last to be dropped.
    """
    n, E, k = hidden.shape[0], config.n_experts, config.top_k
    probs = torch.softmax(router(hidden).float(), dim=-1)
    selection = probs.detach() if bias is None else probs.detach() + bias
    experts = selection.topk(k, dim=-1).indices
    gates = probs.gather(1, experts)
    capacity = expert_capacity(n, E, k, config.capacity_factor)
    one_hot = F.one_hot(experts.t().reshape(-1), E)  # (k n, E), choice-major: all first choices first
    position = (one_hot.cumsum(dim=0) - 1) * one_hot  # how many earlier assignments the expert already had
    slots = position.sum(dim=-1).view(k, n).t()
    slots = torch.where(slots < capacity, slots, torch.full_like(slots, -1))
    return Routing(experts, gates, slots, probs, one_hot.sum(dim=0), capacity)


def aux_loss(routing: Routing, n_experts: int) -> torch.Tensor:
    """Switch/GShard load-balancing loss E * sum_e f_e P_e (1 when the routing is uniform)."""
    fraction = routing.load.float() / routing.load.sum()
    return n_experts * (fraction * routing.probs.mean(dim=0)).sum()


def dispatch(hidden: torch.Tensor, routing: Routing, n_experts: int) -> torch.Tensor:
    """Pack the kept (token, choice) pairs into an (E, C, d) buffer; empty slots stay zero."""
    buffer = hidden.new_zeros(n_experts * routing.capacity, hidden.shape[-1])
    kept = routing.slots >= 0
    token = torch.arange(hidden.shape[0], device=hidden.device).unsqueeze(1).expand_as(routing.slots)[kept]
    index = routing.experts[kept] * routing.capacity + routing.slots[kept]
    buffer = buffer.index_add(0, index, hidden[token])
    return buffer.view(n_experts, routing.capacity, -1)


def combine(expert_out: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's gate-weighted sum of its kept experts' outputs ((E, C, d) -> (n, d))."""
    flat = expert_out.reshape(-1, expert_out.shape[-1])
    kept = (routing.slots >= 0).to(flat.dtype)
    index = routing.experts * routing.capacity + routing.slots.clamp(min=0)
    picked = flat[index]  # (n, k, d); dropped choices read slot 0 and are zeroed by ``kept``
    return (picked * (routing.gates.to(flat.dtype) * kept).unsqueeze(-1)).sum(dim=1)


class Expert(nn.Module):
    """One expert: the GPT MLP, d -> d_ff -> d with a tanh GELU."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff, bias=bias)
        self.c_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class MoE(nn.Module):
    """A mixture-of-experts MLP, all experts on this rank. ``forward(x, groups=1)`` returns a tensor shaped as x.

    ``x`` is (..., d); its tokens are cut into ``groups`` equal groups (each with its own capacity). The
    routing of every group of the last forward is kept in ``self.routings`` (auxiliary loss, load).
    ``self.bias`` is the selection bias of auxiliary-loss-free balancing, used when ``balance_by_bias``
    is set (zeros unless :meth:`update_bias` moves it).
    """

    def __init__(self, config: MoEConfig, local_experts: int | None = None):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        count = config.n_experts if local_experts is None else local_experts
        self.experts = nn.ModuleList(Expert(config.d_model, config.d_ff, config.mlp_bias) for _ in range(count))
        self.register_buffer("bias", torch.zeros(config.n_experts, device=self.router.weight.device))
        self.dropout = nn.Dropout(config.dropout)
        self.balance_by_bias = False
        self.routings: list[Routing] = []

    def forward(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] % groups:
            raise ValueError(f"{tokens.shape[0]} tokens do not split into {groups} equal groups")
        outputs, self.routings = [], []
        for group in tokens.chunk(groups):
            routing = route(group, self.router, self.config, self.bias if self.balance_by_bias else None)
            expert_out = self.run_experts(dispatch(group, routing, self.config.n_experts))
            outputs.append(combine(expert_out, routing))
            self.routings.append(routing)
        return self.dropout(torch.cat(outputs).view_as(x))

    def run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        """(E, C, d) tokens in expert order -> the experts' (E, C, d) outputs."""
        return torch.stack([expert(buffer[e]) for e, expert in enumerate(self.experts)])

    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's update: b_e += gamma * sign(mean load - load_e), after each step."""
        with torch.no_grad():
            self.bias += self.config.bias_update * torch.sign(load.float().mean() - load.float())


def moe_mlp(config) -> MoE:
    """The dropless-by-default MoE MLP of a :class:`scalebook.model.GPTConfig` with ``n_experts > 0``: E
    experts shaped as the dense MLP (d -> 4d -> d), top ``expert_top_k`` routing."""
    return MoE(
        MoEConfig(
            d_model=config.n_embd,
            d_ff=4 * config.n_embd,
            n_experts=config.n_experts,
            top_k=config.expert_top_k,
            capacity_factor=config.expert_capacity_factor,
            mlp_bias=config.bias,
            dropout=config.dropout,
        )
    )


# ------------------------------------------------------------------------------------ expert parallelism


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
    """This rank's part of a :class:`MoE`: the whole router, and experts [r E/ep, (r+1) E/ep) of ``group``.

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
        """Copy the router, the selection bias and this rank's experts from an unsharded :class:`MoE`."""
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
    """Make every :class:`MoE` of ``model`` expert-parallel over ``group``, in place; returns ``model``.

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
