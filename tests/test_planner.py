"""The layout planner: it ranks with the system model (no assumed utilization), Llama 3.1 405B's published layout
is feasible and near the top, the reasons of the rejected layouts are kept, bad input is refused."""

import inspect

import pytest

from scalebook import planner

LLAMA = dict(seq_len=8192, global_batch_tokens=16 * 2**20, cluster=planner.Cluster(nodes=2048))
# Grattafiori et al. 2024, Table 4: TP 8, CP 1, PP 16, DP 128 on 16,384 H100 for 8K sequences.
META = dict(tp=8, pp=16, dp=128, cp=1)


@pytest.fixture(scope="module")
def llama_plan():
    return planner.plan("llama-3.1-405b", **LLAMA)


def test_plan_takes_no_mfu_and_says_why():
    assert "mfu" not in inspect.signature(planner.plan).parameters
    with pytest.raises(TypeError, match="predicts utilization"):
        planner.plan("gpt2", seq_len=1024, global_batch_tokens=8192, cluster=planner.Cluster(nodes=1), mfu=0.5)


def test_llama3_layout_is_feasible_and_the_best_without_context_parallelism_within_5_percent(llama_plan):
    meta = llama_plan.ranked[llama_plan.rank_of(**META)]
    without_cp = [e for e in llama_plan.ranked if e.layout.cp == 1]
    # 5 %: the acceptance bound of issue 33 for a layout a published run used.
    assert meta.step_time <= 1.05 * without_cp[0].step_time
    assert meta.memory <= 80e9  # it fits in the H100's 80 GB, as it did for Meta
    assert meta.layout.recompute == "selective"  # Meta trained 8K sequences without activation checkpointing
    assert llama_plan.rank_of(**META) < 0.01 * len(llama_plan.ranked)  # top 1 % of the feasible layouts


def test_the_layouts_ahead_of_llama3s_win_on_the_pipeline_bubble(llama_plan):
    """With 2,048 sequences over 128 replicas, Meta's pipeline runs 16 micro-batches on 16 stages, a bubble of
    (p - 1) / (v m) = 15/64 of the work (the paper's own formula). Every layout predicted more than 5 % faster
    (the resolution issue 33 asks of the ranking) halves the bubble by having fewer replicas (context
    parallelism), and the bubble it saves is more than its whole lead: what it pays elsewhere (CP, data-parallel
    sync, smaller matmuls) is smaller."""
    position = llama_plan.rank_of(**META)
    meta = llama_plan.ranked[position]
    bubble = meta.parts["bubble"] / (meta.parts["compute"] + meta.parts["tp"])
    assert bubble == pytest.approx(15 / 64, rel=0.02)  # 2 %: the stage's largest chunk vs the mean
    clearly_faster = [e for e in llama_plan.ranked[:position] if e.step_time < meta.step_time / 1.05]
    assert clearly_faster and all(e.layout.cp > 1 for e in clearly_faster)
    for faster in clearly_faster:
        saved = meta.parts["bubble"] - faster.parts["bubble"]
        assert 0 < meta.step_time - faster.step_time < saved


def test_predicted_mfu_is_model_flops_over_peak(llama_plan):
    # 6 N + attention per token, 2,048 x 8,192 tokens, 16,384 x 989 TFLOP/s (H100 SXM dense bf16).
    from scalebook import accounting, configs

    meta = llama_plan.ranked[llama_plan.rank_of(**META)]
    per_token = accounting.flops_per_token(configs.get_model("llama-3.1-405b"), seq_len=8192)
    assert meta.mfu == pytest.approx(per_token * 16 * 2**20 / (meta.step_time * 16384 * 989e12), rel=1e-3)


def test_rejections_carry_their_reasons(llama_plan):
    reasons = llama_plan.rejected
    assert reasons["does not fit in memory"] > 0
    assert reasons["fewer micro-batches than pipeline stages"] > 0
    assert all(e.layout.tp <= 8 for e in llama_plan.ranked)  # TP stays inside the node's NVLink domain
    assert all(e.memory <= 80e9 for e in llama_plan.ranked)


def test_data_parallel_time_charges_zero2_and_zero3_per_micro_batch():
    # 1e9 bf16 values (2 GB) over 4 ranks at 1 GB/s, no latency: a ring reduce-scatter or all-gather sends
    # 3/4 of 2 GB = 1.5 s, an all-reduce twice that. With 3 micro-batches ZeRO-2 reduce-scatters 3 times
    # and gathers once; ZeRO-3 gathers twice and reduce-scatters once per micro-batch.
    expected = {0: 3.0, 1: 3.0, 2: 3 * 1.5 + 1.5, 3: 3 * (1.5 + 1.5 + 1.5)}
    for zero, seconds in expected.items():
        assert planner.data_parallel_time(1e9, 4, zero, 3, alpha=0.0, bandwidth=1e9) == pytest.approx(seconds)
    # Latency: each collective of the ring takes n - 1 = 3 steps of alpha.
    assert planner.data_parallel_time(0, 4, 3, 2, alpha=1.0, bandwidth=1e9) == pytest.approx(2 * 3 * 3)
    assert planner.data_parallel_time(1e9, 1, 3, 3, alpha=1.0, bandwidth=1e9) == 0.0


def test_one_gpu_small_model_needs_no_parallelism():
    result = planner.plan(
        "gpt2", seq_len=1024, global_batch_tokens=8 * 1024, cluster=planner.Cluster(nodes=1, gpus_per_node=1)
    )
    best = result.ranked[0].layout
    assert (best.tp, best.pp, best.dp, best.cp) == (1, 1, 1, 1)


def test_bad_input_raises_value_error_before_searching():
    with pytest.raises(ValueError, match="multiple of seq_len"):
        planner.plan("gpt2", seq_len=1000, global_batch_tokens=4096, cluster=planner.Cluster(nodes=1))
    with pytest.raises(ValueError, match="unknown GPU"):
        planner.plan("gpt2", seq_len=1024, global_batch_tokens=4096, cluster=planner.Cluster(gpu="tpu"))
    with pytest.raises(ValueError, match="power of two"):
        planner.plan("gpt2", seq_len=1024, global_batch_tokens=4096, cluster=planner.Cluster(gpus_per_node=3))
    with pytest.raises(ValueError, match="nvlink_domain must be whole nodes of 8 GPUs"):
        planner.plan("gpt2", seq_len=1024, global_batch_tokens=4096, cluster=planner.Cluster(nvlink_domain=12))
    with pytest.raises(ValueError, match="zero_stages"):
        planner.plan("gpt2", seq_len=1024, global_batch_tokens=4096, cluster=planner.Cluster(nodes=1),
                     zero_stages=(4,))  # fmt: skip


def test_a_gpu_without_bf16_is_refused_before_any_layout_is_predicted():
    """The step model predicts bf16 training: a V100 (fp16 and fp32 only) gets one message naming the GPUs
    that can be planned, not an error from deep inside the search."""
    with pytest.raises(ValueError, match="v100-sxm2-32gb has no bf16 arithmetic; choose a GPU that has: a100"):
        planner.plan("llama-3-8b", seq_len=8192, global_batch_tokens=2**19,
                     cluster=planner.Cluster(gpu="v100-sxm2-32gb", nodes=1))  # fmt: skip


def test_tensor_parallelism_is_bounded_by_the_nvlink_domain_not_by_a_constant():
    """GPT-3 175B (96 heads: tp up to 32 divides them) on 2,304 Blackwell GPUs: in GB200 NVL72 racks (72 GPUs per
    NVLink domain) the planner ranks layouts with TP 16 and 32; on HGX B200 boards (8 per domain) none above 8."""
    gpt3 = dict(seq_len=2048, global_batch_tokens=2304 * 2048, zero_stages=(1,), micro_batches=(1,))
    nvl72 = planner.plan("gpt3-175b", cluster=planner.NVL72, **gpt3)
    hgx = planner.plan("gpt3-175b", cluster=planner.Cluster(gpu="b200", nodes=288), **gpt3)
    assert planner.NVL72.gpus == hgx.ranked[0].layout.gpus == 2304
    assert {e.layout.tp for e in nvl72.ranked} >= {16, 32}
    assert max(e.layout.tp for e in hgx.ranked) == 8


DEEPSEEK_BASE = planner.TrainingLayout(tp=1, pp=1, dp=1, schedule="dualpipe", matmul_dtype="fp8", dispatch_bytes=1,
                                       node_limit=4, compute_share=112 / 132, overlap_p2p=True)  # fmt: skip


def test_the_planner_plans_deepseek_v3_with_expert_parallelism():
    """DeepSeek-V3 (DeepSeek-AI 2024, Sec. 3.1-3.2): 2,048 H800 in nodes of 8 with 8 x 400 Gb/s InfiniBand, 15,360
    sequences of 4,096 tokens, DualPipe, FP8, node-limited routing (4 nodes per token), 20 of 132 SMs kept for
    communication. The planner searches the expert-parallel degree; the published PP16 EP64 (DP128, no TP) fits and
    is within 5 % of the best layout it predicts (the acceptance bound of issue 33 for a published layout)."""
    ranked = planner.plan("deepseek-v3", seq_len=4096, global_batch_tokens=15360 * 4096,
                          cluster=planner.Cluster(gpu="h800-sxm", nodes=256), micro_batches=(1,), zero_stages=(1,),
                          recomputes=("selective",), base=DEEPSEEK_BASE)  # fmt: skip
    published = ranked.ranked[ranked.rank_of(tp=1, pp=16, dp=128, ep=64)]
    assert published.memory <= 80e9
    assert published.step_time <= 1.05 * ranked.ranked[0].step_time
    # Without expert parallelism the 671B fit only under TP 4-8 and many pipeline stages: more than twice as slow.
    without_ep = [e for e in ranked.ranked if e.layout.ep == 1]
    assert without_ep[0].step_time > 2 * ranked.ranked[0].step_time
