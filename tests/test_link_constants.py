"""No notebook sets a link's latency or bandwidth by hand (issue 33).

A chapter that prices communication takes its latencies and bandwidths from the one model that holds them
(``scalebook.comm.costmodel.link_model``, ``scalebook.configs.get_link``, ``scalebook.system``), so that two
chapters cannot price the same link two ways. This test reads every notebook's code cells and the code blocks
of its markdown (exercise solutions) and fails on a number written into a latency (``alpha=3e-6``,
``latency = 9.6e-6``) or a bandwidth (``bandwidth=50e9``). Plot transparency (``alpha=0.35``) and the pipeline
simulator's unit-free ``latency=0.2`` are not link constants: a latency is flagged only when written in
micro- or nanoseconds (an exponent from e-5 to e-9, or a ``µs``-sized literal), a bandwidth when at least
1 MB/s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
NUMBER = r"([0-9][0-9_]*\.?[0-9]*(?:[eE][-+]?[0-9]+)?)"
LATENCY = re.compile(r"\b\w*(?:alpha|latency|ALPHA|LATENCY)\w*\s*[=:]\s*" + NUMBER)
BANDWIDTH = re.compile(r"\b\w*(?:bandwidth|BANDWIDTH)\w*\s*[=:]\s*" + NUMBER)


def hand_set_constants(source: str) -> list[str]:
    """The lines of ``source`` that write a link latency or bandwidth as a literal number."""
    found = []
    for line in source.splitlines():
        code = line.split("#", 1)[0]
        latencies = [float(m.group(1).replace("_", "")) for m in LATENCY.finditer(code)]
        bandwidths = [float(m.group(1).replace("_", "")) for m in BANDWIDTH.finditer(code)]
        # seconds: a link latency is micro- or nanoseconds; bandwidths in bytes per second
        if any(0 < value < 1e-4 for value in latencies) or any(value >= 1e6 for value in bandwidths):
            found.append(line.strip())
    return found


def _code_of(cell: dict) -> str:
    source = "".join(cell["source"])
    if cell["cell_type"] == "code":
        return source
    return "\n".join(re.findall(r"```python\n(.*?)```", source, flags=re.S))


def test_the_detector_flags_hand_set_latencies_and_bandwidths_and_nothing_else():
    assert hand_set_constants("links = dict(alpha=3e-6, bandwidth=50e9)") == [
        "links = dict(alpha=3e-6, bandwidth=50e9)"
    ]
    assert hand_set_constants("NETWORK_LATENCY = 9.6e-6") == ["NETWORK_LATENCY = 9.6e-6"]
    assert hand_set_constants("inter_bandwidth = 400_000_000_000") == ["inter_bandwidth = 400_000_000_000"]
    for fine in (
        'ax.plot(x, alpha=0.35, label="a")',
        "pipeline.simulate(s, latency=0.2)",
        "alpha=link.alpha, bandwidth=link.bandwidth",
        "alpha=0.0  # no latency: bandwidth only",
        "# alpha = 3e-6 in a comment",
    ):
        assert hand_set_constants(fine) == [], fine


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_notebook_sets_a_link_latency_or_bandwidth_by_hand(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    found = [f"cell {i}: {line}" for i, cell in enumerate(cells) for line in hand_set_constants(_code_of(cell))]
    assert not found, (
        f"{notebook.name} sets link constants by hand; take them from costmodel.link_model, "
        f"configs.get_link or scalebook.system: {found}"
    )
