"""The built site at the sizes readers use it, and its search, in headless Chromium (tests/test_browser.py's harness).

- At 1400 px every display equation (MathJax's container) fits its column: none hides a part until scrolled.
- At 400 px, as on a phone (overlay scroll bars), no page is wider than the window, and every table wider than
  its box scrolls in it with a scroll bar that shows.
- Opened from disk (file://), search puts the chapter that teaches "ZeRO", "pipeline bubble" and "ring attention"
  in its top three results, each result with an excerpt (book/_ext/search_tuning.py).

Needs /usr/bin/chromium, like tests/test_browser.py (skipped without it, a failure under CI=true).
"""

from __future__ import annotations

import shutil
from urllib.parse import urlencode

import pytest
from conftest import toc_pages
from test_browser import JS_MATH_DONE, PAGE_TIMEOUT_S, Chromium, StaticServer, require_chromium

pytestmark = pytest.mark.browser

WIDE, NARROW = 1400, 400
VISIBLE_BAR_PX = 4  # an overlay scroll bar takes no room; a drawn one takes 10 px (book/_static/scalebook.css)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium that draws scroll bars (test_browser's hides them), so that their room can be measured."""
    require_chromium()
    chromium = Chromium(tmp_path_factory.mktemp("chromium-site"), hide_scrollbars=False)
    yield chromium
    chromium.close()


@pytest.fixture(scope="module")
def served(book_html):
    server = StaticServer(book_html)
    yield server.origin
    server.stop()


def open_at(browser: Chromium, url: str, width: int, mobile: bool = False) -> None:
    """Load ``url`` in a ``width`` px window (a phone's, with overlay scroll bars, if ``mobile``); wait for MathJax."""
    browser.call("Emulation.setDeviceMetricsOverride",
                 {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": mobile})  # fmt: skip
    browser.open(url)
    assert browser.wait_for(JS_MATH_DONE, PAGE_TIMEOUT_S), f"{url}: MathJax did not finish"


# Every display equation: its label, TeX, the width of its column (the container) and of the typeset formula.
# Hidden solutions and dropdowns are opened first, so that their equations are measured as a reader sees them.
JS_EQUATIONS = """(async () => {
  if (!window.MathJax) return [];  // a page without math (open_at checked that none is left untypeset)
  await MathJax.startup.promise;
  await document.fonts.ready;
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  document.querySelectorAll('.toggle-hidden').forEach(el => el.classList.remove('toggle-hidden'));
  const tex = new Map(Array.from(MathJax.startup.document.math).map(item => [item.typesetRoot, item.math]));
  return Array.from(document.querySelectorAll('mjx-container[display="true"]')).map(c => {
    const block = c.closest('div.math');
    const eqno = block && block.querySelector('.eqno');
    return {label: eqno ? eqno.textContent.replace('#', '').trim() : (block && block.id) || 'unnumbered',
            tex: (tex.get(c) || '').trim().replace(/\\s+/g, ' ').slice(0, 90), column: c.clientWidth,
            width: Math.ceil(c.querySelector('mjx-math').getBoundingClientRect().width)};
  });
})()"""


def too_wide(equations: list[dict]) -> list[str]:
    return [f"{e['label']}: {e['width']} px in a {e['column']} px column: {e['tex']}"
            for e in equations if not e["column"] or e["width"] > e["column"]]  # fmt: skip


@pytest.mark.parametrize("page", toc_pages())
def test_display_equations_fit_their_column_at_1400px(page, browser, served):
    open_at(browser, f"{served}/{page}", WIDE)
    wide = too_wide(browser.evaluate(JS_EQUATIONS))
    assert not wide, (f"{page}: display equations wider than their column at {WIDE} px (split them into lines, "
                      "e.g. \\begin{aligned}):\n  " + "\n  ".join(wide))  # fmt: skip


def test_the_equation_check_catches_an_equation_wider_than_its_column(book_html, browser, tmp_path):
    shutil.copytree(book_html / "_static" / "mathjax", tmp_path / "mathjax")
    long_sum = " + ".join(f"x_{{{i}}}" for i in range(60))
    (tmp_path / "index.html").write_text(f"""<!doctype html><html><head>
        <script defer src="mathjax/tex-chtml-full.js"></script></head><body><div style="width: 300px">
        <div class="math">\\[ y = {long_sum} \\]</div><div class="math">\\[ a = b \\]</div></div></body></html>""",
        encoding="utf8")  # fmt: skip
    server = StaticServer(tmp_path)
    try:
        open_at(browser, f"{server.origin}/index.html", WIDE)
        equations = browser.evaluate(JS_EQUATIONS)
    finally:
        server.stop()
    assert len(equations) == 2, equations
    (wide,) = too_wide(equations)
    assert "in a 300 px column: y = x_{0} + x_{1}" in wide, wide


# The page's width and every table that is cut: wider than the box it scrolls in (or than the article, with no
# box), where that box shows no scroll bar (it takes no room: an overlay bar, seen only while scrolling).
JS_NARROW = """(async () => {
  await document.fonts.ready;
  const scrollBox = (el) => {
    for (let b = el; b && b !== document.body; b = b.parentElement)
      if (['auto', 'scroll'].includes(getComputedStyle(b).overflowX)) return b;
    return null;
  };
  const cut = [];
  for (const table of document.querySelectorAll('.bd-article table')) {
    if (!table.getClientRects().length) continue;  // in a closed dropdown
    const box = scrollBox(table);
    const name = (table.querySelector('th, td') || table).textContent.trim().slice(0, 40);
    if (!box) {
      const article = document.querySelector('.bd-article').getBoundingClientRect();
      if (table.getBoundingClientRect().right > article.right + 1) cut.push({name, box: 'none'});
      continue;
    }
    if (box.scrollWidth <= box.clientWidth + 1) continue;
    const style = getComputedStyle(box);
    const bar = box.offsetHeight - box.clientHeight - parseFloat(style.borderTopWidth)
                - parseFloat(style.borderBottomWidth);
    cut.push({name, box: `${box.tagName.toLowerCase()}.${box.className}`, width: box.scrollWidth,
              inside: box.clientWidth, bar});
  }
  return {page: document.documentElement.scrollWidth, window: document.documentElement.clientWidth, cut};
})()"""


def narrow_problems(report: dict) -> list[str]:
    problems = [f"the page is {report['page']} px wide in a {report['window']} px window"
                ] if report["page"] > report["window"] else []  # fmt: skip
    for t in report["cut"]:
        if t["box"] == "none":
            problems.append(f"table '{t['name']}' is wider than the article and has no box to scroll in")
        elif t["bar"] < VISIBLE_BAR_PX:
            problems.append(f"table '{t['name']}': {t['width']} px of table in a {t['inside']} px box ({t['box']}) "
                            f"with no visible scroll bar ({t['bar']} px)")  # fmt: skip
    return problems


@pytest.mark.parametrize("page", toc_pages())
def test_pages_fit_a_400px_window_and_wide_tables_scroll_visibly(page, browser, served):
    open_at(browser, f"{served}/{page}", NARROW, mobile=True)
    problems = narrow_problems(browser.evaluate(JS_NARROW))
    assert not problems, f"{page} at {NARROW} px:\n  " + "\n  ".join(problems)


def test_the_narrow_check_catches_a_cut_table_and_a_wide_page(browser, tmp_path):
    wide_table = "<table><tr>" + "<td>column</td>" * 30 + "</tr></table>"
    (tmp_path / "index.html").write_text(
        f"""<!doctype html><html><head>
        <meta name="viewport" content="width=device-width, initial-scale=1"></head><body>
        <article class="bd-article"><div style="overflow-x: auto">{wide_table}</div>
        <p style="white-space: nowrap">{"wide " * 200}</p></article></body></html>""",
        encoding="utf8",
    )
    server = StaticServer(tmp_path)
    try:
        open_at(browser, f"{server.origin}/index.html", NARROW, mobile=True)
        problems = narrow_problems(browser.evaluate(JS_NARROW))
    finally:
        server.stop()
    assert len(problems) == 2 and "window" in problems[0] and "no visible scroll bar" in problems[1], problems


SEARCHES = [
    ("ZeRO", "notebooks/11_zero_and_fsdp.html"),
    ("pipeline bubble", "notebooks/13_pipeline_parallelism.html"),
    ("ring attention", "notebooks/14_beyond_three_dimensions.html"),
]
JS_RESULTS = """Array.from(document.querySelectorAll('#search-results li')).slice(0, 10).map(li => ({
  href: li.querySelector('a').href, title: li.querySelector('a').textContent,
  excerpt: (li.querySelector('p.context') || {textContent: ''}).textContent.trim()}))"""
JS_TOP_THREE_DONE = """(() => {
  const status = document.querySelector('#search-results p.search-summary');
  const items = Array.from(document.querySelectorAll('#search-results li')).slice(0, 3);
  return !!status && status.textContent.startsWith('Search finished') && items.length > 0
    && items.every(li => li.querySelector('p.context'));
})()"""


@pytest.mark.parametrize("query, chapter", SEARCHES)
def test_search_from_disk_puts_the_teaching_chapter_in_the_top_three_with_excerpts(query, chapter, book_html, browser):
    url = (book_html / "search.html").as_uri() + "?" + urlencode({"q": query})
    open_at(browser, url, 1280)
    finished = browser.wait_for(JS_TOP_THREE_DONE, PAGE_TIMEOUT_S)
    results = browser.evaluate(JS_RESULTS)
    listing = "\n  ".join(f"{r['title']} ({r['href'].split('/html/')[-1]}): {r['excerpt'][:60]!r}" for r in results)
    top = [r["href"].split("#")[0] for r in results[:3]]
    assert any(href.endswith("/" + chapter) for href in top), (
        f"search {query!r}: {chapter} not in the top three:\n  {listing}"
    )
    assert finished, f"search {query!r}: the top three results did not all get an excerpt:\n  {listing}"
    (first_hit,) = [r for r in results[:3] if r["href"].split("#")[0].endswith("/" + chapter)][:1]
    assert any(word in first_hit["excerpt"].lower() for word in query.lower().split()), (
        f"the chapter's excerpt shows no word of {query!r}: {first_hit['excerpt']!r}"
    )
    assert not browser.errors, f"search {query!r}: errors in the page: {browser.errors}"
