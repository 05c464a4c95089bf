"""Every number in book/interview-questions.md that restates a result of the book equals that result.

The interview page is prose (a Markdown page, not a notebook), so it cannot glue its numbers from the
chapters. Instead each number is registered here as a *claim*: the exact phrase the page prints, with
the number recomputed by the package (``accounting``, ``configs``, the cost model), formatted the way the
page formats it. A claim fails when the page's number differs from the package's, and a second test
fails when a percentage appears on the page that no claim (and no listed quotation of a paper) covers,
so a new unchecked percentage cannot slip in.
"""

from __future__ import annotations

import fractions
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from scalebook import accounting, configs, flash, precision, scaling
from scalebook.accounting import roofline
from scalebook.accounting.pipeline import bubble_fraction
from scalebook.accounting.precision import DEEPSEEK_V3_STATES

PAGE = Path(__file__).resolve().parent.parent / "book" / "interview-questions.md"
GB, TB = 1e9, 1e12
SECONDS_PER_DAY = 86_400


def page_text() -> str:
    """The page with line breaks folded into spaces, so a phrase may span two source lines."""
    return re.sub(r"\s+", " ", PAGE.read_text())


def _gpt3():
    return configs.get_model("gpt3-175b")


def _korthikanti_175b():
    from scalebook import calibration

    return next(run for run in calibration.RUNS if run.name == "Korthikanti 175B")


def _h100_bf16() -> float:
    return configs.get_hardware("h100-sxm").peak("bf16")


def _a100_bf16() -> float:
    return configs.get_hardware("a100-sxm4-80gb").peak("bf16")


def _tp_layer_share(tp: int, *, across_nodes: bool) -> float:
    """Chapter 12's communication share of one Llama 2 70B layer (s = 4096, H100 at 50 % MFU): on NVLink 4, or
    across nodes of 8 with a rail-aligned ring (8 NDR ports per node, the network's latency only where the ring
    leaves a node), NCCL's latencies from costmodel.link_model."""
    from scalebook.comm.costmodel import link_model
    from scalebook.experiments import tensor

    nvlink, ndr = link_model("nvlink-4"), link_model("infiniband-ndr")
    bandwidth, alpha = nvlink.bandwidth, nvlink.alpha
    if across_nodes:
        per_node = tp // 2 if tp <= 8 else 8
        bandwidth = min(nvlink.bandwidth, per_node * ndr.bandwidth)
        alpha = accounting.ring_latency("all_reduce", tp, per_node=per_node, intra_alpha=nvlink.alpha,
                                        inter_alpha=ndr.alpha) / (2 * (tp - 1))  # fmt: skip
    times = tensor.tensor_parallel_layer_times(
        configs.get_model("llama-2-70b"), tp, seq_len=4096, micro_batch=1, peak_flops=_h100_bf16(), mfu=0.5,
        bandwidth=bandwidth, alpha=alpha,
    )
    return times.communication_fraction


def _hierarchical_all_reduce_seconds() -> float:
    """Chapter 9, exercise 4: 350 GB reduced inside nodes of 8, across 128 nodes, gathered inside."""
    from scalebook.comm import costmodel

    nvl, ib = costmodel.link_model("nvlink-3"), costmodel.link_model("infiniband-hdr")
    m = 350e9
    return nvl.time("reduce_scatter", m, 8) + ib.time("all_reduce", m / 8, 128) + nvl.time("all_gather", m, 8)


def _flat_all_reduce_seconds(link: str) -> float:
    from scalebook.comm import costmodel

    return costmodel.link_model(link).time("all_reduce", 350e9, 1024)


def _largest_zero2_model(dp: int, budget: float) -> float:
    """Parameters Psi with 2 Psi + 14 Psi / dp <= budget bytes."""
    return budget / (2 + 14 / dp)


def _young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def _young_lost_fraction(checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """Share of time lost at Young's interval: writing, half an interval redone per failure, the restart."""
    interval = _young_interval(checkpoint_s, mtbf_s)
    return checkpoint_s / interval + (interval / 2) / mtbf_s + restart_s / mtbf_s


@dataclass(frozen=True)
class Claim:
    """``template`` as printed on the page, with ``{}`` where ``value()`` goes, formatted by ``fmt``."""

    question: int
    template: str
    value: object  # a callable returning the number, or a tuple of callables for several {}
    fmt: str = "{:.0f}"

    def phrase(self) -> str:
        values = self.value if isinstance(self.value, tuple) else (self.value,)
        return self.template.format(*(self.fmt.format(v()) for v in values))


def _gpt3_layer_op(name: str, batch: int = 1, seq_len: int = 2048):
    """Chapter 8's roofline: operator ``name`` of one GPT-3 175B layer in bf16."""
    ops = roofline.gpt_layer_ops(batch, seq_len, _gpt3().d_model, _gpt3().n_heads, dtype_bytes=2)
    return next(op for op in ops if op.name == name)


def _decode_batch_at_the_ridge() -> int:
    """Chapter 8, exercise 7: the smallest decoding batch whose MLP up-projection is compute-bound on an H100."""
    bandwidth = configs.get_hardware("h100-sxm").hbm_bandwidth
    return next(b for b in range(1, 4096)
                if not roofline.memory_bound(_gpt3_layer_op("MLP up", b, 1), _h100_bf16(), bandwidth))  # fmt: skip


def _llama3_70b():
    return configs.get_model("llama-3-70b")


def _gpt3_on_1024_params() -> float:
    """GPT-3 175B's parameters held by one GPU of a TP 8 x PP 16 layout (each GPU holds 1/128 of the model)."""
    return accounting.param_count(_gpt3()) / (8 * 16)


@functools.cache
def _gpt3_1024_plan():
    """Chapter 14's planner on GPT-3 175B, 1,024 A100 80 GB in nodes of 8 over HDR InfiniBand, micro-batch 1,
    no interleaving (the interview question's sketch); step times and MFU predicted by the system model."""
    from scalebook import planner

    cluster = planner.Cluster(gpu="a100-sxm4-80gb", nodes=128, inter_node_link="infiniband-hdr")
    return planner.plan(_gpt3(), seq_len=2048, global_batch_tokens=_gpt3().batch_sequences * 2048, cluster=cluster,
                        micro_batches=(1,), zero_stages=(1,), virtual_stages=(1,))  # fmt: skip


def _gpt3_megatron_estimate():
    """The planner's estimate for Megatron-LM's GPT-3 recipe, TP 8 x PP 16 x DP 8."""
    plan = _gpt3_1024_plan()
    return plan.ranked[plan.rank_of(tp=8, pp=16, dp=8, cp=1)]


def _refit():
    """Besiroglu et al. 2024's refit of Chinchilla's law (Chapter 1)."""
    return scaling.BESIROGLU_2024


def _pct(x: float) -> float:
    return 100 * x


CLAIMS = (
    Claim(4, "refit gives {} tokens per parameter at Chinchilla's", lambda: _refit().tokens_per_parameter(5.76e23)),
    Claim(4, "20 per parameter), {} at $10^{{21}}$ and {} at $10^{{25}}$",
          (lambda: _refit().tokens_per_parameter(1e21), lambda: _refit().tokens_per_parameter(1e25))),
    Claim(4, "as printed in the paper give {} tokens per parameter",
          lambda: scaling.HOFFMANN_2022.tokens_per_parameter(5.76e23)),
    Claim(4, "Llama 3 8B saw about {} tokens per parameter", lambda: round(15e12 / 8.03e9, -2), fmt="{:,.0f}"),
    Claim(15, "an H100 SM has {} KiB", lambda: configs.get_hardware("h100-sxm").smem_per_sm_bytes / 1024),
    Claim(15, "query tiles of {} rows and key tiles of up to {} rows at head width 128",
          (lambda: flash.flash_block_sizes(configs.get_hardware("h100-sxm"), 128)[0],
           lambda: flash.flash_block_sizes(configs.get_hardware("h100-sxm"), 128)[1])),
    Claim(16, "128k-token sequence would take {} GB",
          lambda: accounting.kv_cache_bytes(_llama3_70b(), seq_len=131072, n_kv_heads=_llama3_70b().n_heads) / GB),
    Claim(16, "cuts it to {} GB", lambda: accounting.kv_cache_bytes(_llama3_70b(), seq_len=131072) / GB),
    Claim(16, "against {} GB of weights", lambda: 2 * accounting.param_count(_llama3_70b()) / GB),
    Claim(31, "$2^{{-13}} \\approx {} \\times 10^{{-4}}$",
          lambda: 1e4 * precision.float_format("bf16").ulp(torch.tensor(0.02)).item(), "{:.1f}"),
    Claim(31, "DeepSeek-V3's model states are {} bytes per parameter",
          lambda: sum(b for _, b in DEEPSEEK_V3_STATES)),
    Claim(1, "2.8 TB for 175B parameters, {} GPUs of 80 GB",
          lambda: accounting.model_state_bytes(175e9).total / (80 * GB)),
    Claim(1, "{} TB for 175B parameters", lambda: accounting.model_state_bytes(175e9).total / TB, "{:.1f}"),
    Claim(1, "about {} years on one A100 at 160 TFLOP/s",
          lambda: accounting.training_flops(175e9, 300e9) / 160e12 / (365 * SECONDS_PER_DAY)),
    Claim(1, "{} GB of 16-bit numbers for GPT-3", lambda: 2 * 175e9 / GB),
    Claim(2, "\\approx {}$ GPUs", lambda: accounting.devices_needed(175e9, 300e9, 30, 160e12, 1.0)),
    Claim(2, "about {} A100s at 35 % MFU",
          lambda: round(accounting.devices_needed(175e9, 300e9, 30, _a100_bf16(), 0.35), -2), "{:,.0f}"),
    Claim(2, "an MFU of {} to {} %", (lambda: 44 * 3 / 4, lambda: 52 * 3 / 4)),
    Claim(2, "Korthikanti et al. (2022) measured {} % MFU", lambda: _pct(_korthikanti_175b().published), "{:.1f}"),
    Claim(2, "at that rate the month takes about {} A100s",
          lambda: round(accounting.devices_needed(_gpt3(), 300e9, 30, _a100_bf16(), _korthikanti_175b().published,
                                                  seq_len=2048), -1)),
    Claim(7, "GPT-2's embedding is {} % of its 124M parameters",
          lambda: _pct(accounting.param_breakdown(configs.get_model("gpt2"))["token embedding"]
                       / accounting.param_count(configs.get_model("gpt2")))),
    Claim(7, "For Llama 3 8B the embedding and head are {} % of the parameters",
          lambda: _pct(2 * 128256 * 4096 / accounting.param_count(configs.get_model("llama-3-8b")))),
    Claim(13, "SwiGLU MLP holds about {} % of a large model",
          lambda: _pct(accounting.param_breakdown(configs.get_model("llama-3-70b"))["MLP weights"]
                       / accounting.param_count(configs.get_model("llama-3-70b")))),
    Claim(17, "for GPT-2 the exact count is {}", lambda: accounting.param_count(configs.get_model("gpt2")), "{:,}"),
    Claim(18, "{} % low for a 125M GPT-3",
          lambda: _pct(1 - 12 * 12 * 768**2 / accounting.param_count(configs.get_model("gpt3-125m")))),
    Claim(18, "only {} % for GPT-3 175B", lambda: _pct(1 - 12 * 96 * 12288**2 / accounting.param_count(_gpt3())),
          "{:.1f}"),
    Claim(20, "$16 \\times 7 \\times 10^9 = {}$ GB", lambda: accounting.model_state_bytes(7e9).total / GB),
    Claim(20, "$4\\Psi + 12\\Psi/8 = {}$ GB",
          lambda: accounting.model_state_bytes(7e9, zero_stage=1, dp=8).total / GB, "{:.1f}"),
    Claim(21, "about {} tokens for GPT-3", lambda: round(34 * 12288 / (5 * 96), -1)),
    Claim(21, "one 2,048-token sequence saves {} GB over its 96 layers",
          lambda: accounting.activation_bytes(_gpt3(), seq_len=2048, micro_batch=1) / GB),
    Claim(22, "per GPU: {} GB with no recomputation, {} GB selective, {} GB full",
          (lambda: round(accounting.activation_bytes(_gpt3(), seq_len=2048, micro_batch=1, tp=8, sp=True) / GB),
           lambda: round(accounting.activation_bytes(_gpt3(), seq_len=2048, micro_batch=1, tp=8, sp=True,
                                                     recompute="selective") / GB),
           lambda: round(accounting.activation_bytes(_gpt3(), seq_len=2048, micro_batch=1, tp=8, sp=True,
                                                     recompute="full") / GB, 1)),
          "{:g}"),
    Claim(24, "For GPT-3 at 2,048 tokens that is only {} % more than $6N$",
          lambda: _pct(accounting.flops_per_token(_gpt3(), seq_len=2048) / accounting.flops_per_token(_gpt3()) - 1)),
    Claim(24, "at 128K tokens attention is {} % of Llama 3.1 405B's FLOPs in that count",
          lambda: _pct(accounting.attention_flop_share(configs.get_model("llama-3.1-405b"), seq_len=131072))),
    Claim(24, "and {} % of what a causal kernel",
          lambda: _pct(accounting.attention_flop_share(configs.get_model("llama-3.1-405b"), seq_len=131072,
                                                       causal=True))),
    Claim(25, "\\approx {}\\,\\%$",
          lambda: _pct(accounting.mfu(configs.get_model("llama-3-8b"), 8000, 1, _h100_bf16()))),
    Claim(26, "as MFU they are about {} to {} %", (lambda: 44 * 3 / 4, lambda: 52 * 3 / 4)),
    Claim(27, "so about {} GPUs",
          lambda: accounting.devices_needed(configs.get_model("llama-3-8b"), 15e12, 30, _h100_bf16(), 0.4)),
    Claim(29, "a token is multiplied by {}B parameters",
          lambda: accounting.active_param_count(configs.get_model("mixtral-8x7b")) / 1e9, "{:.1f}"),
    Claim(29, "16 bytes $\\times$ {}B",
          lambda: accounting.param_count(configs.get_model("mixtral-8x7b")) / 1e9, "{:.1f}"),
    Claim(29, "= {} GB of model states",
          lambda: accounting.model_state_bytes(configs.get_model("mixtral-8x7b")).total / GB),
    Claim(29, "671B total, {}B active",
          lambda: accounting.active_param_count(configs.get_model("deepseek-v3")) / 1e9, "{:.1f}"),
    Claim(30, "a ridge point of about {} FLOPs per byte",
          lambda: roofline.ridge_point(_h100_bf16(), configs.get_hardware("h100-sxm").hbm_bandwidth)),
    Claim(30, "the weight matmuls reach about {} and are compute-bound", lambda: _gpt3_layer_op("MLP up").intensity,
          "{:,.0f}"),
    Claim(30, "unfused attention ($QK^\\top$ and $PV$ with the scores written to memory) about {}",
          lambda: _gpt3_layer_op("attention scores QK^T").intensity),
    Claim(30, "a batch of {} is needed to reach the ridge", lambda: _decode_batch_at_the_ridge()),
    Claim(28, "$N \\approx {}\\text{{B}}$ parameters",
          lambda: math.sqrt(accounting.training_flops(175e9, 300e9) / 120) / 1e9),
    Claim(35, "all-gather inside: about {} s instead of {} s",
          (lambda: round(_hierarchical_all_reduce_seconds(), 1),
           lambda: round(_flat_all_reduce_seconds("infiniband-hdr"))),
          "{:g}"),
    Claim(40, "For 7.5B on 64 GPUs: {}, {}, {} and {} GB",
          tuple(lambda s=s: round(accounting.model_state_bytes(7.5e9, zero_stage=s, dp=64).total / GB, 1)
                for s in range(4)), "{:g}"),
    Claim(43, "gives $\\Psi \\le {}$ trillion", lambda: 40 * GB * 1024 / 16 / 1e12, "{:.2f}"),
    Claim(43, "gives about {} billion", lambda: _largest_zero2_model(1024, 40 * GB) / 1e9),
    Claim(46, "communication is about {} % of the layer's time at $t = 8$ on NVLink",
          lambda: _pct(_tp_layer_share(8, across_nodes=False))),
    Claim(46, "and about {} % at $t = 16$ across two nodes", lambda: _pct(_tp_layer_share(16, across_nodes=True))),
    Claim(51, "{} for $p = 4$, $v = 2$", lambda: fractions.Fraction(2 * 4 - 1, 4 - 1), "{}"),  # (vp - 1)/(p - 1)
    Claim(49, "{} % for $p = 4$, $m = 8$", lambda: _pct(bubble_fraction(4, 8))),
    Claim(51, "from {} % to {} % for $p = 4$, $m = 8$, $v = 2$",
          (lambda: _pct(bubble_fraction(4, 8)), lambda: _pct(bubble_fraction(4, 8, virtual_stages=2)))),
    Claim(52, "{} MB for GPT-3 at 2,048 tokens in bf16", lambda: 2048 * 12288 * 2 / 1e6),
    Claim(56, "16M tokens of 8K sequences is {} sequences", lambda: 16 * 2**20 / 8192, "{:,.0f}"),
    Claim(44, "GPT-2's 124M parameters need {} GB of states",
          lambda: accounting.model_state_bytes(accounting.param_count(configs.get_model("gpt2"))).total / GB, "{:.1f}"),
    Claim(44, "A 7B model needs {} GB per GPU under DDP", lambda: accounting.model_state_bytes(7e9).total / GB),
    Claim(44, "and {} GB under FSDP over 8 GPUs",
          lambda: accounting.model_state_bytes(7e9, zero_stage=3, dp=8).total / GB),
    Claim(57, "The states alone are {} TB, {} times the 640 GB of a whole node",
          (lambda: accounting.model_state_bytes(_gpt3()).total / TB,
           lambda: accounting.model_state_bytes(_gpt3()).total / (8 * 80 * GB)), "{:.1f}"),
    Claim(57, "16 stages of {} layers leave {} GB of model states per GPU",
          (lambda: _gpt3().n_layers // 16,
           lambda: round(accounting.model_state_bytes(_gpt3_on_1024_params()).total / GB, 1)),
          "{:g}"),
    Claim(57, "{} GB with ZeRO-1 over the replicas",
          lambda: accounting.model_state_bytes(_gpt3_on_1024_params(), zero_stage=1, dp=8).total / GB, "{:.1f}"),
    Claim(57, "$1024 / (8 \\cdot 16) = {}$ replicas", lambda: 1024 // (8 * 16)),
    Claim(57, "gives each replica {} micro-batches", lambda: _gpt3().batch_sequences // 8),
    Claim(57, "a 1F1B bubble of $(p-1)/(m+p-1)$, about {} % of the step",
          lambda: _pct(bubble_fraction(16, _gpt3().batch_sequences // 8)), "{:.1f}"),
    Claim(57, "puts this layout within {} % of its fastest",
          lambda: math.ceil(_pct(_gpt3_megatron_estimate().step_time / _gpt3_1024_plan().ranked[0].step_time - 1))),
    Claim(57, "about {} s per step at {} % MFU",
          (lambda: round(_gpt3_megatron_estimate().step_time, 1), lambda: round(_pct(_gpt3_megatron_estimate().mfu))),
          "{:g}"),
    Claim(61, "one GPU that computes {} % slower makes all 1,000 wait: the other 999 idle {} % of every step",
          (lambda: 20, lambda: round(_pct(1 - 1 / 1.2), 1)), "{:g}"),
    Claim(59, "\\approx {}$ s", lambda: _young_interval(30, 3 * 3600)),
    Claim(59, "about {} % of the run", lambda: _pct(_young_lost_fraction(30, 3 * 3600, 300)), "{:.1f}"),
)  # fmt: skip

# Percentages on the page that quote a paper or state a rule of thumb rather than restate a result the
# package computes; each with where it comes from.
QUOTED_PERCENTAGES = {
    "44 to 52 %": "Megatron-LM's published hardware FLOPs utilization (Narayanan et al. 2021)",
    "38 to 43 %": "Llama 3.1 405B's published MFU (Grattafiori et al. 2024)",
    "35 % MFU": "an assumed MFU, the input of the claim that follows it",
    "40 % MFU": "an assumed MFU, the input of the question",
    "50 % MFU": "an assumed MFU, the input of Chapter 12's layer timing",
    "50 % of peak": "an assumed matmul efficiency, the input of the planner's estimate (question 55)",
    "10 to 20 %": "headroom for temporary buffers, a rule of thumb",
    "below 5 %": "the target of the bubble rule that follows it",
}


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: f"Q{c.question}:{c.template[:40]}")
def test_claim_matches_the_package(claim):
    phrase = claim.phrase()
    assert phrase in page_text(), (
        f"interview question {claim.question}: the page should print {phrase!r} (computed by the package); "
        "fix the page or the claim"
    )


def test_every_percentage_on_the_page_is_checked_or_quoted():
    text = page_text()
    covered = [c.phrase() for c in CLAIMS] + list(QUOTED_PERCENTAGES)
    spans = [(m.start(), m.end()) for phrase in covered for m in re.finditer(re.escape(phrase), text)]
    unchecked = []
    for m in re.finditer(r"\d+(?:\.\d+)?\s?(?:\\,)?\\?%", text):
        if not any(start <= m.start() and m.end() <= end for start, end in spans):
            unchecked.append(text[max(0, m.start() - 60) : m.end() + 10])
    assert not unchecked, "percentages with no claim in this file:\n" + "\n".join(unchecked)

