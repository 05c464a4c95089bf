"""Closed-form accounting for training a Transformer: parameters, bytes, FLOPs and time.

Pure Python (no torch), so a notebook, the planner or a widget can ask "how many bytes, how many
FLOPs, how many days" instantly; ``scalebook.measure`` supplies the measured counterparts that the
chapters check these numbers against.

    params   param_count, param_breakdown, param_count_closed_form, active_param_count (MoE),
             layer_weights, mtp_param_count
    memory   model_state_bytes (ZeRO, mixed precision), activation_bytes (Korthikanti et al., GPT and Llama layers),
             kv_cache_bytes (inference)
    flops    flops_per_token, training_flops (6 N D), training_flops_with_attention (Narayanan et al.),
             attention_flop_share (full and causal), mtp_flops_per_token (DeepSeek-V3's multi-token prediction)
    time     mfu, training_days, devices_needed
    comm     bytes_sent_per_rank, alpha_beta_time, ring_latency, data_parallel_bytes_per_step,
             tensor_parallel_bytes_per_layer, parameter_server_bytes_per_step, parameter_server_time,
             algbw, busbw, busbw_factor, seconds_at_busbw (nccl-tests' bandwidths)
    pipeline bubble_fraction, peak_in_flight, p2p_bytes_per_step, balanced_partition, stage_memory
    async_tp chunked_overlap_time, async_tp_layer_times (communication hidden under decomposed matmuls)
    context  ring_attention_bytes_per_rank, ulysses_bytes_per_rank, kv_allgather_bytes_per_rank, ulysses_problems,
             ring_overlap_min_tokens (context parallelism: ring attention, Ulysses, Llama 3's K/V all-gather)
    precision format_bytes (fp8 with its scales), deepseek_v3_state_bytes
    roofline gpt_layer_ops, matmul_cost, ridge_point, attainable_flops, memory_bound (arithmetic intensity)

Source: Rajbhandari et al. 2020 (ZeRO); Korthikanti et al. 2022 (activation recomputation);
Kaplan et al. 2020 and Narayanan et al. 2021 (FLOPs); Chowdhery et al. 2022 (MFU).
"""

from scalebook.accounting.comm import (
    algbw,
    alpha_beta_time,
    busbw,
    busbw_factor,
    bytes_sent_per_rank,
    data_parallel_bytes_per_step,
    parameter_server_bytes_per_step,
    parameter_server_time,
    ring_latency,
    seconds_at_busbw,
    tensor_parallel_bytes_per_layer,
)
from scalebook.accounting.context import (
    kv_allgather_bytes_per_rank,
    ring_attention_bytes_per_rank,
    ring_overlap_min_tokens,
    ulysses_bytes_per_rank,
    ulysses_problems,
)
from scalebook.accounting.flops import (
    attention_flop_share,
    flops_per_token,
    mtp_flops_per_token,
    training_flops,
    training_flops_with_attention,
)
from scalebook.accounting.memory import (
    ATTENTION,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE,
    ZERO_STAGES,
    ModelStateBytes,
    activation_bytes,
    kv_cache_bytes,
    model_state_bytes,
)
from scalebook.accounting.params import (
    active_param_count,
    layer_weights,
    mtp_param_count,
    param_breakdown,
    param_count,
    param_count_closed_form,
)
from scalebook.accounting.pipeline import bubble_fraction
from scalebook.accounting.precision import deepseek_v3_state_bytes, format_bytes
from scalebook.accounting.time import devices_needed, mfu, training_days

__all__ = [
    "ATTENTION",
    "OPTIMIZERS",
    "PRECISIONS",
    "RECOMPUTE",
    "ZERO_STAGES",
    "ModelStateBytes",
    "activation_bytes",
    "active_param_count",
    "algbw",
    "alpha_beta_time",
    "bubble_fraction",
    "busbw",
    "busbw_factor",
    "bytes_sent_per_rank",
    "data_parallel_bytes_per_step",
    "deepseek_v3_state_bytes",
    "devices_needed",
    "attention_flop_share",
    "flops_per_token",
    "format_bytes",
    "kv_cache_bytes",
    "layer_weights",
    "mfu",
    "model_state_bytes",
    "mtp_flops_per_token",
    "mtp_param_count",
    "param_breakdown",
    "param_count",
    "param_count_closed_form",
    "parameter_server_bytes_per_step",
    "parameter_server_time",
    "ring_attention_bytes_per_rank",
    "kv_allgather_bytes_per_rank",
    "ring_overlap_min_tokens",
    "seconds_at_busbw",
    "tensor_parallel_bytes_per_layer",
    "training_days",
    "training_flops",
    "training_flops_with_attention",
    "ulysses_bytes_per_rank",
    "ulysses_problems",
    "ring_latency",
]
