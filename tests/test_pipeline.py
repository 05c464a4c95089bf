"""Pipeline parallelism: stages as slices of the GPT, schedules and their closed forms, a point-to-point plan
that pairs under NCCL's rules, and runs that match the unpartitioned model and torch.distributed.pipelining."""

import contextlib
import copy
import dataclasses
import itertools
import statistics

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from scalebook import configs, data
from scalebook.accounting import pipeline as acc
from scalebook.comm import launch
from scalebook.experiments import pipeline as ex
from scalebook.experiments.pipeline import PipelineRun
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import pipeline as pp

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
    return data.get_batch(data.corpus_tokens(), batch_size, CONFIG.block_size, torch.Generator().manual_seed(0))


def _actions(schedule, rank):
    return " ".join(f"{a.kind}{a.microbatch}" for a in schedule.actions[rank])


# ----- a stage is a slice of the GPT (one process) -------------------------------------------------


def test_stages_chained_in_one_process_are_the_model_with_its_parameter_names():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    x, y = _batch()
    _, reference = model(x, y)
    stages = [pp.pipeline_stage(copy.deepcopy(model), s, 3, layers_per_stage=(2, 5, 1)) for s in range(3)]
    hidden = stages[1](stages[0](x))
    _, loss = stages[2](hidden, y)
    assert loss.item() == reference.item()  # the same operations in the same order: bit-identical
    assert [list(s.blocks.keys()) for s in stages] == [["0", "1"], ["2", "3", "4", "5", "6"], ["7"]]
    assert stages[0].lm_head is None and stages[0].ln_f is None and stages[2].wte is None and stages[2].wpe is None
    # Every parameter keeps the full model's name; the tied matrix is wte on the first stage, lm_head on the last.
    names = [name for s in stages for name, _ in s.named_parameters()]
    assert sorted(names) == sorted([*dict(model.named_parameters()), "lm_head.weight"])
    assert torch.equal(stages[2].lm_head.weight, model.wte.weight)
    with pytest.raises(ValueError, match="already a pipeline stage"):
        pp.pipeline_stage(stages[0], 0, 3)
    with pytest.raises(ValueError, match=r"stage must be an integer in \[0, n_stages=3\)"):
        pp.pipeline_stage(copy.deepcopy(model), 3, 3)
    with pytest.raises(ValueError, match="8 layers do not split evenly over 3 stages"):
        pp.pipeline_stage(copy.deepcopy(model), 0, 3)
    with pytest.raises(ValueError, match="activation_checkpointing must be True, False or None"):
        pp.pipeline_stage(copy.deepcopy(model), 0, 2, activation_checkpointing=1)


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
            simulated = ex.simulated_bubble(schedule, forward=1.0, backward=backward)
            assert simulated == pytest.approx(acc.bubble_fraction(P, M, virtual_stages=v), abs=1e-12)


@pytest.mark.parametrize("name,v", SCHEDULES)
def test_peak_in_flight_of_schedules_matches_closed_form(name, v):
    for P in (2, 3, 4, 8):
        for M in (P, 2 * P, 3 * P):
            closed = [acc.peak_in_flight(name, P, M, r, virtual_stages=v) for r in range(P)]
            assert ex.peak_in_flight(pp.build_schedule(name, P, M, v)) == closed
    assert [acc.peak_in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert acc.peak_in_flight("gpipe", 4, 8, 0) == 8
    # Interleaved, P = 4, v = 2, rank 0: 2 (P - 1) + (v - 1) P = 10 warm-up chunks, then one more.
    assert acc.peak_in_flight("interleaved", 4, 8, 0, virtual_stages=2) == 11


def test_a_schedule_that_deadlocks_is_refused_by_the_simulation_and_the_runtime():
    good = pp.build_schedule("gpipe", 2, 2)
    swapped = (good.actions[0], tuple(reversed(good.actions[1])))  # rank 1 wants B1 before any forward
    bad = pp.Schedule("broken", 2, 2, 1, swapped)
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits at .*, rank 1 waits at .*'B', microbatch=1"):
        pp.simulate(bad)
    with pytest.raises(ValueError, match="deadlocks"):
        pp.p2p_plan(bad, 0)
    split = ex.schedule_from_torch("ZBVZeroBubble", 2, 4)
    with pytest.raises(ValueError, match="the runtime runs F and B actions"):
        pp.p2p_plan(split, 0)


def test_schedule_table_prints_the_gantt_chart():
    assert ex.schedule_table(pp.build_schedule("gpipe", 2, 2)) == (
        "gpipe: p=2 ranks, m=2 micro-batches\nrank 0 | F0 F1 .  .  B0 B1\nrank 1 | .  F0 F1 B0 B1 ."
    )


# ----- the point-to-point plan under NCCL's rules --------------------------------------------------


def _execute_under_nccl_rules(plans):
    """Run every rank's batches as NCCL would: a rank's batches one after another, each finished when every
    transfer in it has its counterpart posted on the peer, the n-th send from a to b paired with the n-th
    receive on b from a (tags ignored). Returns each direction's messages as (sent, received) in pairing
    order; raises AssertionError naming the ranks if they deadlock."""
    P = len(plans)
    posted = {}  # (rank, peer, send?) -> transfers posted so far; finished likewise
    finished, position, messages = {}, [0] * P, {}

    def post(rank):
        for t in plans[rank][position[rank]] if position[rank] < len(plans[rank]) else ():
            posted[rank, t.peer, t.send] = posted.get((rank, t.peer, t.send), 0) + 1
            pair = (rank, t.peer) if t.send else (t.peer, rank)
            messages.setdefault(pair, ([], []))[0 if t.send else 1].append((t.kind, t.microbatch, t.stage))

    for rank in range(P):
        post(rank)
    progress = True
    while progress:
        progress = False
        for rank in range(P):
            if position[rank] == len(plans[rank]):
                continue
            wanted = {}
            for t in plans[rank][position[rank]]:
                wanted[t.peer, t.send] = wanted.get((t.peer, t.send), finished.get((rank, t.peer, t.send), 0)) + 1
            if all(posted.get((peer, rank, not send), 0) >= n for (peer, send), n in wanted.items()):
                finished.update({(rank, peer, send): n for (peer, send), n in wanted.items()})
                position[rank] += 1
                post(rank)
                progress = True
    stuck = [rank for rank in range(P) if position[rank] < len(plans[rank])]
    assert not stuck, f"ranks {stuck} deadlock"
    return messages


def _batches(schedule):
    return [[step for step in pp.p2p_plan(schedule, rank) if isinstance(step, tuple)] for rank in range(schedule.pp)]


@pytest.mark.parametrize("name,v", [*SCHEDULES, ("interleaved", 3)])
@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_p2p_plan_pairs_every_message_and_never_deadlocks_under_nccl_rules(name, v, P):
    for M in (P, 2 * P, 4 * P):
        schedule = pp.build_schedule(name, P, M, v)
        for sent, received in _execute_under_nccl_rules(_batches(schedule)).values():
            assert sent == received  # the n-th send carries what the n-th receive expects
        messages = 2 * M * (schedule.n_stages - 1)  # each boundary: M activations and M gradients
        assert sum(len(batch) for plan in _batches(schedule) for batch in plan) == 2 * messages  # posted twice


def test_the_nccl_check_catches_sends_and_receives_posted_in_separate_batches():
    # Each rank first sends its micro-batch, then receives the other's, in separate batches (as two blocking
    # sends would): under NCCL both wait at their send. The check must fail on this plan.
    plans = [[(pp.Transfer("F", 0, 1, 1, True),), (pp.Transfer("B", 0, 0, 1, False),)],
             [(pp.Transfer("B", 0, 0, 0, True),), (pp.Transfer("F", 0, 1, 0, False),)]]  # fmt: skip
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] deadlock"):
        _execute_under_nccl_rules(plans)
    batched = [[plans[0][0] + plans[0][1]], [plans[1][0] + plans[1][1]]]
    assert _execute_under_nccl_rules(batched)[0, 1] == ([("F", 0, 1)], [("F", 0, 1)])


# ----- layouts that cannot run --------------------------------------------------------------------


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

    monkeypatch.setattr(ex, "launch", no_launch)
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
        (2, [PipelineRun("1f1b", 4, activation_checkpointing="yes")], "activation_checkpointing must be True or False"),
        (2, [PipelineRun("1f1b", 4, overlap_p2p=1)], "overlap_p2p must be True or False"),
        (2, [PipelineRun("1f1b", 4, stand_in_width=0)], "stand_in_width must be a positive integer"),
        (2, [PipelineRun("1f1b", 4, stand_in_width=8, compare_torch=True)], "stand-in stages have no"),
    ]
    for pp_size, runs, message in cases:
        with pytest.raises(ValueError, match=message):
            ex.run_pipeline(CONFIG, pp_size, runs, x, y)
    with pytest.raises(ValueError, match="multiple of 4"):
        pp.build_schedule("interleaved", 4, 6, 2)


# ----- runs on 2 and 4 ranks ----------------------------------------------------------------------


def _check_equivalence_and_counts(results, P, x):
    reference_loss, reference_grads = ex.reference_loss_and_grads(CONFIG, x, _batch()[1], seed=0)
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
    # Emulated timing: every forward lasts 60 ms and every backward 120 ms (per micro-batch and rank), so
    # the bubble is the schedule's; the fastest of three repeats is kept (on a busy machine, with two test
    # workers, another program can delay one). With 30 and 60 ms the fixed cost of each action (below)
    # was a median excess of 0.053 in a CI run at load 5 (2026-11-28); doubling the actions halves its share.
    timed = [PipelineRun(name, 4, v, emulate=(0.06, 0.12), repeats=3) for name, v in SCHEDULES]
    results = ex.run_pipeline(CONFIG, 2, runs + timed, x, y)
    _check_equivalence_and_counts(results[: len(runs)], 2, x)
    excess = [
        statistics.mean(r.measured_bubble()) - acc.bubble_fraction(2, 4, virtual_stages=r.run.virtual_stages)
        for r in results[len(runs) :]
    ]
    # The formula leaves out each action's message latency and wake-up (a millisecond to a few on two busy
    # cores); other programs can delay one run, so the median is held to the tolerance.
    assert min(excess) >= -0.01 and statistics.median(excess) <= 0.05, excess


def test_four_stages_match_unpartitioned_model_and_torch_pipelining_with_and_without_overlapped_transfers():
    x, y = _batch()
    # Every schedule once (the interleaved one with two rounds of micro-batches), and uneven stages; which
    # message pairs with which is checked for many more layouts by the NCCL-rules test above.
    runs = [PipelineRun("gpipe", 4, compare_torch=True), PipelineRun("1f1b", 4, compare_torch=True),
            PipelineRun("interleaved", 8, 2, compare_torch=True),
            PipelineRun("1f1b", 8, layers_per_stage=(1, 3, 3, 1), compare_torch=True)]  # fmt: skip
    overlapped = [dataclasses.replace(run, compare_torch=False, overlap_p2p=True) for run in runs]
    results = ex.run_pipeline(CONFIG, 4, runs + overlapped, x, y)
    _check_equivalence_and_counts(results[: len(runs)], 4, x)
    # Overlapping changes when a transfer is waited for, not what is computed or sent: bit for bit the same.
    for blocking, overlap in zip(results[: len(runs)], results[len(runs) :], strict=True):
        assert overlap.loss == blocking.loss and overlap.bytes_sent == blocking.bytes_sent, overlap.run
        assert all(torch.equal(overlap.grads[name], g) for name, g in blocking.grads.items()), overlap.run


def test_checkpointed_stages_give_the_same_loss_and_gradients_and_save_what_the_formula_says():
    x, y = _batch()
    M, b, s = 4, x.shape[0] // 4, x.shape[1]
    runs = [PipelineRun("1f1b", M), PipelineRun("1f1b", M, activation_checkpointing=True)]
    plain, checkpointed = ex.run_pipeline(CONFIG, 2, runs, x, y)
    # Recomputation reruns the same operators on the same inputs with the same threads: bit-identical.
    assert checkpointed.loss == plain.loss
    assert plain.grads.keys() == checkpointed.grads.keys()
    assert all(torch.equal(checkpointed.grads[name], g) for name, g in plain.grads.items())
    assert plain.peak_in_flight == checkpointed.peak_in_flight == [2, 1]  # 1F1B: p - r micro-batches
    partition = pp.stage_layers(CONFIG.n_layer, 2)
    shape = dict(seq_len=s, microbatches=M, micro_batch=b, dropout=False, dtype_bytes=4)
    model = configs.ModelConfig.from_gpt_config(CONFIG)
    stored, recomputed = (acc.stage_memory(model, partition, recompute=how, **shape) for how in ("none", "full"))
    # Korthikanti et al.'s count leaves out, per layer and micro-batch, each LayerNorm's mean and 1/std per
    # token (2 norms x 2 fp32 numbers) and attention's s x s boolean causal mask; checkpointing drops them too.
    left_out = 2 * 2 * s * b * 4 + s * s
    for r in range(2):
        saved = plain.peak_activation_bytes[r] - checkpointed.peak_activation_bytes[r]
        expected = stored[r].activations - recomputed[r].activations
        assert saved == expected + stored[r].in_flight * len(partition[r]) * left_out, r
    # What is left is the block inputs (the formula's s b h per layer) and what lies outside the blocks, counted
    # by hand: the first stage's token ids and positions (int64); the last stage's final-norm input and
    # statistics, head input, log-softmax output, targets (int64) and the loss's 4-byte total weight.
    h, V = CONFIG.n_embd, CONFIG.vocab_size
    outside = [2 * (b * s * 8 + s * 8), 2 * 4 * s * b * h + 2 * s * b * 4 + 4 * b * s * V + 8 * b * s + 4]
    assert checkpointed.peak_activation_bytes == [recomputed[r].activations + outside[r] for r in range(2)]


class _TrackedWork:
    """A request that remembers whether the runtime waited for it."""

    def __init__(self, work, posted):
        self.work, self.waited = work, False
        posted.append(self)

    def wait(self):
        assert not self.waited, "a request waited for twice (gloo would wait for a second message)"
        self.waited = True
        return self.work.wait()


def _batched_p2p_only_worker(x, y):
    """Run every schedule, blocking and overlapped, with point-to-point calls allowed only inside
    batch_isend_irecv, all with tag 0; return the losses with the most transfers a forward or backward
    started with still unwaited-for, and the errors of a direct isend and of stages that do not fit."""
    direct = {name: getattr(c10d, name) for name in ("send", "recv", "isend", "irecv")}
    batch_isend_irecv, inside, posted = c10d.batch_isend_irecv, [], []

    def guarded(name):
        def call(*args, **kwargs):
            if not inside:
                raise AssertionError(f"dist.{name} called outside batch_isend_irecv")
            return direct[name](*args, **kwargs)

        return call

    def batched(ops):
        assert all(op.tag == 0 for op in ops), "a tag was used"
        inside.append(True)
        try:
            return [_TrackedWork(work, posted) for work in batch_isend_irecv(ops)]
        finally:
            inside.pop()

    in_flight = []  # per forward or backward: the transfers posted and not yet waited for

    @contextlib.contextmanager
    def recorder(phase, action):
        if phase in ("F", "B"):
            in_flight.append(sum(not work.waited for work in posted))
        yield

    for name in direct:  # P2POp and batch_isend_irecv compare ops with c10d.isend: one object in both namespaces
        setattr(c10d, name, guarded(name))
        setattr(dist, name, getattr(c10d, name))
    c10d.batch_isend_irecv = dist.batch_isend_irecv = batched
    group, rank = dist.new_group([0, 1]), dist.get_rank()
    torch.manual_seed(0)
    model, losses = GPT(CONFIG), []
    for (name, v), overlap in itertools.product(SCHEDULES, (False, True)):
        schedule = pp.build_schedule(name, 2, 4, v)
        in_flight.clear()
        loss = pp.run_schedule(schedule, ex.build_stages(model, schedule, rank), x, y, group=group,
                               recorder=recorder, overlap_p2p=overlap)  # fmt: skip
        assert all(work.waited for work in posted)  # every request waited for once, by the end of the step
        losses.append((None if loss is None else loss.item(), max(in_flight)))
    errors, schedule = [], pp.build_schedule("1f1b", 2, 4)
    for attempt in (lambda: dist.isend(torch.zeros(1), dst=1 - rank),
                    lambda: pp.run_schedule(schedule, {5: model}, x, y, group=group)):  # fmt: skip
        try:
            attempt()
        except (AssertionError, ValueError) as error:
            errors.append(str(error))
    return losses, errors


def test_runtime_communicates_only_through_batch_isend_irecv_without_tags():
    x, y = _batch()
    reference_loss, _ = ex.reference_loss_and_grads(CONFIG, x, y, seed=0)
    (first_losses, first_errors), (last_losses, _) = launch(_batched_p2p_only_worker, 2, x, y)
    assert [loss for loss, _ in first_losses] == [None] * 6
    assert [loss for loss, _ in last_losses] == pytest.approx([reference_loss] * 6, abs=TOLERANCE)
    # Blocking, every transfer is waited for before the next computation; overlapped, every schedule computes
    # while some are in flight (on both ranks: sends not waited for, receives posted ahead).
    for losses in (first_losses, last_losses):
        assert [n for _, n in losses[0::2]] == [0] * 3 and all(n > 0 for _, n in losses[1::2]), losses
    assert first_errors == ["dist.isend called outside batch_isend_irecv", "rank 0 holds stages [0], got stages [5]"]
