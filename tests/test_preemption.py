"""A run told to stop (SIGTERM at a preemption, SIGUSR1 before a time limit) finishes its step, saves, exits with
``EXIT_STOPPED``, and ``--resume`` continues it with the losses of a run that was never stopped, bit for bit.

The signals are real (``os.kill``); to make the stopping step exact, most tests have the last rank send SIGUSR1 to
itself after a chosen step (``--simulate-signal-at``). Sent from outside at an arbitrary moment (the last test here,
and the SLURM tests), the run stops after whichever step is in progress, and the same checks hold."""

import argparse
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from scalebook.comm import launch
from scalebook.train import checkpoint, cli
from scalebook.train.preemption import EXIT_STOPPED, Stopped, StopSignals

SMALL = ["--steps", "6", "--micro-batch", "1", "--global-batch", "4", "--seq-len", "32", "--no-progress"]


def args_of(argv: list[str], **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(cli.build_parser().parse_args(argv)), **changes})


def stop_and_resume(argv: list[str], ckpt: str, step: int) -> dict:
    """An uninterrupted run of ``argv``; the same run with SIGUSR1 sent to its last rank after ``step``
    (``--simulate-signal-at``); its resumption.
    What each gave: losses by step, the Stopped exception (its step, signal and exit code), the line printed on
    stderr, the step of the newest checkpoint after the stop."""
    full = {r.step: r.loss for r in cli.run(args_of(argv))}
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(Stopped) as stopped:
        cli.run(args_of(argv, checkpoint_dir=ckpt, simulate_signal_at=step))
    if dist.is_initialized():
        dist.barrier()  # rank 0 publishes the checkpoint after the others' part of the save; a new job starts later
    saved_at = checkpoint.latest_step(ckpt)
    resumed = {r.step: r.loss for r in cli.run(args_of(argv, checkpoint_dir=ckpt, resume=True))}
    exc = stopped.value
    return {
        "full": full,
        "resumed": resumed,
        "stopped": (exc.step, exc.signal_name, exc.code),
        "said": err.getvalue(),
        "saved_at": saved_at,
    }


def test_the_handler_only_sets_a_flag_and_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as stop:
        assert stop.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # without the handler, SIGUSR1 would end this process
        assert stop.received == signal.SIGUSR1 and stop.agreed() == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def off_the_main_thread():  # Python allows handlers only there: nothing installed, nothing raised
        with StopSignals() as stop:
            assert stop.agreed() is None

    thread = threading.Thread(target=off_the_main_thread)
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_one_process_stops_after_the_signalled_step_and_resumes_bit_for_bit(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a launched rank: 2 threads on 2 busy cores only slow the three runs down
    try:
        out = stop_and_resume(SMALL, str(tmp_path), 3)
    finally:
        torch.set_num_threads(threads)
    assert out["stopped"] == (3, "SIGUSR1", EXIT_STOPPED)
    said = f"stopping at step 3 on SIGUSR1: checkpoint saved in {tmp_path}; continue with --resume"
    assert out["said"].strip() == said
    assert out["saved_at"] == 3  # saved where it stopped, not at --checkpoint-every (10)
    assert sorted(out["resumed"]) == [4, 5, 6]
    # Bit for bit: the same state, data stream and arithmetic as the run that never stopped.
    assert out["resumed"] == {step: out["full"][step] for step in (4, 5, 6)}


def _two_ranks(ckpt: str) -> dict:
    return stop_and_resume([*SMALL, "--strategy", "ddp"], ckpt, 2)


def test_two_ranks_agree_to_stop_when_only_one_is_signalled_and_resume_bit_for_bit(tmp_path):
    rank0, rank1 = launch(_two_ranks, 2, str(tmp_path), timeout=120)
    # Rank 1 alone received SIGUSR1 after step 2; both stopped there (one all-reduce of the flag), so neither
    # waits in a collective the other skipped; rank 0 said so, once.
    assert rank0["stopped"] == rank1["stopped"] == (2, "SIGUSR1", EXIT_STOPPED)
    assert rank0["said"].startswith("stopping at step 2 on SIGUSR1: checkpoint saved") and rank1["said"] == ""
    assert rank0["saved_at"] == 2  # rank 0 writes `latest`, after every rank's file is on disk
    for out in (rank0, rank1):
        assert out["resumed"] == {step: out["full"][step] for step in (3, 4, 5, 6)}


def test_the_command_stops_on_sigterm_with_its_exit_code_and_says_that_without_a_checkpoint_all_is_lost():
    # A real process, signalled from outside while it trains (after its first metric line): the step in progress
    # ends, then the run stops. No --checkpoint-dir: nothing saved, and the line says so.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "scalebook.train", *SMALL, "--steps", "1000"]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        first = proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    steps = [line for line in [first, *stdout.splitlines()] if line.startswith("{")]
    assert proc.returncode == EXIT_STOPPED, stderr
    assert f"stopping at step {len(steps)} on SIGTERM: no --checkpoint-dir" in stderr
    assert f"the progress of these {len(steps)} steps is lost" in stderr and len(steps) < 1000
