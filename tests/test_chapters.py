"""Every chapter has what a reader relies on: the opening box (what you will learn, prerequisites, time to
run), a summary, 3-8 exercises of which at least two are solved with code, each solution hidden in a
dropdown, and a few multiple-choice checks with hidden answers."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(REPO.glob("notebooks/[0-9][0-9]_*.ipynb"))

EXERCISE = re.compile(r"^\d+\.\s+\*\*[^*]+\*\*", re.M)  # "1. **Title.** text": a numbered, titled exercise
DROPDOWN = re.compile(r"^:::\{admonition\} (Solution|Answer)\n:class: dropdown\n(.*?)^:::$", re.M | re.S)
CHOICES = re.compile(r"\([a-d]\)")


def markdown(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def section(text: str, title: str) -> str:
    """The text of the section (any level) whose heading is ``title``, up to the next heading of that level."""
    match = re.search(rf"^(#+) {re.escape(title)}\s*$", text, re.M)
    if not match:
        return ""
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
    return text[match.end() : end.start() if end else len(text)]


def problems(text: str) -> list[str]:
    """What a chapter's markdown lacks, in words; empty when it has everything."""
    found = []
    for label in ("**You will learn**", "**Prerequisites**", "**Time to run**"):
        if label not in text:
            found.append(f"no {label} in the opening box")
    if not section(text, "Summary").strip():
        found.append("no Summary section")
    exercises = section(text, "Exercises")
    # The exercises section ends where the checks begin, whatever their heading level.
    exercises = exercises.split("Check your understanding")[0]
    n_exercises = len(EXERCISE.findall(exercises))
    solutions = [body for kind, body in DROPDOWN.findall(exercises) if kind == "Solution"]
    if not 3 <= n_exercises <= 8:
        found.append(f"{n_exercises} exercises (want 3 to 8, each '1. **Title.** ...')")
    if len(solutions) < n_exercises:
        found.append(f"{n_exercises} exercises but {len(solutions)} dropdown solutions")
    if sum("```python" in body for body in solutions) < 2:
        found.append("fewer than two solutions that run code (a ```python block)")
    checks = section(text, "Check your understanding")
    questions = [q for q in re.split(r":::\{admonition\} Answer.*?^:::$", checks, flags=re.M | re.S)
                 if len(CHOICES.findall(q)) >= 2]  # fmt: skip
    answers = [body for kind, body in DROPDOWN.findall(checks) if kind == "Answer"]
    if len(questions) < 2 or len(answers) < len(questions):
        found.append(f"{len(questions)} multiple-choice checks with {len(answers)} hidden answers (want at least 2)")
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_summary_exercises_and_checks(path):
    assert problems(markdown(path)) == [], path.name


def test_all_sixteen_chapters_are_checked():
    assert [p.name[:2] for p in CHAPTERS] == [f"{i:02d}" for i in range(1, 17)]


GOOD = """**You will learn** x **Prerequisites**: y. **Time to run**: z.

## Summary

It works.

## Exercises

1. **One.** Do it.

:::{admonition} Solution
:class: dropdown
```python
print(1)
```
:::

2. **Two.** Again.

:::{admonition} Solution
:class: dropdown
```python
print(2)
```
:::

3. **Three.** Think.

:::{admonition} Solution
:class: dropdown
Words.
:::

## Check your understanding

1. Pick one: (a) this (b) that.

:::{admonition} Answer
:class: dropdown
(a)
:::

2. Pick again: (a) this (b) that.

:::{admonition} Answer
:class: dropdown
(b)
:::

## References
"""


def test_the_check_accepts_a_complete_chapter_and_names_what_is_missing():
    assert problems(GOOD) == []
    no_code = GOOD.replace("```python\nprint(2)\n```", "Words.")
    assert problems(no_code) == ["fewer than two solutions that run code (a ```python block)"]
    two = GOOD[: GOOD.index("3. **Three.**")] + GOOD[GOOD.index("## Check") :]
    assert problems(two) == ["2 exercises (want 3 to 8, each '1. **Title.** ...')"]
    unanswered = GOOD.replace(":::{admonition} Answer\n:class: dropdown\n(b)\n:::", "")
    assert problems(unanswered) == ["2 multiple-choice checks with 1 hidden answers (want at least 2)"]
    assert "no Summary section" in problems(GOOD.replace("## Summary\n\nIt works.", ""))


NOTEBOOKS = sorted(REPO.glob("notebooks/*.ipynb"))


def stderr_outputs(path: Path) -> list[str]:
    """Every stderr stream a committed notebook shows, as 'cell N: first line'."""
    found = []
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf8"))["cells"]):
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream" and out["name"] == "stderr":
                found.append(f"cell {i}: {''.join(out['text']).splitlines()[0][:120]}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_warning_reaches_the_reader(path):
    """A cell's stderr (a library warning, a font fallback) is shown on the page: silence it at its source."""
    assert not stderr_outputs(path)


#: A control character in a markdown cell: "$\beta$" typed through a Python string without the r prefix leaves a
#: backspace (\x08) and "eta", which MathJax fails on in the browser only.
CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def control_characters(text: str) -> list[str]:
    """Each control character (other than newline and tab) in ``text``, with the text around it."""
    return [repr(text[max(0, m.start() - 30) : m.end() + 10]) for m in CONTROL_CHARACTER.finditer(text)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_control_character_in_the_prose(path):
    assert not control_characters(markdown(path))


def test_the_control_character_check_catches_a_backspace_from_an_unescaped_beta():
    found = control_characters("so $tX\beta$ is larger")
    assert len(found) == 1 and "tX\\x08eta" in found[0], found
    assert not control_characters("so $tX\\beta$ is larger,\n\tand more")


LECTURE_NOTES = re.compile(r"lecture notes|\bthe seeds\b|\bseeds'|seed lecture", re.I)
LECTURE_NOTE_KEYS = ("xu2026transformer", "torres2025supercomputing")


def uncited_lecture_notes(text: str) -> list[str]:
    """Paragraphs that mention the lecture notes the book grew from without citing them (or call them seeds)."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        for match in LECTURE_NOTES.finditer(paragraph):
            if "seed" in match.group(0).lower() or not any(key in paragraph for key in LECTURE_NOTE_KEYS):
                found.append(paragraph[max(0, match.start() - 60) : match.end() + 20].replace("\n", " "))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_lecture_notes_are_cited_where_they_are_named(path):
    from scalebook.citations import to_site

    # The prose, without the chapter's list of works for JupyterLab (a venue there may be "Lecture Notes in ...").
    assert not uncited_lecture_notes(to_site(markdown(path)))


def test_the_lecture_notes_check_catches_what_it_must():
    assert uncited_lecture_notes("The seeds of this book put it as one line.")
    assert uncited_lecture_notes("As the lecture notes say, 800 GPUs.")
    assert not uncited_lecture_notes("As the lecture notes {footcite}`xu2026transformer` say, 800 GPUs.")
    assert not uncited_lecture_notes("Two runs with different random seeds differ by noise.")


GLUE_MIME = "application/papermill.record/text/plain"
GLUE_ROLE = re.compile(r"\{glue(:\w*)?\}`")


GLUED_NAME = re.compile(r"\bglued\.(\w+)")
# Numbers that prose reads before the cell that glues them (an opening box quoting a result, a value computed next
# to its table further down). Their stored results show when a chapter is opened, but JupyterLab's "Run All"
# evaluates a markdown cell's expressions when it reaches the cell and shows an error there: open work, listed so
# that no new one comes in.
FORWARD_GLUED = {
    "01_why_train_at_scale": {"gpus_real_rounded", "gpus_korthikanti_rounded"},
    "07_where_the_memory_goes": {"h100_fp8_over_bf16"},
    "10_data_parallelism": {"gpt2_tensors"},
    "11_zero_and_fsdp": {"paper_gb_0", "ddp_share_of_largest", "h100_gb", "largest_gb", "ddp_over_h100"},
    "14_beyond_three_dimensions": {"cal_n"},
}


def number_problems(cells: list[dict], forward_allowed=frozenset()) -> list[str]:
    """Where a notebook's numbers in prose would not show what its cells computed, in words.

    Each ``{eval}`` expression must have a stored result (what JupyterLab and the site show) equal to the
    expression evaluated over the values the code cells glued (their outputs, which nbval compares), so a
    changed number fails nbval and a stale or hand-edited result fails here. Expressions read ``glued`` only,
    and only what a cell above glued: JupyterLab evaluates a markdown cell's expressions when the cell runs, so
    "Run All" fails on a value glued further down (an exercise's solution glued by a hidden cell after it).
    """
    from scalebook.notebook import Glued, eval_expressions, shown_text

    values, glued_above = Glued(), set()
    for cell in cells:
        for out in cell.get("outputs", []):
            name = out.get("metadata", {}).get("scrapbook", {}).get("name")
            if name is not None:
                setattr(values, name, ast.literal_eval(out["data"][GLUE_MIME]))
    found = []
    converted = any(eval_expressions("".join(c["source"])) for c in cells if c["cell_type"] == "markdown")
    for i, cell in enumerate(cells):
        glued_above |= {out["metadata"]["scrapbook"]["name"] for out in cell.get("outputs", [])
                        if "name" in out.get("metadata", {}).get("scrapbook", {})}  # fmt: skip
        if cell["cell_type"] != "markdown":
            continue
        ahead = sorted({n for e in eval_expressions("".join(cell["source"])) for n in GLUED_NAME.findall(e)}
                       - glued_above - set(forward_allowed))  # fmt: skip
        found += [f"cell {i}: glued.{name} is glued only further down (JupyterLab's Run All fails here)"
                  for name in ahead]  # fmt: skip
        if converted and GLUE_ROLE.search("".join(cell["source"])):
            found.append(f"cell {i}: a glue role, which JupyterLab cannot show: write {{eval}} (convert_numbers.py)")
        expressions = eval_expressions("".join(cell["source"]))
        stored = {e["expression"]: e["result"] for e in cell.get("metadata", {}).get("user_expressions", [])}
        if sorted(stored) != sorted(expressions):
            found.append(f"cell {i}: stored results for {sorted(stored)}, roles {sorted(expressions)}")
            continue
        for expression in expressions:
            try:
                want = str(eval(expression, {"__builtins__": {}}, {"glued": values}))  # noqa: S307 (the book's own)
                shown = shown_text(stored[expression])
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                found.append(f"cell {i}: {expression}: {type(exc).__name__}: {exc}")
                continue
            if shown != want:
                found.append(f"cell {i}: {expression} shows {shown!r}, the glued value gives {want!r}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_number_in_prose_shows_the_glued_value(path):
    cells = json.loads(path.read_text(encoding="utf8"))["cells"]
    assert number_problems(cells, FORWARD_GLUED.get(path.stem, ())) == []


def test_the_number_check_catches_stale_missing_and_typed_results():
    def ok(text):
        return {"status": "ok", "data": {"text/plain": repr(text)}, "metadata": {}}

    glue_cell = {
        "cell_type": "code",
        "source": "",
        "outputs": [
            {"output_type": "display_data", "data": {GLUE_MIME: "2.84"}, "metadata": {"scrapbook": {"name": "tb"}}}
        ],
    }
    expression = 'f"{glued.tb:.1f}"'
    prose = {
        "cell_type": "markdown",
        "source": "It is {eval}`" + expression + "` TB.",
        "metadata": {"user_expressions": [{"expression": expression, "result": ok("2.8")}]},
    }
    assert number_problems([glue_cell, prose]) == []
    stale = json.loads(json.dumps(prose))
    stale["metadata"]["user_expressions"][0]["result"] = ok("3.1")
    assert number_problems([glue_cell, stale]) == [f"cell 1: {expression} shows '3.1', the glued value gives '2.8'"]
    missing = {**prose, "metadata": {}}
    assert number_problems([glue_cell, missing])[0].startswith("cell 1: stored results for []")
    other = {
        **prose,
        "source": "It is {eval}`tb * 2` TB.",
        "metadata": {"user_expressions": [{"expression": "tb * 2", "result": ok("5.68")}]},
    }
    assert "NameError" in number_problems([glue_cell, other])[0]
    assert number_problems([prose, glue_cell]) == [
        "cell 0: glued.tb is glued only further down (JupyterLab's Run All fails here)"
    ]
    assert number_problems([prose, glue_cell], forward_allowed={"tb"}) == []
    mixed = {**prose, "source": prose["source"] + " Also {glue:text}`tb:.1f`."}
    assert number_problems([glue_cell, mixed]) == [
        "cell 1: a glue role, which JupyterLab cannot show: write {eval} (convert_numbers.py)"
    ]


FOOTBIBLIOGRAPHY_DIRECTIVE = re.compile(r"^```\{footbibliography\}", re.M)
FOOTBIBLIOGRAPHY_MARKER = re.compile(r"^% footbibliography[ \t]*$", re.M)
DOC_ROLE = re.compile(r"\{doc\}`")


def lab_citation_problems(cells: list[dict]) -> list[str]:
    """Where a notebook read in JupyterLab would show a citation aid broken, in words (chapters in {eval} only).

    jupyterlab-myst draws ``{footbibliography}`` as a red "Unknown Directive" box and a ``{doc}`` role as its bare
    target. A chapter converted to ``{eval}`` (so meant for JupyterLab too) closes with the comment line
    ``% footbibliography`` instead, which book/_ext/footbibliography_marker.py turns into the directive on the
    site, and links to pages with Markdown links to their files (/work/briefs/s3/convert_citations.py does both).
    """
    from scalebook.notebook import eval_expressions

    texts = ["".join(c["source"]) if c["cell_type"] == "markdown" else "" for c in cells]
    if not any(eval_expressions(text) for text in texts):
        return []
    found = [f"cell {i}: a {{footbibliography}} directive: write the line '% footbibliography' (convert_citations.py)"
             for i, text in enumerate(texts) if FOOTBIBLIOGRAPHY_DIRECTIVE.search(text)]  # fmt: skip
    found += [f"cell {i}: a {{doc}} role: write a Markdown link to the file (convert_citations.py)"
              for i, text in enumerate(texts) if DOC_ROLE.search(text)]  # fmt: skip
    n_markers = sum(len(FOOTBIBLIOGRAPHY_MARKER.findall(text)) for text in texts)
    if n_markers != 1:
        found.append(f"{n_markers} '% footbibliography' lines (want one, in the References cell)")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_citations_and_page_links_read_in_jupyterlab_too(path):
    assert lab_citation_problems(json.loads(path.read_text(encoding="utf8"))["cells"]) == []


def test_the_citation_check_names_the_directive_the_role_and_a_missing_list():
    def md(text):
        return {"cell_type": "markdown", "source": text, "metadata": {}}

    number = md("It is {eval}`glued.x`.")
    closing = "## References\n\n% footbibliography\n\nAll on the [References](../book/bibliography.md) page."
    assert lab_citation_problems([number, md(closing)]) == []
    old = "## References\n\n```{footbibliography}\n```\n\nAll on the {doc}`../book/bibliography` page."
    assert lab_citation_problems([number, md(old)]) == [
        "cell 1: a {footbibliography} directive: write the line '% footbibliography' (convert_citations.py)",
        "cell 1: a {doc} role: write a Markdown link to the file (convert_citations.py)",
        "0 '% footbibliography' lines (want one, in the References cell)",
    ]
    assert lab_citation_problems([md("It is {glue:text}`x`."), md(old)]) == []  # not converted yet


FOOTCITE = re.compile(r"\{footcite(?::\w+)?\}`([^`]+)`")


def test_the_site_lists_the_works_each_page_cites_as_footnotes(book_html):
    """On the site the closing ``% footbibliography`` line is the footnote list (book/_ext/footbibliography_marker.py
    expands it to sphinxcontrib-bibtex's directive, and the chapter's author-year links to {footcite} roles, see
    scalebook.citations): one footnote per work the page cites, none lost."""
    from scalebook.citations import to_site

    counts = {}
    for path in NOTEBOOKS:
        cited = {key.strip() for keys in FOOTCITE.findall(to_site(markdown(path))) for key in keys.split(",")}
        html = (book_html / "notebooks" / f"{path.stem}.html").read_text(encoding="utf8")
        counts[path.stem] = (len(cited), html.count('<aside class="footnote brackets"'))
    assert all(cited > 0 for cited, _ in counts.values()), counts
    assert {name: shown for name, (_, shown) in counts.items()} == {name: n for name, (n, _) in counts.items()}


# ----- prose that characterises a number must be computed or checked --------------------------------------------
# A sentence that puts a characterising word ("measured", "faster", "the slowest", "about", "plus a little") next to
# a number with a unit of time, rate or ratio states a result. That number must come from an executed cell (an
# {eval} of a glued value, which the number check above ties to the output) or appear in an `assert` of the same
# notebook, so that the sentence cannot outlive a change of what the cells compute. Published numbers carry their
# citation in the same sentence and are exempt; so are the inputs of an exercise's question. What remains is listed
# in UNCHECKED_NUMBERS with the reason it may stay literal (a definition, a hardware datasheet value named earlier,
# a hypothetical): each entry is a decision a reader of this file can review.
QUANTITY = re.compile(
    r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s?(%|×|times\b|x\b|s\b|ms\b|µs\b|min\b|minutes?\b|seconds?\b|tok/s|tokens/s"
    r"|[KMGT]i?B/s|[GTP]FLOP/s)"
)
CHARACTERISING = re.compile(
    r"\b(measured|took|takes|faster|slower|slowest|fastest|above|below|more than|less than|plus a little|about"
    r"|on this machine|this run|as promised)\b",
    re.I,
)
CITED = re.compile(r"\[cited\]|\[[^\]]*\b(19|20)\d\d[a-z]?\]")  # a role, or a citation written as a link
SENTENCE = re.compile(r"(?<=[.!?:])\s+(?=[A-Z(*])|\n\s*\n|\n\s*[-*] |\n\|")


def _plain_prose(text: str) -> str:
    """Markdown without what is not literal prose: {eval} results, code, math, link targets, the question of a
    multiple-choice check or an exercise (its numbers are inputs), the opening box's time to run."""
    text = re.sub(r"\{eval\}`[^`]*`", "(computed)", text)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"\{(foot)?cite(:\w+)?\}`[^`]*`", "[cited]", text)
    text = re.sub(r"`[^`]*`", "(code)", text)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"\$[^$\n]*\$", "(math)", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"\*\*Time to run\*\*:[^\n]*", " ", text)


def unchecked_numbers(cells: list[dict]) -> list[tuple[str, str]]:
    """(quantity, sentence) for each characterised number in prose that is neither computed nor asserted."""
    asserted = " ".join(line.split("#")[0] for c in cells if c["cell_type"] == "code"
                        for line in "".join(c["source"]).splitlines() if "assert" in line).replace(",", "")  # fmt: skip
    found = []
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        text = _plain_prose("".join(cell["source"]))
        # An exercise's or a check's question states its inputs; its solution or answer (a dropdown) states results.
        if re.search(r"^\d+\.\s+\*\*|\([a-d]\)", text, re.M):
            text = "\n\n".join(m.group(0) for m in DROPDOWN.finditer(text))
        for sentence in SENTENCE.split(text):
            if CITED.search(sentence) or not CHARACTERISING.search(sentence):
                continue
            for match in QUANTITY.finditer(sentence):
                if not re.search(rf"(?<![\d.]){re.escape(match.group(1).replace(',', ''))}(?![\d])", asserted):
                    found.append((match.group(0), " ".join(sentence.split())[:200]))
    return found


# Literal numbers that stay literal, by notebook: the quantity as the check prints it, and why it needs no glue.
UNCHECKED_NUMBERS: dict[str, dict[str, str]] = {
    "08_compute_time_and_gpus": {
        "160 TFLOP/s": "the rate Chapter 1's estimate assumed, named as such",
        "40 %": "the MFU the table above assumes (an input, stated with it)",
        "140 TFLOP/s": "Narayanan et al.'s published rate, the exercise's input",
        "312 TFLOP/s": "the A100's dense bf16 datasheet peak (configs.get_hardware)",
    },
    "09_collective_communication": {
        "12 times": "NVLink 3's 300 GB/s against a 200 Gb/s port's 25 GB/s, two datasheet values",
        "450 GB/s": "NVLink 4's datasheet bandwidth per direction",
        "50 GB/s": "400 Gb/s written in bytes",
        "300 GB/s": "NVLink 3's datasheet bandwidth per direction",
    },
    "11_zero_and_fsdp": {
        "50 %": "'ZeRO-3 sends 50 % more than DDP': 3 against 2 units of eq-zero-comm, the equation above",
        "50 GB/s": "400 Gb/s written in bytes",
    },
    "16_when_training_goes_wrong": {
        "1,023 x": "the exercise's own inputs multiplied (1,024 ranks, 24 bytes each)",
        "4 times": "the sum over 4 ranks is 4 times their mean, by definition",
        "80 ms": "the question's own number, restated in its answer",
    },
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_numbers_that_prose_characterises_are_computed_or_asserted(path):
    allowed = UNCHECKED_NUMBERS.get(path.stem, {})
    cells = json.loads(path.read_text(encoding="utf8"))["cells"]
    found = [(quantity, sentence) for quantity, sentence in unchecked_numbers(cells) if quantity not in allowed]
    assert found == [], "glue these numbers ({eval}) or assert them in a cell:\n" + "\n".join(
        f"{quantity}: {sentence}" for quantity, sentence in found
    )


def test_the_characterised_number_check_catches_a_stale_timing_and_accepts_glued_asserted_and_cited_ones():
    def cells(prose, code=""):
        return [{"cell_type": "code", "source": code, "outputs": []}, {"cell_type": "markdown", "source": prose}]

    stale = "The run took about 82.6 s on this machine. Each measured bubble is the formula's plus a little: 0.148."
    assert [q for q, _ in unchecked_numbers(cells(stale))] == ["82.6 s"]
    assert unchecked_numbers(cells("The run took about {eval}`f'{glued.t:.0f}'` s.")) == []
    assert unchecked_numbers(cells(stale, code="assert round(seconds, 1) == 82.6")) == []
    assert unchecked_numbers(cells(stale, code="assert 80 < seconds < 85  # 82.6 s")) != []  # a comment checks nothing
    assert unchecked_numbers(cells("It reaches about 75 % on an H100 {footcite}`shah2024flashattention3`.")) == []
    assert unchecked_numbers(cells("It reaches about 75 % on an H100 ([Shah et al., 2024](../book/x.md)).")) == []
    question = "1. **Bigger.** At 50 % MFU, how long does it take?\n\n:::{admonition} Solution\n:class: dropdown\n" \
               "About 26 s per step.\n:::\n"  # fmt: skip
    assert [q for q, _ in unchecked_numbers(cells(question))] == ["26 s"]  # the question's 50 % is an input
