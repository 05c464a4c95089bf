"""Every citation of every chapter reads as author-year text in JupyterLab and is a numbered footnote on the site.

A chapter stores the lab form that :mod:`scalebook.citations` writes from book/references.bib (jupyterlab-myst
resolves no key from a .bib): links such as ``([Kaplan et al., 2020](#cite-kaplan2020scaling))`` and, in its
References cell, one labelled paragraph per work cited; book/_ext/footbibliography_marker.py turns them back into
``{footcite}`` roles and the ``{footbibliography}`` directive for the site. The checks here read the notebooks'
markdown; tests/test_lab.py sees the same text rendered in a real JupyterLab, tests/test_chapters.py counts the
site's footnotes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scalebook.citations import (
    ALL_WORKS_BLOCK,
    FOOTCITE,
    LINK,
    MARKER,
    all_works_block,
    convert_cells,
    labels,
    link_text,
    to_lab,
    to_site,
    works_block,
)

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
FIX = "run `python -m scalebook.citations {}` (it rewrites citations and the References list from book/references.bib)"


def markdown_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def citation_problems(cells: list[str], name: str = "NOTEBOOK") -> list[str]:
    """What a chapter's markdown would show wrong in JupyterLab or on the site, in words; empty when all is well."""
    known = labels()
    found = []
    for i, text in enumerate(cells):
        found += [f"markdown cell {i}: {{footcite}}`{keys}` shows its bare key in JupyterLab"
                  for keys in FOOTCITE.findall(text)]  # fmt: skip
        for link in LINK.finditer(text):
            key, shown = link.group("key"), link.group("text")
            if key not in known:
                found.append(f"markdown cell {i}: #cite-{key} is no key of book/references.bib")
            elif shown != link_text(known[key], text[: link.start()]):
                found.append(f"markdown cell {i}: {key} shows {shown!r}, not its author-year label {known[key]!r}")
        stray = text.count("](#cite-") - len(LINK.findall(text))
        found += [f"markdown cell {i}: {stray} malformed citation link(s)"] if stray else []
    n_lists = sum(text.count(MARKER) for text in cells)
    if n_lists != 1:
        found.append(f"{n_lists} '{MARKER}' lines (want one, in the References cell)")
    elif not found and convert_cells(cells) != cells:
        found.append("the References list is not the works the chapter cites, in the order first cited")
    return [f"{problem}: {FIX.format(name)}" for problem in found]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_citation_shows_author_year_text_and_the_chapter_lists_its_works(path):
    cells = markdown_cells(path)
    assert citation_problems(cells, f"notebooks/{path.name}") == []
    assert any(LINK.search(text) for text in cells), f"{path.name} cites nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_site_reads_the_same_citations_as_footnotes(path):
    """The site's form cites every key the lab form links, and lists them with one {footbibliography}."""
    cells = markdown_cells(path)
    site = "\n\n".join(to_site(text) for text in cells)
    site_keys = [key.strip() for keys in FOOTCITE.findall(site) for key in keys.split(",")]
    assert set(site_keys) == {link.group("key") for text in cells for link in LINK.finditer(text)}
    assert site.count("```{footbibliography}\n```") == 1
    assert "#cite-" not in site and "(cite-" not in site, "a lab-only link or target would reach the site"


def test_the_references_page_lists_every_work_in_the_lab_and_only_its_directive_on_the_site():
    page = REPO / "book" / "bibliography.md"
    text = page.read_text(encoding="utf8")
    assert ALL_WORKS_BLOCK.sub(lambda _m: all_works_block(), text) == text, FIX.format("book/bibliography.md")
    assert all(f"**{label}.**" in text for label in labels().values())
    assert to_site(text).rstrip() == "# References\n\n```{bibliography}\n:all:\n```"


def test_labels_are_author_year_and_tell_works_apart():
    known = labels()
    assert known["loshchilov2019decoupled"] == "Loshchilov and Hutter, 2019"
    assert known["kaplan2020scaling"] == "Kaplan et al., 2020"
    assert known["hockney1994communication"] == "Hockney, 1994"
    assert known["deepseekai2024deepseekv3"] == "DeepSeek-AI, 2024"
    nvidia = sorted(label for label in known.values() if label.startswith("NVIDIA, 2024"))
    assert len(nvidia) > 1 and len(set(nvidia)) == len(nvidia) and nvidia[0] == "NVIDIA, 2024a"


def test_a_footcite_becomes_the_lab_form_and_back():
    text = "With Adam {footcite}`loshchilov2019decoupled` it is 16 bytes (ZeRO, {footcite}`rajbhandari2020zero`)."
    lab = to_lab(text)
    assert lab == ("With Adam ([Loshchilov and Hutter, 2019](#cite-loshchilov2019decoupled)) it is 16 bytes "
                   "(ZeRO, [Rajbhandari et al., 2020](#cite-rajbhandari2020zero)).")  # fmt: skip
    assert to_site(lab) == text
    two = to_lab("The alpha-beta model {footcite}`hockney1994communication,thakur2005optimization`.")
    assert "([Hockney, 1994](#cite-hockney1994communication); [Thakur et al., 2005]" in two
    assert to_site(two) == "The alpha-beta model {footcite}`hockney1994communication,thakur2005optimization`."
    narrative = to_lab("Kaplan et al. {footcite}`kaplan2020scaling` fit")
    assert narrative == "Kaplan et al. ([2020](#cite-kaplan2020scaling)) fit"
    with pytest.raises(KeyError, match="references.bib does not hold"):
        to_lab("{footcite}`nobody2099`")


def test_the_check_names_a_bare_key_a_wrong_label_an_unknown_key_and_a_stale_list():
    cited = "With Adam {footcite}`loshchilov2019decoupled`."
    closing = f"## References\n\n{MARKER}\n\nAll on the [References](../book/bibliography.md) page."
    good = convert_cells([cited, closing])
    assert works_block(["loshchilov2019decoupled"]) in good[1]
    assert citation_problems(good) == []
    assert citation_problems([cited, good[1]])[0].startswith(
        "markdown cell 0: {footcite}`loshchilov2019decoupled` shows its bare key in JupyterLab: run `python -m"
    )
    wrong = good[0].replace("Loshchilov and Hutter, 2019", "loshchilov2019decoupled")
    assert "shows 'loshchilov2019decoupled', not its author-year label" in citation_problems([wrong, good[1]])[0]
    unknown = good[0].replace("#cite-loshchilov2019decoupled", "#cite-loshchilov2019")
    assert "#cite-loshchilov2019 is no key" in citation_problems([unknown, good[1]])[0]
    other = to_lab("ZeRO {footcite}`rajbhandari2020zero`.")
    assert "is not the works the chapter cites" in citation_problems([other, good[1]])[0]
    assert re.search(r"0 '% footbibliography' lines", citation_problems([good[0]])[0])
