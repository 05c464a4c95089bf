"""Parallel training, one module per dimension, each readable in one sitting; this is what a run imports.

    dims         the layout: ParallelDims validates dp x tp x pp x cp (x ep) once, DeviceMesh builds the groups
    parallelize  parallelize(model, dims): PP split, TP/SP, CP, EP, then the data-parallel wrapper, in that order
    ddp          data parallelism: all-reduce gradients, bucketing, overlap with backward (any nn.Module)
    zero         ZeRO-1 as an optimizer wrapper (any torch.optim class); clipping and bytes over shards
    fsdp         ZeRO-2/3 as a module wrapper (fully_shard), with prefetching and hybrid sharding (HSDP)
    tensor       Megatron-style tensor parallelism applied in place (column/row-parallel layers, vocab-parallel loss)
    sequence     sequence parallelism on top of tensor parallelism
    pipeline     pipeline parallelism: a stage is a slice of the model; GPipe / 1F1B / interleaved, one runtime
    context      context parallelism: ring attention with a load-balanced causal split
    expert       expert parallelism (all-to-all dispatch and combine); the MoE layer itself is scalebook.moe
    state_dict   each rank's state as DCP reads and writes it, resharding between layouts

Every strategy runs on CPU ranks with gloo (see :func:`scalebook.comm.launch`) and on GPUs with NCCL,
and is tested against PyTorch's own implementation and against single-process training. The chapters'
timing studies and comparisons live in :mod:`scalebook.experiments`, not here.
"""

from scalebook import compat as _compat  # noqa: F401  (a PyTorch before 2.13 gets the collectives' new names)
