"""``python -m scalebook.train.torchrun``: PyTorch's ``torchrun``, ending quietly when it is told to stop.

Told to stop (SIGTERM, SIGINT, or SIGUSR1 when ``PET_SIGNALS_TO_HANDLE`` lists it), torchrun passes the signal to
its ranks, waits for them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds) and then lets the ``SignalException`` its
handler made of the signal leave its ``main``: Python prints it as a 25-line traceback and exits with 1, in the
log of a job that stopped as it was asked to (the ranks saved: :mod:`scalebook.train.preemption`). Its agent also
logs one warning that it received the signal and one per rank that it passed it on.

This runs torchrun's own ``main``, arguments and all, and changes only that ending: no traceback and no
warnings of the stop it was asked for. It exits with 0 when every rank ended by itself within the grace period
(the stop went as asked: rank 0 prints the step it stopped at and where it saved), so that ``srun``, which
started it on each node, reports no failed task and stops no other node's ranks mid-save; else, when torchrun
had to kill a rank, with the status of a process that the signal ended, 128 + its number (138 for SIGUSR1, 143
for SIGTERM), after torchrun's warning naming the rank it killed. Anything else (a rank that fails, a rendezvous
that times out) torchrun reports as it always does.

Source: PyTorch documentation, "torchrun (Elastic Launch)" and ``torch/distributed/elastic/multiprocessing/api.py``
(``SignalException``, ``TORCHELASTIC_SIGNALS_TO_HANDLE``).
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main

__all__ = ["main"]

# The loggers of the warnings a stop produces: the agent's "Received 10 death signal, shutting down workers",
# then the process context's "Sending process 123 closing signal SIGUSR1", one per rank.
_AGENT, _PROCESSES = "torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"


class _StopWarnings(logging.Filter):
    """Drops the agent's warning that it received a stop signal and the per-rank warnings that it passed the signal
    on; notes (and lets through) the warning that a rank did not stop in time and was killed.

    The ranks may stop before torchrun does (SLURM signals every process of a job step, in no set order): torchrun
    then sees a rank end and closes the others before its own signal arrives. Those closing warnings are held back
    and dropped if a stop signal follows; if torchrun ends for another reason (a failed rank), :meth:`release`
    logs them after all, so a rank closed because a peer failed is still reported."""

    def __init__(self):
        super().__init__()
        self.stopping = self.killed = self.releasing = False
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if self.releasing:
            return True
        if message.startswith("Received %s death signal"):
            self.stopping = True
            return False
        self.killed |= message.startswith("Unable to shutdown process")
        if message.startswith("Sending process %s closing signal"):
            if not self.stopping:
                self.held.append(record)
            return False
        return True

    def release(self) -> None:
        """Log the held closing warnings: torchrun ended without a stop signal, so they were not part of one."""
        self.releasing = True
        for record in self.held:
            logging.getLogger(record.name).handle(record)
        self.held.clear()


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments); its exit status."""
    quiet = _StopWarnings()
    for name in (_AGENT, _PROCESSES):
        logging.getLogger(name).addFilter(quiet)
    try:
        torchrun_main(argv)
    except SignalException as stop:
        return 128 + int(stop.sigval) if quiet.killed else 0
    except BaseException:
        quiet.release()
        raise
    quiet.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
