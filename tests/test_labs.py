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
    """One launch on 2 ranks runs the fixed hang worker and labs 2, 3 and 4."""
    return launch(
        run_experiments,
        2,
        hang_fixed=(labs.sync_and_check_stop, {"variant": FIXED_HANG}),
        accumulation=(labs.accumulation_lab, {"steps": 2}),
        no_sync=(labs.no_sync_lab, {"steps": 2}),
        randomness=(labs.randomness_lab, {}),
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
