"""Memory per GPU, by kind, on the busiest GPU of a layout: what decides whether it fits.

- **states**: parameters, gradients and Adam state of the first stage's layers (the embedding with them), by
  ZeRO stage (:func:`scalebook.accounting.memory.model_state_bytes`), mixed precision (16 bytes per
  parameter before sharding: gradients counted in bf16); routed experts are split ``ep`` ways and sharded over
  their ``dp cp / ep`` replicas. Not counted: a run that accumulates unsharded gradients in fp32 (Megatron's
  ``main_grad``; Llama 3 says it does) holds 2 more bytes per parameter of its stage, 7 GB for Llama 3's.
- **activations**: :func:`layer_activation_bytes` (Korthikanti et al.'s count, the one in
  :func:`scalebook.accounting.memory.activation_bytes`, less what the kernels below do not keep) for each of the
  stage's layers, times the micro-batches the
  busiest stage holds in flight (:func:`scalebook.accounting.pipeline.peak_in_flight`, Megatron-LM's warm-up
  count; an interleaved rank holds chunks of ``layers / v`` layers each; DualPipe holds ``p + 1``). This is not
  an overcount: with ``m = p`` micro-batches Megatron's interleaved warm-up, ``2 (p - r - 1) + (v - 1) p``
  chunks, covers all ``v m`` chunks on the first ranks, so they hold every micro-batch's activations of all
  their layers, as non-interleaved 1F1B's first stage does (Llama 3's 16,384-GPU layout: 16 micro-batches of
  8 layers). The count assumes the busiest stage holds the most layers of any (Llama 3 gives its first and last
  stage one layer fewer; the ranks just after the first hold as many micro-batches and a full share). What a layer
  keeps for its backward, per token, in 16-bit elements (``a`` is ``h / t`` under sequence parallelism, else
  ``h``; no dropout):

  * the inputs of its two norms, ``2 a``, always;
  * the norms' outputs (the inputs of the QKV and MLP matmuls), ``2 a``, unless recomputation is
    ``selective``: then they are recomputed from the saved inputs in the backward (Megatron-Core's
    ``--recompute-modules layernorm``; what PyTorch's compiler does with cheap pointwise results);
  * Q and the attention output, ``2 h / t``; K and V, ``2 d_kv / t`` (explicit attention without
    recomputation keeps them repeated to all heads, and its ``n_h s^2 / t`` scores);
  * the MLP's hidden tensors: GELU's input and output, ``2 d_ff / t``; SwiGLU's gate and up projections and
    their product, ``3 d_ff / t``: the fused SwiGLU kernel saves only its input (gate and up) and recomputes
    the SiLU in its backward, and the down projection saves the product (four tensors would also count the
    SiLU output, which no fused kernel keeps). ``selective`` recomputes the activation's output from its
    input as well (Megatron-Core's ``moe_act`` for experts; PyTorch's compiler for every pointwise op),
    leaving ``d_ff / t`` (GELU) or ``2 d_ff / t`` (SwiGLU);
  * with ``full`` recomputation, only the layer's input, ``a``.

  A MoE layer is counted with its dense MLP's width (the routed copies' hidden tensors are not modelled).
  These recomputations cost one pointwise pass each in the backward
  (:func:`scalebook.system.compute.rematerialized_bytes`), charged in the step time.
- **logits**: the fp32 logits of one micro-batch and their gradient, ``2 x 4 b s V / (t cp)`` bytes, counted
  on the busiest GPU only when there is one stage (the last stage holds fewer activations than the first).
- **temporary**: two gathered or transposed copies of one layer's bf16 weights, and one fp32 copy of the
  micro-batch's residual stream.
- **runtime**: the CUDA context, NCCL's buffers and the kernels' workspaces, 1.5 GB (a stated allowance).
- **fragmentation**: 5 % of the allocated total (PyTorch's caching allocator; more without expandable
  segments), stated, not measured.

Source: Rajbhandari et al. 2020 (ZeRO); Korthikanti et al. 2022 (activations); Narayanan et al. 2021, Sec. 2.2
(in-flight micro-batches); Megatron-LM ``megatron/core/pipeline_parallel/schedules.py`` (interleaved warm-up) and
``--recompute-modules`` (selective recomputation of ``layernorm``, ``moe_act``, ``core_attn``); Grattafiori et al.
2024, Sec. 3.3.2 (8K sequences trained without activation checkpointing; FP32 gradient accumulation); PyTorch
documentation, "CUDA semantics: memory management" (caching allocator).
"""

from __future__ import annotations

from scalebook.accounting.memory import activation_bytes, model_state_bytes
from scalebook.accounting.params import layer_weights
from scalebook.accounting.pipeline import peak_in_flight
from scalebook.configs import ModelConfig
from scalebook.system.layout import TrainingLayout
from scalebook.system.step import stage_params

RUNTIME_BYTES = 1.5e9
FRAGMENTATION = 0.05


def layer_activation_bytes(cfg: ModelConfig, lay: TrainingLayout, *, seq_len: int) -> float:
    """Bytes one layer keeps for its backward on one GPU for one micro-batch (the inventory in the module
    docstring): ``micro_batch * seq_len / cp`` tokens, 16-bit tensors, no dropout.

    Korthikanti et al.'s bookkeeping, :func:`scalebook.accounting.memory.activation_bytes` (one layer of it, at
    the ``seq_len / cp`` tokens a context-parallel rank holds, without dropout), less what this model's kernels
    do not keep: the SiLU output (a fused SwiGLU saves gate and up, and the down projection the product) and,
    under ``selective``, the two norm outputs and the MLP activation's output. Explicit attention kept without
    recomputation scores the local queries against all ``seq_len`` keys."""
    n, h, t, local = lay.micro_batch * seq_len // lay.cp, cfg.d_model, lay.tp, seq_len // lay.cp
    korthikanti = (
        activation_bytes(
            cfg,
            seq_len=local,
            micro_batch=lay.micro_batch,
            tp=t,
            sp=lay.sp,
            recompute=lay.recompute,
            attention=lay.attention,
            dropout=False,
        )
        / cfg.n_layers
    )
    if lay.recompute == "full":
        return korthikanti
    a = h / t if lay.sp and t > 1 else h
    d_ff = -(-cfg.d_ff // t)
    dropped = (d_ff if cfg.mlp == "swiglu" else 0) + ((2 * a + d_ff) if lay.recompute == "selective" else 0)
    keys_elsewhere = 0
    if lay.attention == "explicit" and lay.recompute == "none":
        keys_elsewhere = (cfg.n_heads // t) * local * (seq_len - local) * lay.micro_batch
    return korthikanti + 2 * (keys_elsewhere - n * dropped)


def memory_by_kind(
    cfg: ModelConfig, lay: TrainingLayout, *, seq_len: int, layers: int, microbatches: int
) -> dict[str, float]:
    """Bytes on the busiest GPU by kind (see the module docstring), for a stage of ``layers`` layers."""
    dense, expert = stage_params(cfg, layers)
    states = model_state_bytes(dense, zero_stage=lay.zero_stage, dp=lay.dp * lay.cp, tp=lay.tp).total
    if expert:
        states += model_state_bytes(
            expert, zero_stage=lay.zero_stage, dp=max(1, lay.dp * lay.cp // lay.ep), tp=lay.tp * lay.ep
        ).total
    n = lay.micro_batch * seq_len // lay.cp
    per_layer = layer_activation_bytes(cfg, lay, seq_len=seq_len)
    if lay.pp == 1:
        in_flight = 1
    elif lay.schedule == "dualpipe":
        in_flight = min(lay.pp + 1, 2 * microbatches)
    else:
        schedule = "interleaved" if lay.virtual_stages > 1 else lay.schedule
        in_flight = peak_in_flight(schedule, lay.pp, microbatches, 0, virtual_stages=lay.virtual_stages)
        in_flight = in_flight / lay.virtual_stages  # chunks hold layers / v each
    kinds = {
        "states": float(states),
        "activations": per_layer * layers * in_flight,
        "logits": 2 * 4 * n * cfg.vocab_size / lay.tp if lay.pp == 1 else 0.0,
        "temporary": 2 * 2 * layer_weights(cfg, cfg.n_layers - 1) / (lay.tp * lay.ep) + 4 * n * cfg.d_model,
        "runtime": RUNTIME_BYTES,
    }
    kinds["fragmentation"] = FRAGMENTATION * sum(kinds.values())
    return kinds
