"""Run a launcher in a subprocess and, whatever happens, leave nothing of it running.

A launcher such as ``torchrun`` or ``accelerate launch`` arranges its ranks as it likes: torchrun starts each
rank in a session of its own, so killing the launcher's process group misses them, and a rank whose launcher
died is re-parented to init, so walking the tree from the launcher misses it too. Ranks that survive keep the
launcher's stdout and stderr pipes open, and a ``communicate()`` that waits for those pipes to close never
returns.

:func:`run` therefore marks every process it starts: the launcher gets a unique value of
:data:`MARK` in its environment, which every rank inherits whatever its session or parent. When the launcher
finishes, times out or the caller is interrupted, :func:`kill_marked` kills every process that carries the
mark (and the launcher's descendants, for a rank that cleared its environment), and the pipes are read with
a bounded wait. Linux reads both from ``/proc``; elsewhere only the launcher's process group is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

#: The environment variable :func:`run` sets to a fresh value for each launch; every descendant inherits it.
MARK = "SCALEBOOK_LAUNCH_ID"
PROC = Path("/proc")
#: How long processes may keep a finished launcher's pipes open before :func:`run` kills them.
ORPHAN_GRACE_S = 5.0


class LaunchTimeout(subprocess.TimeoutExpired, TimeoutError):
    """A launch that ran past its timeout and was killed with everything it started.

    Both a ``subprocess.TimeoutExpired`` (what ``subprocess.run`` raises) and a ``TimeoutError``.
    """

    def __init__(self, cmd, timeout: float, stdout: str, stderr: str, message: str):
        super().__init__(cmd, timeout, output=stdout, stderr=stderr)
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass
class Finished:
    """What :func:`run` returns: the launcher's exit code and everything it (and its ranks) printed."""

    returncode: int
    stdout: str
    stderr: str


def with_env(name: str, value: str) -> set[int]:
    """Every process but this one whose initial environment holds ``name=value`` (those we may not read are
    skipped)."""
    needle = f"{name}={value}".encode()
    found = set()
    for entry in PROC.iterdir() if PROC.is_dir() else ():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:  # gone meanwhile, a kernel thread, or another user's
                pass
    found.discard(os.getpid())
    return found


def descendants(pid: int) -> set[int]:
    """The processes below ``pid`` in the parent tree, read from ``/proc`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir() if PROC.is_dir() else ():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
            children.setdefault(parent, []).append(int(entry.name))
    found, pending = set(), [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_marked(value: str | None, root: int | None = None, *, settle_s: float = 5.0, name: str = MARK) -> set[int]:
    """SIGKILL every process carrying ``name=value`` (default :data:`MARK`) and every descendant of ``root``;
    return the pids killed.

    Repeats until none is left (a launcher may start a rank between two scans) or ``settle_s`` has passed.
    """
    killed: set[int] = set()
    if root is not None:
        try:
            if os.getpgid(root) == root != os.getpgid(0):  # a launcher that leads its own group (never ours)
                os.killpg(root, signal.SIGKILL)  # the group first, so that the launcher starts nobody new
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + settle_s
    while True:
        targets = (with_env(name, value) if value else set()) | (descendants(root) if root is not None else set())
        targets -= {os.getpid()}
        alive = {pid for pid in targets if _is_running(pid)}
        if not alive or time.monotonic() > deadline:
            return killed
        for pid in alive:
            _kill(pid)
        killed |= alive
        time.sleep(0.05)


def _is_running(pid: int) -> bool:
    """True unless the process is gone or a zombie (dead, waiting for its parent to read its status)."""
    try:
        state = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float, name: str | None = None,
        cwd=None, reap_s: float = 10.0) -> Finished:  # fmt: skip
    """Run ``cmd`` (a launcher) with its output captured; kill everything it started once it is done.

    After ``timeout`` seconds the launcher and every process it started are killed and :class:`LaunchTimeout`
    raised, naming the launcher (``name``, default the command's first word) with the end of its stderr. Reading
    the pipes afterwards waits at most ``reap_s`` seconds, so nothing here can block for ever.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    value = uuid.uuid4().hex
    env = {**(os.environ if env is None else env), MARK: value}
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    timed_out, deadline, exited_at = False, time.monotonic() + timeout, None
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=1.0)  # retrying loses no output (subprocess docs)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if exited_at is None and proc.poll() is not None:
                    exited_at = now  # the launcher is done, but something it started still holds its pipes
                if now > deadline or (exited_at is not None and now - exited_at > ORPHAN_GRACE_S):
                    timed_out = proc.poll() is None
                    kill_marked(value, _unreaped(proc))
                    stdout, stderr = _drain(proc, reap_s)
                    break
    finally:
        kill_marked(value, _unreaped(proc))  # ranks the launcher left behind, however it ended (Ctrl-C too)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=reap_s)
    if timed_out:
        label = name or Path(cmd[0]).name
        raise LaunchTimeout(cmd, timeout, stdout, stderr,
                            f"{label} did not finish in {timeout:.0f} s (killed with its ranks); "
                            f"the end of its stderr:\n{stderr[-3000:]}")  # fmt: skip
    return Finished(proc.returncode, stdout, stderr)


def _unreaped(proc: subprocess.Popen) -> int | None:
    """The launcher's pid while it is still ours to kill; None once it has been reaped (its pid may be reused)."""
    return proc.pid if proc.returncode is None else None


def _drain(proc: subprocess.Popen, reap_s: float) -> tuple[str, str]:
    """What is left in the pipes of a killed launcher, waiting at most ``reap_s`` seconds."""
    try:
        return proc.communicate(timeout=reap_s)
    except subprocess.TimeoutExpired:  # something we could not find still holds a pipe: give up on it
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return "", "(the pipes were still held open after the launcher was killed)"
