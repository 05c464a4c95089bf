"""The book builds from the committed notebook outputs, and the built site loads nothing from
another host: every script, stylesheet, font and image is served from the site itself.

The build (the session fixture ``book_html`` in conftest.py) runs with execution off, warnings as
errors and nitpicky cross-references. Links (``<a href="https://...">``) may point anywhere.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import REPO, toc_pages

# What _config.yml loads from _static (book/_vendor/static): each must be in the built site.
VENDORED = [
    "_static/mathjax/tex-chtml-full.js",
    "_static/mathjax/output/chtml/fonts/woff-v2/MathJax_Main-Regular.woff",
    "_static/mathjax/output/chtml/fonts/woff-v2/MathJax_Math-Italic.woff",
    "_static/mathjax/LICENSE",
    "_static/requirejs/require.js",
    "_static/requirejs/LICENSE",
    "_static/html-manager/embed-amd.js",
    "_static/html-manager/LICENSE",
    "_static/html-manager-offline.js",
]

# (tag, attribute) pairs whose URL the browser fetches by itself when it renders the page.
FETCHED = {
    ("script", "src"), ("img", "src"), ("img", "srcset"), ("source", "src"), ("source", "srcset"),
    ("iframe", "src"), ("embed", "src"), ("object", "data"), ("video", "src"), ("video", "poster"),
    ("audio", "src"), ("track", "src"), ("input", "src"), ("image", "href"), ("use", "href"),
    ("image", "xlink:href"), ("use", "xlink:href"),
}
# <link rel=...> values that make the browser fetch href (a plain rel="next" link is navigation).
FETCHING_RELS = {"stylesheet", "preload", "modulepreload", "prefetch", "preconnect",
                 "dns-prefetch", "icon", "shortcut", "apple-touch-icon", "manifest", "mask-icon"}
# Attributes of script tags that name a base URL the script loads code from at run time.
SCRIPT_URL_ATTRS = {"data-jupyter-widgets-cdn"}

# A URL of code, a stylesheet or a font written into an inline script (to be loaded later, as
# sphinx-thebe does with its THEBE_JS_URL).
INLINE_ASSET_URL = re.compile(r"""(?:https?:)?//[^\s"'`<>]+?\.(?:m?js|css|woff2?|ttf|otf)\b""", re.I)
CSS_URL = re.compile(r"""url\(\s*(['"]?)(.*?)\1\s*\)|@import\s+(['"])(.*?)\3""", re.I | re.S)


def is_external(url: str) -> bool:
    """True for a URL that names a host (or is protocol-relative): anything not on this site."""
    url = url.strip()
    if not url or url.startswith(("data:", "#", "about:", "blob:")):
        return False
    parts = urlsplit(url)
    return bool(parts.netloc) or url.startswith("//") or parts.scheme in ("http", "https", "ftp")


def srcset_urls(value: str) -> list[str]:
    return [item.strip().split()[0] for item in value.split(",") if item.strip()]


class ExternalLoads(HTMLParser):
    """Collect the URLs on other hosts that an HTML page would load (not the ones it links to)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._in_style = self._in_script = False

    def handle_starttag(self, tag, attrs):
        attributes = {name.lower(): (value or "") for name, value in attrs}
        for name, value in attributes.items():
            urls = srcset_urls(value) if name == "srcset" else [value]
            if (tag, name) in FETCHED or (tag == "script" and name in SCRIPT_URL_ATTRS):
                self.found += [f"<{tag} {name}={u!r}>" for u in urls if is_external(u)]
        if tag == "link":
            rels = set(attributes.get("rel", "").lower().split())
            if rels & FETCHING_RELS and is_external(attributes.get("href", "")):
                self.found.append(f"<link rel={attributes['rel']!r} href={attributes['href']!r}>")
        if "style" in attributes:
            self.found += [f"<{tag} style=...{u!r}>" for u in css_external_urls(attributes["style"])]
        self._in_style = tag == "style"
        self._in_script = tag == "script" and "src" not in attributes and attributes.get(
            "type", "text/javascript") in ("text/javascript", "module", "application/javascript")

    def handle_endtag(self, tag):
        if tag in ("style", "script"):
            self._in_style = self._in_script = False

    def handle_data(self, data):
        if self._in_style:
            self.found += [f"<style> {u!r}" for u in css_external_urls(data)]
        if self._in_script:
            self.found += [f"<script> ...{u!r}" for u in INLINE_ASSET_URL.findall(data)]


def css_external_urls(css: str) -> list[str]:
    urls = []
    for match in CSS_URL.finditer(css):
        url = match.group(2) if match.group(2) is not None else match.group(4)
        if is_external(url):
            urls.append(url)
    return urls


def html_pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if "_sources" not in p.parts)


def test_book_builds(book_html):
    """The build itself (warnings are errors) is the fixture; here: the pages of _toc.yml exist."""
    missing = [page for page in toc_pages() if not (book_html / page).is_file()]
    assert not missing, f"pages of _toc.yml missing from the built site {book_html}: {missing}"


def test_no_page_loads_from_another_host(book_html):
    offending = {}
    for page in html_pages(book_html):
        parser = ExternalLoads()
        parser.feed(page.read_text(encoding="utf8", errors="replace"))
        if parser.found:
            offending[str(page.relative_to(book_html))] = parser.found
    assert not offending, "built pages load from another host:\n" + "\n".join(
        f"  {page}: {', '.join(urls)}" for page, urls in offending.items())


def test_no_stylesheet_loads_from_another_host(book_html):
    offending = {}
    for css in sorted((book_html / "_static").rglob("*.css")):
        urls = css_external_urls(css.read_text(encoding="utf8", errors="replace"))
        if urls:
            offending[str(css.relative_to(book_html))] = urls
    assert not offending, "stylesheets under _static import or url() another host:\n" + "\n".join(
        f"  {css}: {', '.join(urls)}" for css, urls in offending.items())


@pytest.mark.parametrize("path", VENDORED)
def test_vendored_files_are_in_the_site(book_html, path):
    target = book_html / path
    assert target.is_file() and target.stat().st_size > 0, f"{path} is missing from {book_html}"


def test_pages_use_the_vendored_mathjax(book_html):
    """Pages with math load MathJax from _static (and so never from Sphinx's default CDN)."""
    with_math = [p for p in html_pages(book_html) if 'class="math' in p.read_text(encoding="utf8")]
    assert with_math, "no built page has math: the check below would check nothing"
    for page in with_math:
        text = page.read_text(encoding="utf8")
        assert re.search(r'<script[^>]+src="[^"]*_static/mathjax/tex-chtml-full\.js', text), (
            f"{page.relative_to(book_html)} has math but does not load _static/mathjax/tex-chtml-full.js")


def test_the_checks_catch_external_loads():
    """The parser flags what it must, and leaves prose links alone."""
    parser = ExternalLoads()
    parser.feed("""<html><head>
        <script src="https://cdn.example.org/x.js"></script>
        <script src="_static/local.js" data-jupyter-widgets-cdn="https://cdn.jsdelivr.net/npm/"></script>
        <link rel="stylesheet" href="//fonts.example.org/css">
        <link rel="preload" as="font" href="http://fonts.example.org/f.woff2">
        <link rel="next" href="https://example.org/next.html">
        <style>@import url("https://fonts.example.org/css2");
               .a { background: url(data:image/png;base64,AA) }</style>
        </head><body style="background: url('https://example.org/bg.png')">
        <img src="https://example.org/a.png" srcset="b.png 1x, https://example.org/c.png 2x">
        <iframe src="https://example.org/embed"></iframe>
        <a href="https://example.org/paper.pdf">a paper</a><img src="../_images/local.png">
        <script>const THEBE_JS_URL = "https://unpkg.com/thebe@0.8.2/lib/index.js"</script>
        <script type="application/vnd.jupyter.widget-state+json">{"a": "https://x.org/y.js"}</script>
        <script>window.MathJax = {"loader": {"paths": {"x": "_static/x.js"}}}</script>
        </body></html>""")
    found = " ".join(parser.found)
    for url in ("cdn.example.org/x.js", "cdn.jsdelivr.net", "//fonts.example.org/css",
                "f.woff2", "fonts.example.org/css2", "bg.png", "a.png", "c.png", "embed",
                "unpkg.com/thebe@0.8.2/lib/index.js"):
        assert url in found, f"{url} was not flagged: {parser.found}"
    assert len(parser.found) == 10, parser.found
    assert css_external_urls("a{b:url(https://x.org/f.woff)} @import 'https://x.org/s.css';") == [
        "https://x.org/f.woff", "https://x.org/s.css"]


LAUNCH_NOTE = re.compile(r'<p class="launch-note">(.*?)</p>', re.S)


def test_every_page_says_how_to_run_it_locally(book_html):
    """Each page of the toc opens with the launch note; a chapter's names the command for its own notebook."""
    for page in toc_pages():
        text = (book_html / page).read_text(encoding="utf8")
        notes = [re.sub(r"<[^>]+>", "", note) for note in LAUNCH_NOTE.findall(text)]
        assert len(notes) == 1, f"{page}: {len(notes)} launch notes (want one, under the title)"
        source = Path(page).with_suffix(".ipynb")
        command = f"make lab NB={source.as_posix()}" if (REPO / source).is_file() else "make lab opens them"
        assert command in notes[0], f"{page}: {notes[0]}"
        # The note comes right after the page title, before any of the page's own text.
        article = text[text.index('<article class="bd-article">') :]
        assert re.search(r'</h1>\s*<p class="launch-note">', article[: article.index("<p") + 30]), page
