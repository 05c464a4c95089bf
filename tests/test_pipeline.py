"""Pipeline parallelism: schedules, their closed forms, and runs that match the unpartitioned model
and torch.distributed.pipelining."""

import statistics

import pytest
import torch

from scalebook import configs, data
from scalebook.accounting import pipeline as acc
from scalebook.model import GPTConfig
from scalebook.parallel import pipeline as pp
from scalebook.parallel.pipeline import PipelineRun

# Small enough that a P=4 launch runs a dozen steps in seconds; 8 layers split over up to 8 stages.
CONFIG = GPTConfig(vocab_size=256, block_size=16, n_layer=8, n_head=2, n_embd=32)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
# float32 sums in a different order (micro-batches, per-stage backward) differ by ~1e-7 relative;
# 1e-5 is far below any real error (a missing 1/M or a lost gradient is O(1) relative).
TOLERANCE = 1e-5
# Gradients are also compared tensor by tensor, relative to the tensor's largest reference entry, so that
# a wrong factor in a tensor of small gradients cannot hide under the absolute tolerance: rounding leaves
# ~1e-6 there, a missing 1/M leaves M - 1, a tied copy left unsummed order 1.
RELATIVE_TOLERANCE = 1e-4


def _relative_error(grad, reference):
    return ((grad - reference).abs().max() / reference.abs().max()).item()


def _batch(batch_size=8):
    tokens = data.tokenize(data.default_corpus())
    return data.get_batch(tokens, batch_size, CONFIG.block_size, torch.Generator().manual_seed(0))


def _actions(schedule, rank):
    return " ".join(f"{a.kind}{a.microbatch}" for a in schedule.actions[rank])


# ----- closed forms and schedules (no processes) --------------------------------------------------


def test_bubble_fraction_hand_values():
    assert acc.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    # The seed's example: P = 16 stages, M = 48 micro-batches.
    assert acc.bubble_fraction(16, 48) == pytest.approx(15 / 63)
    assert acc.bubble_fraction(4, 8, virtual_stages=2) == pytest.approx(3 / 19)
    # Narayanan et al. 2021 state it relative to the ideal time: (p - 1) / m, and (1/v)(p - 1)/m interleaved.
    assert acc.bubble_overhead(16, 48) == pytest.approx(15 / 48)
    assert acc.bubble_overhead(4, 8, virtual_stages=2) == pytest.approx(3 / 16)
    assert acc.step_time(4, 8, 1.0, 2.0) == pytest.approx(33.0)


def test_gpipe_runs_all_forwards_then_all_backwards():
    schedule = pp.build_schedule("gpipe", 3, 4)
    for rank in range(3):
        assert _actions(schedule, rank) == "F0 F1 F2 F3 B0 B1 B2 B3"
        assert {a.stage for a in schedule.actions[rank]} == {rank}


def test_1f1b_order_matches_megatron_figure():
    # Narayanan et al. 2021, Fig. 4 (top): 4 devices, 8 micro-batches (the figure counts from 1).
    schedule = pp.build_schedule("1f1b", 4, 8)
    assert _actions(schedule, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert _actions(schedule, 1) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert _actions(schedule, 2) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert _actions(schedule, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


@pytest.mark.parametrize("P,M,v", [(2, 4, 2), (2, 8, 4), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 2)])
def test_interleaved_order_matches_torch_pipeline_order(P, M, v):
    # torch's visualizer builds ScheduleInterleaved1F1B's action lists without running anything.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    theirs = get_schedule_ops("Interleaved1F1B", P, M, v)
    ours = pp.build_schedule("interleaved", P, M, v)
    for rank in range(P):
        expected = [
            (op.computation_type.value, op.microbatch_index, op.stage_index)
            for op in theirs[rank]
            if op is not None and op.computation_type.value in ("F", "B")
        ]
        assert [(a.kind, a.microbatch, a.stage) for a in ours.actions[rank]] == expected


@pytest.mark.parametrize("name,v", SCHEDULES)
@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_simulated_bubble_equals_formula(name, v, P):
    for M in (P, 2 * P, 4 * P):
        schedule = pp.build_schedule(name, P, M, v)
        for backward in (1.0, 2.0, 3.0):
            simulated = pp.simulated_bubble(schedule, forward=1.0, backward=backward)
            assert simulated == pytest.approx(acc.bubble_fraction(P, M, virtual_stages=v), abs=1e-12)


@pytest.mark.parametrize("name,v", SCHEDULES)
def test_peak_in_flight_of_schedules_matches_closed_form(name, v):
    for P in (2, 3, 4, 8):
        for M in (P, 2 * P, 3 * P):
            closed = [acc.peak_in_flight(name, P, M, r, virtual_stages=v) for r in range(P)]
            assert pp.peak_in_flight(pp.build_schedule(name, P, M, v)) == closed
    assert [acc.peak_in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert acc.peak_in_flight("gpipe", 4, 8, 0) == 8
    # Interleaved, P = 4, v = 2, rank 0: 2 (P - 1) + (v - 1) P = 10 warm-up chunks, then one more.
    assert acc.peak_in_flight("interleaved", 4, 8, 0, virtual_stages=2) == 11


def test_a_schedule_that_deadlocks_is_refused():
    good = pp.build_schedule("gpipe", 2, 2)
    swapped = (good.actions[0], tuple(reversed(good.actions[1])))  # rank 1 wants B1 before any forward
    bad = pp.Schedule("broken", 2, 2, 1, swapped)
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits at .*, rank 1 waits at .*'B', microbatch=1"):
        pp.simulate(bad)


def test_schedule_table_prints_the_gantt_chart():
    assert str(pp.build_schedule("gpipe", 2, 2)) == (
        "gpipe: p=2 ranks, m=2 micro-batches\nrank 0 | F0 F1 .  .  B0 B1\nrank 1 | .  F0 F1 B0 B1 ."
    )


def test_balanced_partition_hand_examples():
    assert acc.balanced_partition([0, 1, 1, 1, 1, 0], 2) == [range(0, 2), range(2, 4)]
    # A head as costly as three layers pushes layers to the first stage: 3 | 1 + 3.
    assert acc.balanced_partition([0, 1, 1, 1, 1, 3], 2) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 stages"):
        acc.balanced_partition([0, 1, 1, 1, 0], 4)


def test_gpt2_costs_sum_to_its_parameter_count_and_its_head_wants_a_short_last_stage():
    gpt2 = configs.get_model("gpt2")
    params = acc.layer_costs(gpt2)
    # 124,439,808 parameters (GPT2LMHeadModel, tied), plus the last stage's copy of the 50257 x 768 matrix.
    assert sum(params) == 124_439_808 + 50257 * 768
    flops = acc.layer_costs(gpt2, by="flops", seq_len=1024)
    # Per token: 3 (2 * 12 h^2 + 4 s h) per layer and 3 * 2 h V for the head, by hand.
    assert flops[1] == 3 * (2 * 12 * 768**2 + 4 * 1024 * 768)
    assert flops[-1] / flops[1] == pytest.approx(4.46, abs=0.01)
    stages = acc.balanced_partition(flops, 4)
    assert len(stages[-1]) == 1 and max(len(s) for s in stages) == 4


def test_llama3_405b_balanced_over_16_stages_has_one_layer_fewer_on_first_and_last():
    # Grattafiori et al. 2024, Sec. 3.3.2: 126 layers on 16 pipeline stages, one Transformer layer
    # fewer on the first stage (embedding) and on the last (output layer and loss).
    llama = configs.get_model("llama-3.1-405b")
    stages = acc.balanced_partition(acc.layer_costs(llama), 16)
    assert [len(s) for s in stages] == [7] + [8] * 14 + [7]


def test_invalid_layouts_raise_before_any_process_starts(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started for an invalid layout")

    monkeypatch.setattr(pp, "launch", no_launch)
    x, y = _batch()
    cases = [
        (4, [PipelineRun("interleaved", 6, 2)], "microbatches must be a multiple of 4"),
        (4, [PipelineRun("interleaved", 2, 2)], "microbatches must be a multiple of 4"),
        (2, [PipelineRun("interleaved", 4, 1)], "needs virtual_stages >= 2"),
        (2, [PipelineRun("gpipe", 4, 2)], "needs schedule='interleaved'"),
        (4, [PipelineRun("1f1b", 4, 1, layers_per_stage=(3, 3, 1, 0))], "at least one layer"),
        (4, [PipelineRun("interleaved", 4, 3)], "8 layers do not split evenly over 12 stages"),
        (2, [PipelineRun("1f1b", 3)], "batch size 8 does not split into 3 equal micro-batches"),
        (4, [PipelineRun("1f1b", 2, compare_torch=True)], "Schedule1F1B needs microbatches >= pp=4"),
        (1, [PipelineRun("gpipe", 4)], "needs pp >= 2"),
        (2, [PipelineRun("zero-bubble", 4)], "schedule must be one of"),
        (2, [PipelineRun("1f1b", 4, emulate=(0.01,))], "emulate must be .forward seconds, backward seconds."),
        (2, [PipelineRun("1f1b", 4, repeats=0)], "repeats must be an integer >= 1"),
    ]
    for pp_size, runs, message in cases:
        with pytest.raises(ValueError, match=message):
            pp.run_pipeline(CONFIG, pp_size, runs, x, y)
    with pytest.raises(ValueError, match="multiple of 4"):
        pp.build_schedule("interleaved", 4, 6, 2)


# ----- runs on 2 and 4 ranks ----------------------------------------------------------------------


def _check_equivalence_and_counts(results, P, x):
    reference_loss, reference_grads = pp.reference_loss_and_grads(CONFIG, x, _batch()[1], seed=0)
    for result in results:
        run = result.run
        assert result.loss == pytest.approx(reference_loss, abs=TOLERANCE)
        assert result.torch_loss == pytest.approx(reference_loss, abs=TOLERANCE)
        assert result.grads.keys() == result.torch_grads.keys() == reference_grads.keys()
        for name, expected in reference_grads.items():
            torch.testing.assert_close(result.grads[name], expected, atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(result.torch_grads[name], expected, atol=TOLERANCE, rtol=0)
            assert _relative_error(result.grads[name], expected) < RELATIVE_TOLERANCE, (run, name)
            assert _relative_error(result.torch_grads[name], expected) < RELATIVE_TOLERANCE, (run, name)
        # Activations the autograd graph held at once, counted by saved-tensor hooks.
        expected_peaks = [acc.peak_in_flight(run.schedule, P, run.microbatches, r, virtual_stages=run.virtual_stages)
                          for r in range(P)]  # fmt: skip
        assert result.peak_in_flight == expected_peaks
        message = acc.p2p_bytes_per_microbatch(x.shape[0] // run.microbatches, x.shape[1], CONFIG.n_embd, dtype_bytes=4)
        for r in range(P):
            sent = acc.p2p_bytes_per_step(P, run.microbatches, message, rank=r, virtual_stages=run.virtual_stages)
            assert result.bytes_sent[r]["isend"] == sent
        # The tied embedding: one all-reduce of the V x d fp32 gradient between the first and last rank
        # (the message size is measured; its bytes sent are the ring's 2 (2 - 1) / 2 = 1 message).
        tied = CONFIG.vocab_size * CONFIG.n_embd * 4
        assert [m.get("all_reduce", 0) for m in result.message_bytes] == [tied] + [0] * (P - 2) + [tied]
        assert [b.get("all_reduce", 0) for b in result.bytes_sent] == [tied] + [0] * (P - 2) + [tied]


def test_two_stages_match_unpartitioned_model_and_torch_pipelining():
    x, y = _batch()
    runs = [PipelineRun(name, M, v, compare_torch=True) for name, v in SCHEDULES for M in (4, 8)]
    # Emulated timing: every forward lasts 30 ms and every backward 60 ms (per micro-batch and rank), so
    # the bubble is the schedule's; the faster of two repeats is kept.
    timed = [PipelineRun(name, 4, v, emulate=(0.03, 0.06), repeats=2) for name, v in SCHEDULES]
    results = pp.run_pipeline(CONFIG, 2, runs + timed, x, y)
    _check_equivalence_and_counts(results[: len(runs)], 2, x)
    excess = [
        statistics.mean(r.measured_bubble()) - acc.bubble_fraction(2, 4, virtual_stages=r.run.virtual_stages)
        for r in results[len(runs) :]
    ]
    # The formula leaves out each action's message latency and wake-up (about a millisecond on a busy
    # machine); other programs can delay one run, so the median is held to the tolerance.
    assert min(excess) >= -0.01 and statistics.median(excess) <= 0.05, excess


def test_four_stages_match_unpartitioned_model_and_torch_pipelining():
    x, y = _batch()
    runs = [PipelineRun(name, M, v, compare_torch=True) for name, v in SCHEDULES for M in (4, 8)]
    runs.append(PipelineRun("1f1b", 8, layers_per_stage=(1, 3, 3, 1), compare_torch=True))
    results = pp.run_pipeline(CONFIG, 4, runs, x, y)
    _check_equivalence_and_counts(results, 4, x)
