"""Tensor parallelism benchmarks: the book's TP (and TP+SP) against PyTorch's DTensor ``parallelize_module``.

Two ranks (gloo on CPU, CUDA's NCCL where ranks have GPUs) train the same GPT on the same batch, one step of the
book's version and one of DTensor's in turn, so that drifts in machine load hit both alike. Reported: the median
step time and the collective message bytes of one step, counted for both by one dispatch-mode counter (the
book's through its c10d calls, DTensor's through its functional collectives). Run with
``python bench/run.py --only tensor``.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scalebook.comm import backend_and_device, count_traffic, launch
from scalebook.data import corpus_tokens, get_batch
from scalebook.experiments.tensor import dtensor_tensor_parallel, sharded_copy
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.sequence import all_reduce_sequence_parallel_grads

SIZE, BATCH, SEQ_LEN, STEPS = "tiny", 8, 128, 5
# The collectives of c10d (the book's calls) and of the functional collectives (DTensor's); functional
# all-gathers take the local shard and the group size, the others their whole message.
COLLECTIVES = {"allreduce_", "_allgather_base_", "allgather_", "_reduce_scatter_base_", "reduce_scatter_",
               "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}  # fmt: skip
_GATHERS = ("all_gather_into_tensor",)


class CollectiveBytes(TorchDispatchMode):
    """Message bytes of every collective dispatched meanwhile: an all-gather's output, a reduce-scatter's
    input, an all-reduce's tensor, as :func:`scalebook.comm.count_traffic` counts them."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives, then see those
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace in ("c10d", "_c10d_functional") and name in COLLECTIVES:
            tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            largest = max((t.numel() * t.element_size() for t in tensors), default=0)
            self.bytes += largest * (args[1] if name in _GATHERS else 1)
        return func(*args, **(kwargs or {}))


def _step(model, optimizer, batch, sp_group) -> None:
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(*batch)
    loss.backward()
    if sp_group is not None:
        all_reduce_sequence_parallel_grads(model, sp_group)
    optimizer.step()


def compare_steps(sequence_parallel: bool, repeats: int) -> dict:
    """Worker on 2 ranks: step seconds (interleaved) and message bytes of one step, book's TP vs DTensor's."""
    device = backend_and_device(dist.get_rank())[1]
    torch.manual_seed(0)
    reference = GPT(GPTConfig.named(SIZE)).to(device)
    batch = [t.to(device) for t in get_batch(corpus_tokens(), BATCH, SEQ_LEN, torch.Generator().manual_seed(0))]
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    group = mesh.get_group()
    models = {
        "ours": sharded_copy(reference, group, sequence_parallel=sequence_parallel),
        "dtensor": dtensor_tensor_parallel(copy.deepcopy(reference), mesh, sequence_parallel=sequence_parallel),
    }
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for k, m in models.items()}
    sp_group = {"ours": group if sequence_parallel else None, "dtensor": None}  # DTensor reduces them itself
    messages = {}
    for key, model in models.items():  # the first step allocates optimizer state; count its bytes
        with CollectiveBytes() as counted, count_traffic() as traffic:
            _step(model, optimizers[key], batch, sp_group[key])
        messages[key] = counted.bytes
        if key == "ours" and counted.bytes != sum(traffic.message_bytes_by_op().values()):
            raise RuntimeError("the dispatch counter disagrees with count_traffic on the book's collectives")
    seconds = {key: [] for key in models}
    for _ in range(repeats * STEPS):
        for key, model in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            _step(model, optimizers[key], batch, sp_group[key])
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[key].append(time.perf_counter() - start)
    return {"seconds": {k: statistics.median(v) for k, v in seconds.items()}, "bytes": messages}


def bench_tensor_parallel_step(repeats: int) -> list[dict]:
    """Step time and bytes per step of the book's TP and TP+SP vs DTensor's on 2 ranks, tiny GPT."""
    entries = []
    for sp in (False, True):
        result = launch(compare_steps, 2, sp, repeats, timeout=600)[0]
        label, plans = ("TP + SP", "Colwise/Rowwise/SequenceParallel") if sp else ("TP", "Colwise/RowwiseParallel")
        setup = f"2 ranks, {SIZE} GPT, batch {BATCH}x{SEQ_LEN}, forward + backward + AdamW; DTensor shards the "
        setup += f"blocks ({plans}) and keeps the embedding and head replicated, the book's splits them by vocabulary"
        extra = "the book's version also moves the embedding's and the head's activations and 3 numbers per token"
        if sp:
            extra += ", and re-gathers each layer's two saved input shards in the backward pass (Megatron-LM's memory"
            extra += " saving; DTensor keeps the gathered inputs)"
        seconds, messages = result["seconds"], result["bytes"]
        entries += [
            {
                "name": f"{label} step time, book's vs DTensor parallelize_module",
                "ours": round(1e3 * seconds["ours"], 2),
                "reference": round(1e3 * seconds["dtensor"], 2),
                "unit": "ms",
                "ratio": seconds["ours"] / seconds["dtensor"],
                "note": f"median step, interleaved; {setup}; ratio < 1 means ours is faster",
            },
            {
                "name": f"{label} collective bytes per step, book's vs DTensor",
                "ours": messages["ours"],
                "reference": messages["dtensor"],
                "unit": "bytes",
                "ratio": messages["ours"] / messages["dtensor"],
                "note": f"message bytes handed to collectives in one step; {setup}; {extra}",
            },
        ]
    return entries


ENTRIES = [bench_tensor_parallel_step]
