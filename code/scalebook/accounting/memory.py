"""Bytes a training run keeps on each device: model states, and the activations saved for backward.

Model states, bytes per parameter (Psi parameters in all):

    precision            parameters   gradients      optimizer with Adam                  total
    "fp32"               4            4              m 4 + v 4                            16
    "mixed"              2 (bf16)     2              fp32 master 4 + m 4 + v 4 (K = 12)   16
    "mixed-fp32-grads"   2            2 + 4 (fp32)   fp32 master 4 + m 4 + v 4            20

``optimizer="sgd"`` keeps no state (a mixed-precision run still keeps its fp32 master copy, K = 4);
``"sgd-momentum"`` keeps one fp32 buffer. The fp32 master copy counts as optimizer state, as in the
ZeRO paper's K. "mixed-fp32-grads" accumulates gradients in fp32 beside the 16-bit ones, as Nanotron
does; its extra buffer is a gradient, so ZeRO-2 shards it.

ZeRO-DP over N_d data-parallel ranks removes the replication stage by stage (ZeRO paper, Fig. 1):

    stage 0:  (2 + 2 + K) Psi                stage 2:  2 Psi + (2 + K) Psi / N_d
    stage 1:  (2 + 2) Psi + K Psi / N_d      stage 3:  (2 + 2 + K) Psi / N_d

Tensor and pipeline parallelism split the model itself, so tp * pp divides every term.

DDP's buckets (Li et al. 2020): torch DDP all-reduces flat bucket buffers that it keeps beside ``.grad``
by default, one more copy of the gradients it reduces, in their dtype, on every replica:

    DDP bucket copy = g Psi      g = 4 ("fp32", "mixed-fp32-grads": the fp32 gradients are reduced), 2 ("mixed")

and 0 with ``gradient_as_bucket_view=True``, under which ``.grad`` is a view of the buckets. It is opt-in
(``ddp_bucket_copy=True``) and exists at ZeRO stages 0 and 1 (DDP, or DDP with a sharded optimizer); stages
2 and 3 reduce-scatter the gradients instead.

Activations saved per Transformer layer, 16-bit, sequence s, micro-batch b, width h, heads a, tensor
parallel degree t, in Korthikanti et al.'s bookkeeping (the tensors backward needs; a norm's per-token
statistics and attention's per-row log-sum-exp are left out). For their GPT-3 layer (multi-head
attention, 4h GELU MLP, dropout; Sec. 4 and Table 2):

    no parallelism                     s b h (34 + 5 a s / h)
    tensor parallel                    s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel         s b h / t (34 + 5 a s / h)
    selective recomputation            the 5 a s / h term is recomputed, not stored
    full recomputation                 only the layer input, 2 s b h (divided by t under SP)

The same bookkeeping for any layer of width d_ff and key/value width d_kv, without dropout:

    s b (12 h + 4 d_kv + m d_ff) + 2 a s^2 b,     m = 4 (GELU: its input and W2's input)
                                                  m = 8 (SwiGLU: gate, up, SiLU output, their product)

12 h: the two norm inputs, the QKV input, Q, the output projection's input, the MLP input. Explicit
attention saves the a s^2 scores and, as Hugging Face's eager path and Megatron-LM's unfused one do,
keeps K and V repeated to all a heads (d_kv -> h); fused attention (FlashAttention) and selective
recomputation keep K and V at d_kv and no scores. A GPT layer (d_kv = h, d_ff = 4h) gives 32 s b h, and
dropout adds its two 1-byte s b h masks: 34. Llama 3 8B's layer (d_kv = h/4, d_ff = 3.5h) is 41 s b h.

Measured on this package's Llama layer (:mod:`scalebook.llama`, fp32, SDPA), the formula's fused-attention
count holds exactly up to three named extras: attention's log-sum-exp (a s b numbers), each norm's per-token
statistic, and, because an RMSNorm written out in PyTorch (Hugging Face's and Meta's) is not one fused kernel,
each norm's normalized tensor before its weight: 2 s b h more per layer. A fused norm (Apex, Transformer
Engine, ``torch.compile``) keeps only its input, as the formula assumes.

At inference nothing is saved for backward, but decoding keeps every layer's keys and values of every
position so far, the KV cache:

    kv_cache_bytes = 2 L n_kv d_head s b x bytes per element      (K and V, L layers, n_kv heads)

n_kv = a is multi-head attention, n_kv < a grouped-query attention (Llama 3: 8), n_kv = 1 multi-query.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", Sec. 3 and Fig. 1; Li et al. 2020, "PyTorch Distributed" (VLDB), Sec. 3.2 (buckets), and PyTorch's
``DistributedDataParallel(gradient_as_bucket_view=...)``; Tazi et al. 2025, "The Ultra-Scale Playbook", "Memory usage in
Transformers"; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models";
Dao et al. 2022, "FlashAttention" (what a fused kernel keeps); Ainslie et al. 2023, "GQA"; Pope et al.
2023, "Efficiently Scaling Transformer Inference" (the KV cache); Megatron-LM
``megatron/core/transformer/dot_product_attention.py`` (K and V repeated per query group).
"""

from __future__ import annotations

from dataclasses import dataclass

from scalebook.accounting import _checks
from scalebook.accounting.params import params_of
from scalebook.configs import ModelConfig

PRECISIONS = ("fp32", "mixed", "mixed-fp32-grads")
OPTIMIZERS = ("adam", "sgd", "sgd-momentum")
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("explicit", "fused")

# (row, bytes per parameter, kind); a kind is sharded over dp from ZeRO stage _SHARDED_FROM[kind] on.
_MASTER = (("fp32 master parameters", 4, "optimizer"),)
_PRECISION_ROWS = {
    "fp32": ((), (("fp32 parameters", 4, "params"), ("fp32 gradients", 4, "grads"))),
    "mixed": (_MASTER, (("16-bit parameters", 2, "params"), ("16-bit gradients", 2, "grads"))),
    "mixed-fp32-grads": (
        _MASTER,
        (
            ("16-bit parameters", 2, "params"),
            ("16-bit gradients", 2, "grads"),
            ("fp32 gradients", 4, "grads"),
        ),
    ),
}
_OPTIMIZER_ROWS = {
    "adam": (("Adam first moment", 4, "optimizer"), ("Adam second moment", 4, "optimizer")),
    "sgd": (),
    "sgd-momentum": (("SGD momentum", 4, "optimizer"),),
}
_SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}
# DDP's flat buckets beside .grad: bytes per parameter of the gradients it all-reduces.
_DDP_BUCKET_BYTES = {"fp32": 4, "mixed": 2, "mixed-fp32-grads": 4}
DDP_BUCKET_ROW = "DDP bucket buffers (second gradient copy)"


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state on one device, by kind, with the finer rows in ``detail``."""

    params: int
    grads: int
    optimizer: int
    detail: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def rows(self) -> list[tuple[str, int]]:
        """(what, bytes) for every buffer: optimizer state first, then parameters, then gradients."""
        return list(self.detail)


def model_state_bytes(
    n_params: ModelConfig | float,
    *,
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    precision: str = "mixed",
    optimizer: str = "adam",
    ddp_bucket_copy: bool = False,
) -> ModelStateBytes:
    """Parameters, gradients and optimizer state held per device (``n_params``: a count or a ModelConfig).

    With ``ddp_bucket_copy``, one more gradient row: torch DDP's buckets kept beside ``.grad`` (its default,
    ``gradient_as_bucket_view=False``), at ZeRO stage 0 or 1; leave it False for ``gradient_as_bucket_view=True``.
    """
    _checks.require(
        _checks.model_or_count(n_params),
        _checks.one_of("zero_stage", zero_stage, ZERO_STAGES),
        _checks.parallel_layout(n_params, dp=dp, tp=tp, pp=pp),
        _checks.one_of("precision", precision, PRECISIONS),
        _checks.one_of("optimizer", optimizer, OPTIMIZERS),
        _checks.boolean(ddp_bucket_copy=ddp_bucket_copy),
        _ddp_buckets_exist(zero_stage) if ddp_bucket_copy is True else [],
    )
    n = params_of(n_params)
    master, weights = _PRECISION_ROWS[precision]
    rows = master + _OPTIMIZER_ROWS[optimizer] + weights
    if ddp_bucket_copy:
        rows += ((DDP_BUCKET_ROW, _DDP_BUCKET_BYTES[precision], "grads"),)
    by_kind = {"params": 0, "grads": 0, "optimizer": 0}
    detail = []
    for label, bytes_per_param, kind in rows:
        shards = tp * pp * (dp if zero_stage >= _SHARDED_FROM[kind] else 1)
        held = -(-n * bytes_per_param // shards)  # ceil: the device with the largest shard
        by_kind[kind] += held
        detail.append((label, held))
    return ModelStateBytes(**by_kind, detail=tuple(detail))


def _ddp_buckets_exist(zero_stage) -> list[str]:
    if zero_stage in (2, 3):
        return [
            f"ddp_bucket_copy counts DDP's all-reduce buckets, which ZeRO stage {zero_stage} does not keep (it "
            "reduce-scatters the gradients): use zero_stage 0 or 1, or ddp_bucket_copy=False"
        ]
    return []


def activation_bytes(
    cfg: ModelConfig,
    *,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    attention: str = "explicit",
    dtype_bytes: int = 2,
    dropout: bool = True,
) -> int:
    """Activation bytes saved for the backward pass on one device, summed over all layers.

    Exact, in Korthikanti et al.'s bookkeeping, for the GPT layout (LayerNorm, GELU MLP) and the Llama
    layout (RMSNorm, grouped-query attention, SwiGLU MLP): the MLP and the key/value widths come from
    ``cfg``. ``attention="fused"`` (FlashAttention) stores no scores, the bytes of selective
    recomputation. ``dropout=False`` removes the two 1-byte masks per s b h and the attention dropout's
    mask and output, as for a model trained without dropout. Not counted: the embedding output, the
    final norm, the logits and the loss. Under 1F1B pipeline parallelism the first stage holds L/p
    layers for p micro-batches in flight, so this all-layer figure is also that stage's.
    """
    _checks.require(
        _checks.model_config(cfg),
        _checks.positive_int(seq_len=seq_len, micro_batch=micro_batch, dtype_bytes=dtype_bytes),
        _checks.parallel_layout(cfg, tp=tp, sp=sp, seq_len=seq_len),
        _checks.one_of("sp", sp, (False, True)),
        _checks.one_of("recompute", recompute, RECOMPUTE),
        _checks.one_of("attention", attention, ATTENTION),
    )
    s, b, h, a, t = seq_len, micro_batch, cfg.d_model, cfg.n_heads, tp
    seq_shard = s // t if sp else s  # SP splits the sequence of the otherwise replicated tensors
    if recompute == "full":
        # Only each layer's input is kept: 2 s b h (16-bit), / t with SP.
        return cfg.n_layers * seq_shard * b * h * dtype_bytes
    mask = 1 if dropout else 0
    # Replicated across TP ranks: the two norm inputs, the QKV input and the MLP input (4 s b h
    # elements), plus the dropout masks after attention and after the MLP (1 byte each): 10 s b h at 16 bit.
    replicated = seq_shard * b * h * (4 * dtype_bytes + 2 * mask)
    # Split by TP: Q and the output projection's input (2 s b h), K and V (2 s b d_kv; explicit attention
    # keeps them repeated to all heads, 2 s b h), and the MLP's hidden tensors, m s b d_ff: GELU keeps
    # its input and the second linear's input (m = 2), SwiGLU the gate and up outputs, the SiLU output
    # and the product (m = 4). GPT: 12 s b h elements, 24 s b h / t bytes at 16 bit.
    scores_kept = attention == "explicit" and recompute == "none"
    kv_width = h if scores_kept else cfg.d_kv
    mlp_tensors = 4 if cfg.mlp == "swiglu" else 2
    d_ff_shard = -(-cfg.d_ff // t)  # the largest shard
    split = s * b * (2 * (h // t) + 2 * (kv_width // t) + mlp_tensors * d_ff_shard) * dtype_bytes
    # Attention scores per head: softmax output, dropout mask (1 byte) and dropout output: 5 a s^2 b / t
    # bytes at 16 bit. Fused attention never stores them; selective recomputation recomputes them.
    bytes_per_score = dtype_bytes + mask * (1 + dtype_bytes)
    scores = (a // t) * s * s * b * bytes_per_score if scores_kept else 0
    return cfg.n_layers * (replicated + split + scores)


def kv_cache_bytes(
    cfg: ModelConfig, *, seq_len: int, batch: int = 1, dtype_bytes: int = 2, n_kv_heads: int | None = None
) -> int:
    """Bytes of the KV cache for ``batch`` sequences of ``seq_len`` positions: 2 L n_kv d_head s b x bytes.

    ``n_kv_heads`` overrides the config's key/value heads: ``cfg.n_heads`` gives the multi-head (MHA) cache
    of the same model, 1 the multi-query (MQA) one. ``dtype_bytes``: 2 for bf16, 1 for fp8.
    """
    _checks.require(_checks.model_config(cfg))
    n_kv = cfg.n_kv_heads if n_kv_heads is None else n_kv_heads
    _checks.require(
        _checks.positive_int(seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes, n_kv_heads=n_kv),
        [] if isinstance(n_kv, bool) or not isinstance(n_kv, int) or n_kv < 1 or cfg.n_heads % n_kv == 0 else [
            f"n_kv_heads ({n_kv}) must divide n_heads ({cfg.n_heads}) of {cfg.name}: every key/value head "
            "serves the same number of query heads"],
    )  # fmt: skip
    return 2 * cfg.n_layers * n_kv * cfg.d_head * seq_len * batch * dtype_bytes
