"""A chapter's closing footnote list is written as the MyST comment ``% footbibliography``; the site expands it.

sphinxcontrib-bibtex's ``{footbibliography}`` directive lists a page's ``{footcite}`` works as footnotes. JupyterLab
(jupyterlab-myst 2.7.0) knows no such directive and draws a red "Unknown Directive" box where it stands. So a
chapter's "References" cell holds the line ``% footbibliography``, a MyST comment that JupyterLab renders as
nothing, followed by a sentence linking to the bibliography page, which both render. At build time this extension
turns each such line back into the directive, in Sphinx's ``source-read`` event: for a notebook, myst-nb parses
the text that event hands on (the notebook's JSON), so the markdown cells are rewritten there and the page gets
exactly the footnote list it had with the directive written out.

Source: sphinxcontrib-bibtex, https://sphinxcontrib-bibtex.readthedocs.io/en/latest/usage.html#role-footcite;
Sphinx's source-read event, https://www.sphinx-doc.org/en/master/extdev/event_callbacks.html#event-source-read
"""

from __future__ import annotations

import json
import re

MARKER = "% footbibliography"
DIRECTIVE = "```{footbibliography}\n```"
MARKER_LINE = re.compile(r"^% footbibliography[ \t]*$", re.M)


def expand_markdown(text: str) -> str:
    """Markdown with each ``% footbibliography`` line replaced by the ``{footbibliography}`` directive."""
    return MARKER_LINE.sub(DIRECTIVE, text)


def expand_notebook(text: str) -> str:
    """A notebook's JSON with the marker expanded in its markdown cells (unchanged text when it has none)."""
    notebook = json.loads(text)
    changed = False
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"])
        expanded = expand_markdown(source)
        if expanded != source:
            cell["source"], changed = expanded, True
    return json.dumps(notebook) if changed else text


def expand_marker(app, docname: str, source: list[str]) -> None:
    if MARKER not in source[0]:
        return
    is_notebook = str(app.env.doc2path(docname)).endswith(".ipynb")
    source[0] = expand_notebook(source[0]) if is_notebook else expand_markdown(source[0])


def setup(app):
    app.connect("source-read", expand_marker)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
