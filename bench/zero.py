"""ZeRO benchmarks: the book's stages against PyTorch's, same GPT, ranks and batch, in one run.

Two ranks (gloo, CPU) hold one model per method and take one training step of each in turn, so that drifts
in machine load hit all alike: our ZeRO-1 behind DDP vs ``ZeroRedundancyOptimizer`` behind DDP, our stage 2
vs FSDP2 with ``reshard_after_forward=False`` (the same traffic), our stage 3 vs FSDP2. Reported: the median
step time (forward, backward, AdamW) and the bytes a rank sends in one step (every collective call recorded by
``scalebook.comm.count_traffic``, charged the ring algorithm's cost). Run with
``python bench/run.py --only zero``.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch.distributed as dist

from scalebook.comm import count_traffic, launch
from scalebook.experiments.zero import Recipe, wrap
from scalebook.model import GPTConfig

RECIPE = Recipe(GPTConfig.named("tiny"), steps=1, batch_size=8, seq_len=128)
SIDES = ("ours", "torch")
STEPS = 5  # timed steps of each method per repeat
PAIRS = {  # entry name: (ours, PyTorch's), each (method, options) for scalebook.experiments.zero.wrap
    "ZeRO-1 (behind DDP) vs ZeroRedundancyOptimizer": (("ZeRO-1 on DDP", {}), ("ZeroRedundancyOptimizer", {})),
    "ZeRO-2 vs FSDP2 reshard_after_forward=False": (("ZeRO-2", {}), ("FSDP2", {"reshard_after_forward": False})),
    "ZeRO-3 vs FSDP2": (("ZeRO-3", {}), ("FSDP2", {"reshard_after_forward": True})),
}


def time_and_count(setups: dict, batch, repeats: int) -> dict:
    """Rank's median step seconds (every setup in turn, the order rotated each round) and the ring bytes it sends
    in one step, for ``setups`` (key: (module, optimizer)) training on ``batch`` (x, y). Shared with hsdp.py."""
    x, y = batch

    def step(module, optimizer):
        _, loss = module(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    sent = {}
    for key, (module, optimizer) in setups.items():
        step(module, optimizer)  # allocates the optimizer state (and runs FSDP2's lazy initialisation)
        with count_traffic() as traffic:
            step(module, optimizer)
        sent[key] = traffic.bytes_sent()
    seconds, keys = {key: [] for key in setups}, list(setups)
    for i in range(repeats * STEPS):
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:  # rotate which goes first
            dist.barrier()  # every rank starts together: a step's time includes waiting for the slowest rank
            start = time.perf_counter()
            step(*setups[key])
            seconds[key].append(time.perf_counter() - start)
    return {"seconds": {key: statistics.median(v) for key, v in seconds.items()}, "sent": sent}


def compare_steps(repeats: int) -> dict:
    """Worker on 2 ranks: median step seconds (interleaved) and ring bytes sent in one step, for every method."""
    methods = {(name, side): method for name, pair in PAIRS.items() for side, method in zip(SIDES, pair, strict=True)}
    setups = {key: wrap(RECIPE.model(), method, RECIPE, **options) for key, (method, options) in methods.items()}
    return time_and_count(setups, RECIPE.batches(dist.get_rank(), dist.get_world_size())[0], repeats)


@functools.cache
def _results(repeats: int) -> dict:
    return launch(compare_steps, 2, repeats, timeout=600)[0]


def bench_zero_step(repeats: int) -> list[dict]:
    """Step time and bytes sent per step of our ZeRO-1/2/3 vs ZeroRedundancyOptimizer and FSDP2, 2 ranks."""
    result = _results(repeats)
    setup = f"2 ranks (gloo, CPU), tiny GPT, batch {RECIPE.batch_size}x{RECIPE.seq_len} per rank, AdamW"
    entries = []
    for name in PAIRS:
        seconds = {side: result["seconds"][(name, side)] for side in SIDES}
        sent = {side: result["sent"][(name, side)] for side in SIDES}
        entries += [
            {"name": f"{name}, step time", "ours": round(1e3 * seconds["ours"], 2),
             "reference": round(1e3 * seconds["torch"], 2), "unit": "ms", "ratio": seconds["ours"] / seconds["torch"],
             "note": f"median step, interleaved; {setup}; ratio < 1 means ours is faster"},
            {"name": f"{name}, bytes sent per step", "ours": round(sent["ours"]), "reference": round(sent["torch"]),
             "unit": "bytes", "ratio": sent["ours"] / sent["torch"],
             "note": f"ring cost of every collective call in one step (count_traffic; DDP counted through its "
                     f"default all-reduce hook); {setup}"},
        ]  # fmt: skip
    return entries


ENTRIES = [bench_zero_step]
