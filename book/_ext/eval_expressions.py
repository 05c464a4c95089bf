"""The site renders each ``{eval}`` inline expression from the result stored in its notebook.

A number in a chapter's prose is an ``{eval}`` role whose expression formats a glued value, such as
``f"{glued.gpt3_states_tb:.1f}"`` (see :mod:`scalebook.notebook`). ``python -m scalebook.notebook`` evaluates
it in the kernel and stores the result in the markdown cell's ``user_expressions`` metadata, which is what
JupyterLab (jupyterlab-myst) shows. myst-nb's own ``{eval}`` role asks a live kernel instead, which this
book's build (notebooks executed into a cache, or not at all) does not have. This extension replaces that
role: it shows the stored result's text, exactly as JupyterLab does, and an expression with no stored
result (the notebook was not re-executed after its prose changed) is a build warning, so the book, built
with warnings as errors, fails.

Source: jupyterlab-myst 2.7.0's inline expressions, https://github.com/jupyter-book/jupyterlab-myst;
myst-nb's roles, https://myst-nb.readthedocs.io/en/latest/render/inline.html
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxRole

from scalebook.notebook import shown_text

logger = logging.getLogger(__name__)


@lru_cache(maxsize=64)
def stored_results(path: str, mtime: float) -> tuple[dict, list[str]]:
    """Every ``{eval}`` expression's stored result in a notebook, and the expressions stored twice, differently."""
    del mtime  # part of the cache key only: a notebook rewritten during a session is read again
    cells = json.loads(Path(path).read_text(encoding="utf8"))["cells"]
    results: dict[str, dict] = {}
    conflicts = []
    for cell in cells:
        for entry in cell.get("metadata", {}).get("user_expressions", []):
            old = results.setdefault(entry["expression"], entry["result"])
            if old != entry["result"]:
                conflicts.append(entry["expression"])
    return results, conflicts


class StoredEval(SphinxRole):
    """``{eval}`expression```: the text of the result stored for ``expression`` in this page's notebook."""

    def run(self):
        path = Path(self.env.doc2path(self.env.docname))
        results, conflicts = stored_results(str(path), path.stat().st_mtime) if path.suffix == ".ipynb" else ({}, [])
        problem = None
        if self.text in conflicts:
            problem = "has different stored results in two cells; glue the two values under different names"
        elif self.text not in results:
            problem = "has no stored result; re-execute the notebook with `python -m scalebook.notebook`"
        else:
            try:
                text = shown_text(results[self.text])
            except ValueError as exc:
                problem = str(exc)
        if problem:
            logger.warning("{eval}`%s` %s", self.text, problem, location=self.get_location(), type="eval")
            return [nodes.literal(self.rawtext, self.text)], []
        return [nodes.inline(text, text, classes=["pasted-text"])], []


def setup(app):
    # After myst_nb (earlier in the extension list), whose eval role needs a live kernel.
    app.add_role("eval", StoredEval(), override=True)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
