"""Sphinx extension: a 404.html page at the root of the built site, for static hosts such as GitHub Pages.

A host serves its 404.html for any missing address, at any depth (``/book/no/such/page.html``), so the
page cannot use relative links the way the book's pages do: it is one self-contained file (its style
inline, no script) whose links are absolute, made from ``html_baseurl`` (``html.baseurl`` in _config.yml;
the publish workflow passes the address GitHub Pages gives the repository). Without a base URL the links
point at the host's root.

Source: GitHub Docs, "Creating a custom 404 page for your GitHub Pages site"; Sphinx, ``html_baseurl``.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

PAGE = "404.html"

TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="robots" content="noindex">
<title>Page not found - {title}</title>
<style>
  body {{ font-family: system-ui, sans-serif; max-width: 40rem; margin: 4rem auto; padding: 0 1rem;
         line-height: 1.5; color: #222832; background: #fff; }}
  a {{ color: #0a7d91; }}
  @media (prefers-color-scheme: dark) {{ body {{ color: #ced6dd; background: #14181e; }} a {{ color: #3fb1c5; }} }}
</style>
</head>
<body>
<main>
<h1>Page not found</h1>
<p>There is no page at this address in <em>{title}</em>. The chapters may have moved when the book was
rebuilt.</p>
<ul>
<li><a href="{root}index.html">The book's first page</a></li>
<li><a href="{root}search.html">Search the book</a></li>
<li><a href="{root}book/glossary.html">The glossary</a></li>
</ul>
</main>
</body>
</html>
"""


def not_found_html(title: str, baseurl: str) -> str:
    """The 404 page for a book called ``title`` published at ``baseurl`` (empty: the host's root)."""
    root = baseurl.rstrip("/") + "/" if baseurl else "/"
    return TEMPLATE.format(title=escape(title), root=escape(root, quote=True))


def _write(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    page = not_found_html(app.config.project, app.config.html_baseurl)
    (Path(app.outdir) / PAGE).write_text(page, encoding="utf8")


def setup(app):
    app.connect("build-finished", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
