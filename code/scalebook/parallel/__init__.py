"""Parallel training strategies, one module per dimension, each readable in one sitting.

    ddp        data parallelism: all-reduce gradients, bucketing, overlap with backward
    zero       ZeRO stages 1-3: shard optimizer state, gradients and parameters
    tensor     Megatron-style tensor parallelism (column/row-parallel layers, vocab-parallel loss)
    sequence   sequence parallelism on top of tensor parallelism
    pipeline   pipeline parallelism: stages, GPipe / 1F1B / interleaved schedules
    context    context parallelism: ring attention with a load-balanced causal split
    expert     mixture of experts and expert parallelism (all-to-all dispatch and combine)
    mesh       N-D process groups (DP x TP x PP x CP x EP) and 3-D training

Every strategy runs on CPU ranks with gloo (see :func:`scalebook.comm.launch`) and on GPUs with NCCL,
and is tested against PyTorch's own implementation and against single-process training.
"""
