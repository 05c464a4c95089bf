"""Stopping a training run cleanly when the cluster or the user asks: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) -> finish
the step, save, exit.

A SLURM job learns that it must go in two ways. At a preemption, a ``scancel`` or the time limit, SLURM sends
SIGTERM to every process of the job and SIGKILL ``KillWait`` seconds later (30 s by default); with
``sbatch --signal=USR1@S`` it also sends SIGUSR1 ``S`` seconds before the time limit, time enough to save. Python's
default for both signals is to die on the spot, mid-step, losing every step since the last checkpoint.

:class:`StopSignals` replaces that default while the training loop runs. Its handler only sets a flag: a
handler runs between two bytecodes of the main thread, possibly inside a collective or a checkpoint write,
where doing real work could deadlock or tear a file. After each step every rank calls :meth:`StopSignals.agreed`,
one all-reduce (MAX) of the signal number it received (0 for none): the signal may reach one rank, or reach
the ranks during different steps, yet every rank gets the same answer at the same step, so all of them take
the same path (save, then leave) and none waits forever in a collective its peers skipped. The all-reduce of
one int64 per step sends a few bytes (one latency) beside the step's gradient all-reduce. On GPUs reading its
result (``.item()``) also blocks the host until the collective has run, so the CPU cannot queue the next step's
kernels while this one finishes; production loops check every k steps, or start the all-reduce asynchronously
and read it a step later. This loop checks every step: the stop comes at once, within the grace period.

The loop then saves (``python -m scalebook.train`` calls its usual checkpoint function, and waits for it) and
raises :class:`Stopped`, a ``SystemExit`` with code ``EXIT_STOPPED``: the process ends with that status
and no traceback, after the ``finally`` clauses that leave the process group. The status means "stopped
early, not failed": ``--resume`` continues from the checkpoint, with the losses the run would have had.

Ctrl-C (SIGINT) is the user's "stop": Python's default raises KeyboardInterrupt wherever the main thread is, a
traceback and the steps since the last checkpoint lost. While the loop runs it is handled as the cluster's signals
are, with the shell's code for it, ``EXIT_INTERRUPTED`` (130 = 128 + 2); the first one also gives SIGINT back its
system default, so that a second Ctrl-C ends the process at once, without saving, even inside a collective that
never returns. Outside the loop (starting, finishing) ``python -m scalebook.train`` exits 130 at once, without a
traceback: nothing is in progress there. ``torchrun`` forwards a Ctrl-C to every rank as one SIGINT.

Under ``torchrun``, the launcher must survive the signal and pass it on: torchrun handles SIGTERM by forwarding
it to the ranks and waiting ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (30 by default) before killing them, but
SIGUSR1 kills it unless ``TORCHELASTIC_SIGNALS_TO_HANDLE`` lists it; the scripts in ``slurm/`` set both.

Source: SLURM documentation, "sbatch --signal", "scontrol requeue" and "Preemption"; Python documentation,
"signal — Set handlers for asynchronous events"; PyTorch documentation, "torchrun (Elastic Launch)".
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

__all__ = ["EXIT_INTERRUPTED", "EXIT_STOPPED", "STOP_SIGNALS", "StopSignals", "Stopped"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_STOPPED = 3  # 0 done, 1 failed or diverged, 2 invalid arguments (see ``python -m scalebook.train --help``)
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C: 128 + SIGINT, what a shell reports for a process that Ctrl-C ended


def rank_zero() -> bool:
    """Whether this process is rank 0 by its launcher's variables (torchrun's, SLURM's), or the only one."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


class Stopped(SystemExit):
    """The run stopped at ``step`` on ``signal_name``, saved in ``checkpoint_dir`` (None: not saved); a SystemExit
    with ``EXIT_INTERRUPTED`` for SIGINT, else ``EXIT_STOPPED``. Its text is the line rank 0 prints."""

    def __init__(self, signal_name: str, step: int, checkpoint_dir: str | None):
        super().__init__(EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_STOPPED)
        self.signal_name, self.step, self.checkpoint_dir = signal_name, step, checkpoint_dir

    def __str__(self) -> str:
        if self.checkpoint_dir:
            saved = f"checkpoint saved in {self.checkpoint_dir}; continue with --resume"
        else:
            saved = f"no --checkpoint-dir, so the progress of these {self.step} steps is lost"
        return f"stopping at step {self.step} on {self.signal_name}: {saved}"


class StopSignals:
    """While active (``with StopSignals(device) as stop:``), ``STOP_SIGNALS`` set a flag instead of ending the
    process; :meth:`agreed` tells every rank, at the same step, whether any of them received one. The previous
    handlers come back on exit, but after a SIGINT, SIGINT's default stays (a second Ctrl-C ends the process).
    Off the main thread (where Python allows no handler) it installs nothing; an ignored SIGINT (``nohup``, a
    background job) stays ignored."""

    def __init__(self, device: torch.device | str = "cpu", signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.device, self.signals = torch.device(device), tuple(signals)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handler(self, signum: int, frame) -> None:
        self.received = self.received or signal.Signals(signum)  # a flag, nothing more: see the module docstring
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C: the system ends the process at once
            if rank_zero():  # os.write: safe even if the main thread was inside a write to stderr
                os.write(2, b"\nCtrl-C: the step in progress ends, then the run saves and stops; Ctrl-C again "
                            b"stops at once, without saving\n")  # fmt: skip

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            keep = {signal.SIGINT} if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else set()
            self._previous = {sig: signal.signal(sig, self._handler) for sig in self.signals if sig not in keep}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            if not (sig == signal.SIGINT == self.received):  # after a Ctrl-C, a second one still ends the process
                signal.signal(sig, handler)
        self._previous = {}

    def agreed(self) -> str | None:
        """The name of the signal any rank received (``"SIGUSR1"``), the same on every rank, or None. A collective
        when a process group is initialized: every rank must call it at the same point of every step."""
        number = int(self.received or 0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([number], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            number = int(flag.item())
        return signal.Signals(number).name if number else None
