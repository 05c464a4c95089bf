"""Mixture of experts and expert parallelism: top-k routing, capacity, all-to-all dispatch, load balancing.

A mixture-of-experts (MoE) MLP holds E expert MLPs and a router, a linear map from a token's hidden
state to E scores. Each token goes to the k experts with the highest softmax probability and its output
is the sum of their outputs weighted by those probabilities (the gates). Experts have a **capacity**,

    C = ceil(capacity_factor * k * tokens / E)          tokens per expert per group,

so that every expert's work has a fixed shape; the tokens an expert receives beyond C are **dropped**
(they contribute nothing, and the residual connection carries them past the layer). As in GShard the
batch is split into ``groups`` and the capacity holds per group; under expert parallelism a group is
one rank's tokens.

Expert parallelism puts E / ep experts on each of ep ranks. Each rank routes its own tokens, packs
them into an (E, C, d) buffer in expert order, and one ``all_to_all_single`` sends every expert's slice
to the rank that holds it; the experts run on what arrived, a second all-to-all sends the results back,
and each rank combines them with its gates. Both all-to-alls are their own transposes, so the backward
pass is the same two exchanges in reverse.

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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scalebook import data
from scalebook.comm import count_traffic, launch
from scalebook.model import CausalSelfAttention, GPTConfig

BALANCING = ("none", "aux_loss", "bias")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of a :class:`MoE` layer."""

    d_model: int = 64
    d_ff: int = 128
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.1  # alpha of the Switch/GShard auxiliary loss
    bias_update: float = 0.01  # gamma of the auxiliary-loss-free bias update

    def __post_init__(self):
        problems = []
        for name in ("d_model", "d_ff", "n_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.top_k > self.n_experts:
            problems.append(f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        if not self.capacity_factor > 0:
            problems.append(f"capacity_factor must be > 0, got {self.capacity_factor!r}")
        if problems:
            raise ValueError("invalid MoEConfig: " + "; ".join(problems))


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * k * tokens / E): slots per expert for ``tokens`` tokens of one group."""
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
    token = torch.arange(hidden.shape[0]).unsqueeze(1).expand_as(routing.slots)[kept]
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

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff)
        self.c_proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class MoE(nn.Module):
    """A mixture-of-experts MLP on one rank, all experts here. ``forward(x)`` returns ``(y, routings)``.

    ``x`` is (b, s, d); its b s tokens are cut into ``groups`` equal groups (each with its own capacity).
    ``self.bias`` is the selection bias of auxiliary-loss-free balancing (zeros unless updated).
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.d_model, config.d_ff) for _ in range(config.n_experts))
        self.register_buffer("bias", torch.zeros(config.n_experts))

    def forward(self, x: torch.Tensor, groups: int = 1, *, use_bias: bool = False):
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] % groups:
            raise ValueError(f"{tokens.shape[0]} tokens do not split into {groups} equal groups")
        outputs, routings = [], []
        for group in tokens.chunk(groups):
            routing = route(group, self.router, self.config, self.bias if use_bias else None)
            buffer = dispatch(group, routing, self.config.n_experts)
            expert_out = torch.stack([expert(buffer[e]) for e, expert in enumerate(self.experts)])
            outputs.append(combine(expert_out, routing))
            routings.append(routing)
        return torch.cat(outputs).view_as(x), routings

    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's update: b_e += gamma * sign(mean load - load_e), after each step."""
        with torch.no_grad():
            self.bias += self.config.bias_update * torch.sign(load.float().mean() - load.float())


# ------------------------------------------------------------------------------------ expert parallelism


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """Send row block i of ``x`` to rank i of ``group`` and receive rank i's block in its place (autograd-aware)."""
    return _AllToAll.apply(x, group)


class ExpertParallelMoE(nn.Module):
    """This rank's part of a :class:`MoE`: the whole router, and experts [r E/ep, (r+1) E/ep).

    ``forward(x)`` routes this rank's tokens (one group), exchanges them with all-to-all, runs the local
    experts, and exchanges the results back. Build it with :meth:`from_moe`. After the backward pass
    call :meth:`average_gradients`: every rank's router saw different tokens, and every expert received
    gradients from every rank's loss.
    """

    def __init__(self, config: MoEConfig, group=None):
        super().__init__()
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if config.n_experts % self.ep:
            raise ValueError(
                f"n_experts ({config.n_experts}) must be divisible by the expert-parallel size ({self.ep})"
            )
        self.config, self.group = config, group
        self.local = config.n_experts // self.ep
        self.first_expert = self.rank * self.local
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.d_model, config.d_ff) for _ in range(self.local))

    @classmethod
    def from_moe(cls, moe: MoE, group=None) -> ExpertParallelMoE:
        """Copy the router and this rank's experts from an unsharded :class:`MoE`."""
        ep_moe = cls(moe.config, group)
        ep_moe.router.load_state_dict(moe.router.state_dict())
        for j, expert in enumerate(ep_moe.experts):
            expert.load_state_dict(moe.experts[ep_moe.first_expert + j].state_dict())
        return ep_moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        tokens = x.reshape(-1, x.shape[-1])
        routing = route(tokens, self.router, self.config)
        buffer = dispatch(tokens, routing, self.config.n_experts)  # (E, C, d), experts in owner-rank order
        C, d = routing.capacity, tokens.shape[-1]
        received = all_to_all(buffer, self.group).view(self.ep, self.local, C, d)  # [source rank, my expert]
        outputs = torch.stack([expert(received[:, j]) for j, expert in enumerate(self.experts)], dim=1)
        returned = all_to_all(outputs.reshape(self.ep * self.local, C, d), self.group)
        return combine(returned, routing).view_as(x), routing

    def average_gradients(self) -> None:
        """Turn gradients of every rank's own mean loss into gradients of the mean over all ranks' tokens.

        Each rank's loss is the mean over its own tokens, as in data parallelism, so the global loss is
        the average of the ep local losses and every gradient needs a 1/ep. The router's gradient is
        this rank's share only: sum it over the ranks, then divide. An expert's gradient already holds
        every rank's share (the backward all-to-all brought it home): divide only (torchtitan's
        ``gradient_divide_factor`` for the experts does the same).
        """
        dist.all_reduce(self.router.weight.grad, group=self.group)
        for param in self.parameters():
            param.grad /= self.ep


def dispatch_bytes_per_rank(tokens: int, config: MoEConfig, ep: int, *, dtype_bytes: int = 4) -> float:
    """Bytes one rank sends in one all-to-all of the (E, C, d) buffer: all but its own 1/ep share."""
    capacity = expert_capacity(tokens, config.n_experts, config.top_k, config.capacity_factor)
    return (ep - 1) / ep * config.n_experts * capacity * config.d_model * dtype_bytes


def compare_expert_parallel(*, tokens_per_rank: int = 32, config: MoEConfig | None = None, seed: int = 0) -> dict:
    """On every rank (run it with :func:`scalebook.comm.launch`): expert-parallel MoE against one :class:`MoE`
    holding all experts, with one group per rank.

    The loss is a weighted mean over tokens: the reference takes it over all ep * tokens_per_rank tokens,
    each rank over its own (as data parallelism does), and :meth:`ExpertParallelMoE.average_gradients`
    reconciles the two. Returns this rank's largest deviation of the output, of its tokens' input
    gradients (times ep: a token's share of the local mean is ep times its share of the global one), of
    the router gradient and of its experts' gradients from the reference, the dropped share of
    assignments, and its all-to-all calls and bytes.
    """
    config = config or MoEConfig()
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = MoE(config)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ep * tokens_per_rank, config.d_model, generator=gen).requires_grad_()
    weight = torch.randn(ep * tokens_per_rank, config.d_model, generator=gen)  # loss = mean_tokens(sum_d w * y)
    y_ref, routings = reference(x, groups=ep)
    ((weight * y_ref).sum() / (ep * tokens_per_rank)).backward()

    model = ExpertParallelMoE.from_moe(reference, None)
    mine = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    x_mine = x.detach()[mine].clone().requires_grad_()
    with count_traffic() as forward:
        y, routing = model(x_mine)
    with count_traffic() as backward:
        ((weight[mine] * y).sum() / tokens_per_rank).backward()
    model.average_gradients()
    expert_error = max(
        (p.grad - q.grad).abs().max().item()
        for j, expert in enumerate(model.experts)
        for p, q in zip(expert.parameters(), reference.experts[model.first_expert + j].parameters(), strict=True)
    )
    return {
        "output_error": (y - y_ref[mine]).abs().max().item(),
        "input_grad_error": (x_mine.grad - ep * x.grad[mine]).abs().max().item(),
        "router_grad_error": (model.router.weight.grad - reference.router.weight.grad).abs().max().item(),
        "expert_grad_error": expert_error,
        "grad_scale": max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None),
        "dropped": float((routing.slots < 0).float().mean()),
        "forward": {op: (n, float(sent)) for op, (n, sent) in forward.by_op().items()},
        "backward": {op: (n, float(sent)) for op, (n, sent) in backward.by_op().items()},
        "capacity": routing.capacity,
    }


def expert_parallel_study(
    eps: tuple[int, ...] = (2, 4), *, tokens_per_rank: int = 32, config: MoEConfig | None = None, timeout=300.0
) -> dict[int, list[dict]]:
    """Run :func:`compare_expert_parallel` on ``ep`` fresh ranks for each ``ep``; every rank's results."""
    config = config or MoEConfig()
    bad = [ep for ep in eps if config.n_experts % ep]
    if bad:
        raise ValueError(f"expert-parallel sizes {bad} do not divide n_experts ({config.n_experts})")
    return {
        ep: launch(compare_expert_parallel, ep, tokens_per_rank=tokens_per_rank, config=config, timeout=timeout)
        for ep in eps
    }


# ------------------------------------------------------------------------------ load balance in training


class MoEBlock(nn.Module):
    """A pre-LN Transformer block whose MLP is a :class:`MoE`."""

    def __init__(self, gpt_config: GPTConfig, moe_config: MoEConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(gpt_config.n_embd)
        self.attn = CausalSelfAttention(gpt_config)
        self.ln_2 = nn.LayerNorm(gpt_config.n_embd)
        self.moe = MoE(moe_config)

    def forward(self, x: torch.Tensor, use_bias: bool):
        x = x + self.attn(self.ln_1(x))
        y, routings = self.moe(self.ln_2(x), use_bias=use_bias)
        return x + y, routings[0]


class MoELanguageModel(nn.Module):
    """A small byte-level decoder with MoE MLPs, to watch expert load while it trains."""

    def __init__(self, n_layer: int = 2, block_size: int = 64, moe_config: MoEConfig | None = None):
        super().__init__()
        self.moe_config = moe_config or MoEConfig()
        d = self.moe_config.d_model
        gpt_config = GPTConfig(vocab_size=256, block_size=block_size, n_layer=n_layer, n_head=4, n_embd=d)
        self.wte = nn.Embedding(256, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(MoEBlock(gpt_config, self.moe_config) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_bias: bool = False):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        routings = []
        for block in self.blocks:
            x, routing = block(x, use_bias)
            routings.append(routing)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)), routings


def train_load_balance(
    balancing: str, *, steps: int = 100, batch_size: int = 8, seq_len: int = 64, lr: float = 1e-3, seed: int = 0,
    moe_config: MoEConfig | None = None,
) -> dict[str, list[float]]:  # fmt: skip
    """Train :class:`MoELanguageModel` on the default corpus with ``balancing`` in ``BALANCING``.

    Returns per step the language-model loss, the load imbalance (max over mean assignments per expert,
    averaged over layers, before dropping) and the share of dropped assignments.
    """
    if balancing not in BALANCING:
        raise ValueError(f"balancing must be one of {BALANCING}, got {balancing!r}")
    # Matrices this small gain nothing from a second thread, and on a busy machine the threads' waiting
    # for each other costs many times the work; one thread also makes the run bit-identical everywhere.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_load_balance(balancing, steps, batch_size, seq_len, lr, seed, moe_config)
    finally:
        torch.set_num_threads(threads)


def _train_load_balance(balancing, steps, batch_size, seq_len, lr, seed, moe_config) -> dict[str, list[float]]:
    torch.manual_seed(seed)
    model = MoELanguageModel(block_size=seq_len, moe_config=moe_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens = data.tokenize(data.default_corpus())
    gen = torch.Generator().manual_seed(seed)
    history = {"loss": [], "imbalance": [], "dropped": []}
    for _ in range(steps):
        idx, targets = data.get_batch(tokens, batch_size, seq_len, gen)
        loss, routings = model(idx, targets, use_bias=balancing == "bias")
        total = loss
        if balancing == "aux_loss":
            total = loss + model.moe_config.aux_loss_weight * sum(aux_loss(r, model.moe_config.n_experts)
                                                                  for r in routings)  # fmt: skip
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        if balancing == "bias":
            for block, routing in zip(model.blocks, routings, strict=True):
                block.moe.update_bias(routing.load)
        history["loss"].append(loss.item())
        history["imbalance"].append(sum(float(r.load.max() / r.load.float().mean()) for r in routings) / len(routings))
        history["dropped"].append(sum(float((r.slots < 0).float().mean()) for r in routings) / len(routings))
    return history
