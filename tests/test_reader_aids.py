"""Reader aids: the glossary (book/glossary.md), the notation page (book/notation.md) and the convention
that ties the text to them.

The convention: **bold** marks a defined term where it is introduced, and every bold term has a glossary
entry; *italic* is emphasis. Bold that ends with ".", ":" or "?" is a run-in heading (an exercise title,
"**Overlap.**", "**Q1.**"), and the chapters' fixed labels "**Prerequisites**", "**You will learn**" and
"**Time to run**" are labels; neither is a term. In the built book, book/_ext/glossary_links.py turns every
bold term into a link to its entry, which the last test checks on the pages the ``book_html`` fixture builds.
The formulas use the one notation of book/notation.md: letters it retired (``RETIRED``) must not come back,
and the letters every chapter's formulas use agree with the page's tables (the notation section below says what
that can and cannot check). A glossary entry links first to the chapter that introduces its term in bold, and
no numbered equation's label is shown to a reader as text.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from bs4 import BeautifulSoup, SoupStrainer
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
    # A sanity range for the parse (a broken split gives a handful or thousands), not a quota: 16 chapters define
    # about 200 terms.
    assert 100 <= len(entries) <= 260, f"{len(entries)} glossary entries"
    without_chapter = [e.splitlines()[0] for e in entries if "{doc}`../notebooks/" not in e]
    assert not without_chapter, f"entries without a link to a chapter: {without_chapter}"
    for target in set(re.findall(r"\{doc\}`(?:[^`<]*<)?\.\./(notebooks/[^`>]+)>?`", text)):
        assert (REPO / f"{target}.ipynb").is_file(), f"glossary links to a missing chapter: {target}"


def test_glossary_entries_point_first_to_the_chapter_that_introduces_them():
    """A term is introduced where a chapter first writes it in bold: its entry links that chapter, and links no
    later chapter before it (an earlier chapter may come first, one that explains it without the bold)."""
    text = GLOSSARY.read_text(encoding="utf8")
    block = re.search(r"^```\{glossary\}\n(.*?)^```$", text, re.M | re.S).group(1)
    first_bold: dict[str, int] = {}
    for path in CHAPTERS:
        for span in bold_spans(markdown_of(path)):
            first_bold.setdefault(normalize(span), int(path.name[:2]))
    problems = []
    for entry in re.split(r"\n\s*\n", block):
        terms = [normalize(line) for line in entry.splitlines() if line.strip() and not line[0].isspace()]
        links = [int(n) for n in re.findall(r"\{doc\}`\.\./notebooks/(\d\d)_", entry)]
        introduced = min((first_bold[t] for t in terms if t in first_bold), default=None)
        if terms and links and introduced is not None and (introduced not in links or links[0] > introduced):
            problems.append(f"{terms[0]}: links chapters {links}, but Chapter {introduced} introduces it in bold")
    assert not problems, "\n".join(problems)


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
        article = BeautifulSoup(  # the article alone: a page's navigation is most of its HTML
            (book_html / page).read_text(encoding="utf8"), "html.parser", parse_only=SoupStrainer("article")
        ).find("article")
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


# ---- notation: every letter a chapter's formulas use is in book/notation.md's tables ------------------------
#
# notation.md has three kinds of table: the book-wide letters, each with the chapter where it first appears; the
# symbols local to one chapter (one row per chapter: items separated by ";", each starting with its symbols,
# "$e$, $m$ exponent and mantissa bits"); and the letters with more than one meaning, each with the chapters of
# each meaning. What a program can check against the chapters' formulas, and what these tests check:
#   1. a chapter that uses a book-wide letter before the chapter the page dates it to lists that letter in its own
#      row (a different meaning, an index, a paper's letter), else the date is wrong;
#   2. the chapter a book-wide letter is dated to uses it (alone or with a subscript), and a chapter's own row
#      lists only symbols its formulas use;
#   3. every symbol in more than one row (book-wide or local) is in the table of letters with more than one
#      meaning, with exactly the chapters of those rows.
# What they cannot check is meaning: a letter used after its first chapter in a new sense, not written in that
# chapter's row, passes; so does a chapter's row that names a letter with the wrong meaning. The review of the
# page against the text stays a reader's job; these tests keep the tables and the formulas from drifting apart.
# A symbol is a letter (Latin, Greek, \mathcal, \mathbf) with its subscript, if any: d_h, d_{kv} and B_r are
# symbols of their own, not d or B. Words in \text{}, \mathrm{} and \operatorname{}, \sum/\max/\log with their
# limits, environment names, a d written before a capital (a gradient, dO) and the names pos and PE (Chapter
# 3's sinusoidal table, Vaswani et al.'s spelling) are not letters; a product such as sbh is three letters.

LOCAL_SECTION = "Symbols local to one chapter"
OVERLOAD_SECTION = "Letters with more than one meaning"
_WORDS = r"\\(?:text|mathrm|textrm|mathit|operatorname\*?|rm|textsf|mathsf|texttt|hat|bar|tilde|boldsymbol)"
_SUBSCRIPT = r"(\{(?:[^{}]|\{[^{}]*\})*\}|" + _WORDS + r"\s*\{[^{}]*\}|\\[A-Za-z]+|[A-Za-z0-9])"
_LETTER = r"(\\(?:mathcal|mathbf)\s*\{[A-Za-z]\}|\\[A-Za-z]+|(?<!\\)[A-Za-z])"
_GREEK = set(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta kappa lambda mu nu xi pi rho sigma tau phi chi psi "
    "omega Gamma Delta Theta Lambda Xi Pi Sigma Phi Psi Omega ell".split()
)


def math_symbols(math: str) -> set[str]:
    """The symbols of one formula, written as notation.md's tables are read: 'd_h', 'd_kv', '\\alpha', 'N'."""
    found = set()
    math = re.sub(r"\\(?:begin|end)\s*\{[^{}]*\}", " ", math)
    math = re.sub(r"\\(?:operatorname\*?|text|mathrm|textrm)\s*\{[^{}]*\}\s*(?=_)", r"\\op", math)  # arg max_x
    math = re.sub(
        r"\\(?:sum|prod|max|min|log|lim|sup|inf|exp|ln|det|op)(?![A-Za-z])\s*(?:_\s*(?:\{(?:[^{}]|\{[^{}]*\})*\}|\S))?",
        " ",
        math,
    )
    math = re.sub(r"(?<![\\A-Za-z])d(?=[A-Z])", " ", math)  # dO, dS: the gradient of O, of S
    math = re.sub(r"(?<![\\A-Za-z])(?:pos|PE)(?![A-Za-z])", " ", math)  # Chapter 3's names of the sinusoidal table

    def subscripted(match: re.Match) -> str:
        sub = re.sub(r"[{}\s\\]", "", re.sub(_WORDS, "", match.group(2)))
        found.add(f"{_letter(match.group(1))}_{sub}")
        return " "

    math = re.sub(_LETTER + r"\s*_\s*" + _SUBSCRIPT, subscripted, math)
    math = re.sub(_WORDS + r"\s*\{[^{}]*\}", " ", math)
    for match in re.finditer(_LETTER, math):
        letter = _letter(match.group(1))
        if not letter.startswith("\\") or letter[1:] in _GREEK or letter.startswith(("\\mathcal", "\\mathbf")):
            found.add(letter)
    return found


def _letter(text: str) -> str:
    return re.sub(r"\s", "", text)


def formulas_of(markdown: str) -> list[str]:
    """Every formula of a page: $...$, $$...$$ (also inside MyST directives) and {math}`...` roles."""
    found = []

    def walk(tokens) -> None:
        for token in tokens:
            if token.type in ("math_block", "math_block_label"):
                found.append(token.content)
            elif token.type == "fence" and token.info.startswith("{"):
                walk(_MARKDOWN.parse(token.content))
            elif token.type == "inline":
                for child in token.children or []:
                    if child.type in ("math_inline", "math_inline_double"):
                        found.append(child.content)
                found.extend(re.findall(r"\{math\}`([^`]*)`", token.content))

    walk(_MARKDOWN.parse(markdown))
    return found


def notation_tables(text: str) -> tuple[dict[str, list[int]], dict[int, set[str]], dict[str, set[int]]]:
    """notation.md as ({book-wide symbol: [chapters of its rows]}, {chapter: its own symbols},
    {symbol with more than one meaning: the chapters its row names})."""
    book_wide, local, overloaded = {}, {}, {}
    section = ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        chapters = [int(n) for n in re.findall(r"\{doc\}`(\d+) <", line)]
        if not chapters:
            continue  # a header row
        if section == LOCAL_SECTION:
            symbols = set()
            for item in cells[1].split(";"):  # an item starts with its symbols: "$e$, $m$ exponent and ..."
                lead = re.match(r"\s*\$[^$]+\$(?:\s*(?:,|and)\s*\$[^$]+\$)*", item)
                for math in re.findall(r"\$([^$]+)\$", lead.group(0) if lead else ""):
                    symbols |= math_symbols(math.split("=")[0])  # "$I = F/Q$": the symbol is I
            local[chapters[0]] = symbols
        elif section == OVERLOAD_SECTION:
            (symbol,) = math_symbols(cells[0].strip("$"))
            overloaded[symbol] = set(chapters)
        elif len(cells) == 3:
            for math in re.findall(r"\$([^$]+)\$", cells[0]):
                for symbol in math_symbols(math):
                    book_wide.setdefault(symbol, []).append(chapters[0])
    return book_wide, local, overloaded


def notation_problems(text: str, chapters: dict[int, str]) -> list[str]:
    """What notation.md (``text``) says that the chapters' formulas (``chapters``: {number: markdown}) contradict."""
    book_wide, local, overloaded = notation_tables(text)
    used = {n: set().union(*map(math_symbols, formulas_of(md))) for n, md in chapters.items()}
    problems = []
    for n, symbols in sorted(used.items()):
        for symbol in sorted(symbols & book_wide.keys()):
            first = min(book_wide[symbol])
            if first > n and symbol not in local.get(n, set()):
                problems.append(
                    f"Chapter {n} uses ${symbol}$, which notation.md dates to Chapter {first}: correct the date, or "
                    f"list the letter in Chapter {n}'s row of the local symbols if it means something else there"
                )
    for symbol, firsts in sorted(book_wide.items()):
        for n in firsts:
            if n in used and not any(s == symbol or s.startswith(symbol + "_") for s in used[n]):
                problems.append(f"notation.md dates ${symbol}$ to Chapter {n}, whose formulas do not use it")
    for n, symbols in sorted(local.items()):
        for symbol in sorted(symbols - used.get(n, set())):
            problems.append(f"notation.md lists ${symbol}$ as Chapter {n}'s own, but its formulas do not use it")
    rows: dict[str, list[int]] = {}
    for symbol, firsts in book_wide.items():
        rows.setdefault(symbol, []).extend(firsts)
    for n, symbols in local.items():
        for symbol in symbols:
            rows.setdefault(symbol, []).append(n)
    for symbol, where in sorted(rows.items()):
        if len(where) > 1 and set(where) != overloaded.get(symbol):
            problems.append(
                f"${symbol}$ is in the rows of chapters {sorted(where)}: the table of letters with more than one "
                f"meaning must name exactly those chapters (it names {sorted(overloaded.get(symbol, []))})"
            )
    problems += [
        f"${symbol}$ is in the table of letters with more than one meaning but in only one row"
        for symbol in sorted(overloaded)
        if len(rows.get(symbol, [])) < 2
    ]
    return problems


def test_notation_page_matches_the_chapters():
    chapters = {int(p.name[:2]): markdown_of(p) for p in CHAPTERS}
    problems = notation_problems(NOTATION.read_text(encoding="utf8"), chapters)
    assert not problems, f"{len(problems)} disagreements:\n  " + "\n  ".join(problems)


def test_the_notation_check_catches_what_it_must():
    """A three-chapter book: each kind of error planted once, next to spellings that must pass."""
    page = r"""## The model

| symbol | meaning | first in |
| --- | --- | --- |
| $h$ | hidden size | {doc}`1 <../notebooks/01_a>` |
| $d_{ff}$ | MLP width | {doc}`3 <../notebooks/03_c>` |
| $E$, $k$ | experts, and experts per token | {doc}`3 <../notebooks/03_c>` |
| $d$ | data-parallel degree | {doc}`2 <../notebooks/02_b>` |
| $\alpha$ | latency | {doc}`2 <../notebooks/02_b>` |

## Symbols local to one chapter

| chapter | symbols |
| --- | --- |
| {doc}`1 <../notebooks/01_a>` | $m \times k$, $k \times n$ the shapes of a product; $q$ a query |
| {doc}`2 <../notebooks/02_b>` | $\beta$ bytes per number |

## Letters with more than one meaning

| symbol | meanings (chapters) |
| --- | --- |
| $k$ | experts per token ({doc}`3 <../notebooks/03_c>`); a shape ({doc}`2 <../notebooks/02_b>`) |
| $h$ | hidden size ({doc}`1 <../notebooks/01_a>`) |
"""
    chapters = {
        1: r"A product of $m\times k$ by $k \times n$, a width $h$ and $4h \cdot d_{ff}$ with $\alpha$, but not "
        r"$d_h$, $d_\text{kv}$, $\text{bytes}$, $\sum_{d} x_d$, $dO$ or $\operatorname*{arg\,max}_{d} f$.",
        2: r"$$T = 2(d - 1)\alpha + \beta\,\mathcal{L}$$ (eq-x)",
        3: r"```{admonition} A directive's formulas count too" "\n" r"$E$ experts, top-$k$, {math}`d_{ff}`" "\n```",
    }
    assert math_symbols(r"2sbh + 4\,d_\text{ff} + s b\, d_{kv} + \mathcal{L}_r + \hat m + W_{\text{gate}}") == {
        "s",
        "b",
        "h",
        "d_ff",
        "d_kv",
        "\\mathcal{L}_r",
        "m",
        "W_gate",
    }
    assert notation_problems(page, chapters) == [
        "Chapter 1 uses $\\alpha$, which notation.md dates to Chapter 2: correct the date, or list the letter in "
        "Chapter 1's row of the local symbols if it means something else there",
        "Chapter 1 uses $d_ff$, which notation.md dates to Chapter 3: correct the date, or list the letter in "
        "Chapter 1's row of the local symbols if it means something else there",
        "notation.md lists $q$ as Chapter 1's own, but its formulas do not use it",
        "$k$ is in the rows of chapters [1, 3]: the table of letters with more than one meaning must name exactly "
        "those chapters (it names [2, 3])",
        "$h$ is in the table of letters with more than one meaning but in only one row",
    ]


# ---- equation labels: a reader sees "Eq. (5.3)", never "eq-kv-cache" ---------------------------------------

_EQ_DEFINITION = re.compile(r"\$\$\s*\(([A-Za-z][\w-]*)\)")


def equation_labels(markdowns: list[str]) -> set[str]:
    """The labels of the book's numbered equations, the ``(label)`` after a closing ``$$``."""
    return {label for md in markdowns for label in _EQ_DEFINITION.findall(md)}


def labels_shown_as_text(cells: list[dict], labels: set[str]) -> list[str]:
    """'cell N: label' for every equation label that a notebook's cells show as plain text: in a markdown cell
    outside an {eq} role, a link target and its own definition, or in a code cell's Markdown or printed output,
    which MyST renders without roles (a table made by ``markdown_table`` names the formula instead)."""
    if not labels:
        return []
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, sorted(labels))) + r")(?![\w-])")
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "markdown":
            text = _EQ_DEFINITION.sub(" ", "".join(cell["source"]))
            texts = [re.sub(r"\{eq\}`[^`]*`|\]\(#[^)]*\)", " ", text)]
        elif cell["cell_type"] == "code":
            texts = [
                "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/markdown", ""))
                for out in cell.get("outputs", [])
            ]
        else:
            continue
        found += [f"cell {i}: {m.group(1)}" for text in texts for m in pattern.finditer(text)]
    return found


def test_no_equation_label_is_shown_as_text():
    notebooks = sorted(REPO.glob("notebooks/*.ipynb"))
    cells = {p.name: json.loads(p.read_text(encoding="utf8"))["cells"] for p in notebooks}
    labels = equation_labels([markdown_of(p) for p in notebooks] + [markdown_of(p) for p in book_sources()])
    assert len(labels) >= 20, f"only {len(labels)} equation labels found: has the $$ (label) syntax changed?"
    offenders = [f"{name} {hit}" for name, nb_cells in cells.items() for hit in labels_shown_as_text(nb_cells, labels)]
    assert not offenders, (
        "equation labels shown as text (write {eq}`label` in prose; name the formula or its number in a generated "
        "table):\n  " + "\n  ".join(offenders)
    )


def test_the_equation_label_check_catches_what_it_must():
    cells = [
        {
            "cell_type": "markdown",
            "source": [
                "$$\nM = 2Ls\n$$ (eq-kv-cache)\n\nBy {eq}`eq-kv-cache`, see "
                "[it](#eq-kv-cache); eq-kv-cached is another word."
            ],
        },
        {"cell_type": "markdown", "source": ["Per sequence, eq-kv-cache."]},
        {
            "cell_type": "code",
            "source": ["# eq-kv-cache: a comment in code is for the programmer"],
            "outputs": [
                {"output_type": "display_data", "data": {"text/markdown": "| dtype | eq-kv-cache |"}},
                {"output_type": "stream", "name": "stdout", "text": ["formula $2Ls$ x bytes\n"]},
            ],
        },
    ]
    labels = equation_labels(["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"])
    assert labels == {"eq-kv-cache"}
    assert labels_shown_as_text(cells, labels) == ["cell 1: eq-kv-cache", "cell 2: eq-kv-cache"]
