"""A training layout: the parallel degrees and the choices that change a step's time and memory.

Ranks are placed in Megatron-LM's order, tensor parallelism innermost, then context, expert, data and
pipeline parallelism (``tp-cp-ep-dp-pp``), so a dimension's group has as many ranks in one NVLink domain as fit
after the dimensions inside it (:func:`scalebook.system.hardware.ranks_per_domain`). Expert parallelism runs
inside the data-parallel ranks (``ep`` divides ``dp * cp``), as in Megatron-Core and DeepSeek-V3.

Source: Megatron-LM ``megatron/core/parallel_state.py`` (``order="tp-cp-ep-dp-pp"``); Narayanan et al. 2021,
Sec. 2-3 (schedules); DeepSeek-AI 2024, Sec. 3.2.1 (DualPipe).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "dualpipe")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("fused", "explicit")
CP_MODES = ("all_gather", "ring")


@dataclass(frozen=True)
class TrainingLayout:
    """Degrees (``tp pp dp cp`` multiply to the GPU count; ``ep`` divides ``dp cp``) and how the step runs.

    ``schedule``: ``1f1b`` (``interleaved`` when ``virtual_stages`` > 1), ``gpipe`` or ``dualpipe``.
    ``attention``: ``fused`` (FlashAttention) or ``explicit`` (scores in HBM). ``overlap_dp``: gradient
    reduce-scatter under the last backward and parameter all-gather under the next forward (Megatron-Core's
    ``--overlap-grad-reduce --overlap-param-gather``, FSDP); off, the whole data-parallel sync is exposed.
    ``async_tp``: tensor-parallel collectives overlap the matmuls. ``overlap_tp_backward``: the column-parallel
    layers' backward collectives overlap their gradient GEMMs (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``, on since its sequence-parallel release of 2022; off for
    Narayanan et al. 2021's runs). ``overlap_p2p``: pipeline sends hidden in the steady state.
    ``grad_reduce_bytes``: 4 for fp32 gradient reduction (Megatron, Llama 3), 2 for bf16.
    ``matmul_dtype``: ``bf16`` or ``fp8`` (DeepSeek-V3). ``node_limit``: most nodes a token's experts span.
    ``compute_share``: the share of the GPU's SMs left to compute kernels when communication kernels keep the
    rest (DeepSeek-V3's DualPipe gives 20 of the H800's 132 SMs to all-to-all: 112/132).
    """

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    zero_stage: int = 1
    virtual_stages: int = 1
    micro_batch: int = 1
    recompute: str = "selective"
    sp: bool = True
    schedule: str = "1f1b"
    attention: str = "fused"
    cp_mode: str = "all_gather"
    overlap_dp: bool = True
    async_tp: bool = False
    overlap_tp_backward: bool = True
    overlap_p2p: bool = False
    grad_reduce_bytes: int = 4
    matmul_dtype: str = "bf16"
    dispatch_bytes: int = 2
    node_limit: int | None = None
    compute_share: float = 1.0

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def problems(self) -> list[str]:
        """What is wrong with the layout on its own (the model and cluster are checked by ``predict``)."""
        found = []
        for name in ("tp", "pp", "dp", "cp", "ep", "virtual_stages", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                found.append(f"{name} must be a positive integer, got {value!r}")
        for name, value, choices in (
            ("schedule", self.schedule, SCHEDULES),
            ("recompute", self.recompute, RECOMPUTE),
            ("attention", self.attention, ATTENTION),
            ("cp_mode", self.cp_mode, CP_MODES),
            ("zero_stage", self.zero_stage, (0, 1, 2, 3)),
            ("matmul_dtype", self.matmul_dtype, ("bf16", "fp8")),
        ):
            if value not in choices:
                found.append(f"{name} must be one of {choices}, got {value!r}")
        if not 0 < self.compute_share <= 1:
            found.append(f"compute_share must be in (0, 1], got {self.compute_share!r}")
        if not found and (self.dp * self.cp) % self.ep:
            found.append(f"ep ({self.ep}) must divide dp * cp ({self.dp * self.cp})")
        if not found and self.virtual_stages > 1 and self.schedule != "interleaved":
            found.append("virtual_stages > 1 needs schedule='interleaved'")
        return found

    def label(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + ([f"v{self.virtual_stages}"] if self.virtual_stages > 1 else [])
        parts += [f"DP{self.dp}", f"CP{self.cp}"] + ([f"EP{self.ep}"] if self.ep > 1 else [])
        return " ".join(parts + [f"mb{self.micro_batch}", self.recompute, f"ZeRO-{self.zero_stage}"])
