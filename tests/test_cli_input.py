"""`python -m scalebook.train` against what a user types and does (issue 37): Ctrl-C saves and exits 130, a second
one stops at once, no rank prints a KeyboardInterrupt traceback under torchrun; a run that cannot fit in memory is
refused before any work; text that is not valid in its --encoding is refused, naming the file and the byte; a
refused run creates no folder; the embedded corpus is named as such; a fresh run does not overwrite checkpoints;
a refused layout launched by run_local is the message alone (exit 2), under torchrun by hand one message from rank 0.

In-process where the behaviour is the pre-flight's (its checks are functions of the arguments and the files);
subprocesses where it is the process's (signals, exit codes, torchrun), each wait bounded and every process it
started killed afterwards (:func:`scalebook.comm.processes.kill_marked`)."""

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from scalebook import accounting, data
from scalebook.comm import processes
from scalebook.train import checkpoint, cli, preflight
from scalebook.train.preemption import EXIT_INTERRUPTED, Stopped, StopSignals

TINY = ["--steps", "2", "--micro-batch", "1", "--global-batch", "2", "--seq-len", "16", "--no-progress"]
LATIN1 = "Le café où l'on a déjà mangé, près de la forêt.\n".encode("latin-1") * 20


def args_of(argv: list[str], **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(cli.build_parser().parse_args(argv)), **changes})


def refused(argv: list[str], capsys) -> str:
    """``cli.main(argv)``'s message, after checking that it exited with code 2 before any step (nothing on stdout)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == "", err
    return err


def one_thread_main(argv: list[str]) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a launched rank: faster than 2 threads on 2 busy cores
    try:
        return cli.main(argv)
    finally:
        torch.set_num_threads(threads)


# ----- 1. Ctrl-C ---------------------------------------------------------------------------------------------


def test_ctrl_c_sets_the_flag_gives_back_the_default_for_a_second_one_and_means_exit_130():
    before, elsewhere = signal.getsignal(signal.SIGINT), []

    def previous(signum, frame):  # what a SIGINT that StopSignals missed would reach (not pytest's KeyboardInterrupt)
        elsewhere.append(signum)

    signal.signal(signal.SIGINT, previous)
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert elsewhere == [] and stop.received == signal.SIGINT and stop.agreed() == "SIGINT"
            assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # a second Ctrl-C: the system ends the process
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # ... until the process has gone
        signal.signal(signal.SIGINT, previous)
        with StopSignals():  # no Ctrl-C: the previous handler comes back
            pass
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, before)
    stopped = Stopped("SIGINT", 4, "ckpt")
    assert stopped.code == EXIT_INTERRUPTED == 130 and isinstance(stopped, SystemExit)
    assert str(stopped) == "stopping at step 4 on SIGINT: checkpoint saved in ckpt; continue with --resume"


class Launched:
    """A launcher started with :data:`processes.MARK` set, whose stderr is read with a deadline, and which leaves
    nothing running when the ``with`` ends."""

    def __init__(self, command: list[str]):
        self.mark = uuid.uuid4().hex
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", processes.MARK: self.mark}
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)  # fmt: skip
        self.err = ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        processes.kill_marked(self.mark, self.proc.pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            pipe.close()

    def wait_for(self, pipe: str, text: str, timeout: float = 120.0) -> str:
        """Read ``pipe`` ("stdout" or "stderr") until ``text`` appears or ``timeout`` seconds pass (then fail)."""
        fd, seen, deadline = getattr(self.proc, pipe).fileno(), "", time.monotonic() + timeout
        while text not in seen:
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, f"no {text!r} on {pipe}: {(self.err + seen)[-3000:]}"
            if select.select([fd], [], [], min(left, 1.0))[0]:
                seen += os.read(fd, 1 << 16).decode(errors="replace")  # unbuffered: nothing left behind
        if pipe == "stderr":
            self.err += seen
        return seen

    def finish(self, timeout: float = 120.0) -> tuple[str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        self.err += err
        return out, self.err


# Ctrl-C as a terminal delivers it: the command starts with SIGINT at its default and unblocked. The test process
# itself may have it ignored (a job started with `nohup ... &`, and so its pytest-xdist workers), and an ignored
# SIGINT is inherited across exec and, by design, stays ignored (preemption.StopSignals): then no Ctrl-C test
# could pass. The command is exec'd from a small Python that resets the two first.
AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def train_command(*args: str, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-c", AS_FROM_A_TERMINAL, "-m", "scalebook.train", *args]
    return [sys.executable, "-c", AS_FROM_A_TERMINAL, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "scalebook.train", *args]  # fmt: skip


LONG = [*TINY, "--steps", "100000", "--checkpoint-every", "100000"]


def test_ctrl_c_finishes_the_step_saves_and_exits_130_with_the_resume_hint(tmp_path):
    ckpt = tmp_path / "ckpt"
    with Launched(train_command(*LONG, "--checkpoint-dir", str(ckpt))) as run:
        run.wait_for("stdout", '"step": 1,')  # training: the loop's handler is in place
        run.proc.send_signal(signal.SIGINT)
        out, err = run.finish()
    saved = checkpoint.latest_step(ckpt)
    assert run.proc.returncode == EXIT_INTERRUPTED, err
    assert f"stopping at step {saved} on SIGINT: checkpoint saved in {ckpt}; continue with --resume" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert saved >= 1 and checkpoint.newest_intact(ckpt) == (saved, [])  # the step it stopped at, intact


def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    ckpt = tmp_path / "ckpt"
    with Launched(train_command(*LONG, "--checkpoint-dir", str(ckpt))) as run:
        run.wait_for("stdout", '"step": 1,')
        run.proc.send_signal(signal.SIGINT)
        run.wait_for("stderr", "Ctrl-C again stops at once")  # the first one was handled
        run.proc.send_signal(signal.SIGINT)
        _, err = run.finish(timeout=30)
    assert run.proc.returncode == -signal.SIGINT, err  # ended by the signal: a shell says 130
    assert "Traceback" not in err and "stopping at step" not in err


def test_under_torchrun_a_ctrl_c_stops_every_rank_without_a_traceback(tmp_path):
    # torchrun forwards the Ctrl-C to each rank as one SIGINT (the ranks run in sessions of their own). Before: each
    # rank printed a KeyboardInterrupt traceback and nothing was saved.
    ckpt = tmp_path / "ckpt"
    with Launched(train_command(*LONG, "--strategy", "ddp", "--checkpoint-dir", str(ckpt), nproc=2)) as run:
        run.wait_for("stdout", '"step": 1,')
        run.proc.send_signal(signal.SIGINT)
        _, err = run.finish()
    saved = checkpoint.latest_step(ckpt)
    assert saved is not None and checkpoint.newest_intact(ckpt) == (saved, []), err
    assert "KeyboardInterrupt" not in err
    tracebacks = err.split("Traceback (most recent call last):")[1:]
    assert len(tracebacks) <= 1 and all("SignalException: Process" in t for t in tracebacks)  # torchrun's own only
    assert err.count(f"stopping at step {saved} on SIGINT: checkpoint saved in {ckpt}") == 1  # rank 0 only
    assert err.count("Ctrl-C: the step in progress ends") == 1


# ----- 2. memory --------------------------------------------------------------------------------------------


def test_a_run_that_cannot_fit_in_memory_is_refused_with_the_numbers(monkeypatch, capsys):
    free = 8e9
    monkeypatch.setattr(preflight, "device_memory", lambda local_rank: (int(free), "of RAM available (test)", True))
    args = args_of(["--model", "gpt2-xl"])
    need, what = preflight.memory_estimate(args, preflight.layout(args, 1))
    assert need >= accounting.model_state_bytes(1_557_611_200, precision="fp32").total == 16 * 1_557_611_200
    assert "1,557,611,200 parameters" in what
    err = refused(["--model", "gpt2-xl", "--check-only", "1"], capsys)
    assert f"memory: --model gpt2-xl needs at least {need / 1e9:.1f} GB on each rank" in err
    assert "more than the 8.0 GB of RAM available (test); choose a smaller --model, --micro-batch" in err
    assert "--skip-memory-check" in err
    assert cli.main(["--model", "gpt2-xl", "--check-only", "1", "--skip-memory-check"]) == 0
    # ZeRO-3 over 8 replicas: an eighth of the model states each, under 8 GB, so it may start.
    assert cli.main(["--model", "gpt2-xl", "--check-only", "8", "--strategy", "zero3"]) == 0
    # The ranks of one machine share its RAM: 4 local ranks of a model that fits twice are refused.
    gpt2 = args_of(["--model", "gpt2", "--strategy", "ddp"])
    dims = preflight.layout(gpt2, 4)
    free = 2 * preflight.memory_estimate(gpt2, dims)[0]
    assert preflight.memory_problems(gpt2, dims) == []  # one process: fits
    for name, value in {"RANK": 0, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 4}.items():
        monkeypatch.setenv(name, str(value))
    (problem,) = preflight.memory_problems(gpt2, dims)
    assert "; 4 ranks on this machine need" in problem


def test_the_book_s_runs_pass_the_memory_check_on_this_machine():
    free, where, shared = preflight.device_memory(0)
    assert free > 0 and ("RAM" in where or "GPU" in where or "cgroup" in where)
    for model in ("tiny", "small"):
        args = args_of(["--model", model])
        assert preflight.memory_problems(args, preflight.layout(args, 1)) == []


# ----- 3. text decoded strictly ------------------------------------------------------------------------------


def test_text_that_is_not_utf8_is_refused_naming_the_file_the_byte_and_the_way_out(tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("plain English text. " * 20, encoding="utf-8")
    (folder / "b.txt").write_bytes(LATIN1)
    err = refused([*TINY, "--data", str(folder)], capsys)
    assert (f"--data: data file {folder / 'b.txt'} is not valid utf-8: byte 0xE9 at offset 6 (invalid continuation "
            "byte); if the file is in another encoding, name it: --encoding latin-1") in err  # fmt: skip
    assert "--encoding bytes to train on its exact bytes" in err
    err = refused([*TINY, "--data", str(folder), "--encoding", "klingon"], capsys)
    assert "--encoding klingon is not an encoding Python knows" in err and "--data" not in err  # one message
    # Named, it decodes: Latin-1 "é" is trained on as UTF-8's two bytes, as the embedded corpus has it.
    tokens = data.read_corpus(folder / "b.txt", "latin-1")
    assert tokens.tolist() == list(LATIN1.decode("latin-1").encode("utf-8")) and tokens[6:8].tolist() == [0xC3, 0xA9]
    assert data.read_corpus(folder / "b.txt", "bytes").tolist() == list(LATIN1)  # bytes: the exact bytes


def test_a_named_encoding_trains_on_the_decoded_text(tmp_path, monkeypatch):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(LATIN1)
    sampled, get_batch = [], data.get_batch

    def recording_get_batch(tokens, *args, **kwargs):
        sampled.append(tokens)
        return get_batch(tokens, *args, **kwargs)

    monkeypatch.setattr(data, "get_batch", recording_get_batch)
    assert one_thread_main([*TINY, "--steps", "1", "--data", str(latin1), "--encoding", "latin-1"]) == 0
    assert sampled and sampled[0].tolist() == list(LATIN1.decode("latin-1").encode("utf-8"))


# ----- 4. no folder from a refused run ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [["--checkpoint-every", "0"], ["--keep-last", "-1"], ["--model", "nope"],
                                 ["--encoding", "klingon"], ["--seq-len", "0"]])  # fmt: skip
def test_a_refused_run_creates_no_folder(bad, tmp_path, capsys):
    ckpt, metrics = tmp_path / "runs" / "ckpt", tmp_path / "logs" / "metrics.jsonl"
    with pytest.raises(SystemExit) as exited:
        cli.main([*TINY, "--checkpoint-dir", str(ckpt), "--metrics", str(metrics), *bad])
    assert exited.value.code == 2 and capsys.readouterr().out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither folder, nor a parent of one
    # Nor does a pre-flight that passes: the run creates them when it starts.
    assert cli.main([*TINY, "--checkpoint-dir", str(ckpt), "--metrics", str(metrics), "--check-only", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ----- 5. the embedded corpus ---------------------------------------------------------------------------------


def test_the_embedded_corpus_is_named_as_such():
    n = len(data.corpus_bytes(None))
    with pytest.raises(ValueError) as error:
        data.check_corpus(None, min_tokens=n + 1)
    assert str(error.value).startswith(f"the embedded corpus has {n:,} byte tokens, fewer than the {n + 1:,}")
    with pytest.raises(ValueError) as error:
        preflight.preflight(args_of(["--seq-len", str(n), "--skip-memory-check"]), 1)
    (line,) = [line.strip() for line in str(error.value).splitlines() if "--data" in line]
    assert line.startswith(f"--data: the embedded corpus has {n:,} byte tokens") and "None" not in line


# ----- 6. checkpoints are not overwritten without --overwrite -------------------------------------------------


def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_unless_overwrite(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    run = [*TINY, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    assert one_thread_main(run) == 0
    capsys.readouterr()
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001", "step_000002"]
    err = refused(run, capsys)
    assert (f"--checkpoint-dir {ckpt} already holds checkpoints (latest, step_000002, step_000001); pass --resume to "
            "continue them, --overwrite to delete them and start over, or another --checkpoint-dir") in err  # fmt: skip
    assert "continue them" in refused([*run, "--check-only", "1"], capsys)  # the sbatch scripts' check says so too
    assert "pass one of them" in refused([*run, "--resume", "--overwrite"], capsys)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001", "step_000002"]  # untouched
    assert one_thread_main([*run, "--steps", "1", "--overwrite"]) == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001"]  # the old run's step 2 is gone
    assert checkpoint.newest_intact(ckpt) == (1, [])


# ----- 7. a refusal under torchrun ----------------------------------------------------------------------------


REFUSED_LAYOUT = [*TINY, "--strategy", "3d", "--tp", "2", "--pp", "2"]  # 2 x 2 ranks asked of 2


def test_a_refused_layout_launched_through_torchrun_by_run_local_is_the_message_alone_with_exit_code_2():
    # The issue: the one good message, then 44 lines of torchrun's own ChildFailedError traceback, exit code 1.
    # run_local runs the pre-flight for its nproc ranks before it starts torchrun, which a refused run never starts.
    run = cli.run_local(REFUSED_LAYOUT, nproc=2, timeout=120)
    assert (run.returncode, run.records) == (2, [])
    assert run.stderr.splitlines() == [
        "python -m scalebook.train: error: invalid arguments:",
        "  dp x tp x pp x cp = 1 x 2 x 2 x 1 = 4 must equal the 2 ranks started; --tp x --pp x --cp = 4 does not "
        "divide it: change --tp, --pp or --cp, or start 4 ranks",
        "(see python -m scalebook.train --help)",
    ]


def test_run_locals_pre_flight_leaves_sys_stderr_alone_for_the_other_threads(monkeypatch):
    # Notebooks call run_local from several threads at once (Ch. 15). Its pre-flight used to capture the message
    # with contextlib.redirect_stderr, which swaps sys.stderr for every thread: two overlapping checks could
    # leave a thread's StringIO installed as the kernel's stderr. The check must see the same sys.stderr as
    # everyone else and still return the message.
    seen = []

    def refusing_preflight(args, world_size, **kwargs):
        seen.append(sys.stderr)
        raise ValueError("planted refusal")

    monkeypatch.setattr(cli, "preflight", refusing_preflight)
    original = sys.stderr
    run = cli.run_local(TINY, nproc=2, timeout=60)  # refused before torchrun starts: nothing is launched
    assert seen == [original] and sys.stderr is original
    assert run.returncode == 2 and "planted refusal" in run.stderr


def test_a_refused_layout_under_a_torchrun_started_by_hand_is_one_message_and_exit_code_2_from_every_rank():
    # Started by hand, torchrun runs the ranks before any check. They exit with code 2 and rank 0's message, without
    # a traceback or a usage text of theirs; what follows is torchrun's own report (its ChildFailedError traceback
    # and summary, printed for any rank that exits with a code other than 0, however it exits), which no rank can
    # silence: rank 0 says so, and how to check without torchrun.
    finished = processes.run(train_command(*REFUSED_LAYOUT, nproc=2), env={**os.environ, "OMP_NUM_THREADS": "1"},
                             timeout=120, name="torchrun")  # fmt: skip
    assert finished.returncode != 0 and '{"step"' not in finished.stdout
    message = finished.stderr.split("python -m scalebook.train: error: invalid arguments:")
    assert len(message) == 2 and "Traceback" not in message[0] and "usage:" not in finished.stderr
    assert "dp x tp x pp x cp = 1 x 2 x 2 x 1 = 4 must equal the 2" in message[1]
    assert message[1].count("(torchrun's report below only says that the ranks exited with code 2; --check-only") == 1
    tracebacks = finished.stderr.split("Traceback (most recent call last):")[1:]
    assert len(tracebacks) == 1 and "ChildFailedError" in tracebacks[0]  # torchrun's, no rank's
    assert "exitcode  : 1" not in finished.stderr and "exitcode  : 2" in finished.stderr


SLOW_RANK0_REFUSES = (
    "import os, sys, time\n"
    "from scalebook.comm.launch import rank0_says\n"
    "if os.environ['RANK'] == '0':\n"
    "    time.sleep(3)  # rank 0 late to its check: rank 1 finds the error first and would exit at once\n"
    "rank0_says('rank 0 was heard\\n')\n"
    "sys.exit(2)\n"
)


def test_an_error_every_rank_finds_is_said_by_rank_0_even_when_another_rank_finds_it_first(tmp_path):
    # CI once lost the message: rank 1 exited with code 2 first, and torchrun stopped rank 0 (it polls every 0.1 s)
    # before rank 0 had printed. The other ranks now wait, through torchrun's store, until rank 0 has said it.
    script = tmp_path / "refuse.py"
    script.write_text(SLOW_RANK0_REFUSES)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    finished = processes.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120, name="torchrun")
    assert finished.returncode != 0
    assert finished.stderr.count("rank 0 was heard") == 1, finished.stderr
    assert "exitcode  : 2" in finished.stderr and "Signals.SIGTERM" not in finished.stderr, finished.stderr


# ----- 8. torchrun told to stop, as the sbatch scripts run it -------------------------------------------------


def test_torchrun_as_the_sbatch_scripts_run_it_passes_a_stop_on_and_ends_without_a_traceback(tmp_path, monkeypatch):
    # The issue: each preemption left torchrun's 25-line SignalException traceback and a warning per rank in a job
    # log whose run succeeded, and torchrun's exit code 1. scalebook.train.torchrun is torchrun ending such a stop
    # quietly: rank 0's line alone, and exit code 0 once the ranks have stopped by themselves.
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")  # as slurm/*.sbatch set it
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, "-m", "scalebook.train.torchrun", "--standalone", "--nproc-per-node=2",
               "-m", "scalebook.train", *LONG, "--strategy", "ddp", "--checkpoint-dir", str(ckpt)]  # fmt: skip
    with Launched(command) as run:
        run.wait_for("stdout", '"step": 1,')
        run.proc.send_signal(signal.SIGUSR1)  # as the scripts' trap passes it on
        _, err = run.finish()
    saved = checkpoint.latest_step(ckpt)
    assert run.proc.returncode == 0, err
    assert saved is not None and checkpoint.newest_intact(ckpt) == (saved, []), err
    said = [line for line in err.splitlines() if line.strip()]
    assert said == [f"stopping at step {saved} on SIGUSR1: checkpoint saved in {ckpt}; continue with --resume"], err


def _warning(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 0, msg, args, None)


def test_closing_warnings_before_torchruns_own_stop_signal_are_dropped_and_kept_when_no_stop_follows():
    # CI once saw "Sending process N closing signal SIGTERM" in a requeued job's log: SLURM signalled the ranks
    # before torchrun, the ranks saved and ended, and torchrun closed the rest before its own signal arrived, so the
    # filter, which waited for the agent's "Received ... death signal", let them through.
    from scalebook.train import torchrun

    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    handler = Collect()
    logger.addHandler(handler)
    try:
        for stop_follows in (True, False):
            seen.clear()
            quiet = torchrun._StopWarnings()
            logger.addFilter(quiet)
            try:
                for pid in (101, 102):  # the ranks ended first: torchrun closes them before any stop signal
                    logger.warning("Sending process %s closing signal %s", pid, "SIGTERM")
                logger.warning("a warning of another kind")
                if stop_follows:
                    logging.getLogger(torchrun._AGENT).warning("Received %s death signal, shutting down workers", 15)
                else:
                    quiet.release()  # torchrun ended otherwise: main() logs them after all
            finally:
                logger.removeFilter(quiet)
            closing = [m for m in seen if "closing signal" in m]
            assert "a warning of another kind" in seen
            assert closing == ([] if stop_follows else ["Sending process 101 closing signal SIGTERM",
                                                         "Sending process 102 closing signal SIGTERM"])  # fmt: skip
    finally:
        logger.removeHandler(handler)
