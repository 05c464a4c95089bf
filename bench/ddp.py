"""Data-parallel benchmarks: the book's OverlappedDDP against PyTorch's DistributedDataParallel.

Two ranks (gloo on CPU) train the same GPT from the same seed on the same batches, through Chapter 10's
one training loop (:class:`scalebook.experiments.ddp.DataParallelRun`): one step of the book's version and
one of torch DDP in turn, in an order that rotates from step to step, so that drifts in machine load hit
both alike (:func:`scalebook.experiments.ddp.compare_step_times`). Both use 25 MiB buckets. Reported: the
median step time, and the all-reduce bytes of one step, counted for both by
:func:`scalebook.comm.traffic.count_traffic` (torch DDP's through a communication hook that issues the
same all-reduces from Python). Run with ``python bench/run.py --only ddp``.
"""

from __future__ import annotations

import statistics

from scalebook.comm import launch
from scalebook.experiments.ddp import compare_step_times, run_experiments, train_data_parallel
from scalebook.model import GPTConfig
from scalebook.train import TrainConfig

SIZE, BATCH, SEQ_LEN, STEPS = "small", 4, 128, 5
VERSIONS = {"ours": "overlapped", "torch": "torch"}


def bench_ddp_step(repeats: int = 3) -> list[dict]:
    """Median step time and all-reduce bytes per step of OverlappedDDP vs torch DDP, 2 ranks, small GPT."""
    model_config = GPTConfig.named(SIZE)
    timing = TrainConfig(steps=1 + repeats * STEPS, batch_size=BATCH, seq_len=SEQ_LEN, progress=False)
    counting = TrainConfig(steps=2, batch_size=BATCH, seq_len=SEQ_LEN, progress=False)
    plan = {
        "timing": (compare_step_times, {"setups": {k: {"version": v} for k, v in VERSIONS.items()},
                                        "model_config": model_config, "train_config": timing}),
        **{k: (train_data_parallel, {"version": v, "model_config": model_config, "train_config": counting})
           for k, v in VERSIONS.items()},
    }  # fmt: skip
    result = launch(run_experiments, 2, timeout=600, **plan)[0]
    seconds = {k: statistics.median(result["timing"][k][1:]) for k in VERSIONS}  # step 0 pays one-off costs
    sent = {k: result[k]["bytes_sent"][-1] for k in VERSIONS}  # step 0: torch DDP's one provisional bucket
    setup = f"2 ranks, {SIZE} GPT, {BATCH}x{SEQ_LEN} tokens per rank, forward + backward + AdamW, 25 MiB buckets"
    return [
        {
            "name": "DDP step time, book's OverlappedDDP vs torch DistributedDataParallel",
            "ours": round(1e3 * seconds["ours"], 2),
            "reference": round(1e3 * seconds["torch"], 2),
            "unit": "ms",
            "ratio": seconds["ours"] / seconds["torch"],
            "note": f"median step, interleaved; {setup}; ratio < 1 means ours is faster",
        },
        {
            "name": "DDP all-reduce bytes per step, book's vs torch DDP",
            "ours": sent["ours"],
            "reference": sent["torch"],
            "unit": "bytes",
            "ratio": sent["ours"] / sent["torch"],
            "note": f"bytes each rank sends per step, charged per the ring algorithm; {setup}",
        },
    ]


ENTRIES = [bench_ddp_step]
