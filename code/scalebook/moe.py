"""A mixture-of-experts MLP: top-k routing, expert capacity, dispatch and combine, load balancing.

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

This module is the model's layer, all experts in one process; :mod:`scalebook.parallel.expert` deals the
experts out to ranks (expert parallelism) and moves the tokens to them with all-to-alls.

Load balance. Left alone, a router tends to favour a few experts. Switch Transformer and GShard add an
auxiliary loss ``alpha * E * sum_e f_e P_e`` (f_e the share of assignments expert e received, P_e its
mean router probability), minimal when both are uniform. DeepSeek-V3 instead adds a per-expert bias to
the scores used to *select* experts (not to the gates), and after every step raises the bias of
under-loaded experts and lowers that of over-loaded ones by a fixed step ``gamma``: no extra loss
term pulls on the model's weights.

Source: Lepikhin et al. 2021, "GShard: Scaling Giant Models with Conditional Computation and Automatic
Sharding", Sec. 2.2; Fedus, Zoph and Shazeer 2022, "Switch Transformers", Sec. 2.2 (capacity factor,
auxiliary loss); Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts";
DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 2.1.2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoEConfig", "MoE", "moe_mlp"]


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
