"""Reader aids: the glossary (book/glossary.md), the notation page (book/notation.md) and the convention
that ties the text to them.

The convention: **bold** marks a defined term where it is introduced, and every bold term has a glossary
entry; *italic* is emphasis. Bold that ends with ".", ":" or "?" is a run-in heading (an exercise title,
"**Overlap.**", "**Q1.**"), and the chapters' fixed labels "**Prerequisites**", "**You will learn**" and
"**Time to run**" are labels; neither is a term. In the built book, book/_ext/glossary_links.py turns every
bold term into a link to its entry, which the last test checks on the pages the ``book_html`` fixture builds.
The formulas use the one notation of book/notation.md: letters it retired (``RETIRED``) must not come back.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from bs4 import BeautifulSoup
from conftest import REPO, toc_files, toc_pages
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin
from mdit_py_plugins.front_matter import front_matter_plugin

GLOSSARY = REPO / "book" / "glossary.md"
NOTATION = REPO / "book" / "notation.md"
CHAPTERS = sorted(REPO.glob("notebooks/[0-9][0-9]_*.ipynb"))

FIXED_LABELS = {"prerequisites", "you will learn", "time to run"}
HEADING_ENDS = (".", ":", "?")
# Letters every reader meets across chapters; each must have a row of its own on the notation page.
CORE_SYMBOLS = r"s b B h a d_h L V N \Psi D C K t p d c n m M v r \alpha \beta T".split()
# Spellings the book's one notation (Megatron-LM's letters) retired, as regular expressions over the text of
# a formula. Each is unambiguous: d_kv, d_h, p and m do not match. A formula may still show one inside a
# parenthesis that names the paper whose letter it is, "(Vaswani et al.'s $d_\text{model}$)".
RETIRED = {
    "N_d (the data-parallel degree is d)": r"N_\{?d\}?(?![A-Za-z0-9])",
    "d_model (the hidden size is h)": r"d_\{?(?:\\(?:text|mathrm|rm)\s*)?\{?model\b",
    "d_k (the head width is d_h)": r"d_\{?k\}?(?![A-Za-z0-9])",
    "P - 1 (the pipeline degree is p)": r"(?<![\\A-Za-z_])v?P\s*-\s*1(?![0-9])",
    "M + p (the micro-batches are m)": r"(?<![\\A-Za-z_])v?M\s*\+\s*[pP](?![A-Za-z])",
}
NAMES_A_PAPER = re.compile(r"et al\.|paper")

# CommonMark plus what MyST adds that can hide asterisks: $math$ and front matter. Fenced code (also the
# {glossary} and {eval-rst} fences) and inline code are never bold.
_MARKDOWN = MarkdownIt("commonmark").enable("table").use(dollarmath_plugin).use(front_matter_plugin)


def normalize(text: str) -> str:
    """How bold text is compared with glossary terms: whitespace collapsed, case ignored (as Sphinx does)."""
    return " ".join(text.split()).lower()


def bold_spans(markdown: str) -> list[str]:
    """The text of every bold span of a markdown document, in order, whitespace-normalised."""
    spans = []
    for token in _MARKDOWN.parse(markdown):
        if token.type != "inline":
            continue
        depth, parts = 0, []
        for child in token.children or []:
            if child.type == "strong_open":
                depth += 1
                if depth == 1:
                    parts = []
            elif child.type == "strong_close":
                depth -= 1
                if depth == 0:
                    spans.append(" ".join("".join(parts).split()))
            elif depth:
                parts.append(" " if child.type in ("softbreak", "hardbreak") else child.content)
    return spans


def is_term_candidate(span: str) -> bool:
    """False for run-in headings and the chapters' fixed labels: all other bold must be a glossary term."""
    return not span.endswith(HEADING_ENDS) and normalize(span) not in FIXED_LABELS


def glossary_terms(markdown: str) -> dict[str, str]:
    """{normalised term: term} of the ```{glossary} block: its unindented lines, options excepted."""
    match = re.search(r"^(`{3,}|:{3,})\{glossary\}[^\n]*\n(.*?)^\1\s*$", markdown, re.M | re.S)
    assert match, "no ```{glossary} block found"
    terms = {}
    for line in match.group(2).splitlines():
        if line.strip() and not line[0].isspace() and not re.match(r":\w+:", line):
            key = normalize(line)
            assert key not in terms, f"glossary term {line!r} appears twice"
            terms[key] = line.strip()
    return terms


def markdown_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf8"))["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text(encoding="utf8")


def book_sources() -> list[Path]:
    """Every page of _toc.yml, the chapters and the reader-aid pages, as source files."""
    files = toc_files()
    found = []
    for name in files:
        found += [p for p in (REPO / f"{name}.md", REPO / f"{name}.ipynb") if p.is_file()]
    return list(dict.fromkeys(found + CHAPTERS + [GLOSSARY, NOTATION]))


def unknown_bold(sources: dict[str, str], terms: dict[str, str]) -> list[str]:
    """'where: **span**' for every bold span that should be a glossary term and is not."""
    return [
        f"{where}: **{span}**"
        for where, text in sources.items()
        for span in bold_spans(text)
        if is_term_candidate(span) and normalize(span) not in terms
    ]


def retired_spellings(markdown: str) -> list[str]:
    """'$formula$: what it retired' for every formula ($...$, $$...$$, also inside MyST directives such as
    the glossary) that uses a retired spelling, unless it sits inside a parenthesis naming a paper."""
    found = []

    def check(math: str, allowed: bool = False) -> None:
        found.extend(
            f"${' '.join(math.split())}$: {what}"
            for what, pattern in RETIRED.items()
            if re.search(pattern, math) and not allowed
        )

    def parenthesised(text: str) -> list[tuple[int, int]]:
        """(start, end) of every parenthesis of ``text``; an unclosed one runs to the end."""
        groups, stack = [], []
        for i, char in enumerate(text):
            if char == "(":
                stack.append(i)
            elif char == ")" and stack:
                groups.append((stack.pop(), i + 1))
        return groups + [(start, len(text)) for start in stack]

    def walk(tokens) -> None:
        for token in tokens:
            if token.type in ("math_block", "math_block_label"):
                check(token.content)
            elif token.type == "fence" and token.info.startswith("{"):
                walk(_MARKDOWN.parse(token.content))  # a directive's body is markdown too
            elif token.type == "inline":
                # The inline text with each formula replaced by one character, to find the parentheses.
                text, formulas = "", []
                for child in token.children or []:
                    if child.type in ("math_inline", "math_inline_double"):
                        formulas.append((len(text), child.content))
                        text += "\0"
                    else:
                        text += " " if child.type in ("softbreak", "hardbreak") else child.content
                groups = [(a, b) for a, b in parenthesised(text) if NAMES_A_PAPER.search(text[a:b])]
                for at, math in formulas:
                    check(math, allowed=any(a < at < b for a, b in groups))

    walk(_MARKDOWN.parse(markdown))
    return found


# ---- source level ---------------------------------------------------------------------------------------


def test_retired_letters_do_not_come_back():
    sources = sorted(REPO.glob("notebooks/*.ipynb")) + sorted((REPO / "book").glob("*.md"))
    offenders = [f"{p.relative_to(REPO)}: {hit}" for p in sources for hit in retired_spellings(markdown_of(p))]
    assert not offenders, (
        f"{len(offenders)} formulas use letters the book retired (see book/notation.md); write them in the "
        "book's notation, or name the paper whose letter it is in the same parenthesis.\n  " + "\n  ".join(offenders)
    )


def test_the_retired_letters_check_catches_what_it_must():
    """A page with every retired spelling planted once, next to look-alikes that must pass."""
    page = r"""Data parallelism on $N_d$ ranks, heads of width $\sqrt{d_k}$, and a bubble
$(P-1)/(M+P-1)$. Fine: $d$, $d_h$, $d_{kv}$, $n_{kv}$, $\Psi$, $(p-1)/(m+p-1)$, $M\beta$, `$N_d$` in code,
the width $h$ (Vaswani et al.'s $d_\text{model}$), and (the ZeRO paper writes $N_{d}$ for $d$).

$$
\frac{P - 1}{vM + P - 1} = \frac{p-1}{vm+p-1}
$$ (eq-bubble)

| symbol | meaning |
| --- | --- |
| $d_{\text{model}}$ | width, in a table without a paper |

```{glossary}
ZeRO
  Model states over $N_{d}$ ranks.
```
"""
    assert retired_spellings(page) == [
        "$N_d$: N_d (the data-parallel degree is d)",
        "$\\sqrt{d_k}$: d_k (the head width is d_h)",
        "$(P-1)/(M+P-1)$: P - 1 (the pipeline degree is p)",
        "$(P-1)/(M+P-1)$: M + p (the micro-batches are m)",
        "$\\frac{P - 1}{vM + P - 1} = \\frac{p-1}{vm+p-1}$: P - 1 (the pipeline degree is p)",
        "$\\frac{P - 1}{vM + P - 1} = \\frac{p-1}{vm+p-1}$: M + p (the micro-batches are m)",
        "$d_{\\text{model}}$: d_model (the hidden size is h)",
        "$N_{d}$: N_d (the data-parallel degree is d)",
    ]


def test_every_bold_term_is_in_the_glossary():
    terms = glossary_terms(GLOSSARY.read_text(encoding="utf8"))
    sources = {str(p.relative_to(REPO)): markdown_of(p) for p in book_sources()}
    offenders = unknown_bold(sources, terms)
    assert not offenders, (
        f"{len(offenders)} bold spans are not glossary terms. Bold marks a defined term: add it to "
        "book/glossary.md or make it italic (*...*) if it is only emphasis; a run-in heading ends with "
        "'.', ':' or '?'.\n  " + "\n  ".join(offenders)
    )


def test_the_bold_check_catches_what_it_must():
    """A deliberately broken page: the check must name exactly its two emphasised phrases."""
    glossary = """# Glossary

```{glossary}
:sorted:

all-reduce
  The collective that sums every rank's buffer.

ring all-reduce
ring
  An all-reduce in 2(n - 1) steps.
```
"""
    page = """**Overlap.** A run-in heading, **Prerequisites**: a label, **Which is faster?** a question.
An **All-reduce** and a **ring
all-reduce** are terms; `**code**` is not bold, nor is 2**10 ** 3 in

```python
x = 2**10 ** 3
```

and $a^{**}$ is math. Emphasis written as bold: **two thirds** of it, and

| **one block** | $12d^2$ |
| --- | --- |
"""
    terms = glossary_terms(glossary)
    assert set(terms) == {"all-reduce", "ring all-reduce", "ring"}
    assert bold_spans(page) == [
        "Overlap.",
        "Prerequisites",
        "Which is faster?",
        "All-reduce",
        "ring all-reduce",
        "two thirds",
        "one block",
    ]
    assert unknown_bold({"page.md": page}, terms) == ["page.md: **two thirds**", "page.md: **one block**"]
    with pytest.raises(AssertionError, match="appears twice"):
        glossary_terms(glossary.replace("\nring\n", "\nAll-Reduce\n"))


def test_glossary_entries_point_to_chapters_that_exist():
    text = GLOSSARY.read_text(encoding="utf8")
    block = re.search(r"^```\{glossary\}\n(.*?)^```$", text, re.M | re.S).group(1)
    entries = [e for e in re.split(r"\n\s*\n", block) if e.strip() and not e.startswith(":")]
    assert 100 <= len(entries) <= 200, f"{len(entries)} glossary entries"
    without_chapter = [e.splitlines()[0] for e in entries if "{doc}`../notebooks/" not in e]
    assert not without_chapter, f"entries without a link to a chapter: {without_chapter}"
    for target in set(re.findall(r"\{doc\}`(?:[^`<]*<)?\.\./(notebooks/[^`>]+)>?`", text)):
        assert (REPO / f"{target}.ipynb").is_file(), f"glossary links to a missing chapter: {target}"


def test_notation_page_lists_the_core_symbols():
    text = NOTATION.read_text(encoding="utf8")
    rows = re.findall(r"^\| (.+?) \|", text, re.M)
    defined = {sym for row in rows for sym in re.findall(r"\$([^$]+)\$", row)}
    missing = [sym for sym in CORE_SYMBOLS if sym not in defined]
    assert not missing, f"book/notation.md has no row for: {missing}"
    for word in ("GB", "GiB", "FLOP/s", "bf16"):
        assert word in text, f"the units section of book/notation.md does not mention {word}"
    for target in set(re.findall(r"\.\./(notebooks/[^`>]+)>?`", text)):
        assert (REPO / f"{target}.ipynb").is_file(), f"notation links to a missing chapter: {target}"


# ---- built book ---------------------------------------------------------------------------------------


def test_bold_terms_link_to_their_glossary_entries(book_html):
    glossary_page = book_html / "book" / "glossary.html"
    assert glossary_page.is_file(), (
        "the built book has no book/glossary.html: book/glossary (and book/notation) must be in _toc.yml "
        "and the glossary_links extension in _config.yml"
    )
    anchors = {
        tag["id"]
        for tag in BeautifulSoup(glossary_page.read_text(encoding="utf8"), "html.parser").select("dl.glossary dt[id]")
    }
    terms = glossary_terms(GLOSSARY.read_text(encoding="utf8"))
    # Each page's bold terms in its source, with repeats: the page must show at least as many glossary links.
    expected = {
        p.with_suffix(".html").relative_to(REPO).as_posix(): Counter(
            normalize(s) for s in bold_spans(markdown_of(p)) if normalize(s) in terms
        )
        for p in book_sources()
    }
    problems, pages_with_links = [], 0
    for page in toc_pages():
        if page == "book/glossary.html":
            continue
        article = BeautifulSoup((book_html / page).read_text(encoding="utf8"), "html.parser").find("article")
        linked = Counter()
        for strong in article.find_all("strong"):
            text = normalize(strong.get_text())
            if text not in terms:
                continue
            link = strong.find_parent("a")
            path, _, anchor = (link.get("href", "") if link else "").partition("#")
            if not (link and "glossary-link" in link.get("class", []) and path.endswith("glossary.html")):
                problems.append(f"{page}: <strong>{text}</strong> is not a glossary link")
            elif anchor not in anchors:
                problems.append(f"{page}: <strong>{text}</strong> links to #{anchor}, which glossary.html lacks")
            else:
                linked[text] += 1
        missing = expected.get(page, Counter()) - linked
        problems += [f"{page}: bold term '{t}' of the source is not linked ({n}x)" for t, n in missing.items()]
        pages_with_links += bool(linked)
    assert not problems, "\n".join(problems)
    chapters_in_toc = [p for p in toc_pages() if p.startswith("notebooks/")]
    assert pages_with_links >= len(chapters_in_toc) - 2, f"glossary links on only {pages_with_links} pages"
