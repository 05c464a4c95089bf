"""Stopping a training run cleanly when the cluster asks: SIGTERM or SIGUSR1 -> finish the step, save, exit.

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
one int64 per step costs microseconds (one latency, a few bytes) beside the step's gradient all-reduce; checking
every k steps would save little and delay the stop by up to k - 1 steps of the grace period.

The loop then saves (``python -m scalebook.train`` calls its usual checkpoint function, and waits for it) and
raises :class:`Stopped`, a ``SystemExit`` with code ``EXIT_STOPPED``: the process ends with that status
and no traceback, after the ``finally`` clauses that leave the process group. The status means "stopped
early, not failed": ``--resume`` continues from the checkpoint, with the losses the run would have had.

Under ``torchrun``, the launcher must survive the signal and pass it on: torchrun handles SIGTERM by forwarding
it to the ranks and waiting ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (30 by default) before killing them, but
SIGUSR1 kills it unless ``TORCHELASTIC_SIGNALS_TO_HANDLE`` lists it; the scripts in ``slurm/`` set both.

Source: SLURM documentation, "sbatch --signal", "scontrol requeue" and "Preemption"; Python documentation,
"signal — Set handlers for asynchronous events"; PyTorch documentation, "torchrun (Elastic Launch)".
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

__all__ = ["EXIT_STOPPED", "STOP_SIGNALS", "StopSignals", "Stopped"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_STOPPED = 3  # 0 done, 1 failed or diverged, 2 invalid arguments (see ``python -m scalebook.train --help``)


class Stopped(SystemExit):
    """The run stopped at ``step`` on ``signal_name``, saved in ``checkpoint_dir`` (None: not saved); a SystemExit
    with ``EXIT_STOPPED``. Its text is the line rank 0 prints."""

    def __init__(self, signal_name: str, step: int, checkpoint_dir: str | None):
        super().__init__(EXIT_STOPPED)
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
    handlers come back on exit. Off the main thread (where Python allows no handler) it installs nothing."""

    def __init__(self, device: torch.device | str = "cpu", signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.device, self.signals = torch.device(device), tuple(signals)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handler(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum)  # nothing else: see the module docstring

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handler) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
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
