"""Pipeline parallelism benchmark: the book's 1F1B runtime against ``torch.distributed.pipelining``'s Schedule1F1B.

Two ranks (gloo on CPU, NCCL where ranks have GPUs) hold the same two stages of the same GPT, once as the book
runs them (:func:`scalebook.parallel.pipeline.run_schedule`) and once wrapped in PyTorch's ``PipelineStage``; the
two take turns, one step each, so that drifts in machine load hit both alike. A step is one batch through the
1F1B schedule (forward, backward, the tied embedding's gradient summed), timed from a common start to the last
rank's end. Reported: the median step time and the point-to-point bytes each rank sends per step, counted for both
by :func:`scalebook.comm.count_traffic`. Run with ``python bench/run.py --only pipeline``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from scalebook.comm import backend_and_device, count_traffic, launch
from scalebook.data import corpus_tokens, get_batch
from scalebook.experiments.pipeline import build_stages, torch_pipelining_schedule
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.pipeline import build_schedule, run_schedule, sync_tied_embedding

SIZE, BATCH, SEQ_LEN, MICROBATCHES, STEPS = "tiny", 16, 128, 4, 5


def _ours(schedule, stages, x, y):
    return lambda: run_schedule(schedule, stages, x, y)


def _torch(schedule, stages, x, y):
    runner = torch_pipelining_schedule(stages, schedule)
    if dist.get_rank() == 0:
        return lambda: runner.step(x)
    return lambda: runner.step(target=y)


def compare_steps(repeats: int) -> dict:
    """Worker on 2 ranks: step seconds (interleaved, slowest rank) and p2p bytes sent per step, ours vs torch's."""
    rank, device = dist.get_rank(), backend_and_device(dist.get_rank())[1]
    torch.manual_seed(0)
    model = GPT(GPTConfig.named(SIZE)).to(device)
    x, y = (t.to(device) for t in get_batch(corpus_tokens(), BATCH, SEQ_LEN, torch.Generator().manual_seed(0)))
    schedule = build_schedule("1f1b", 2, MICROBATCHES)
    steps, stages, tied = {}, {}, dist.new_group([0, 1])
    for key, make in (("ours", _ours), ("torch", _torch)):
        stages[key] = build_stages(model, schedule, rank)
        steps[key] = make(schedule, stages[key], x, y)

    def step(key):
        for stage in stages[key].values():
            stage.zero_grad(set_to_none=False)
        steps[key]()
        for stage in stages[key].values():
            sync_tied_embedding(stage, tied)

    sent = {}
    for key in steps:  # a first step each: torch's stages infer their shapes, both allocate the gradients
        step(key)
        with count_traffic() as traffic:
            step(key)
        sent[key] = traffic.bytes_sent("isend")
    seconds = {key: [] for key in steps}
    for _ in range(repeats * STEPS):
        for key in steps:
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(key)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            seconds[key].append(elapsed.item())
    return {"seconds": {k: statistics.median(v) for k, v in seconds.items()}, "bytes": sent}


def bench_pipeline_1f1b_step(repeats: int) -> list[dict]:
    """Step time and p2p bytes per step of the book's 1F1B vs torch's Schedule1F1B on 2 ranks, tiny GPT."""
    result = launch(compare_steps, 2, repeats, timeout=600)[0]
    seconds, sent = result["seconds"], result["bytes"]
    setup = (f"2 ranks, {SIZE} GPT cut in 2 stages, batch {BATCH}x{SEQ_LEN} in {MICROBATCHES} micro-batches, "
             "forward + backward + the tied embedding's all-reduce")  # fmt: skip
    return [
        {
            "name": "1F1B step time, book's run_schedule vs torch.distributed.pipelining Schedule1F1B",
            "ours": round(1e3 * seconds["ours"], 2),
            "reference": round(1e3 * seconds["torch"], 2),
            "unit": "ms",
            "ratio": seconds["ours"] / seconds["torch"],
            "note": f"median step, interleaved; {setup}; ratio < 1 means ours is faster",
        },
        {
            "name": "1F1B p2p bytes sent by rank 0 per step, book's vs torch.distributed.pipelining",
            "ours": sent["ours"],
            "reference": sent["torch"],
            "unit": "bytes",
            "ratio": sent["ours"] / sent["torch"],
            "note": f"activations forward and gradients backward, counted by count_traffic; {setup}",
        },
    ]


ENTRIES = [bench_pipeline_1f1b_step]
