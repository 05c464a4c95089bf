"""Sphinx extension: every bold term of the book links to its glossary entry.

The book's convention is that **bold** marks a defined term where it is introduced, and that every such
term has an entry in the glossary (book/glossary.md, checked by tests/test_reader_aids.py). This hook
runs when a page's cross-references have been resolved and wraps each ``nodes.strong`` whose text is a
glossary term (whitespace-normalised, case-insensitive, as Sphinx's own ``:term:`` role matches) in an
internal reference to that entry. The strong node stays inside the link, so the term is still bold; the
link carries the class ``glossary-link`` for styling.

Left alone: bold text that is no term (run-in headings such as "**Overlap.**"), bold inside an existing
link, a title, a glossary term or an API signature, and everything on the page that defines the terms.
"""

from __future__ import annotations

from docutils import nodes
from sphinx import addnodes
from sphinx.util.nodes import make_refnode

CSS_CLASS = "glossary-link"

# Bold inside these nodes is never turned into a link (a link in a title would also land in the toc).
_SKIP_INSIDE = (nodes.reference, nodes.title, nodes.term, addnodes.desc_signature, addnodes.toctree)


def normalize(text: str) -> str:
    """The key a bold text and a glossary term are compared by."""
    return " ".join(text.split()).lower()


def glossary_terms(env) -> dict[str, tuple[str, str]]:
    """{normalised term: (docname, anchor id)} for every term of every glossary of the project."""
    std = env.get_domain("std")
    return {
        normalize(name): (docname, labelid)
        for (objtype, name), (docname, labelid) in std.objects.items()
        if objtype == "term"
    }


def _inside_skipped(node: nodes.Node) -> bool:
    parent = node.parent
    while parent is not None:
        if isinstance(parent, _SKIP_INSIDE):
            return True
        parent = parent.parent
    return False


def link_bold_terms(app, doctree: nodes.document, docname: str) -> None:
    terms = glossary_terms(app.env)
    if not terms:
        return
    glossary_docs = {termdoc for termdoc, _ in terms.values()}
    if docname in glossary_docs:
        return
    # Exactly nodes.strong: addnodes.literal_strong (API field names, option lists) subclasses it.
    for strong in [n for n in doctree.findall(nodes.strong) if type(n) is nodes.strong]:
        target = terms.get(normalize(strong.astext()))
        if target is None or _inside_skipped(strong):
            continue
        termdoc, anchor = target
        parent = strong.parent
        index = parent.index(strong)
        parent.remove(strong)
        link = make_refnode(app.builder, docname, termdoc, anchor, strong, title=f"glossary: {strong.astext()}")
        link["classes"].append(CSS_CLASS)
        parent.insert(index, link)


def setup(app):
    app.connect("doctree-resolved", link_bold_terms)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
