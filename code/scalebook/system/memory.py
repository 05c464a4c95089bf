"""Memory per GPU, by kind, on the busiest GPU of a layout: what decides whether it fits.

- **states**: parameters, gradients and Adam state of the first stage's layers (the embedding with them), by
  ZeRO stage (:func:`scalebook.accounting.memory.model_state_bytes`), mixed precision (16 bytes per
  parameter before sharding); routed experts are split ``ep`` ways and sharded over their ``dp cp / ep``
  replicas.
- **activations**: :func:`scalebook.accounting.memory.activation_bytes` for the stage's layers, fused or
  explicit attention, with the recomputation and sequence parallelism of the layout, without dropout, times the
  micro-batches the first stage holds in flight (:func:`scalebook.accounting.pipeline.peak_in_flight`; DualPipe
  holds ``p + 1``). A MoE layer is counted with its dense MLP's width (the routed copies' hidden tensors are
  not modelled).
- **logits**: the fp32 logits of one micro-batch and their gradient, ``2 x 4 b s V / (t cp)`` bytes, counted
  on the busiest GPU only when there is one stage (the last stage holds fewer activations than the first).
- **temporary**: two gathered or transposed copies of one layer's bf16 weights, and one fp32 copy of the
  micro-batch's residual stream.
- **runtime**: the CUDA context, NCCL's buffers and the kernels' workspaces, 1.5 GB (a stated allowance).
- **fragmentation**: 5 % of the allocated total (PyTorch's caching allocator; more without expandable
  segments), stated, not measured.

Source: Rajbhandari et al. 2020 (ZeRO); Korthikanti et al. 2022 (activations); Narayanan et al. 2021, Sec. 2.2
(in-flight micro-batches); PyTorch documentation, "CUDA semantics: memory management" (caching allocator).
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
    per_layer = (
        activation_bytes(
            cfg,
            seq_len=seq_len // lay.cp,
            micro_batch=lay.micro_batch,
            tp=lay.tp,
            sp=lay.sp and lay.tp > 1,
            recompute=lay.recompute,
            attention=lay.attention,
            dropout=False,
        )
        / cfg.n_layers
    )
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
