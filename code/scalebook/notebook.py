"""Helpers for the chapters: reproducible set-up, showing the package's own source, tables, units.

A chapter shows the code it teaches with :func:`show_source`, which renders the package's source as it
is, so the book can never drift from the code it runs.
"""

from __future__ import annotations

import inspect
import os
import random
import textwrap
import warnings


def setup(seed: int = 0, threads: int = 2) -> None:
    """Seed every generator, fix the thread count (float results depend on it) and quiet known noise."""
    import numpy as np
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if _in_kernel():
        # Figures must appear as cell outputs even when MPLBACKEND (e.g. Agg) is set in the environment;
        # the magic, unlike matplotlib.use, also installs the hook that displays figures after each cell.
        from IPython import get_ipython

        get_ipython().run_line_magic("matplotlib", "inline")
    from scalebook.plots import use_style

    use_style()


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def show_source(obj, *, lines: tuple[int, int] | None = None):
    """Display the source of a package function, class or module as a highlighted code block."""
    from IPython.display import Markdown

    source = textwrap.dedent(inspect.getsource(obj))
    if lines is not None:
        source = "\n".join(source.splitlines()[lines[0] - 1 : lines[1]])
    where = f"{inspect.getmodule(obj).__name__}"
    return Markdown(f"*From `{where}`:*\n\n```python\n{source.rstrip()}\n```")


def markdown_table(rows, headers) -> object:
    """A list of rows as a Markdown table (rendered by JupyterLab and by the book)."""
    from IPython.display import Markdown

    def cell(value):
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return Markdown("\n".join(lines))


def human_bytes(n: float, unit: str = "auto") -> str:
    """Decimal units, as GPU datasheets use: 80 GB means 80e9 bytes."""
    units = [("B", 1), ("KB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12), ("PB", 1e15)]
    if unit != "auto":
        factor = dict(units)[unit]
        return f"{n / factor:,.0f} {unit}" if n / factor >= 100 else f"{n / factor:,.3g} {unit}"
    for name, factor in reversed(units):
        if abs(n) >= factor:
            return f"{n / factor:.3g} {name}"
    return f"{n:.0f} B"


def human_count(n: float) -> str:
    """1.25e8 -> '125M', 1.75e11 -> '175B'."""
    for suffix, factor in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= factor:
            return f"{n / factor:.3g}{suffix}"
    return f"{n:.0f}"


def execute_notebook(path, *, timeout: int = 600, write: bool = True) -> float:
    """Run a chapter top to bottom in a fresh kernel (widget state kept for the book); return seconds.

    With ``write`` the executed notebook, outputs included, replaces the file: chapters are committed
    with their outputs so the book renders them and nbval can compare against them.
    """
    import time
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
        store_widget_state=True,
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    if write:
        nbformat.write(nb, path)
    return seconds


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python -m scalebook.notebook NOTEBOOK.ipynb [...]  (executes and saves outputs)")
    for notebook_path in sys.argv[1:]:
        print(f"{notebook_path}: {execute_notebook(notebook_path):.1f} s", flush=True)
