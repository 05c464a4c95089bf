"""HSDP benchmark: the book's hybrid sharding against FSDP2's, 4 ranks as 2 nodes of 2.

Four ranks (gloo, CPU, one thread each) form a 2-D ``DeviceMesh`` (replicate 2, shard 2). The book's stage 3
(:func:`scalebook.parallel.zero.fully_shard` with ``process_group`` the shard group and ``replicate_group`` the
other dimension, backward prefetch on) and ``torch.distributed.fsdp.fully_shard`` on the 2-D mesh (FSDP2's
HSDP: one unit per block and the root, ``reshard_after_forward=True``; FSDP2 prefetches the backward pass's
all-gathers by default) train the same GPT from the same seed on the same batch, one step of each in turn,
every step started on all ranks together. Reported: rank 0's median step time (forward, backward, AdamW) and
the bytes a rank sends in one step (``scalebook.comm.count_traffic``, charged the ring algorithm's cost).
Run with ``python bench/run.py --only hsdp``.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from zero import time_and_count  # bench/ is on sys.path (run.py), in the ranks too

from scalebook.comm import launch
from scalebook.experiments.zero import Recipe, wrap
from scalebook.model import GPTConfig

RECIPE = Recipe(GPTConfig.named("tiny"), steps=1, batch_size=4, seq_len=128)
NODES, GPUS_PER_NODE = 2, 2


def compare_steps(repeats: int) -> dict:
    """Worker on 4 ranks: rank 0's median step seconds (interleaved) and ring bytes sent in one step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (NODES, GPUS_PER_NODE), mesh_dim_names=("replicate", "shard"))
    groups = {"process_group": mesh.get_group("shard"), "replicate_group": mesh.get_group("replicate")}
    setups = {"ours": wrap(RECIPE.model(), "ZeRO-3", RECIPE, backward_prefetch=True, **groups),
              "torch": wrap(RECIPE.model(), "FSDP2", RECIPE, mesh=mesh)}  # fmt: skip
    return time_and_count(setups, RECIPE.batches(dist.get_rank(), dist.get_world_size())[0], repeats)


@functools.cache
def _results(repeats: int) -> dict:
    return launch(compare_steps, NODES * GPUS_PER_NODE, repeats, timeout=900)[0]


def bench_hsdp_step(repeats: int) -> list[dict]:
    """Step time and bytes sent per step of the book's HSDP vs FSDP2 on a 2-D DeviceMesh, 4 ranks."""
    result = _results(repeats)
    seconds, sent = result["seconds"], result["sent"]
    setup = (f"4 ranks as {NODES} nodes x {GPUS_PER_NODE} (gloo, CPU, 1 thread each, on this machine's cores), "
             f"tiny GPT, batch {RECIPE.batch_size}x{RECIPE.seq_len} per rank, AdamW (foreach=False both)")  # fmt: skip
    return [
        {"name": "HSDP, 4 ranks: book's stage 3 with replicate_group vs FSDP2 on a 2-D DeviceMesh, step time",
         "ours": round(1e3 * seconds["ours"], 2), "reference": round(1e3 * seconds["torch"], 2), "unit": "ms",
         "ratio": seconds["ours"] / seconds["torch"],
         "note": f"rank 0's median step, interleaved; {setup}; ratio < 1 means ours is faster"},
        {"name": "HSDP, 4 ranks: book's vs FSDP2's, bytes sent per step", "ours": round(sent["ours"]),
         "reference": round(sent["torch"]), "unit": "bytes", "ratio": sent["ours"] / sent["torch"],
         "note": f"ring cost of every collective call in one step (count_traffic), per rank; {setup}"},
    ]  # fmt: skip


ENTRIES = [bench_hsdp_step]
