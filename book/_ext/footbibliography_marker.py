"""The site's citations from a chapter's lab form: author-year links become ``{footcite}``, the lab's list footnotes.

A chapter stores its citations as JupyterLab (jupyterlab-myst 2.7.0, which resolves no key from a .bib) shows
them: ``([Loshchilov and Hutter, 2019](#cite-loshchilov2019decoupled))``, and a References cell whose
``% footbibliography`` comment line is followed by the works cited, up to ``% end of the works cited`` (see
:mod:`scalebook.citations`, which writes both from book/references.bib). At build time this extension turns each
run of citation links back into sphinxcontrib-bibtex's ``{footcite}`` role and the block from the marker line into
the ``{footbibliography}`` directive, in Sphinx's ``source-read`` event: for a notebook, myst-nb parses the text
that event hands on (the notebook's JSON), so the markdown cells are rewritten there and the page gets exactly the
numbered citations and footnote list it had with the roles and the directive written out. The References page's list
of every work, there for JupyterLab, which shows nothing for its ``{bibliography}`` directive, is dropped the same way.

Source: sphinxcontrib-bibtex, https://sphinxcontrib-bibtex.readthedocs.io/en/latest/usage.html#role-footcite;
Sphinx's source-read event, https://www.sphinx-doc.org/en/master/extdev/event_callbacks.html#event-source-read
"""

from __future__ import annotations

import json

from scalebook.citations import ALL_WORKS, MARKER, to_site

LAB_FORM = (MARKER, "](#cite-", ALL_WORKS)


def expand_markdown(text: str) -> str:
    """Markdown in the site's form: ``{footcite}`` roles and the ``{footbibliography}`` directive."""
    return to_site(text)


def expand_notebook(text: str) -> str:
    """A notebook's JSON with its markdown cells in the site's form (unchanged text when none changes)."""
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
    if not any(mark in source[0] for mark in LAB_FORM):
        return
    is_notebook = str(app.env.doc2path(docname)).endswith(".ipynb")
    source[0] = expand_notebook(source[0]) if is_notebook else expand_markdown(source[0])


def setup(app):
    app.connect("source-read", expand_marker)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
