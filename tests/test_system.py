"""The system model (scalebook.system) against published runs, published link numbers and its own conventions.

Expected values are published numbers (Narayanan et al. 2021 Table 1, Korthikanti et al. 2022 Table 5, Llama 3
Table 4, DeepSeek-V3's GPU hours, NCCL's tuning constants, vendor-reported bus bandwidths), never the output of
the code under test.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from scalebook import configs, planner
from scalebook.accounting.flops import flops_per_token
from scalebook.calibration import FIT_RUNS, LEAVE_ONE_OUT_TOLERANCE, RUNS, TOLERANCE
from scalebook.system import FITTED, Cluster, TrainingLayout, fit, predict
from scalebook.system.compute import attention_flops
from scalebook.system.hardware import collective_time
from scalebook.system.search import rank_layouts

RUN = {r.name: r for r in RUNS}
MEDIAN_TOLERANCE = 0.05  # stated beside TOLERANCE: the median |error| of the fitted runs


def _error(run) -> float:
    return fit.predicted_tflops(run, FITTED) / run.model_tflops - 1


@pytest.mark.parametrize("run", FIT_RUNS, ids=lambda r: r.name)
def test_every_fitted_run_is_predicted_within_the_stated_tolerance(run):
    error = _error(run)
    assert abs(error) <= TOLERANCE, f"{run.name}: predicted {error:+.1%} off the published throughput"


def test_median_error_of_the_fitted_runs_is_within_five_percent():
    assert statistics.median(abs(_error(r)) for r in FIT_RUNS) <= MEDIAN_TOLERANCE


def test_deepseek_v3_is_kept_in_the_table_but_held_out_and_outside_the_goal():
    run = RUN["DeepSeek-V3 671B"]
    assert run.held_out and run not in FIT_RUNS
    # If this fails, the model now explains DeepSeek-V3: bring it into the fit and restate the tolerance.
    assert _error(run) > TOLERANCE


def test_published_throughputs_convert_to_model_tflops_as_the_papers_define_them():
    # Narayanan et al.'s 96 B s L h^2 (1 + s/6h + V/16Lh) counts recomputation; the model FLOPs are
    # 72 B s L h^2 (1 + s/6h + V/12Lh). 1T row: h 25600, L 128, printed 163 TFLOP/s.
    s, h, L, V = 2048, 25600, 128, 51200
    ratio = 72 * (1 + s / (6 * h) + V / (12 * L * h)) / (96 * (1 + s / (6 * h) + V / (16 * L * h)))
    assert RUN["Megatron-LM 1008B"].model_tflops == pytest.approx(163 * ratio, rel=2e-3)
    assert RUN["Korthikanti 1T"].model_tflops == pytest.approx(0.563 * 312, rel=1e-9)
    # Llama 3's Table 4: 430 TFLOP/s is 43 % "BF16 MFU" of the H100's 989 TFLOP/s.
    assert round(100 * RUN["Llama 3 405B 8K, 8,192 GPUs"].model_tflops / 989) == 43
    # DeepSeek-V3: 2,664K GPU hours for 14.8T tokens is the report's 180K hours per trillion tokens.
    deepseek = RUN["DeepSeek-V3 671B"]
    tokens_per_gpu_second = 14.8e12 / (2664e3 * 3600)
    per_token = flops_per_token(deepseek.model, seq_len=4096)
    assert deepseek.model_tflops == pytest.approx(tokens_per_gpu_second * per_token / 1e12, rel=2e-3)


def test_refitting_reproduces_the_committed_parameters():
    refit = fit.fit_params(FIT_RUNS)
    for name, committed, fresh in zip(
        ("matmul", "attention", "memory"), FITTED.as_tuple(), refit.as_tuple(), strict=True
    ):
        assert fresh == pytest.approx(committed, abs=3e-3), f"{name}_efficiency refits to {fresh}"


@pytest.mark.parametrize("name", [r.name for r in FIT_RUNS if r.name != "Llama 3 405B 128K, 16,384 GPUs"])
def test_leave_one_out_errors_stay_within_the_tolerance(name):
    """A run the fit has not seen is predicted as well as the others (the 128K Llama run is the exception the
    calibration table reports: it alone pins the fused-attention efficiency)."""
    (row,) = fit.calibration_table([RUN[name]], FITTED, fitted=FIT_RUNS)
    assert abs(row.leave_one_out_error) <= LEAVE_ONE_OUT_TOLERANCE


def test_the_128k_run_alone_pins_the_fused_attention_efficiency():
    """Left out, the 128K run is mispredicted by far more than the tolerance: no other run of the table uses a
    fused kernel at a length where attention dominates. The calibration table shows this error; a second
    long-context run in the table would make this test fail, and should."""
    (row,) = fit.calibration_table([RUN["Llama 3 405B 128K, 16,384 GPUs"]], FITTED, fitted=FIT_RUNS)
    assert abs(row.error) <= TOLERANCE and LEAVE_ONE_OUT_TOLERANCE < abs(row.leave_one_out_error)


def test_nccl_ring_latency_charges_one_network_hop_per_node():
    """NCCL tuning.cc (2.23-2.27): 8.4 us base + 3.4 us per NVLink step + 14.0 us per network step, 2 (nodes - 1)
    network steps in a ring all-reduce. 16 ranks on 2 nodes, a 1-byte message: the bandwidth term is nil."""
    cluster = Cluster("h100-sxm", 16)
    expected = 8.4e-6 + (30 - 2) * 3.4e-6 + 2 * 14.0e-6
    assert collective_time("all_reduce", 1, 16, per_domain=8, cluster=cluster) == pytest.approx(expected, rel=1e-3)


def test_rings_reach_the_reported_bus_bandwidths():
    """A large all-reduce's busbw, 2 (n-1)/n M / T: 8 H100s on NVLink ~370 GB/s (nccl-tests #212, ring); 2 DGX A100
    with 8 HDR ports each ~192 GB/s (nccl #812), within 5 %."""
    message = 8e9
    for cluster, n, reported in (
        (Cluster("h100-sxm", 8), 8, 370e9),
        (Cluster("a100-sxm4-80gb", 16, nic_bandwidth=200e9 / 8), 16, 192e9),
    ):
        seconds = collective_time("all_reduce", message, n, per_domain=8, cluster=cluster)
        assert 2 * (n - 1) / n * message / seconds == pytest.approx(reported, rel=0.05)


def test_a_causal_kernel_executes_about_half_the_attention_of_the_mfu_convention():
    """Llama 3.1 405B at 128K: attention is 57 % of the FLOPs in the MFU convention, about 40 % of what runs
    (issue 33's figures, from 2 s n_h (d_qk + d_v) per token and layer against 2 W per token)."""
    cfg, s = configs.get_model("llama-3.1-405b"), 131072
    full = attention_flops(cfg, s, s, tp=1, causal=False) * cfg.n_layers * 3 / s
    causal = attention_flops(cfg, s, s, tp=1, causal=True) * cfg.n_layers * 3 / s
    total = flops_per_token(cfg, seq_len=s)
    assert round(full / total, 2) == 0.57
    assert round(causal / (total - full + causal), 2) == 0.40


def _hand_built():
    model = configs.llama_like(
        "hand-built 70B",
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=16,
        d_ff=28672,
        max_seq_len=8192,
    )
    nvl72 = Cluster(
        "b200",
        144,
        gpus_per_node=4,
        nics_per_node=4,
        nic_bandwidth=800e9 / 8,
        nvlink_domain=72,
        name="two GB200-NVL72-like racks",
    )
    hgx = Cluster("b200", 144, gpus_per_node=8, nics_per_node=8, nic_bandwidth=400e9 / 8, name="HGX B200")
    return model, nvl72, hgx


def test_predict_takes_a_hand_built_model_and_cluster_and_returns_every_field():
    model, nvl72, _ = _hand_built()
    layout = TrainingLayout(tp=8, pp=2, dp=9, micro_batch=1)
    p = planner.predict(model, nvl72, layout, seq_len=8192, global_batch=72)
    assert p.tokens_per_second == pytest.approx(72 * 8192 / p.step_time)
    peak = configs.get_hardware("b200").peak("bf16")
    assert p.mfu == pytest.approx(p.model_tflops_per_gpu * 1e12 / peak)
    assert p.hfu > p.mfu  # selective recomputation reruns the scores
    assert set(p.breakdown) == {"compute", "tp", "cp", "ep", "bubble", "pp", "dp", "optimizer"}
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time)
    assert set(p.memory) == {"states", "activations", "logits", "temporary", "runtime", "fragmentation"}
    assert p.feasible and p.reasons == ()


def test_tensor_parallelism_over_16_gpus_is_cheap_in_an_nvl72_domain_and_dear_across_hgx_nodes():
    model, nvl72, hgx = _hand_built()
    layout = TrainingLayout(tp=16, pp=1, dp=9)
    in_domain = predict(model, nvl72, layout, seq_len=8192, global_batch=72).breakdown["tp"]
    across = predict(model, hgx, layout, seq_len=8192, global_batch=72).breakdown["tp"]
    # A rail-aligned ring leaves each HGX node on its 8 NICs: 8 x 50 GB/s x 0.96 = 384 GB/s of bus bandwidth
    # against NVLink 5's 900 GB/s x 0.79 = 715 GB/s per direction, so about 1.9x slower (not 16x: the ring
    # does not cross one port), plus the network latency.
    assert 1.5 < across / in_domain < 2.2


def test_an_impossible_layout_is_refused_with_every_reason():
    model, nvl72, _ = _hand_built()
    with pytest.raises(ValueError) as info:
        predict(model, nvl72, TrainingLayout(tp=3, pp=1, dp=7), seq_len=8192, global_batch=10)
    message = str(info.value)
    assert "GPUs" in message and "heads" in message and "global_batch" in message


def test_a_layout_that_does_not_fit_says_why():
    model, nvl72, _ = _hand_built()
    p = predict(model, nvl72, TrainingLayout(tp=1, pp=1, dp=144, zero_stage=0), seq_len=8192, global_batch=144)
    assert not p.feasible and "memory" in p.reasons[0]


def test_the_system_model_imports_without_torch():
    code = "import sys, scalebook.system, scalebook.calibration, scalebook.system.fit; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_rank_layouts_returns_fitting_layouts_fastest_first_and_counts_the_rest():
    model, nvl72, _ = _hand_built()
    ranking = rank_layouts(model, nvl72, seq_len=8192, global_batch=72, virtual_stages=(1,), micro_batches=(1,))
    times = [p.step_time for _, p in ranking.ranked]
    assert times == sorted(times) and all(p.feasible for _, p in ranking.ranked)
    assert ranking.rejected["does not fit in memory"] > 0  # TP1 PP1 keeps 70B of states on one GPU
    layout, _ = ranking.best_matching(tp=8, pp=1)
    assert layout.dp * layout.cp == 18


@pytest.mark.parametrize("name", [r.name for r in RUNS if r.name.startswith(("Llama 3", "DeepSeek"))])
def test_the_published_layouts_fit_in_80_gb(name):
    """Llama 3 trained these layouts on H100 80 GB (8K sequences without activation checkpointing), DeepSeek-V3 on
    H800 80 GB: whatever the model counts (states, activations, buffers, runtime, fragmentation) must fit."""
    run = RUN[name]
    p = predict(run.model, run.cluster, run.layout, seq_len=run.seq_len, global_batch=run.global_batch)
    assert p.feasible and p.memory_total <= 80e9, f"{name}: {p.memory_total / 1e9:.1f} GB"


def _llama_layer(recompute: str) -> float:
    from scalebook.system.memory import layer_activation_bytes

    cfg = configs.get_model("llama-3.1-405b")
    return layer_activation_bytes(cfg, TrainingLayout(tp=8, pp=16, dp=128, recompute=recompute), seq_len=8192)


def test_a_llama_layer_keeps_three_swiglu_tensors_and_its_norm_outputs_without_recomputation():
    """Llama 3.1 405B (h 16,384, d_kv 1,024, d_ff 53,248), TP 8 with SP, 8,192 tokens, 2 bytes: norm inputs and
    outputs 4 h/8, Q and the attention output 2 h/8, K and V 2 d_kv/8, SwiGLU's gate, up and product 3 d_ff/8
    (the fused kernel recomputes the SiLU; four tensors would add 8,192 x 6,656 x 2 = 109 MB)."""
    h, kv, ff = 16384 / 8, 1024 / 8, 53248 / 8
    assert _llama_layer("none") == pytest.approx(2 * 8192 * (4 * h + 2 * h + 2 * kv + 3 * ff), rel=1e-9)


def test_selective_recomputation_drops_the_norm_outputs_and_the_swiglu_product():
    h, kv, ff = 16384 / 8, 1024 / 8, 53248 / 8
    assert _llama_layer("selective") == pytest.approx(2 * 8192 * (2 * h + 2 * h + 2 * kv + 2 * ff), rel=1e-9)
    assert _llama_layer("full") == pytest.approx(2 * 8192 * h, rel=1e-9)  # only the layer's (SP-sharded) input


# Korthikanti et al. 2022, Table 2, per layer in units of s b h bytes for GPT-3 175B (a = 96 heads, s = 2,048,
# h = 12,288, so 5 a s / h = 80), t = 8, less dropout's bytes (two 1-byte s b h masks, and per score a 1-byte mask
# and a 2-byte output: 3 a s / h = 48), because the system model trains without dropout.
_TABLE_2_WITHOUT_DROPOUT = [
    (dict(tp=1, sp=False, recompute="none"), 34 + 80 - 2 - 48),  # s b h (34 + 5 a s / h)
    (dict(tp=8, sp=False, recompute="none"), 10 + 24 / 8 + 80 / 8 - 2 - 48 / 8),  # s b h (10 + 24/t + 5as/(ht))
    (dict(tp=8, sp=True, recompute="none"), (34 + 80 - 2 - 48) / 8),  # s b h / t (34 + 5 a s / h)
    (dict(tp=8, sp=True, recompute="full"), 2 / 8),  # the layer's input, 2 s b h, sharded by SP
]


@pytest.mark.parametrize(("options", "sbh"), _TABLE_2_WITHOUT_DROPOUT, ids=lambda x: str(x))
def test_the_system_model_keeps_korthikantis_activations_for_a_gpt3_layer(options, sbh):
    """One memory model: the step model's per-layer activations are Korthikanti et al.'s Table 2 (through
    scalebook.accounting) for their own GPT-3 layer with explicit attention, exact, dropout aside."""
    from scalebook.system.memory import layer_activation_bytes

    layout = TrainingLayout(pp=1, dp=1, attention="explicit", **options)
    kept = layer_activation_bytes(configs.get_model("gpt3-175b"), layout, seq_len=2048)
    assert kept == pytest.approx(sbh * 2048 * 12288, rel=1e-12)  # exact up to float rounding


def test_selective_recomputation_keeps_korthikantis_34_less_what_the_step_model_also_recomputes():
    """Table 2's SP + selective row is s b h 34 / t; without dropout 32 / t. The step model also recomputes the
    two norm outputs (2 x 2 s b h / t) and the GELU output (2 x 4 s b h / t): 20 s b h / t remain."""
    from scalebook.system.memory import layer_activation_bytes

    layout = TrainingLayout(tp=8, pp=1, dp=1, attention="explicit", recompute="selective")
    kept = layer_activation_bytes(configs.get_model("gpt3-175b"), layout, seq_len=2048)
    assert kept == pytest.approx((34 - 2 - 4 - 8) / 8 * 2048 * 12288, rel=1e-12)


def test_overlapping_the_backward_leaves_three_of_five_tensor_parallel_pairs_exposed():
    """Under SP a layer runs 5 reduce-scatter/all-gather pairs (2 forward, 2 backward, 1 re-gather); Megatron
    overlaps the column-parallel layers' backward ones (the dgrad reduce-scatter and the re-gather: 2 pairs)
    with their gradient GEMMs, which at 8K tokens of a 405B layer take far longer."""
    cfg, cluster = configs.get_model("llama-3.1-405b"), Cluster("h100-sxm", 8)
    from scalebook.system.step import layer_time

    def tp(overlap: bool) -> float:
        layout = TrainingLayout(tp=8, pp=1, dp=1, overlap_tp_backward=overlap)
        return layer_time(cfg, 1, layout, 8192, cluster, FITTED).tp

    assert tp(True) == pytest.approx(3 / 5 * tp(False), rel=1e-9)


def test_the_busiest_stage_does_not_hang_on_the_last_bit_of_a_sum():
    """0.1 + 0.2 + 0.3 is 0.6000000000000001 added in turn and 0.6 exactly (math.fsum, and sum() from Python
    3.12, which the calculators' Pyodide runs): one stage still holds all three layers, and two stages split
    them 3 | 1, whichever way the total was rounded (the calculators once showed another memory than CPython)."""
    from scalebook.system.step import busiest_stage

    capacity, most = busiest_stage([0.1, 0.2, 0.3], 0.0, 1)
    assert most == 3 and capacity == pytest.approx(0.6, rel=1e-15)
    capacity, most = busiest_stage([0.1, 0.2, 0.3, 0.6], 0.0, 2)
    assert most == 3 and capacity == pytest.approx(0.6, rel=1e-6)  # the search stops within 1e-6 of the optimum


def test_expert_all_to_all_crosses_the_network_for_at_most_node_limit_copies():
    """DeepSeek-V3's dispatch on 2,048 H800 (nodes of 8, eight 400 Gb/s NICs, EP 64 over 8 nodes): 4,096 tokens
    x 8 routed copies x 7,168 bytes (FP8). Spread evenly, 56/64 of the copies leave the node; node-limited
    routing sends a token to at most 4 nodes, once per node, so at most 4/8 of the copies cross the network,
    at one NIC's 50 GB/s times the InfiniBand ring efficiency of nccl #812 (192/200), while the 7/64 bound for
    the node's other GPUs move over NVLink at the same time. Latency: NCCL's base plus one network step."""
    from scalebook.system.hardware import all_to_all_time

    cluster = Cluster("h800-sxm", 2048)
    message = 4096 * 8 * 7168
    latency = 8.4e-6 + 14.0e-6  # NCCL 2.23-2.27 baseLat Ring/Simple + hwLat NET Ring/Simple
    nic = 50e9 * 192 / 200
    limited = all_to_all_time(message, 64, per_domain=8, cluster=cluster, node_limit=4, fanout=8)
    spread = all_to_all_time(message, 64, per_domain=8, cluster=cluster)
    assert limited == pytest.approx(latency + message * 4 / 8 / nic, rel=1e-9)
    assert spread == pytest.approx(latency + message * 56 / 64 / nic, rel=1e-9)
