"""Helpers for the chapters: reproducible set-up, showing the package's own source, tables, units, numbers in prose.

A chapter shows the code it teaches with :func:`show_source`, which renders the package's source as it
is, so the book can never drift from the code it runs.

Numbers in prose are computed by the cells, never typed. A code cell calls :func:`glue` (myst-nb's, so nbval
compares the value) and the markdown holds an ``{eval}`` role whose expression formats the value, such as
``f"{glued.gpt3_states_tb:.1f}"``. JupyterLab (jupyterlab-myst) and the site (book/_ext/eval_expressions.py)
both render it from the result that :func:`execute_notebook` stores in the markdown cell's
``user_expressions`` metadata, evaluated in the kernel after the code cells above it ran.

Source: jupyterlab-myst's inline expressions, https://github.com/jupyter-book/jupyterlab-myst (2.7.0);
IPython's ``user_expressions`` in the execute request, https://jupyter-client.readthedocs.io/en/stable/messaging.html
"""

from __future__ import annotations

import inspect
import math
import os
import random
import re
import textwrap
import warnings

#: An inline ``{eval}`` role in MyST markdown; group 2 is the expression (any run of backticks delimits it).
EVAL_ROLE = re.compile(r"\{eval\}(`+)(.+?)\1", re.S)


def setup(seed: int = 0, threads: int = 2) -> None:
    """Seed every generator, fix the thread count and quiet known noise.

    ``SCALEBOOK_THREADS`` overrides ``threads`` (how the outputs are checked on 1 thread, as on a 1-core machine,
    against outputs written with 2: they must agree at the precision the chapters show them).
    """
    threads = int(os.environ.get("SCALEBOOK_THREADS", threads))
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


#: Significant digits at which :func:`glue` and :func:`markdown_table` show a float (see :func:`rounded`).
DIGITS = 4


def rounded(value, digits: int = DIGITS):
    """``value`` with every float in it rounded to ``digits`` significant digits (containers are walked).

    What a chapter shows and nbval compares must not depend on the CPU: the last digits of a float differ between
    kernels (AVX-512, AVX2, ARM) and thread counts, so the full ``repr`` of a float reproduces only on the machine
    that wrote it. Four significant digits are more than the prose shows (it formats with ``.1f`` or ``.2f``,
    mostly) and far above float64's, or a short float32 computation's, rounding differences, so a changed result
    still fails the comparison. Ints, strings and bools are returned as they are; a NumPy or 0-d torch number
    becomes a Python one; -0.0 becomes 0.0.
    """
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") + 0.0 if math.isfinite(value) else value
    if isinstance(value, dict):
        return {key: rounded(item, digits) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [rounded(item, digits) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples too
    item = getattr(value, "item", None)  # a NumPy scalar or a one-element tensor
    if callable(item) and getattr(value, "ndim", None) == 0:
        return rounded(item(), digits)
    return value


def markdown_table(rows, headers, *, digits: int = DIGITS) -> object:
    """A list of rows as a Markdown table (rendered by JupyterLab and by the book); floats at ``digits``
    significant digits (:func:`rounded`), everything else as ``str`` shows it."""
    from IPython.display import Markdown

    def cell(value):
        value = rounded(value, digits)
        text = f"{value:.{digits}g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|")

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


class Glued:
    """The values :func:`glue` has recorded in this kernel: ``glued.name`` or ``glued["name"]``."""

    def __getitem__(self, name: str):
        return getattr(self, name)

    def __repr__(self) -> str:
        return f"Glued({', '.join(sorted(vars(self)))})"


glued = Glued()


def error_text(error: float, tolerance: float) -> str:
    """A measured rounding error as any CPU shows it: ``"0"`` when exact, ``"< tolerance"`` below the tolerance,
    else the error at two significant digits.

    The digits of a rounding error (9.5e-07 here, 1.9e-06 on a machine with other kernels) are the machine's, not
    the book's: what reproduces, and what the text claims, is that the error is below its tolerance. An error at
    or above the tolerance (a bug a chapter plants on purpose, say) is large and shown as it is.
    """
    error = abs(float(error))
    if error == 0:
        return "0"
    return f"< {tolerance:g}" if error < tolerance else f"{error:.1e}"


def glue(name: str, variable, display: bool = True, *, digits: int | None = DIGITS, below: float | None = None,
         decimals: int | None = None):
    """``myst_nb.glue`` that also keeps the value for ``{eval}`` in prose, as the cell's output shows it.

    The output (which nbval compares with the committed one) and ``glued.name`` (which the prose formats) hold
    the same value, so every number in prose is checked: ``variable`` at ``digits`` significant digits
    (:func:`rounded`), so that it reproduces on any CPU. ``digits=None`` keeps it whole, for a value computed in
    Python from constants (a FLOP count, a published figure), whose digits are the same everywhere. A measured
    rounding error is glued with ``below=tolerance``: then the value is the tolerance, which the error is below
    (the prose says "within" or "less than"), or the error itself at two digits where it is not. A value near
    zero that the prose shows with a fixed number of decimals (a cosine similarity of 0.007 shown as 0.01) is
    glued with ``decimals``: rounded to that many places, one more than the prose shows, since its 4th
    significant digit is the machine's.
    """
    from myst_nb import glue as myst_glue

    if below is not None:
        shown = below if abs(float(variable)) < below else float(f"{float(variable):.1e}")
    elif decimals is not None:
        shown = round(float(variable), decimals)
    else:
        shown = variable if digits is None else rounded(variable, digits)
    setattr(glued, name, shown)
    return myst_glue(name, shown, display=display)


def eval_expressions(markdown: str) -> list[str]:
    """The expressions of the ``{eval}`` roles in a markdown cell's source, in order, without repeats."""
    return list(dict.fromkeys(match.group(2) for match in EVAL_ROLE.finditer(markdown)))


def shown_text(result: dict) -> str:
    """What JupyterLab and the site show for one stored result: its text/plain, a string without its quotes."""
    if result.get("status") != "ok" or "text/plain" not in result.get("data", {}):
        raise ValueError(f"no text/plain result to show: {result}")
    return re.sub(r"^([\"'])(.*)\1$", r"\2", result["data"]["text/plain"], flags=re.S)


def _expression_client():
    """A NotebookClient that, reaching a markdown cell, stores its ``{eval}`` results in its metadata.

    A cell that refers to a value glued further down (prose announcing a result) is evaluated again after
    the last cell; an expression that fails even then raises ValueError.
    """
    from nbclient import NotebookClient

    class ExpressionClient(NotebookClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.deferred: list[int] = []

        async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
            if cell.cell_type == "markdown":
                await self.store_expressions(cell, cell_index, last_try=False)
            else:
                cell = await super().async_execute_cell(cell, cell_index, execution_count, store_history)
            if cell_index == len(self.nb.cells) - 1:
                for index in self.deferred:
                    await self.store_expressions(self.nb.cells[index], index, last_try=True)
            return cell

        async def store_expressions(self, cell, cell_index: int, last_try: bool) -> None:
            cell.metadata.pop("user_expressions", None)
            expressions = eval_expressions(cell.source)
            if not expressions:
                return
            request = {str(i): expression for i, expression in enumerate(expressions)}
            msg_id = self.kc.execute("", silent=True, store_history=False, user_expressions=request)
            results = (await self.async_wait_for_reply(msg_id, cell))["content"]["user_expressions"]
            stored = [{"expression": request[key], "result": results[key]} for key in request]
            failed = [f"{e['expression']} -> {e['result'].get('ename')}: {e['result'].get('evalue')}"
                      for e in stored if e["result"]["status"] != "ok"]  # fmt: skip
            if failed and not last_try:
                self.deferred.append(cell_index)
            elif failed:
                raise ValueError(f"markdown cell {cell_index}: {{eval}} failed: " + "; ".join(failed))
            else:
                cell.metadata["user_expressions"] = stored

    return ExpressionClient


def execute_notebook(path, *, timeout: int = 600, write: bool = True) -> float:
    """Run a chapter top to bottom in a fresh kernel (widget state kept for the book); return seconds.

    Each markdown cell's ``{eval}`` expressions are evaluated in the kernel when execution reaches the cell
    (or after the last cell, for a value glued further down) and stored as its ``user_expressions``
    (jupyterlab-myst's format); one that fails raises ValueError.
    With ``write`` the executed notebook, outputs included, replaces the file: chapters are committed
    with their outputs so the book renders them and nbval can compare against them.
    """
    import time
    from pathlib import Path

    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = _expression_client()(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
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
