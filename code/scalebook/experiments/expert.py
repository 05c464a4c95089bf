"""Chapter 14's mixture-of-experts experiments: expert parallelism against one MoE, and load balance in training.

:func:`compare_expert_parallel` runs :class:`scalebook.parallel.expert.ExpertParallelMoE` on every rank against
one :class:`~scalebook.moe.MoE` holding all experts, :func:`gpt_expert_parallel_errors` trains the
GPT's MoE option one step with :func:`~scalebook.parallel.expert.apply_expert_parallel` against one process;
:func:`train_load_balance` trains a small
byte-level GPT with MoE MLPs with no balancing, the auxiliary loss or DeepSeek-V3's bias update and records
the experts' load.

Source: Lepikhin et al. 2021, "GShard", Sec. 2.2; Fedus, Zoph and Shazeer 2022, "Switch Transformers";
Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts".
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed as dist

from scalebook import data, measure
from scalebook.comm import count_traffic, launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.expert import (
    ExpertParallelMoE,
    MoE,
    MoEConfig,
    apply_expert_parallel,
    aux_loss,
    expert_parameters,
    full_gradients,
    full_state_dict,
    reduce_expert_gradients,
)

BALANCING = ("none", "aux_loss", "bias")

__all__ = [
    "BALANCING",
    "compare_expert_parallel",
    "expert_parallel_study",
    "gpt_expert_parallel_errors",
    "train_load_balance",
]


def compare_expert_parallel(*, tokens_per_rank: int = 32, config: MoEConfig | None = None, seed: int = 0) -> dict:
    """On every rank (run it with :func:`scalebook.comm.launch`): expert-parallel MoE against one
    :class:`~scalebook.moe.MoE`
    holding all experts, with one group per rank.

    The loss is a weighted mean over tokens: the reference takes it over all ep * tokens_per_rank tokens,
    each rank over its own (as data parallelism does). The router's gradient is averaged over the ranks as a
    data-parallel wrapper would, the experts' by :func:`~scalebook.parallel.expert.reduce_expert_gradients`. Returns
    this rank's
    largest deviation of the output, of its tokens' input gradients (times ep: a token's share of the local
    mean is ep times its share of the global one), of the router gradient and of its experts' gradients
    from the reference, the dropped share of assignments, and its all-to-all calls and bytes.
    """
    config = config or MoEConfig()
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = MoE(config)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ep * tokens_per_rank, config.d_model, generator=gen).requires_grad_()
    weight = torch.randn(ep * tokens_per_rank, config.d_model, generator=gen)  # loss = mean_tokens(sum_d w * y)
    y_ref = reference(x, groups=ep)
    ((weight * y_ref).sum() / (ep * tokens_per_rank)).backward()

    model = ExpertParallelMoE.from_moe(reference, None)
    mine = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    x_mine = x.detach()[mine].clone().requires_grad_()
    with count_traffic() as forward:
        y = model(x_mine)
    with count_traffic() as backward:
        ((weight[mine] * y).sum() / tokens_per_rank).backward()
    dist.all_reduce(model.router.weight.grad.div_(ep))  # the data-parallel average of a replicated parameter
    reduce_expert_gradients(model)
    expert_error = max(
        (p.grad - q.grad).abs().max().item()
        for j, expert in enumerate(model.experts)
        for p, q in zip(expert.parameters(), reference.experts[model.first_expert + j].parameters(), strict=True)
    )
    routing = model.routings[0]
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


def gpt_expert_parallel_errors(ep: int, *, seed: int = 0) -> dict:
    """On every rank of the default group (run it with :func:`scalebook.comm.launch`): a small GPT with 4
    experts per MLP trained one step on dp = world ranks, its experts sharded over blocks of ep of them,
    against the same GPT on the whole batch in this process. The replicated parameters' gradients are
    averaged over dp (the data-parallel wrapper's job), the experts' by
    :func:`~scalebook.parallel.expert.reduce_expert_gradients`
    over the ranks holding the same experts (none when ep == dp), as :mod:`scalebook.parallel.expert`
    prescribes. Returns the experts this rank holds, the deviations of the logged loss, of every gathered
    gradient and of the gathered state from the single process's, and the largest gradient entry."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    ep_groups = [dist.new_group(list(range(b, b + ep))) for b in range(0, dp, ep)]  # every rank makes all
    replica_groups = [dist.new_group(list(range(e, dp, ep))) for e in range(ep)]
    torch.manual_seed(seed)
    reference = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, n_experts=4))
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(seed + 1)
    idx, targets = (torch.randint(0, 64, (2 * dp, 16), generator=gen) for _ in range(2))
    reference(idx, targets)[1].backward()

    apply_expert_parallel(model, ep_groups[rank // ep])
    rows = slice(2 * rank, 2 * rank + 2)  # this data-parallel rank's two sequences
    _, loss = model(idx[rows], targets[rows])
    loss.backward()
    sharded = set(expert_parameters(model))
    for p in model.parameters():
        if p not in sharded:
            dist.all_reduce(p.grad.div_(dp))
    reduce_expert_gradients(model, replica_groups[rank % ep] if dp > ep else None)
    logged = loss.detach().clone()
    dist.all_reduce(logged.div_(dp))
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    grads, state = full_gradients(model), full_state_dict(model)
    return {
        "experts_here": len(model.blocks[0].mlp.experts),
        "sharded": len(sharded),
        "loss_error": abs(logged.item() - reference(idx, targets)[1].item()),
        "grad_names_match": sorted(grads) == sorted(ref_grads),
        "grad_error": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        "state_equal": state.keys() == reference.state_dict().keys()
        and all(torch.equal(state[k], v) for k, v in reference.state_dict().items()),
    }


# ------------------------------------------------------------------------------ load balance in training


def train_load_balance(
    balancing: str, *, steps: int = 100, batch_size: int = 8, seq_len: int = 64, lr: float = 1e-3, seed: int = 0,
    n_experts: int = 8, top_k: int = 2, capacity_factor: float = 1.25, aux_loss_weight: float = 0.01,
    bias_update: float = 0.005,
) -> dict[str, list[float]]:  # fmt: skip
    """Train a small byte-level :class:`scalebook.model.GPT` with MoE MLPs (2 layers, width 64, ``n_experts``
    experts, top ``top_k``, with capacity, so that tokens can drop) on the default corpus, with ``balancing``
    in ``BALANCING``: none, the auxiliary loss added to the language-model loss with weight
    ``aux_loss_weight`` (Switch Transformer's 0.01), or the selection-bias update of ``bias_update`` per step.
    DeepSeek-V3 moves its bias by 0.001 a step over more than a hundred thousand steps; a run of a few hundred
    steps needs a faster rate for the bias to catch up with a router that collapses within tens of steps,
    and 0.005 (a bias moves at most 0.5 in 100 steps, against softmax probabilities of about 1/8) is the default.

    Returns per step the language-model loss, the load imbalance (max over mean assignments per expert,
    averaged over layers, before dropping) and the share of dropped assignments.
    """
    if balancing not in BALANCING:
        raise ValueError(f"balancing must be one of {BALANCING}, got {balancing!r}")
    with measure.one_thread():  # matrices this small: bit-identical everywhere, and no threads waiting
        config = GPTConfig(vocab_size=256, block_size=seq_len, n_layer=2, n_head=4, n_embd=64, n_experts=n_experts,
                           expert_top_k=top_k, expert_capacity_factor=capacity_factor)  # fmt: skip
        torch.manual_seed(seed)
        model = GPT(config)
        for layer in model.modules():
            if isinstance(layer, MoE):
                layer.config = replace(layer.config, aux_loss_weight=aux_loss_weight, bias_update=bias_update)
        return _train_load_balance(model, balancing, steps, batch_size, seq_len, lr, seed)


def _train_load_balance(model, balancing, steps, batch_size, seq_len, lr, seed) -> dict[str, list[float]]:
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.balance_by_bias = balancing == "bias"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens = data.corpus_tokens()
    gen = torch.Generator().manual_seed(seed)
    history = {"loss": [], "imbalance": [], "dropped": []}
    for _ in range(steps):
        idx, targets = data.get_batch(tokens, batch_size, seq_len, gen)
        _, loss = model(idx, targets)
        routings = [layer.routings[0] for layer in layers]
        total = loss
        if balancing == "aux_loss":
            total = loss + sum(layer.config.aux_loss_weight * aux_loss(r, layer.config.n_experts)
                               for layer, r in zip(layers, routings, strict=True))  # fmt: skip
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        if balancing == "bias":
            for layer, routing in zip(layers, routings, strict=True):
                layer.update_bias(routing.load)
        history["loss"].append(loss.item())
        history["imbalance"].append(sum(float(r.load.max() / r.load.float().mean()) for r in routings) / len(routings))
        history["dropped"].append(sum(float((r.slots < 0).float().mean()) for r in routings) / len(routings))
    return history
