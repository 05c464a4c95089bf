"""How `make test` and `make check` share the tests between two pytest-xdist workers.

Tests go to the workers in groups (see ``conftest.xdist_group``): a notebook's cells run in order in one kernel, a
module's shared launch runs once, every user of the built book shares one worker, and the two local SLURM clusters
never run at the same time. pytest-xdist's ``--dist loadscope`` hands the groups out in order of their number of
tests, which has little to do with their time (a notebook of 60 quick cells before a SLURM module of ten 30-second
jobs), so the longest group could start last and run alone at the end. Here the groups are handed out longest
first (the LPT rule: the last groups to start are the shortest, so the workers finish close together), by the
seconds a run measured for each group (``group_durations.json``, written by ``make test-durations``).

Each worker also runs torch on one thread: two workers of two threads each on two cores spin against each other
(what design.md measured for ranks: one thread halves their step time), and the chapters' outputs are checked
on 1 thread as well as the 2 they were written with (they agree at the precision the book shows them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DURATIONS = Path(__file__).with_name("group_durations.json")
# A group that the file does not know (a new test module) counts this much per test: about the median
# test's time, so that a new module with many tests is not handed out after every known one.
UNKNOWN_SECONDS_PER_TEST = 0.2


def group_seconds() -> dict[str, float]:
    """The measured seconds of each group, or an empty table where the file is missing."""
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text(encoding="utf8")).items()}
    except FileNotFoundError:
        return {}


def longest_first(groups: dict[str, dict], seconds: dict[str, float]) -> list[str]:
    """The names of ``groups`` (group -> its tests) in the order to hand them out: longest expected time first."""

    def expected(name: str) -> float:
        return seconds.get(name, UNKNOWN_SECONDS_PER_TEST * len(groups[name]))

    return sorted(groups, key=lambda name: -expected(name))


def make_scheduler(config, log, group_of):
    """``--dist loadscope`` with ``group_of(nodeid)`` as the scope, handing out the longest groups first."""
    from xdist.scheduler import LoadScopeScheduling

    seconds = group_seconds()

    class LongestFirstGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The queue is built once, in collection order (or by test count); reorder it before the first
            # unit leaves it. Reordering an OrderedDict in place keeps xdist's own bookkeeping intact.
            if not getattr(self, "_reordered", False):
                for name in longest_first(dict(self.workqueue), seconds):
                    self.workqueue.move_to_end(name)
                self._reordered = True
            super()._assign_work_unit(node)

    return LongestFirstGroups(config, log)


def one_thread_per_worker() -> None:
    """Under xdist, torch and the notebooks' kernels run on one thread each (see the module docstring)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    os.environ.setdefault("SCALEBOOK_THREADS", "1")  # read by scalebook.notebook.setup in every chapter's kernel
    import torch

    torch.set_num_threads(1)


class DurationRecorder:
    """Sums each group's setup, call and teardown seconds as the controller receives the reports."""

    def __init__(self, path: Path, group_of):
        self.path, self.group_of, self.seconds = path, group_of, {}

    def pytest_runtest_logreport(self, report) -> None:
        group = self.group_of(report.nodeid)
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = dict(sorted(((k, round(v, 1)) for k, v in self.seconds.items()), key=lambda kv: -kv[1]))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf8")
