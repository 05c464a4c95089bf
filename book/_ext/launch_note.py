"""Sphinx extension: a one-line "run this page" note under the title of every page.

A chapter page (a notebook) tells the reader the local command that opens that very notebook in
JupyterLab; a prose page says how to open all of them. Both link to the set-up page. The site has no
launch buttons (each would load code from another host), so this note is the way in.
"""

from __future__ import annotations

from pathlib import Path

from docutils import nodes

SETUP_PAGE = "book/how-to-run"


def _note(app, docname: str) -> nodes.paragraph | None:
    source = Path(app.env.doc2path(docname))
    try:
        relative = source.resolve().relative_to(Path(app.srcdir).resolve()).as_posix()
    except ValueError:
        return None
    paragraph = nodes.paragraph(classes=["launch-note"])
    if source.suffix == ".ipynb":
        paragraph += nodes.Text("Run this notebook yourself: ")
        paragraph += nodes.literal(text=f"make lab NB={relative}")
        paragraph += nodes.Text(" opens it in JupyterLab")
    else:
        paragraph += nodes.Text("Run the chapters yourself: ")
        paragraph += nodes.literal(text="make lab")
        paragraph += nodes.Text(" opens them in JupyterLab")
    if docname == SETUP_PAGE:
        paragraph += nodes.Text(" (set-up below).")
    else:
        paragraph += nodes.Text(" (set-up: ")
        uri = app.builder.get_relative_uri(docname, SETUP_PAGE)
        paragraph += nodes.reference("", "How to run this book", internal=True, refuri=uri)
        paragraph += nodes.Text(").")
    return paragraph


def _insert(app, doctree: nodes.document, docname: str) -> None:
    if app.builder.format != "html" or docname not in app.env.found_docs:
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not section.children or not isinstance(section[0], nodes.title):
        return
    note = _note(app, docname)
    if note is not None:
        section.insert(1, note)


def setup(app):
    app.connect("doctree-resolved", _insert)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
