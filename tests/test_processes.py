"""scalebook.comm.processes: a launcher and everything it started are gone after its timeout, however arranged.

The case that once hung CI for 14 minutes: torchrun starts each rank in a session of its own, so killing the
launcher's process group missed them, and the surviving ranks held the pipes that ``communicate()`` waited on.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scalebook.comm import processes

# A launcher that starts two "ranks" in sessions of their own (as torchrun does), each holding the launcher's
# stdout and stderr, writes their pids and then waits for ever (or exits at once with EXIT set).
LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    out = sys.argv[1]
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
             for _ in range(2)]
    with open(out + ".tmp", "w") as f:
        f.write(" ".join(str(r.pid) for r in ranks))
    with open(out + ".sessions", "w") as f:  # each rank's session, read while it runs (after the kill it is gone)
        f.write(" ".join(str(os.getsid(r.pid)) for r in ranks))
    os.replace(out + ".tmp", out)
    print("ranks started", flush=True)
    print("a line on stderr", file=sys.stderr, flush=True)
    if os.environ.get("EXIT"):
        sys.exit(0)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    return processes._is_running(pid)


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _ranks(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()]


def test_a_launcher_past_its_timeout_is_killed_with_ranks_in_their_own_sessions(tmp_path):
    script, pids = tmp_path / "launcher.py", tmp_path / "pids"
    script.write_text(LAUNCHER)
    started = time.monotonic()
    with pytest.raises(processes.LaunchTimeout, match=r"fake-launcher did not finish in 3 s") as caught:
        processes.run([sys.executable, str(script), str(pids)], timeout=3, name="fake-launcher")
    elapsed = time.monotonic() - started
    ranks = _ranks(pids)
    sessions = [int(sid) for sid in (tmp_path / "pids.sessions").read_text().split()]
    assert len(ranks) == 2 and sessions == ranks, "each rank leads a session of its own, as torchrun's do"
    assert not [pid for pid in ranks if _alive(pid)], "ranks survived the launcher's timeout"
    assert "a line on stderr" in caught.value.stderr  # what the launcher printed comes back with the error
    assert isinstance(caught.value, TimeoutError)  # and the error is both kinds of timeout
    assert elapsed < 3 + 10, f"the kill and the bounded read of the pipes took {elapsed:.1f} s"


def test_orphans_holding_a_finished_launchers_pipes_are_killed_and_the_launch_returns(tmp_path):
    script, pids = tmp_path / "launcher.py", tmp_path / "pids"
    script.write_text(LAUNCHER)
    started = time.monotonic()
    finished = processes.run([sys.executable, str(script), str(pids)], env={**os.environ, "EXIT": "1"}, timeout=60)
    elapsed = time.monotonic() - started
    assert finished.returncode == 0 and "ranks started" in finished.stdout
    assert not [pid for pid in _ranks(pids) if _alive(pid)], "orphaned ranks survived their launcher"
    # It waits ORPHAN_GRACE_S for the pipes to close, not the whole 60 s timeout.
    assert elapsed < processes.ORPHAN_GRACE_S + 10, f"took {elapsed:.1f} s"


def test_torchrun_ranks_already_running_are_killed_on_timeout(tmp_path):
    """The real launcher: both ranks have started (each wrote its file) when the timeout fires."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(tmp_path)!r}, 'rank' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    with pytest.raises(processes.LaunchTimeout, match="torchrun did not finish in 20 s"):
        processes.run(cmd, timeout=20, name="torchrun")
    ranks = [tmp_path / f"rank{r}" for r in range(2)]
    assert all(path.exists() for path in ranks), "the ranks had not started within 20 s: nothing was tested"
    survivors = [int(path.read_text()) for path in ranks if _alive(int(path.read_text()))]
    assert survivors == [], f"torchrun's ranks {survivors} survived the timeout"


def test_without_the_mark_the_ranks_would_have_survived(tmp_path):
    """The check above can fail: killing only the launcher's process group (the old code) leaves the ranks."""
    script, pids = tmp_path / "launcher.py", tmp_path / "pids"
    script.write_text(LAUNCHER)
    import signal
    import subprocess

    proc = subprocess.Popen([sys.executable, str(script), str(pids)], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        _wait_for(pids, 30)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        ranks = _ranks(pids)
        assert all(_alive(pid) for pid in ranks), "the group kill alone was expected to miss the ranks"
    finally:
        for pid in _ranks(pids) if pids.exists() else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_non_positive_timeout_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="timeout must be positive"):
        processes.run([sys.executable, "-c", "pass"], timeout=0)
