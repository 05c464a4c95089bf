"""The chapters in JupyterLab, as a learner opens them with `make lab`: a real server, a real browser.

`jupyter lab` starts with the very command line `make lab NB=<Ch. 7>` runs (read with `make -n`: the repository as
the server's root, the chapter as the page it opens, --allow-root when root), headless on a free port of 127.0.0.1
with a token. Headless Chromium, driven over the DevTools protocol (tests/test_browser.py's client; every request
to another host is failed), opens converted chapters. Once jupyterlab-myst has rendered them, each markdown
cell's rendered text must hold the number every ``{eval}`` shows (the result stored in the cell, computed by
the cells) and none of the raw MyST that JupyterLab's own renderer would leave: ``{glue``, ``{eval``,
``{footcite``, ``:::{admonition``. Two screenshots of each chapter, at its first number and at its closing
References, go to the test's tmp folder. Then one chapter's code cells run through the server as the front end
runs them (a REST session, then execute requests on the kernel's websocket), without an error, and its markdown
cells' expressions evaluated by that live kernel show what the notebook stores.

Citations and links: a chapter's closing ``% footbibliography`` line (the site's footnote list, see
book/_ext/footbibliography_marker.py) renders as nothing, so no red "Unknown Directive" box may show, nor a raw
``{doc}`` role or its bare target. Citations show author-year text, never a bare key, and the chapter ends with the
works it cites (scalebook.citations writes both; jupyterlab-myst 2.7.0 resolves no key from a .bib). Every link of
Ch. 7 and of the cheat sheet is followed: a link to a file answers 200 from the server (no 404: the lab serves the
repository, so ``../book/`` pages are inside it), a link within the chapter (a citation, a heading) has its target
on the page, and a click on a citation brings the cited work into view, a click on the References (or Notation) link
opens that page in JupyterLab (where the References page lists every work, see scalebook.citations).

Needs /usr/bin/chromium; skipped with a reason when it is absent, a failure under CI=true (tests/_skips.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from test_browser import Chromium, require_chromium

from scalebook.citations import LINK, labels
from scalebook.notebook import eval_expressions, shown_text

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
JUPYTER = Path(sys.executable).with_name("jupyter")
# Chapters opened in the lab: Chapter 7 holds the model-state total of the issue; the cheat sheet links to most pages.
CHAPTERS = ["02_tokenization", "07_where_the_memory_goes", "09_collective_communication", "11_zero_and_fsdp",
            "cheat_sheet"]  # fmt: skip
RUN_CHAPTER = "02_tokenization"  # the quickest of them to run (about 10 s)
# The chapter the lab is started on (`make lab NB=...`), and the chapters whose every link the test follows.
LAB_CHAPTER = "notebooks/07_where_the_memory_goes.ipynb"
LINK_CHAPTERS = ["07_where_the_memory_goes", "cheat_sheet"]
RAW_MYST = ("{glue", "{eval", "{footcite", ":::{admonition", "{doc}", "{footbibliography")
# The titles of jupyterlab-myst's red boxes for a directive or a role it does not know.
ERROR_BOXES = ("Unknown Directive", "Unknown Role")
DOC_TARGET = re.compile(r"\{doc\}`(?:[^`<]*<)?([^`>]+?)>?`")
# JupyterLab settings for the test only: render every cell (the default windowing renders only those on
# screen, so the others would have no text to check), never save a chapter, do not ask about news.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_lab_command(notebook: str) -> list[str]:
    """The command line `make lab NB=notebook` runs (as `make -n` prints it), the venv's jupyter made absolute."""
    dry = subprocess.run(["make", "-n", "--no-print-directory", "lab", f"NB={notebook}"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    # Only the lab's line is split: a recipe that (re)builds .venv first may print comments with quotes.
    lines = [shlex.split(line) for line in dry.replace("\\\n", " ").splitlines() if "jupyter lab" in line]
    argv = next((a for a in lines if len(a) > 1 and Path(a[0]).name == "jupyter" and a[1] == "lab"), None)
    assert argv, f"`make -n lab` runs no `jupyter lab`:\n{dry}"
    return [str(REPO / argv[0]), *argv[1:]]


class Lab:
    """`jupyter lab` as `make lab NB=notebook` starts it, headless, with its own settings and a random token."""

    def __init__(self, workdir: Path, notebook: str = LAB_CHAPTER):
        for name, value in SETTINGS.items():
            (workdir / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
            (workdir / "settings" / name).write_text(json.dumps(value))
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(workdir / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(workdir / "workspaces"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
        self.command = make_lab_command(notebook)
        args = [*self.command, "--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port_retries=0",
                f"--ServerApp.port={self.url.rsplit(':', 1)[1]}", f"--IdentityProvider.token={self.token}"]  # fmt: skip
        self.log_path = workdir / "lab.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                self.api("GET", "/api/status")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    log = self.log_path.read_text(errors="replace")
                    raise RuntimeError(f"jupyter lab did not start:\n{log}") from None
                time.sleep(0.2)

    def api(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(self.url + path, method=method, headers={
            "Authorization": f"token {self.token}", "Content-Type": "application/json"},
            data=None if body is None else json.dumps(body).encode())  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("lab"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    require_chromium()
    chromium = Chromium(tmp_path_factory.mktemp("chromium"))
    yield chromium
    chromium.close()


def read_cells(name: str) -> list[dict]:
    return json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text(encoding="utf8"))["cells"]


# The text jupyterlab-myst rendered for each markdown cell, in notebook order (null: not rendered yet).
# textContent, not innerText: the answers folded in dropdowns count too.
JS_RENDERED = """Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell')).map(cell =>
  cell.classList.contains('jp-MarkdownCell') ? (cell.querySelector('.lm-Widget.myst') || {}).textContent ?? null
                                             : '')"""

# The repository paths that the rendered markdown's links to files point at (jupyterlab-myst resolves a relative
# link to the server's /files/ URL; a click opens the file in JupyterLab).
JS_FILE_LINKS = """Array.from(document.querySelectorAll('.jp-Notebook .jp-MarkdownCell .myst a[href*="/files/"]')).map(
  a => decodeURIComponent(new URL(a.href).pathname.split('/files/')[1]))"""
# The cheat sheet's link to Chapter 6, which the test clicks.
JS_CHAPTER_6_LINK = """Array.from(document.querySelectorAll('.jp-Notebook .jp-MarkdownCell a')).find(
  a => a.getAttribute('href').includes('/files/notebooks/06_counting_parameters.ipynb'))"""


def rendering_problems(cells: list[dict], rendered: list) -> list[str]:
    """What a chapter's rendered markdown lacks or shows raw, in words; empty when it reads as on the site."""
    if len(rendered) != len(cells):
        return [f"{len(rendered)} cells on the page, {len(cells)} in the notebook"]
    found = []
    for i, (cell, text) in enumerate(zip(cells, rendered, strict=True)):
        if cell["cell_type"] != "markdown":
            continue
        if not text:
            found.append(f"cell {i}: not rendered")
            continue
        stored = {e["expression"]: e["result"] for e in cell["metadata"].get("user_expressions", [])}
        for expression in eval_expressions("".join(cell["source"])):
            if expression not in stored or shown_text(stored[expression]) not in text:
                found.append(f"cell {i}: {expression} is not shown")
        found += [f"cell {i}: raw {raw!r}" for raw in RAW_MYST if raw in text]
        found += [f"cell {i}: {box!r} box" for box in ERROR_BOXES if box in text]
        targets = DOC_TARGET.findall("".join(cell["source"]))
        found += [f"cell {i}: raw {{doc}} target {target!r}" for target in targets if target in text]
    return found


def test_chapters_render_their_numbers_answers_and_citations(lab, browser, tmp_path):
    for name in CHAPTERS:
        cells = read_cells(name)
        n_numbers = sum(len(c["metadata"].get("user_expressions", [])) for c in cells)
        assert n_numbers > 5, f"{name} has {n_numbers} numbers in prose: is it converted to {{eval}}?"
        browser.open(f"{lab.url}/lab/tree/notebooks/{name}.ipynb?token={lab.token}&reset", timeout=60)
        ready = f"(() => {{ const r = {JS_RENDERED}; return r.length === {len(cells)} && !r.includes(null); }})()"
        browser.wait_for(ready, timeout=60)
        browser.pump(1.0)  # the inline expressions render after their cell
        problems = rendering_problems(cells, browser.evaluate(JS_RENDERED))
        problems += [f"a link to {path}, which is no file" for path in browser.evaluate(JS_FILE_LINKS)
                     if not (REPO / path).is_file()]  # fmt: skip
        first = next(i for i, c in enumerate(cells) if c["metadata"].get("user_expressions"))
        browser.evaluate(f"document.querySelectorAll('.jp-Notebook .jp-Cell')[{first}].scrollIntoView(); true")
        browser.pump(0.5)
        browser.screenshot(tmp_path / f"lab-{name}.png")
        closing = next(i for i, c in enumerate(cells) if "% footbibliography" in "".join(c["source"]))
        at_end = "const e = Array.from(c.querySelectorAll('.myst *')).pop(); e.scrollIntoView({block: 'end'}); true"
        browser.evaluate(f"(c => {{ {at_end} }})(document.querySelectorAll('.jp-Notebook .jp-Cell')[{closing}])")
        browser.pump(0.5)
        browser.screenshot(tmp_path / f"lab-{name}-references.png")
        assert problems == [], f"{name} in JupyterLab (screenshot {tmp_path / f'lab-{name}.png'})"
        assert not browser.blocked, f"{name}: JupyterLab asked another host for {browser.blocked}"
        if name == "cheat_sheet":  # its link to a chapter opens that chapter in JupyterLab, as on the site
            browser.evaluate(f"{JS_CHAPTER_6_LINK}.click(); true")
            opened = "location.pathname.endsWith('/lab/tree/notebooks/06_counting_parameters.ipynb')"
            assert browser.wait_for(opened, timeout=30), f"the link opened {browser.evaluate('location.href')}"
    assert "cheat_sheet" in CHAPTERS, "the link check above needs the cheat sheet"
    if os.environ.get("LAB_SHOTS"):  # copy the screenshots for review
        for png in tmp_path.glob("lab-*.png"):
            shutil.copy(png, Path(os.environ["LAB_SHOTS"]) / png.name)


# Every link in a chapter's rendered markdown: [its href as written, as the browser resolves it, its text].
JS_LINKS = """Array.from(document.querySelectorAll('.jp-Notebook .jp-MarkdownCell .myst a[href]')).map(
  a => [a.getAttribute('href'), a.href, a.textContent])"""
# Each URL fetched by the page, as a click would ask the server for it: its HTTP status.
JS_STATUS = "Promise.all(%s.map(url => fetch(url).then(r => r.status, e => String(e))))"
JS_MISSING_IDS = "%s.filter(id => !document.getElementById(id))"
# The element is in the upper half of the window (where a click on a link to it scrolls it, smoothly).
JS_IN_VIEW = """(e => { const r = e.getBoundingClientRect(); return r.top >= 0 && r.top < innerHeight / 2; })(
  document.getElementById(%s))"""
JS_CLICK = """(raw => { const a = Array.from(document.querySelectorAll('.jp-Notebook .jp-MarkdownCell .myst a'))
  .find(a => a.getAttribute('href') === raw); a.scrollIntoView({block: 'center'}); a.click(); return true; })(%s)"""


def link_problems(browser: Chromium, origin: str, links: list[list[str]]) -> list[str]:
    """The links of a rendered chapter that lead nowhere in the lab, in words: a file the server does not serve
    (a 404), a target missing from the page, a link off the machine (but a cited work's address)."""
    files = [url for raw, url, _ in links if not raw.startswith("#") and url.startswith(origin + "/")]
    statuses = browser.evaluate(JS_STATUS % json.dumps(files), timeout=60) if files else []
    found = [f"{url.split('?')[0]} answers {status}" for url, status in zip(files, statuses, strict=True)
             if status != 200]  # fmt: skip
    ids = sorted({raw[1:] for raw, _, _ in links if raw.startswith("#")})
    missing = browser.evaluate(JS_MISSING_IDS % json.dumps(ids))
    found += [f"#{target}: no such target on the page" for target in missing]
    bib = (REPO / "book" / "references.bib").read_text(encoding="utf8")  # a work's own address may stand in its entry
    found += [f"{raw}: a link off the machine" for raw, url, _ in links
              if not raw.startswith("#") and not url.startswith(origin + "/") and raw not in bib]  # fmt: skip
    return found


def citation_text_problems(cells: list[dict], links: list[list[str]], rendered: list) -> list[str]:
    """Citations shown with other text than the notebook's author-year link, and any bib key in the rendered text."""
    source = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    written = {(m.group("key"), m.group("text")) for m in LINK.finditer(source)}
    shown = {(raw.removeprefix("#cite-"), text) for raw, _, text in links if raw.startswith("#cite-")}
    found = [f"{key} is shown as {text!r}" for key, text in sorted(shown - written)]
    found += [f"{key} ({text!r}) is not shown" for key, text in sorted(written - shown)]
    known = labels()
    found += [f"{key} shows {text!r}, no author-year text" for key, text in sorted(shown)
              if key in known and text not in (known[key], known[key].rsplit(", ", 1)[1])]  # fmt: skip
    text = " ".join(t or "" for t in rendered)
    found += [f"the bare key {key} is on the page" for key in sorted(known) if key in text]
    return found


def test_every_link_of_two_chapters_works_in_the_lab_and_citations_show_author_year(lab, browser, tmp_path):
    for name in LINK_CHAPTERS:
        cells = read_cells(name)
        # Ch. 7 as `make lab NB=...` opens it: the server's front page, which redirects to the chapter.
        page = "/" if f"notebooks/{name}.ipynb" == LAB_CHAPTER else f"/lab/tree/notebooks/{name}.ipynb"
        browser.open(f"{lab.url}{page}?token={lab.token}&reset", timeout=60)
        ready = f"(() => {{ const r = {JS_RENDERED}; return r.length === {len(cells)} && !r.includes(null); }})()"
        assert browser.wait_for(ready, timeout=60), f"{name} is not shown at {browser.evaluate('location.href')}"
        browser.pump(1.0)
        links = browser.evaluate(JS_LINKS)
        assert len(links) > 10, f"{name}: {len(links)} links"
        assert link_problems(browser, lab.url, links) == [], name
        assert citation_text_problems(cells, links, browser.evaluate(JS_RENDERED)) == [], name
        first = next(raw for raw, _, _ in links if raw.startswith("#cite-"))
        assert not browser.evaluate(JS_IN_VIEW % json.dumps(first[1:])), f"{name}: the works cited are in view already"
        browser.evaluate(JS_CLICK % json.dumps(first))
        shown = browser.wait_for(JS_IN_VIEW % json.dumps(first[1:]), timeout=10)
        browser.screenshot(tmp_path / f"lab-{name}-citation.png")
        assert shown, f"{name}: a click on {first} does not bring the work into view"
        # jupyterlab-myst writes a relative link as the server's /files/ URL; a click opens the file in the lab.
        pages = {raw: url.split("/files/", 1)[1].split("?")[0] for raw, url, _ in links if "/files/book/" in url}
        assert pages, f"{name} links to no page of book/"
        for raw, path in pages.items():
            browser.evaluate(JS_CLICK % json.dumps(raw))
            opened = f"location.pathname.endsWith('/lab/tree/{path}')"
            assert browser.wait_for(opened, timeout=30), f"{path} opened {browser.evaluate('location.href')}"
            if path == "book/bibliography.md":  # its list for the lab: a work this chapter does not cite is there too
                other = next(label for key, label in labels().items() if f"#cite-{key})" not in json.dumps(cells))
                listed = f"document.body.innerText.includes({json.dumps(other + '.')})"
                assert browser.wait_for(listed, timeout=30), f"{path} does not list {other} in the lab"
            browser.pump(2.0)
            browser.screenshot(tmp_path / f"lab-{name}-{Path(path).stem}.png")
        assert browser.failed == [], f"{name}: requests that failed"
        assert not browser.blocked, f"{name}: JupyterLab asked another host for {browser.blocked}"
    if os.environ.get("LAB_SHOTS"):
        for png in tmp_path.glob("lab-*.png"):
            shutil.copy(png, Path(os.environ["LAB_SHOTS"]) / png.name)


def test_the_citation_check_names_a_bare_key_and_a_citation_shown_otherwise():
    cells = [{"cell_type": "markdown", "source": "Adam ([Loshchilov and Hutter, 2019](#cite-loshchilov2019decoupled)).",
              "metadata": {}}]  # fmt: skip
    link = ["#cite-loshchilov2019decoupled", "http://lab/#cite-loshchilov2019decoupled", "Loshchilov and Hutter, 2019"]
    assert citation_text_problems(cells, [link], ["Adam (Loshchilov and Hutter, 2019)."]) == []
    assert citation_text_problems(cells, [], ["Adam loshchilov2019decoupled."]) == [
        "loshchilov2019decoupled ('Loshchilov and Hutter, 2019') is not shown",
        "the bare key loshchilov2019decoupled is on the page"]  # fmt: skip
    shown = [link[:2] + ["loshchilov2019decoupled"]]
    assert citation_text_problems(cells, shown, [""])[0] == f"{shown[0][2]} is shown as {shown[0][2]!r}"


def test_the_rendering_check_names_what_is_missing_or_raw():
    number = {"expression": "glued.x", "result": {"status": "ok", "data": {"text/plain": "42"}, "metadata": {}}}
    cells = [
        {"cell_type": "markdown", "source": "It is {eval}`glued.x`.", "metadata": {"user_expressions": [number]}},
        {"cell_type": "code", "source": "", "metadata": {}},
    ]
    assert rendering_problems(cells, ["It is 42.", ""]) == []
    assert rendering_problems(cells, ["It is glued.x.", ""]) == ["cell 0: glued.x is not shown"]
    assert rendering_problems(cells, ["It is 42 {footcite}`a`.", ""]) == ["cell 0: raw '{footcite'"]
    assert rendering_problems(cells, [None, ""]) == ["cell 0: not rendered"]
    closing = "## References\n\n```{footbibliography}\n```\n\nAll on the {doc}`../book/bibliography` page."
    cells[0]["source"] = "It is {eval}`glued.x`. " + closing
    shown = "It is 42. References footbibliography - Unknown Directive All on the ../book/bibliography page."
    assert rendering_problems(cells, [shown, ""]) == [
        "cell 0: 'Unknown Directive' box", "cell 0: raw {doc} target '../book/bibliography'"]  # fmt: skip
    converted = "## References\n\n% footbibliography\n\nAll on the [References](../book/bibliography.md) page."
    cells[0]["source"] = "It is {eval}`glued.x`. " + converted
    assert rendering_problems(cells, ["It is 42. References All on the References page.", ""]) == []


class Kernel:
    """A kernel of the lab, reached as the front end reaches it: the session API, then its websocket."""

    def __init__(self, lab: Lab, notebook: str):
        import websocket  # websocket-client

        self.lab = lab
        body = {"path": notebook, "type": "notebook", "name": Path(notebook).name, "kernel": {"name": "python3"}}
        self.session = lab.api("POST", "/api/sessions", body)
        self.client_id = uuid.uuid4().hex
        ws_url = lab.url.replace("http", "ws", 1)
        self.ws = websocket.create_connection(
            f"{ws_url}/api/kernels/{self.session['kernel']['id']}/channels?session_id={self.client_id}",
            header=[f"Authorization: token {lab.token}"], timeout=300, suppress_origin=True)  # fmt: skip

    def execute(self, code: str, user_expressions: dict | None = None) -> tuple[dict, list[dict]]:
        """Run ``code``; the execute_reply's content and the iopub messages (errors, stderr) it caused."""
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": self.client_id,
                       "username": "test", "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "allow_stdin": False,
                        "user_expressions": user_expressions or {}, "stop_on_error": True}}))  # fmt: skip
        reply, messages = None, []
        while reply is None or not any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                                       for m in messages):  # fmt: skip
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["channel"] == "shell":
                reply = msg["content"]
            else:
                messages.append({"msg_type": msg["msg_type"], "content": msg["content"]})
        return reply, messages

    def close(self):
        self.ws.close()
        self.lab.api("DELETE", f"/api/sessions/{self.session['id']}")


def timing_names(cells: list[dict]) -> set[str]:
    """Values glued by cells whose output nbval ignores (timings): a live kernel measures them anew."""
    ignored = [c for c in cells if "nbval-ignore-output" in c["metadata"].get("tags", [])]
    return {out["metadata"]["scrapbook"]["name"] for c in ignored for out in c.get("outputs", [])
            if "scrapbook" in out.get("metadata", {})}  # fmt: skip


def test_a_chapter_runs_through_the_server_and_its_kernel_recomputes_the_numbers(lab):
    cells = read_cells(RUN_CHAPTER)
    timings = timing_names(cells)
    assert timings, "the check below compares every number but the timings: name them"
    kernel = Kernel(lab, f"notebooks/{RUN_CHAPTER}.ipynb")
    try:
        for i, cell in enumerate(cells):
            source = "".join(cell["source"])
            if cell["cell_type"] == "code":
                reply, messages = kernel.execute(source)
                errors = [m["content"] for m in messages if m["msg_type"] == "error"]
                stderr = [m["content"]["text"] for m in messages
                          if m["msg_type"] == "stream" and m["content"]["name"] == "stderr"]  # fmt: skip
                assert reply["status"] == "ok" and not errors and not stderr, f"cell {i}: {reply} {errors} {stderr}"
            elif expressions := eval_expressions(source):
                # What jupyterlab-myst sends when the reader runs a markdown cell.
                reply, _ = kernel.execute("", {str(k): e for k, e in enumerate(expressions)})
                stored = {e["expression"]: shown_text(e["result"]) for e in cell["metadata"]["user_expressions"]}
                live = {e: shown_text(reply["user_expressions"][str(k)]) for k, e in enumerate(expressions)}
                same = [e for e in expressions if not any(f"glued.{name}" in e for name in timings)]
                assert {e: live[e] for e in same} == {e: stored[e] for e in same}, f"cell {i}"
    finally:
        kernel.close()
