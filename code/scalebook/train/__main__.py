"""``python -m scalebook.train``: the command line of :mod:`scalebook.train.cli`.

Source: Python documentation, "__main__ — Top-level code environment" (``__main__.py`` in packages).
"""

import os
import signal
import sys


def _interrupted(signum, frame) -> None:
    """Ctrl-C outside the training loop (which handles it: :mod:`scalebook.train.preemption`): exit 130 at once,
    without a KeyboardInterrupt traceback (on any rank); a second Ctrl-C meanwhile ends the process."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        os.write(2, b"\npython -m scalebook.train: stopped by Ctrl-C outside a training step (none was in progress)\n")
    raise SystemExit(130)


if __name__ == "__main__":  # imported (say by a test that imports every module), it runs nothing
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # first, before torch loads (seconds)
        signal.signal(signal.SIGINT, _interrupted)
    from scalebook.train.cli import main

    sys.exit(main())
