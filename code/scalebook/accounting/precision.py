"""Bytes of tensors in each floating-point format, and what fp8 training saves in memory and communication.

A tensor of n elements in a 16- or 32-bit format takes n times 2 or 4 bytes. An fp8 tensor takes n bytes
plus its fp32 scales (4 bytes each): one per tensor with tensorwise scaling (torchao), one per block with
DeepSeek-V3's fine-grained scaling,

    fp8 bytes = n + 4 ceil(rows / r) ceil(cols / c)     (r x c blocks: 1 x 128 activation tiles,
                                                         128 x 128 weight blocks)

so a 1 x 128 tile costs 1 + 4/128 bytes per value, a 128 x 128 block 1 + 4/128^2: half of bf16, plus 3 %
or 0.02 %. Where fp8 training uses it:

- the weights a matmul reads (cast from the master copy per step: transient, 1 byte instead of 2);
- the inputs of linear layers saved for backward (DeepSeek-V3 caches them in fp8 with 1 x 128 tiles);
- FSDP's parameter all-gathers (torchao's fp8 all-gather, DeepSeek-V3's fp8 MoE dispatch): half the
  bytes of a bf16 gather, per rank (n-1)/n M per gather (``accounting.comm.bytes_sent_per_rank``).

What stays in higher precision: the master weights (fp32), the gradients that accumulate over
micro-batches (fp32), and the optimizer moments (DeepSeek-V3 keeps Adam's two moments in bf16: 12 bytes
per parameter, against 16 for bf16 mixed precision with fp32 moments, ``model_state_bytes``);
embeddings, norms, the output head and attention's softmax stay in bf16 or fp32 in both recipes.

Source: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 3.3 ("Low-precision storage and
communication"); torchao ``float8`` README (tensorwise scaling, ``enable_fsdp_float8_all_gather``);
Micikevicius et al. 2022, "FP8 Formats for Deep Learning".
"""

from __future__ import annotations

from scalebook.accounting import _checks
from scalebook.accounting.params import params_of
from scalebook.configs import ModelConfig

BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8-e4m3": 1, "fp8-e5m2": 1}
SCALE_BYTES = 4  # one fp32 scale per fp8 tensor or block

# DeepSeek-V3's model states per parameter (Sec. 3.3.3): fp32 master weights and gradients, bf16 moments.
DEEPSEEK_V3_STATES = (
    ("fp32 master weights", 4),
    ("fp32 gradients", 4),
    ("Adam first moment (bf16)", 2),
    ("Adam second moment (bf16)", 2),
)


def _shape_problems(shape, block) -> list[str]:
    def ints(values, least):
        return isinstance(values, (tuple, list)) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= least for v in values
        )

    if not (ints(shape, 0) and shape):
        return [f"shape must be a tuple of integers >= 0, got {shape!r}"]
    if block is not None and not (ints(block, 1) and len(block) == len(shape)):
        return [f"block must be None (one scale per tensor) or one integer >= 1 per dimension of {shape!r}"]
    return []


def format_bytes(shape: tuple[int, ...], fmt: str = "bf16", *, block: tuple[int, ...] | None = None) -> int:
    """Bytes of a ``shape`` tensor in format ``fmt``; an fp8 tensor adds one fp32 scale per ``block``.

    ``block=None`` is one scale per tensor (fp8) or none (16 and 32 bit, where ``block`` must be None).
    """
    _checks.require(
        _checks.one_of("fmt", fmt, tuple(BYTES_PER_ELEMENT)),
        _shape_problems(shape, block),
        [] if block is None or BYTES_PER_ELEMENT.get(fmt) == 1 else [f"only fp8 tensors carry scales; "
                                                                      f"use block=None for {fmt}"],
    )  # fmt: skip
    numel, scales = 1, 1
    for i, d in enumerate(shape):
        numel *= d
        scales *= -(-d // block[i]) if block is not None else 1
    scale_bytes = SCALE_BYTES * scales if BYTES_PER_ELEMENT[fmt] == 1 else 0
    return numel * BYTES_PER_ELEMENT[fmt] + scale_bytes


def deepseek_v3_state_bytes(n_params: ModelConfig | float) -> list[tuple[str, int]]:
    """(what, bytes) of DeepSeek-V3's model states, 12 bytes per parameter (``n_params``: a count or a ModelConfig)."""
    n = params_of(n_params)
    return [(what, n * b) for what, b in DEEPSEEK_V3_STATES]
