"""Citations that read the same in JupyterLab and on the site: author-year text in the notebook, footnotes on the site.

jupyterlab-myst 2.7.0 resolves no citation key from a .bib file, so a ``{footcite}`key``` role shows its bare key
in JupyterLab. A chapter therefore stores what the lab shows, its *lab form*, and the site's extension
(book/_ext/footbibliography_marker.py) turns it back into sphinxcontrib-bibtex's roles before the page is parsed:

- a citation is a link whose text is the work's author-year label (its year alone right after the authors' names
  in the prose) and whose target is ``#cite-<key>``:
  ``([Loshchilov and Hutter, 2019](#cite-loshchilov2019decoupled))``, several in one pair of parentheses joined
  by semicolons; inside prose that is already in parentheses, the links stand without their own. The site reads
  each run of such links (with its parentheses) as one ``{footcite}`key1,key2```.
- the chapter's References cell holds, after its ``% footbibliography`` line, the works it cites in the order
  first cited, each a paragraph labelled ``(cite-<key>)=`` (the target of the links above), up to the line
  ``% end of the works cited``. The site replaces that block with the ``{footbibliography}`` directive.

Authors may write ``{footcite}`key``` as before: ``python -m scalebook.citations notebooks/*.ipynb`` rewrites
it to the lab form and rewrites each References list from book/references.bib (it edits markdown only; no
code cell or output changes, so nothing needs re-executing); given book/bibliography.md it rewrites the list of
every work that page shows in JupyterLab, where its ``{bibliography}`` directive shows nothing (the site drops the
list). tests/test_citations.py checks every notebook and that page.

Source: sphinxcontrib-bibtex's footcite, https://sphinxcontrib-bibtex.readthedocs.io/en/latest/usage.html;
MyST targets and links, https://mystmd.org/guide/cross-references; pybtex's styles, https://docs.pybtex.org/
"""

from __future__ import annotations

import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

BIB = Path(__file__).resolve().parents[2] / "book" / "references.bib"
FOOTCITE = re.compile(r"\{footcite\}`([^`]+)`")
_LINK = r"\[[^\]\n]+\]\(#cite-[^)\s]+\)"
LINK = re.compile(r"\[(?P<text>[^\]\n]+)\]\(#cite-(?P<key>[^)\s]+)\)")
#: A run of lab-form citation links, with the parentheses that belong to it when it has them.
CITATION_RUN = re.compile(rf"\((?:{_LINK})(?:; {_LINK})*\)|(?:{_LINK})(?:; {_LINK})*")
MARKER = "% footbibliography"
END = "% end of the works cited"
LIST_NOTE = ("% JupyterLab shows the works below; the site lists them as footnotes. "
             "Written by `python -m scalebook.citations` from book/references.bib.")  # fmt: skip
#: The lab's list of works: from the marker line through the end line (or the marker line alone).
WORKS_BLOCK = re.compile(rf"^{re.escape(MARKER)}[ \t]*$(?:.*?^{re.escape(END)}[ \t]*$)?", re.M | re.S)
#: The References page's list of every work for the lab (the site shows its ``{bibliography}`` directive instead).
ALL_WORKS = "% every work of book/references.bib, for JupyterLab"
ALL_WORKS_BLOCK = re.compile(rf"^{re.escape(ALL_WORKS)}[ \t]*$.*?^{re.escape(END)}[ \t]*$\n?", re.M | re.S)


@lru_cache(maxsize=2)
def _bibliography(path: str):
    from pybtex.database import parse_file

    return parse_file(path)


@lru_cache(maxsize=1)
def _pybtex():
    """pybtex's unsrt style and plain-text backend (each find_plugin call scans every installed entry point)."""
    from pybtex.plugin import find_plugin

    return find_plugin("pybtex.style.formatting", "unsrt")(), find_plugin("pybtex.backends", "text")()


def _plain(latex: str) -> str:
    from pybtex.richtext import Text

    return Text.from_latex(latex).render(_pybtex()[1])


def _names(entry) -> str:
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    last = [_plain(" ".join(p.prelast_names + p.last_names)) for p in people if str(p) != "others"]
    if len(people) > 2 or (len(people) == 2 and len(last) < 2):
        return f"{last[0]} et al."
    return " and ".join(last)


@lru_cache(maxsize=2)
def labels(path: str = str(BIB)) -> dict[str, str]:
    """Every work's author-year label, ``Kaplan et al., 2020``; works that share one get 2024a, 2024b, in bib order."""
    entries = _bibliography(path).entries
    plain = {key: f"{_names(e)}, {e.fields.get('year', 'n.d.')}" for key, e in entries.items()}
    groups = defaultdict(list)
    for key, label in plain.items():
        groups[label].append(key)
    for keys in groups.values():
        if len(keys) > 1:
            for letter, key in zip("abcdefghijklmnopqrstuvwxyz", keys, strict=False):
                plain[key] += letter
    return plain


def work(key: str, path: str = str(BIB)) -> str:
    """One work as the lab's list shows it: its label in bold, then authors, title and venue (pybtex's unsrt)."""
    style, backend = _pybtex()
    entry = _bibliography(path).entries[key]
    text = next(iter(style.format_entries([entry]))).text.render(backend).replace("\\url ", "")
    return f"**{labels(path)[key]}.** " + re.sub(r"([*_`\[\]<>])", r"\\\1", text)


def _inside_parentheses(before: str) -> bool:
    before = re.sub(r"\$[^$]*\$", "", before)  # math's parentheses do not count
    return before.count("(") > before.count(")")


def link_text(label: str, before: str) -> str:
    """A citation's text: its label, or its year alone after prose that names the authors ("Kaplan et al. (2020)")."""
    names, year = label.rsplit(", ", 1)
    return year if before.rstrip(" \n(").endswith(names) else label


def to_lab(markdown: str, path: str = str(BIB)) -> str:
    """Markdown with each ``{footcite}`keys``` written in the lab form (author-year links)."""
    known = labels(path)

    def lab_form(match: re.Match, paragraph: str) -> str:
        keys = [k.strip() for k in match.group(1).split(",")]
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise KeyError(f"{{footcite}} cites {unknown}, which book/references.bib does not hold: add them there")
        before = paragraph[: match.start()]
        links = "; ".join(f"[{link_text(known[k], before)}](#cite-{k})" for k in keys)
        return links if _inside_parentheses(before) else f"({links})"

    paragraphs = re.split(r"(\n[ \t]*\n)", markdown)
    return "".join(FOOTCITE.sub(lambda m, p=p: lab_form(m, p), p) for p in paragraphs)


def to_site(markdown: str) -> str:
    """Markdown in the site's form: each run of citation links a ``{footcite}`` role, the lab's list the directive."""

    def footcite(run: re.Match) -> str:
        return "{footcite}`" + ",".join(link.group("key") for link in LINK.finditer(run.group(0))) + "`"

    cited = CITATION_RUN.sub(footcite, markdown)
    return ALL_WORKS_BLOCK.sub("", WORKS_BLOCK.sub("```{footbibliography}\n```", cited))


def cited_keys(markdown_cells: list[str]) -> list[str]:
    """The keys a chapter cites in the lab form, in the order first cited."""
    keys = [m.group("key") for text in markdown_cells for m in LINK.finditer(text)]
    return list(dict.fromkeys(keys))


def works_block(keys: list[str], path: str = str(BIB)) -> str:
    """The References cell's block: the marker, a note, one labelled paragraph per work, the end line."""
    works = "".join(f"(cite-{key})=\n{work(key, path)}\n\n" for key in keys)
    return f"{MARKER}\n{LIST_NOTE}\n\n{works}{END}"


def all_works_block(path: str = str(BIB)) -> str:
    """The References page's list for JupyterLab: every work, by label (JupyterLab does not render its directive)."""
    keys = sorted(labels(path), key=lambda key: labels(path)[key].lower())
    works = "".join(f"{work(key, path)}\n\n" for key in keys)
    note = "% The site shows the {bibliography} directive above instead. Written by `python -m scalebook.citations`."
    return f"{ALL_WORKS}\n{note}\n\n{works}{END}\n"


def convert_page(page_path, path: str = str(BIB)) -> bool:
    """Rewrite a page's list of every work (book/bibliography.md); True if it changed."""
    page = Path(page_path)
    text = page.read_text(encoding="utf8")
    if not ALL_WORKS_BLOCK.search(text):
        raise ValueError(f"{page} has no list to rewrite: add the lines {ALL_WORKS!r} and {END!r}")
    new = ALL_WORKS_BLOCK.sub(lambda _m: all_works_block(path), text)
    if new != text:
        page.write_text(new, encoding="utf8")
    return new != text


def convert_cells(markdown_cells: list[str], path: str = str(BIB)) -> list[str]:
    """A chapter's markdown cells in the lab form, with the References list rewritten for what they cite."""
    cells = [to_lab(text, path) for text in markdown_cells]
    keys = cited_keys(cells)
    return [WORKS_BLOCK.sub(lambda _m: works_block(keys, path), text) for text in cells]


def convert_notebook(notebook_path) -> bool:
    """Rewrite one notebook's markdown cells in the lab form (nbformat, same format); True if anything changed."""
    import nbformat

    nb = nbformat.read(notebook_path, as_version=nbformat.NO_CONVERT)
    markdown = [cell for cell in nb.cells if cell.cell_type == "markdown"]
    converted = convert_cells([cell.source for cell in markdown])
    changed = False
    for cell, text in zip(markdown, converted, strict=True):
        if cell.source != text:
            cell.source, changed = text, True
    if changed:
        nbformat.write(nb, notebook_path)
    return changed


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python -m scalebook.citations NOTEBOOK.ipynb [...] [book/bibliography.md]  (in place)")
    for name in sys.argv[1:]:
        changed = convert_page(name) if name.endswith(".md") else convert_notebook(name)
        print(f"{name}: {'rewritten' if changed else 'unchanged'}", flush=True)
