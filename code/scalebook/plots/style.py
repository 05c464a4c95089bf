"""The book's matplotlib style, and the figure helper every plot shares.

``scalebook.mplstyle`` (next to the package's ``__init__``) sets sizes, fonts, an opaque white background
that reads on light and dark pages, grid and colours. :func:`scalebook.notebook.setup` applies it; call
:func:`use_style` to get it in your own scripts.

Source: matplotlib documentation, "Customizing Matplotlib with style sheets and rcParams".
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

STYLE = Path(__file__).resolve().parent.parent / "scalebook.mplstyle"


def use_style() -> None:
    """Apply the book's matplotlib style (``STYLE``) to every figure drawn from now on."""
    plt.style.use(STYLE)


def figure_and_axes(ax):
    """``(ax.figure, ax)``, or a fresh figure and its axes when ``ax`` is None."""
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots()
    return fig, ax
