"""Sphinx extension: the chapters' calculators, live in the built book, computed by the package's own Python.

A notebook code cell whose metadata has ``"live_calculator": "<name>"`` (a key of
``scalebook.widgets.CALCULATORS``) shows, in the book, a web form instead of the frozen ipywidget it
printed: the same inputs, labelled, and the result for the default inputs, computed here at build time
by the same function. The page reads normally with no JavaScript (the inputs are then read-only and a note
says why). The first time the reader changes
an input (or presses the button), _static/live_calculators.js starts Pyodide (CPython compiled to
WebAssembly, vendored in book/_vendor/pyodide) in a Web Worker, so the page never freezes, and calls
``scalebook.widgets.calculator_html`` there on every change. Only pages with a calculator load that
script; Pyodide itself loads on demand.

At the end of an HTML build this extension writes _static/live/: each file as a script that assigns
its text: pyodide.js and pyodide.asm.js as they are, the binary files (the WebAssembly module, the
standard library, the lock file and a zip of scalebook's pure-Python modules, built now from
code/scalebook) in base64. Scripts load from file:// where fetch() and workers do not, so the same
files serve a book opened from disk and one on a web server: the page builds Pyodide's worker from
their text and answers Pyodide's fetch() of its files from their bytes.

Source: Pyodide documentation, "Using Pyodide" (loadPyodide options indexURL, lockFileContents) and
"Loading custom Python code" (unpackArchive); Sphinx, "Sphinx core events" (html-page-context).
"""

from __future__ import annotations

import base64
import html
import io
import json
import shutil
import zipfile
from pathlib import Path

from docutils import nodes
from sphinx.util import logging

from scalebook import widgets

logger = logging.getLogger(__name__)

VENDOR = Path(__file__).resolve().parent.parent / "_vendor" / "pyodide"
PACKAGE = Path(widgets.__file__).resolve().parent
# What the calculators import: widgets, and through it accounting, configs, planner and the system model that
# the planner's predict comes from. Each must import without torch (tests/test_live_calculators.py checks it).
PURE_MODULES = ("__init__.py", "widgets.py", "configs.py", "planner.py", "accounting/*.py", "system/*.py")
SCRIPTS = ("pyodide.js", "pyodide.asm.js")  # embedded as text: the worker is built from it
BINARIES = ("pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")  # embedded as base64
MARKER = "live-calculator"


def pure_python_zip() -> bytes:
    """A zip of the scalebook modules the calculators run (``scalebook/...`` paths), from the source tree."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for pattern in PURE_MODULES:
            for path in sorted(PACKAGE.glob(pattern)):
                archive.write(path, f"scalebook/{path.relative_to(PACKAGE).as_posix()}")
    return buffer.getvalue()


def _control_html(calculator: str, name: str, control: widgets.Control) -> str:
    field_id = f"{MARKER}-{calculator}-{name}"
    label = f'<label for="{field_id}">{html.escape(control.label)}</label>'
    if control.kind == "checkbox":
        checked = " checked" if control.default else ""
        box = f'<input type="checkbox" id="{field_id}" name="{name}"{checked}>'
        return f'<div class="live-field live-check">{box}{label}</div>'
    if control.kind == "choice":
        options = "".join(
            f"<option{' selected' if option == control.default else ''}>{html.escape(str(option))}</option>"
            for option in control.options
        )
        return f'<div class="live-field">{label}<select id="{field_id}" name="{name}">{options}</select></div>'
    step = "1" if isinstance(control.default, int) else "any"
    bounds = "".join(
        f' {attribute}="{value:g}"'
        for attribute, value in (("min", control.minimum), ("max", control.maximum))
        if value is not None
    )
    return (
        f'<div class="live-field">{label}<input type="number" id="{field_id}" name="{name}" '
        f'value="{control.default}" step="{step}"{bounds}></div>'
    )


def calculator_form(name: str) -> str:
    """The calculator's HTML: its labelled inputs, a status line, and the result for the default inputs.

    As built, the inputs are disabled, the "Make it live" button hidden, and a note says that the values are the
    ones computed when the book was built and that the form needs JavaScript: what a reader sees with JavaScript
    off (or the script blocked). live_calculators.js removes the note, enables the inputs and shows the button.
    """
    calculator = widgets.CALCULATORS[name]()
    fields = "".join(_control_html(name, field, control) for field, control in calculator.controls.items())
    return (
        f'<form class="{MARKER}" data-calculator="{name}" data-state="static" data-computed="0" '
        f'aria-label="{html.escape(name.replace("-", " "))} calculator">'
        f'<fieldset class="live-inputs" disabled><div class="live-fields">{fields}</div></fieldset>'
        '<p class="live-nojs">The values below were computed when the book was built, for the inputs shown. '
        "Changing the inputs needs JavaScript, which is off (or blocked) in this browser, so the form is "
        "read-only.</p>"
        '<p class="live-status" role="status" tabindex="-1">Values for the inputs above, computed when the book '
        'was built.<span class="live-offer" hidden> <button type="button" class="live-start">Make it live</button> '
        "(runs the book's own Python in this page; about 16 MB, loaded once)</span></p>"
        f'<div class="live-result" aria-live="polite">{calculator.html(**calculator.defaults)}</div></form>'
    )


def _calculator_cells(doctree: nodes.document):
    """(cell, calculator name) for every notebook code cell whose metadata has ``live_calculator``."""
    for cell in doctree.findall(nodes.container):
        if cell.get("nb_element") == "cell_code" and cell.get("cell_metadata", {}).get("live_calculator"):
            yield cell, cell["cell_metadata"]["live_calculator"]


def _record_calculator_pages(app, doctree: nodes.document) -> None:
    """Remember which documents have a calculator: only then does the site need _static/live/."""
    pages = app.env.__dict__.setdefault("live_calculator_docs", set())
    pages.discard(app.env.docname)
    if any(True for _ in _calculator_cells(doctree)):
        pages.add(app.env.docname)


def _forget_page(app, env, docname: str) -> None:
    env.__dict__.setdefault("live_calculator_docs", set()).discard(docname)


def _merge_pages(app, env, docnames, other) -> None:  # from parallel readers
    env.__dict__.setdefault("live_calculator_docs", set()).update(getattr(other, "live_calculator_docs", ()))


def _replace_widget_outputs(app, doctree: nodes.document, docname: str) -> None:
    """Put the live calculator in place of the outputs of every cell marked with ``live_calculator``."""
    if app.builder.format != "html":
        return
    for cell, name in list(_calculator_cells(doctree)):
        if name not in widgets.CALCULATORS:
            logger.warning("live_calculator %r is not one of %s", name, ", ".join(widgets.CALCULATORS), location=cell)
            continue
        for output in [child for child in cell.children if child.get("nb_element") == "cell_code_output"]:
            cell.remove(output)
        cell += nodes.raw("", calculator_form(name), format="html", classes=[MARKER])


def _add_assets(app, pagename, templatename, context, doctree) -> None:
    """Load the calculators' script and styles on the pages that have a calculator, and only there."""
    if doctree is not None and any(MARKER in node.get("classes", ()) for node in doctree.findall(nodes.raw)):
        app.add_js_file("live_calculators.js", loading_method="defer")
        app.add_css_file("live_calculators.css")


def _embedded_js(name: str, text: str) -> str:
    """A script that stores ``text`` as ``self.scalebookLiveFiles[name]`` (what live_calculators.js reads)."""
    return f"(self.scalebookLiveFiles = self.scalebookLiveFiles || {{}})[{json.dumps(name)}] = {json.dumps(text)};\n"


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def write_runtime(outdir: Path) -> Path:
    """Write _static/live/ (Pyodide and the package's pure-Python zip) into a built site at ``outdir``."""
    live = outdir / "_static" / "live"
    live.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(VENDOR / "LICENSE", live / "LICENSE")
    for name in SCRIPTS:
        (live / f"{name}.js").write_text(_embedded_js(name, (VENDOR / name).read_text("utf8")), encoding="ascii")
    for name in BINARIES:
        (live / f"{name}.js").write_text(_embedded_js(name, _base64((VENDOR / name).read_bytes())), encoding="ascii")
    (live / "scalebook.zip.js").write_text(_embedded_js("scalebook.zip", _base64(pure_python_zip())), encoding="ascii")
    return live


def _write_runtime(app, exception) -> None:
    if exception is None and app.builder.format == "html" and getattr(app.env, "live_calculator_docs", None):
        write_runtime(Path(app.outdir))


def setup(app):
    app.connect("doctree-read", _record_calculator_pages)
    app.connect("env-purge-doc", _forget_page)
    app.connect("env-merge-info", _merge_pages)
    app.connect("doctree-resolved", _replace_widget_outputs)
    app.connect("html-page-context", _add_assets)
    app.connect("build-finished", _write_runtime)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
