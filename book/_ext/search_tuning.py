"""Sphinx extension: the search page ranks the chapter that teaches a term first, and shows excerpts offline.

Two changes to Sphinx's own search (searchtools.js), both made by book/_static/search_tuning.js, which this
extension adds to the search page only, before searchtools.js:

- **Ranking.** Sphinx scores a glossary entry whose name matches the query far above a chapter that merely
  contains the word (an index entry scores ``100 * len(query) / len(entry)``, a word in a chapter 5 or 15), so
  "ZeRO" listed the glossary's five ZeRO entries first and the ZeRO chapter eighth. Every glossary entry links
  first to the chapter that explains it (book/glossary.md says so, tests/test_reader_aids.py checks it): that
  chapter is the one that *teaches* the term. The page's ``Scorer.score`` raises the results of that chapter
  above all others when the query is a glossary term (or contains one), and lowers the back matter (the
  ``search_back_matter`` pages: glossary, API, notation, ...) below every other page.
- **Excerpts from file://.** Sphinx fetches each result page to cut an excerpt from it, which a browser
  refuses for file:// URLs (the book is meant to be opened from disk), so no result had one. The text of
  every page (its sections, and each glossary term with its definition, keyed by their ids) is written to
  ``_static/search_excerpts.js``, a script the search page loads like ``searchindex.js``; the page answers
  Sphinx's fetch of a result page from it, over HTTP and from disk alike.

Source: Sphinx 7.4, sphinx/themes/basic/static/searchtools.js (``Scorer``, ``_displayItem``, ``htmlToText``)
and "Sphinx core events" (html-page-context; ``add_js_file`` there adds a script to that page only).
"""

from __future__ import annotations

import json
from html import escape
from html.parser import HTMLParser
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.util import docname_join

DATA_FILE = "search_excerpts.js"
GLOSSARY_DOC = "book/glossary"


def normalize(term: str) -> str:
    """The key a query and a glossary term are compared by (as glossary_links.normalize)."""
    return " ".join(term.split()).lower()


def teaching_chapters(env, glossary_doc: str = GLOSSARY_DOC) -> dict[str, str]:
    """{normalised term: docname of the first page its glossary entry links to} for every term and alias."""
    if glossary_doc not in env.found_docs:
        return {}
    doctree = env.get_doctree(glossary_doc)
    teaches = {}
    for item in doctree.findall(nodes.definition_list_item):
        terms = [normalize(term.astext()) for term in item.findall(nodes.term)]
        refs = [ref for ref in item.findall(addnodes.pending_xref) if ref.get("reftype") == "doc"]
        if terms and refs:
            target = docname_join(refs[0].get("refdoc", glossary_doc), refs[0]["reftarget"])
            teaches.update(dict.fromkeys(terms, target))
    return teaches


class _ExcerptText(HTMLParser):
    """A page's body reduced to its text, keeping the ids that search results point at.

    A section stays a ``<section id>`` around its text; a glossary term (a ``<dt id>``, one per alias) becomes
    nested ``<div id>`` elements around the term and its definition, so that each alias's anchor holds the
    definition. Scripts, styles and the "#" of header links are dropped.
    """

    SKIP = {"script", "style"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip_depth = 0
        self.headerlink = False
        self.section_ids: list[str | None] = []
        self.open_terms = 0  # <div id> opened for consecutive <dt>s, closed after their <dd>
        self.dd_depth = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in self.SKIP:
            self.skip_depth += 1
        elif tag == "a" and "headerlink" in (attrs.get("class") or "").split():
            self.headerlink = True
        elif tag == "section":
            self.section_ids.append(attrs.get("id"))
            self.out.append(f'<section id="{escape(attrs["id"])}">' if attrs.get("id") else "<section>")
        elif tag == "dt" and attrs.get("id") and self.dd_depth == 0:
            self.out.append(f'<div id="{escape(attrs["id"])}">')
            self.open_terms += 1
        elif tag == "dd" and self.open_terms:
            self.dd_depth += 1
        elif tag in ("p", "dt", "dd", "li", "div", "td", "th", "pre", "h1", "h2", "h3", "h4", "br"):
            self.out.append(" ")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip_depth = max(0, self.skip_depth - 1)
        elif tag == "a":
            self.headerlink = False
        elif tag == "section" and self.section_ids:
            self.section_ids.pop()
            self.out.append("</section>")
        elif tag == "dd" and self.dd_depth:
            self.dd_depth -= 1
            if self.dd_depth == 0:
                self.out.append("</div>" * self.open_terms)
                self.open_terms = 0
        elif tag == "dt":
            self.out.append(": ")

    def handle_data(self, data):
        if not self.skip_depth and not self.headerlink:
            self.out.append(escape(data, quote=False))

    def text(self) -> str:
        return " ".join("".join(self.out).split())


def excerpt_html(body: str) -> str:
    """The text of a page's body (HTML) with its section and glossary-term ids, as HTML."""
    parser = _ExcerptText()
    parser.feed(body)
    parser.close()
    return parser.text()


def _collect(app, pagename, templatename, context, doctree):
    """Keep each page's text; give the search page its scripts."""
    if pagename == "search":
        app.add_js_file(DATA_FILE)
        app.add_js_file("search_tuning.js")
    elif doctree is not None and "body" in context:
        app.builder.scalebook_excerpts[pagename] = excerpt_html(context["body"])


def _start(app):
    app.builder.scalebook_excerpts = {}


def _write(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    data = {
        "teaches": teaching_chapters(app.env),
        "backMatter": list(app.config.search_back_matter),
        "excerpts": app.builder.scalebook_excerpts,
    }
    target = Path(app.outdir) / "_static" / DATA_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"window.SCALEBOOK_SEARCH = {json.dumps(data, sort_keys=True)};\n", encoding="utf8")


def setup(app):
    app.add_config_value("search_back_matter", [], "html")
    app.connect("builder-inited", _start)
    app.connect("html-page-context", _collect)
    app.connect("build-finished", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": False}
