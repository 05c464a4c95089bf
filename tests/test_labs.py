"""Each lab of Chapter 16: the diagnosis detects the deliberately broken variant, and the fix removes it."""

import os
from pathlib import Path

import pytest
import torch

from scalebook import labs
from scalebook.comm import launch
from scalebook.experiments.ddp import run_experiments
from scalebook.model import GPTConfig

BROKEN_HANG, FIXED_HANG = labs.HANG_VARIANTS


def _ranks_alive() -> set[int]:
    """Live spawned children of this process, read from /proc. multiprocessing's resource tracker, a
    helper that lives as long as the session, is not a rank and is left out."""
    mine, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == mine and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            found.add(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def results():
    """One launch on 2 ranks runs the fixed hang worker and labs 2, 3, 4 and 9."""
    return launch(
        run_experiments,
        2,
        hang_fixed=(labs.sync_and_check_stop, {"variant": FIXED_HANG}),
        accumulation=(labs.accumulation_lab, {"steps": 2}),
        no_sync=(labs.no_sync_lab, {"steps": 2}),
        randomness=(labs.randomness_lab, {}),
        sdc=(labs.sdc_lab, {}),
        timeout=120,
    )


def test_mismatched_collectives_surface_within_the_timeout_and_leave_no_process():
    before = _ranks_alive()
    report = labs.diagnose_hang(BROKEN_HANG, debug="OFF", timeout=2.0)
    assert report.surfaced and "timed out" in report.cause
    # gloo waits exactly the process-group timeout; the launcher adds at most a few seconds of grace.
    assert 1.9 <= report.seconds_in_rank <= 3.0
    assert report.mismatch == "collective #0: rank 0 broadcast of 4 bytes, rank 1 all_reduce of 4,000 bytes"
    assert _ranks_alive() <= before


def test_distributed_debug_detail_names_the_mismatch_at_once():
    report = labs.diagnose_hang(BROKEN_HANG, debug="DETAIL", timeout=30.0)
    assert report.surfaced and report.seconds_in_rank < 2.0  # far below the 30 s timeout
    assert report.cause == "fingerprint mismatch: rank 0 runs BROADCAST[1], rank 1 runs ALLREDUCE[1000]"
    assert "TORCH_DISTRIBUTED_DEBUG" not in os.environ or os.environ["TORCH_DISTRIBUTED_DEBUG"] != "DETAIL"


def test_same_collective_order_completes(results):
    assert [r["hang_fixed"] for r in results] == [1000.0, 1000.0]  # ranks 0 and 1 each add 0 + 1, 1000 times


def test_flight_recorder_finds_no_mismatch_in_identical_traces(tmp_path):
    for rank in range(2):
        (tmp_path / f"rank{rank}.trace").write_text("all_reduce 4000 2\nbroadcast 4 2\n")
    assert labs.first_mismatch(tmp_path, 2) is None
    (tmp_path / "rank1.trace").write_text("all_reduce 4000 2\n")
    assert labs.first_mismatch(tmp_path, 2) == "collective #1: rank 0 broadcast of 4 bytes, rank 1 issued nothing"


def test_accumulation_parity_catches_both_scaling_bugs_and_passes_the_fix(results):
    acc = results[0]["accumulation"]
    unscaled, per_micro_batch, fixed = (acc[v] for v in labs.ACCUMULATION_VARIANTS)
    # Forgetting 1/grad_accum multiplies the gradient by about grad_accum = 4: relative error near 3.
    assert 2.5 < unscaled["grad_error"] < 3.5
    assert per_micro_batch["grad_error"] > 0.05  # micro-batches weighted by 1/4, not by their tokens
    assert fixed["grad_error"] < 1e-5  # fp32 sums in another order
    for broken in (unscaled, per_micro_batch):
        assert max(abs(a - b) / b for a, b in zip(broken["losses"], acc["reference"], strict=True)) > 1e-3
    assert max(abs(a - b) / b for a, b in zip(fixed["losses"], acc["reference"], strict=True)) < 1e-5


def test_no_sync_misuse_shows_in_checksums_and_traffic(results):
    runs = results[0]["no_sync"]
    never, always, fixed = (runs[v] for v in labs.NO_SYNC_VARIANTS)
    assert all(labs.spread(c) > 0 for c in never["checksums"])  # replicas drift apart
    assert all(labs.spread(c) == 0 for c in always["checksums"] + fixed["checksums"])
    assert never["bytes_sent"] == [0.0, 0.0]
    assert fixed["bytes_sent"] == [fixed["expected_bytes"]] * 2
    assert always["bytes_sent"] == [4 * fixed["expected_bytes"]] * 2  # once per micro-batch: grad_accum = 4


def test_checksums_expose_unsynchronized_seeds_and_unsharded_data(results):
    tp, data = results[0]["randomness"]["tp"], results[0]["randomness"]["data"]
    broken_tp, fixed_tp = (tp[v] for v in labs.TP_SEED_VARIANTS)
    assert labs.spread(broken_tp["checksums"]) > 0 and broken_tp["loss_error"] > 1e-3
    assert labs.spread(fixed_tp["checksums"]) == 0 and fixed_tp["loss_error"] < 1e-5
    broken_data, fixed_data = (data[v]["checksums"] for v in labs.DATA_VARIANTS)
    assert broken_data[0] == broken_data[1] and fixed_data[0] != fixed_data[1]


def test_checksum_sees_a_permutation():
    t = torch.arange(10.0)
    assert labs.checksum([t]) != labs.checksum([t.flip(0)])
    assert labs.checksum([t]) == labs.checksum([t.clone()])


def test_accounting_refuses_exactly_the_micro_batches_the_emulated_device_cannot_hold():
    config = GPTConfig.named("tiny")
    one = labs.predicted_peak_bytes(config, micro_batch=1, seq_len=64)
    capacity = int(one["model_states"] + 4.5 * (one["total"] - one["model_states"]))
    rows = labs.oom_sweep(config, [3, 4, 5, 6], seq_len=64, capacity=capacity)
    assert [r["refused"] for r in rows] == [False, False, True, True]
    assert [r["out_of_memory"] for r in rows] == [r["refused"] for r in rows]
    for r in rows[:2]:  # the prediction is within 1 % of the measured peak
        assert abs(r["observed"] - r["predicted"]) / r["observed"] < 0.01
    with pytest.raises(ValueError, match="use micro_batch <= 4"):
        labs.check_fits(config, micro_batch=6, seq_len=64, capacity=capacity)


def test_bad_variant_is_refused():
    with pytest.raises(ValueError, match="variants must be"):
        labs.diagnose_hang("broken: something else")


def test_flight_recorder_compares_calls_not_the_times_ranks_entered_them(tmp_path):
    (tmp_path / "rank0.trace").write_text("all_reduce 4000 2 100.000000\nbroadcast 4 2 100.500000\n")
    (tmp_path / "rank1.trace").write_text("all_reduce 4000 2 100.250000\nbroadcast 4 2 100.500000\n")
    assert labs.first_mismatch(tmp_path, 2) is None
    assert [c.entered for c in labs.read_trace(tmp_path / "rank1.trace")] == [100.25, 100.5]


def test_find_straggler_needs_a_rank_slower_by_the_margin_in_most_steps():
    fast, slow = 0.02, 0.25
    assert labs.find_straggler([[fast, slow, fast]] * 5) == 1
    assert labs.find_straggler([[fast, fast, fast]] * 5) is None
    # One disturbed step on rank 0 is not a straggler: the medians ignore it.
    assert labs.find_straggler([[slow, fast, fast]] + [[fast, fast, fast]] * 4) is None
    # Slower by more than the ratio but by less than min_excess seconds: noise on a busy machine, not a straggler.
    assert labs.find_straggler([[0.001, 0.004]] * 3, min_excess=0.05) is None
    with pytest.raises(ValueError, match="at least 2 ranks"):
        labs.find_straggler([[fast]])


def test_entry_times_in_the_flight_recorder_name_the_rank_that_enters_last(tmp_path):
    entries = [[0.0, 0.30, 0.01], [0.02, 0.31, 0.0], [0.0, 0.29, 0.0]]  # rank 1 enters each all-reduce last
    for rank in range(3):
        lines = [f"all_reduce 4000 3 {100 + i + times[rank]:.6f}\nall_gather_single 24 3 {100.5 + i:.6f}\n"
                 for i, times in enumerate(entries)]  # fmt: skip
        (tmp_path / f"rank{rank}.trace").write_text("".join(lines))
    lateness = labs.entry_lateness(tmp_path, 3)
    assert [[round(t, 6) for t in row] for row in lateness] == [[0.0, 0.3, 0.01], [0.02, 0.31, 0.0], [0.0, 0.29, 0.0]]
    assert labs.straggler_from_trace(tmp_path, 3) == 1
    assert labs.straggler_from_trace(tmp_path, 3, op="all_gather_single") is None  # everyone entered together


def test_step_times_and_flight_recorder_name_the_slow_rank_and_find_none_without_it():
    # A 0.5 s sleep against a detection margin of 0.25 s: far above what a loaded machine's scheduling does.
    broken, fixed = labs.diagnose_slow_rank(world_size=3, slow_rank=2, delay=0.5, steps=6, min_excess=0.25)
    assert broken.variant.startswith("broken") and fixed.variant.startswith("fixed")
    assert broken.from_times == 2 and broken.from_trace == 2
    assert fixed.from_times is None and fixed.from_trace is None
    # The straggler computes longest and waits least: its peers wait in the all-reduce for it.
    compute, wait = broken.medians("compute"), broken.medians("wait")
    assert max(range(3), key=compute.__getitem__) == 2 and min(range(3), key=wait.__getitem__) == 2
    assert broken.last_to_enter()[2] > 6 / 2
    # Every rank's step takes at least the sleep: one slow rank sets the pace of all of them.
    assert min(broken.medians("step")) >= 0.5


def test_slow_rank_lab_refuses_a_rank_that_does_not_exist():
    with pytest.raises(ValueError, match="slow_rank must be one of the 2 ranks"):
        labs.diagnose_slow_rank(world_size=2, slow_rank=2)


def test_flip_bit_flips_exactly_one_bit_of_a_float32():
    t = torch.tensor([1.0, 1.0, 1.0, 3.0])
    # 1.0 is 0x3F800000: bit 23 is the exponent's lowest (1.0 -> 0.5), bit 31 the sign, bit 0 the mantissa's last.
    assert labs.flip_bit(t, 0, 23) == (1.0, 0.5)
    assert labs.flip_bit(t, 1, 31) == (1.0, -1.0)
    assert labs.flip_bit(t, 2, 0) == (1.0, 1.0 + 2.0**-23)
    assert t.tolist() == [0.5, -1.0, 1.0 + 2.0**-23, 3.0]
    with pytest.raises(ValueError, match="float32"):
        labs.flip_bit(t.double(), 0, 1)


def test_a_bit_flip_after_the_all_reduce_shows_in_checksums_and_recomputation_names_rank_and_step(results):
    runs = [r["sdc"] for r in results]
    after, before, clean = (runs[0][v] for v in labs.SDC_VARIANTS)
    # Planted on rank 1 at step 2 (sdc_lab's defaults): the replicas part at that step, and only then.
    assert after["checksum_step"] == 2 and after["blamed"] == [(1, 2)]
    # A flip before the all-reduce is averaged into both replicas: checksums agree; recomputation still names it.
    assert before["checksum_step"] is None and before["blamed"] == [(1, 2)]
    assert clean["checksum_step"] is None and clean["blamed"] == []
    old, new = runs[1][labs.SDC_VARIANTS[0]]["flip"]
    assert new in (2 * old, old / 2)  # bit 23, the exponent's lowest bit: a factor of 2, not an inf or a NaN
    # Silent: every loss of the faulty runs within 1e-3 of the clean run's (the flip changes one update element).
    for broken in (after, before):
        assert max(abs(a - b) for a, b in zip(broken["losses"], clean["losses"], strict=True)) < 1e-3


def test_blame_prefers_the_rank_whose_local_gradient_changed():
    healthy, local_and_reduced, reduced_only = (False, False), (True, True), (False, True)
    assert labs.blame([[healthy, healthy], [reduced_only, local_and_reduced]]) == [(1, 1)]  # flip before
    assert labs.blame([[healthy, reduced_only]]) == [(1, 0)]  # flip after the all-reduce
    assert labs.blame([[healthy, healthy]]) == []


@pytest.fixture(scope="module")
def stability():
    return labs.stability_lab()


def test_find_spikes_flags_a_jump_above_the_running_median_and_not_noise():
    calm = [3.0, 3.2, 2.9, 3.1, 3.0, 3.3, 2.8, 3.1]
    assert labs.find_spikes(calm + [3.4, 6.0, 3.1]) == [9]  # 3.4 is within the 1-nat margin, 6.0 is not
    assert labs.find_spikes(calm + [float("nan")]) == [8]
    assert labs.find_spikes(calm) == []
    with pytest.raises(ValueError, match="window >= 2"):
        labs.find_spikes(calm, window=1)


def test_a_learning_rate_raised_too_far_spikes_and_the_detector_finds_it(stability):
    broken = stability["broken: learning rate raised too far"]
    assert broken["spikes"][0] == 13  # the loss after the first step at spike_lr (calm_steps = 12)
    # Lowering the learning rate, or rewinding once with a lower one, removes the spike from the run.
    assert stability["fixed: lower learning rate"]["spikes"] == []
    rewound = stability["fixed: rewind, skip and lower the learning rate"]
    assert rewound["spikes"] == [] and rewound["rewinds"] == [13] and len(rewound["losses"]) == 28
    # Rewinding without lowering the rate meets the spike again each time, gives up after 3, and spikes.
    again = stability["rewind and skip only"]
    assert len(again["rewinds"]) == 3 and again["spikes"]


def test_qk_norm_bounds_the_attention_logits_but_does_not_remove_a_learning_rate_spike(stability):
    broken, qk, z = (stability[v] for v in ("broken: learning rate raised too far", "QK-norm", "z-loss"))
    # LayerNormed queries and keys: |q.k|/sqrt(d) <= sqrt(d) * gain^2 = 5.7 at init (d = 32); measured about 8.
    assert max(qk["max_attention_logit"]) < 20 < 100 < max(broken["max_attention_logit"])
    assert qk["spikes"] and z["spikes"]  # the cause here is the step size, not the logits


def test_stability_runs_are_deterministic():
    first, second = (labs.train_through_spike(steps=14) for _ in range(2))
    assert first == second
