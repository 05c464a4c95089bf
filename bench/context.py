"""Context-parallel benchmarks: the book's ring attention and Ulysses against PyTorch's attention, 2 ranks.

Two ranks (gloo, CPU, one thread each) hold one long sequence's queries, keys and values. Each of three
methods runs one causal attention forward and backward pass, in turn, in an order that rotates from pass to
pass (so that drifts in machine load hit all alike), every pass started on both ranks together (a barrier):

* ours, ring: :func:`scalebook.parallel.context.ring_attention` on this rank's zig-zag half of the tokens,
  K/V blocks passed round the ring, masked pairs skipped, transfers overlapped;
* ours, Ulysses: :func:`scalebook.parallel.ulysses.ulysses_attention` on the same half (two all-to-alls
  re-deal the tensors to half the heads over the whole sequence, then PyTorch's SDPA);
* reference: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` over the whole sequence
  on each rank, that is, what each rank computes without context parallelism.

Reported: rank 0's median pass, and the ratio ours / reference. Perfect splitting of the causal work over 2
ranks with free communication would give 0.5. PyTorch's own context parallelism
(``torch.distributed.tensor.experimental.context_parallel``) is tried first and is the preferred reference; in
torch 2.13 it has no CPU path (see :func:`try_torch_context_parallel`), and the entry's note says so.
Run with ``python bench/run.py --only context``.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scalebook.comm import launch
from scalebook.parallel.context import ring_attention, shard_sequence
from scalebook.parallel.ulysses import ulysses_attention

BATCH, HEADS, SEQ_LEN, HEAD_DIM = 1, 8, 2048, 64
PASSES = 3  # timed passes of each method per repeat


def try_torch_context_parallel() -> str | None:
    """On every rank: one causal SDPA pass under torch's ``context_parallel`` on a 1-D CPU mesh; None if it
    ran, else the first line of the error (the same on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
        q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as error:  # noqa: BLE001 - any failure is the answer
        lines = [line for line in str(error).splitlines() if line.strip()]
        return f"{type(error).__name__}: {lines[0] if lines else ''}"
    return None


def compare_passes(repeats: int) -> dict:
    """Worker on 2 ranks: rank 0's median seconds of one forward + backward pass of each method."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(BATCH, HEADS, SEQ_LEN, HEAD_DIM, generator=gen) for _ in range(4)]  # q, k, v, grad_out
    mine = [shard_sequence(t, cp, rank, split="zigzag") for t in full]

    def run(attention, tensors):
        q, k, v = (t.clone().requires_grad_() for t in tensors[:3])
        attention(q, k, v).backward(tensors[3])

    methods = {
        "ring": lambda: run(functools.partial(ring_attention, split="zigzag"), mine),
        "ulysses": lambda: run(functools.partial(ulysses_attention, split="zigzag"), mine),
        "sdpa": lambda: run(functools.partial(F.scaled_dot_product_attention, is_causal=True), full),
    }
    for method in methods.values():  # warm-up: first calls allocate and pick kernels
        method()
    seconds = {name: [] for name in methods}
    names = list(methods)
    for i in range(repeats * PASSES):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
            dist.barrier()
            start = time.perf_counter()
            methods[name]()
            seconds[name].append(time.perf_counter() - start)
    return {"seconds": {name: statistics.median(v) for name, v in seconds.items()},
            "torch_cp_error": try_torch_context_parallel()}  # fmt: skip


@functools.cache
def _results(repeats: int) -> dict:
    return launch(compare_passes, 2, repeats, timeout=900)[0]


def bench_context_parallel(repeats: int) -> list[dict]:
    """Forward + backward seconds of ring attention and Ulysses on 2 ranks vs SDPA over the whole sequence."""
    result = _results(repeats)
    seconds = result["seconds"]
    setup = (f"2 ranks (gloo, CPU, 1 thread each), causal attention, b={BATCH}, {HEADS} heads, s={SEQ_LEN}, "
             f"d={HEAD_DIM}, fp32, forward + backward; rank 0's median pass, interleaved")  # fmt: skip
    torch_cp = "torch's context_parallel ran on this machine but is not timed by this entry"
    if result["torch_cp_error"]:
        torch_cp = ("torch's context_parallel (the preferred reference) does not run here: "
                    f"{result['torch_cp_error']} (its ring handles only the CUDA SDPA kernels: flash, efficient, "
                    "cuDNN; CPU SDPA dispatches _scaled_dot_product_flash_attention_for_cpu)")  # fmt: skip
    reference = ("reference: torch SDPA (its fused CPU kernel) over the whole sequence on each rank, no context "
                 "parallelism; 0.5 would be a perfect 2-way split with free communication; the ring computes each "
                 "block with matmuls and an explicit softmax, Ulysses calls SDPA")  # fmt: skip
    kinds = {"ring": "ring attention (zig-zag, skip masked pairs, overlap)",
             "ulysses": "Ulysses attention (all-to-all, SDPA on half the heads)"}  # fmt: skip
    return [
        {
            "name": f"context parallelism, 2 ranks: book's {kind} vs torch SDPA over the whole sequence",
            "ours": round(1e3 * seconds[key], 2),
            "reference": round(1e3 * seconds["sdpa"], 2),
            "unit": "ms",
            "ratio": seconds[key] / seconds["sdpa"],
            "note": f"{setup}; {reference}; {torch_cp}",
        }
        for key, kind in kinds.items()
    ]


ENTRIES = [bench_context_parallel]
