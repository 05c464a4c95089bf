"""Expert-parallel benchmarks: the book's mixture-of-experts layer, sharded and not, against references, 2 ranks.

Two ranks (gloo, CPU, one thread each) each hold ``TOKENS`` tokens. Four layers run one forward and backward
pass each, in turn, in an order that rotates from pass to pass, every pass started on both ranks together:

1. ``ExpertParallelMoE`` (:mod:`scalebook.parallel.expert`): the router on every rank, half the experts on
   each, the (E, C, d) buffer dealt out and back by all-to-all (capacity factor 1.25);
2. the same layer unsharded (``MoE``, the same weights, every expert on every rank) on each rank's own tokens:
   what a rank computes without expert parallelism. Both run the same expert FLOPs per rank, so the ratio is
   the price of the two all-to-alls in each direction;
3. the book's ``MoE`` dropless (``capacity_factor=None``, the GPT's ``--moe-experts`` default): every expert
   gets a buffer of all the tokens, most of its rows empty;
4. a plain per-expert loop, as Hugging Face's Mixtral block writes it (each expert runs only on the tokens
   routed to it, the outputs added back gate-weighted), with the same router and experts, checked equal to 3.

Gradient synchronisation (the router's all-reduce, the experts' scaling) is left out of both sides.
Run with ``python bench/run.py --only expert``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import statistics
import time

import torch
import torch.distributed as dist

from scalebook.comm import launch
from scalebook.parallel.expert import ExpertParallelMoE, MoE, MoEConfig

CONFIG = MoEConfig(d_model=256, d_ff=1024, n_experts=8, top_k=2, capacity_factor=1.25)
TOKENS = 1024  # per rank
PASSES = 3  # timed passes of each layer per repeat


def plain_moe_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Top-k MoE as a per-expert loop over the tokens routed to each expert (Mixtral's sparse block pattern;
    gates are the router's softmax probabilities of the chosen experts, not renormalised, as the book's)."""
    probs = torch.softmax(moe.router(x).float(), dim=-1)
    gates, experts = probs.topk(moe.config.top_k, dim=-1)
    out = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        token, choice = torch.where(experts == e)
        if token.numel():
            out = out.index_add(0, token, expert(x[token]) * gates[token, choice, None].to(x.dtype))
    return out


def compare_passes(repeats: int) -> dict:
    """Worker on 2 ranks: rank 0's median seconds of one forward + backward pass of each layer, and the largest
    difference between the book's dropless layer and the plain loop."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    unsharded = MoE(CONFIG)
    dropless = copy.deepcopy(unsharded)
    dropless.config = dataclasses.replace(CONFIG, capacity_factor=None)
    layers = {"ep": ExpertParallelMoE.from_moe(unsharded), "unsharded": unsharded, "dropless": dropless,
              "plain": lambda x: plain_moe_forward(dropless, x)}  # fmt: skip
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(TOKENS, CONFIG.d_model, generator=gen)
    weight = torch.randn(TOKENS, CONFIG.d_model, generator=gen)  # loss = mean over tokens of sum_d w * y

    def run(layer):
        xs = x.clone().requires_grad_()
        y = layer(xs)
        ((weight * y).sum() / TOKENS).backward()
        return y

    difference = (run(layers["dropless"]) - run(layers["plain"])).abs().max().item()
    for layer in layers.values():  # warm-up
        run(layer)
    seconds = {name: [] for name in layers}
    names = list(layers)
    for i in range(repeats * PASSES):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            run(layers[name])
            seconds[name].append(time.perf_counter() - start)
    return {"seconds": {name: statistics.median(v) for name, v in seconds.items()}, "difference": difference}


@functools.cache
def _results(repeats: int) -> dict:
    return launch(compare_passes, 2, repeats, timeout=900)[0]


def bench_expert_parallel(repeats: int) -> list[dict]:
    """Forward + backward seconds: expert-parallel MoE vs the unsharded layer; dropless MoE vs a per-expert loop."""
    result = _results(repeats)
    seconds = result["seconds"]
    c = CONFIG
    setup = (f"2 ranks (gloo, CPU, 1 thread each), {TOKENS} tokens per rank, d={c.d_model}, d_ff={c.d_ff}, "
             f"{c.n_experts} experts, top-{c.top_k}, fp32, forward + backward, no gradient sync; rank 0's median "
             "pass, interleaved")  # fmt: skip
    return [
        {
            "name": "expert parallelism, 2 ranks: book's ExpertParallelMoE vs the same MoE unsharded on each rank",
            "ours": round(1e3 * seconds["ep"], 2),
            "reference": round(1e3 * seconds["unsharded"], 2),
            "unit": "ms",
            "ratio": seconds["ep"] / seconds["unsharded"],
            "note": f"capacity factor 1.25, same weights, same expert FLOPs per rank: the ratio is the all-to-alls' "
                    f"cost; {setup}",
        },
        {
            "name": "MoE layer, dropless: book's MoE vs a plain per-expert loop (Mixtral style)",
            "ours": round(1e3 * seconds["dropless"], 2),
            "reference": round(1e3 * seconds["plain"], 2),
            "unit": "ms",
            "ratio": seconds["dropless"] / seconds["plain"],
            "note": f"capacity_factor=None, as the GPT's --moe-experts: every expert's buffer holds all tokens, so "
                    f"the book's layer runs E/k = {c.n_experts // c.top_k}x the expert FLOPs of the loop, which runs "
                    f"each expert on its routed tokens only; outputs differ by at most {result['difference']:.1e}; "
                    f"{setup}",
        },
    ]  # fmt: skip


ENTRIES = [bench_expert_parallel]
