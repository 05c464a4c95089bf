"""The built book in a real browser, with no network: headless Chromium over the DevTools protocol.

The site is served from 127.0.0.1; every request to any other host is failed and recorded.
For every page of _toc.yml (and the search page) the test checks: no console error or uncaught
exception, no request to another host, no local request that failed (404, ...), MathJax typeset
every formula, every image loaded, every embedded ipywidget rendered, every figure opaque (so that
it reads on the dark theme), nothing wider than the window. It saves screenshots of the first
screen of each page, light and dark, to _build/screenshots/<page>.png and <page>-dark.png.

A second, generated notebook with ipywidgets state checks that the vendored html-manager renders
the standard controls with nothing fetched from a CDN.

Needs /usr/bin/chromium (Debian's `chromium`); skipped with a reason when it is absent, a failure under CI=true
(tests/_skips.py).
"""

from __future__ import annotations

import base64
import functools
import http.server
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from _skips import require
from conftest import toc_pages

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SCREENSHOTS = REPO / "_build" / "screenshots"
VIEWPORT = (1280, 900)
PAGE_TIMEOUT_S = 20.0  # load + MathJax + widgets, per page


# Pages to test: every file of _toc.yml, plus the search page (its JS loads the search index).
PAGES = toc_pages() + ["search.html?q=scale"]


def screenshot_name(page: str) -> str:
    return page.split("?")[0].removesuffix(".html").replace("/", "-")


# --------------------------------------------------------------------------------------------
# A static web server on 127.0.0.1 and a minimal DevTools protocol client.
# --------------------------------------------------------------------------------------------
class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


class StaticServer:
    """Serve a folder on 127.0.0.1 at an ephemeral port from a daemon thread."""

    def __init__(self, folder: Path):
        handler = functools.partial(_QuietHandler, directory=str(folder))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class CDPError(RuntimeError):
    pass


class Chromium:
    """Headless Chromium with one tab, driven through the DevTools protocol (websocket-client).

    Every request of the page goes through ``Fetch``: requests to ``allowed_origin`` continue,
    all others are failed (and Chromium cannot resolve any host name but 127.0.0.1 anyway).
    """

    def __init__(self, workdir: Path, hide_scrollbars: bool = True):
        """``hide_scrollbars=False`` draws scroll bars (with their width in the layout), for checks that they show."""
        import websocket  # websocket-client

        self.workdir = workdir
        profile = workdir / "profile"
        profile.mkdir()
        self.log_path = workdir / "chromium.log"
        args = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-extensions",
            "--disable-default-apps", "--disable-dev-shm-usage", "--mute-audio",
            *(["--hide-scrollbars"] if hide_scrollbars else []), "--force-device-scale-factor=1",
            f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
            # Belt and braces: no host name resolves, so nothing can leave the machine.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank",
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and len(port_file.read_text().split()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise CDPError("Chromium did not start:\n" + self.log_path.read_text(errors="replace"))
            time.sleep(0.05)
        port, path = port_file.read_text().split()[:2]
        self.ws = websocket.create_connection(f"ws://127.0.0.1:{port}{path}", timeout=30,
                                              suppress_origin=True)
        self._ids = itertools.count(1)
        self._events: list[dict] = []
        self.allowed_origin = ""
        self.reset_records()
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Fetch.enable", {"patterns": [{"urlPattern": "*", "requestStage": "Request"}]})
        self.call("Network.setCacheDisabled", {"cacheDisabled": True})
        self.call("Emulation.setDeviceMetricsOverride", {
            "width": VIEWPORT[0], "height": VIEWPORT[1], "deviceScaleFactor": 1, "mobile": False})

    # -- protocol plumbing --------------------------------------------------------------------
    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        msg_id = next(self._ids)
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply is not None and reply.get("id") == msg_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def call(self, method: str, params: dict | None = None, timeout: float = 30.0) -> dict:
        """A command to the page's session."""
        return self.send(method, params, self.session, timeout)

    def _receive(self, deadline: float) -> dict | None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no answer from Chromium")
        self.ws.settimeout(min(remaining, 0.5))
        try:
            msg = json.loads(self.ws.recv())
        except Exception as exc:  # websocket timeout: let the caller check its deadline
            if type(exc).__name__ in ("WebSocketTimeoutException", "TimeoutError"):
                return None
            raise
        if "method" in msg:
            self._on_event(msg)
        return msg

    def _fire(self, method: str, params: dict):
        """Send a command without waiting for its answer (from inside an event handler)."""
        self.ws.send(json.dumps({"id": next(self._ids), "method": method, "params": params,
                                 "sessionId": self.session}))

    def _on_event(self, msg: dict):
        method, params = msg["method"], msg.get("params", {})
        if method == "Fetch.requestPaused":
            url = params["request"]["url"]
            if self._is_local(url):
                self._fire("Fetch.continueRequest", {"requestId": params["requestId"]})
            else:
                self.blocked.append(url)
                self._fire("Fetch.failRequest",
                           {"requestId": params["requestId"], "errorReason": "BlockedByClient"})
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"uncaught exception: {text} ({details.get('url', '')}:"
                               f"{details.get('lineNumber', '?')})")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            if not (entry["source"] == "network" and self._is_favicon_probe(entry.get("url", ""))):
                self.errors.append(f"log ({entry['source']}): {entry['text']} {entry.get('url', '')}")
        elif method == "Network.requestWillBeSent":
            self.urls[params["requestId"]] = params["request"]["url"]
            self.inflight.add(params["requestId"])
            self.last_activity = time.monotonic()
        elif method in ("Network.loadingFinished", "Network.loadingFailed"):
            self.inflight.discard(params["requestId"])
            self.last_activity = time.monotonic()
            url = self.urls.get(params["requestId"], "?")
            if (method == "Network.loadingFailed" and not params.get("canceled")
                    and url not in self.blocked):
                self.failed.append(f"{url}: {params.get('errorText')}")
        elif method == "Network.responseReceived":
            self.urls[params["requestId"]] = params["response"]["url"]
            if params["response"]["status"] >= 400 and not self._is_favicon_probe(
                    params["response"]["url"]):
                self.failed.append(f"{params['response']['url']}: HTTP {params['response']['status']}")
        elif method == "Page.loadEventFired":
            self.loaded = True

    @staticmethod
    def _is_favicon_probe(text: str) -> bool:
        # Chromium asks for /favicon.ico by itself when a page declares no icon; the book
        # declares none (html.favicon in _config.yml is empty), so that 404 is not a page error.
        return "/favicon.ico" in text

    def _is_local(self, url: str) -> bool:
        parts = urlsplit(url)
        if parts.scheme in ("data", "blob", "about"):
            return True
        return f"{parts.scheme}://{parts.netloc}" == self.allowed_origin

    def pump(self, seconds: float):
        """Handle events for ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self._receive(deadline)
            except TimeoutError:
                return

    # -- page helpers -------------------------------------------------------------------------
    def reset_records(self):
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.failed: list[str] = []
        self.inflight: set[str] = set()
        self.urls: dict[str, str] = {}
        self.loaded = False
        self.last_activity = time.monotonic()

    def open(self, url: str, timeout: float = PAGE_TIMEOUT_S):
        """Navigate the tab to ``url`` and wait for its load event.

        The tab first goes to about:blank under the previous page's origin, so that requests the previous page
        still had in flight (the search page fetches result pages after it listed them) end there and are not
        counted against ``url``.
        """
        self._navigate("about:blank", min(timeout, 5.0))
        self.pump(0.2)
        self.reset_records()
        parts = urlsplit(url)
        self.allowed_origin = f"{parts.scheme}://{parts.netloc}"
        if not self._navigate(url, timeout):
            raise TimeoutError(f"{url} did not finish loading in {timeout} s")

    def _navigate(self, url: str, timeout: float) -> bool:
        """Send the tab to ``url``; handle events until its load event or ``timeout``; whether it loaded."""
        self.loaded = False
        self.call("Page.navigate", {"url": url})
        deadline = time.monotonic() + timeout
        while not self.loaded and time.monotonic() < deadline:
            self._receive(deadline)
        return self.loaded

    def evaluate(self, expression: str, timeout: float = 30.0):
        """Evaluate JavaScript in the page (awaiting a promise) and return its JSON value."""
        result = self.call("Runtime.evaluate", {
            "expression": expression, "awaitPromise": True, "returnByValue": True,
            "timeout": int(timeout * 1000)}, timeout=timeout + 5)
        if "exceptionDetails" in result:
            raise CDPError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float) -> bool:
        """Poll ``expression`` (handling events meanwhile) until it is truthy or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.evaluate(expression):
                return True
            self.pump(0.1)
        return False

    def wait_network_idle(self, quiet: float = 0.3, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.05)
            if not self.inflight and time.monotonic() - self.last_activity >= quiet:
                return

    def screenshot(self, path: Path):
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self):
        try:
            if getattr(self, "ws", None):
                try:
                    self.send("Browser.close", timeout=5)
                except Exception:
                    pass
                self.ws.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self._log.close()


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------
def require_chromium() -> None:
    """Skip without Chromium; under CI=true fail instead (see tests/_skips.py). Also used by test_lab.py and
    test_live_calculators.py."""
    require(Path(CHROMIUM).is_file(), f"Chromium ({CHROMIUM})", "apt-get install chromium fonts-dejavu-core")


@pytest.fixture(scope="session")
def chromium(tmp_path_factory):
    """One headless Chromium for the session; skipped if it is not installed (a failure under CI=true)."""
    require_chromium()
    browser = Chromium(tmp_path_factory.mktemp("chromium"))
    yield browser
    browser.close()


@pytest.fixture(scope="session")
def site(book_html):
    """Base URL of the built book, served from 127.0.0.1."""
    server = StaticServer(book_html)
    yield server.origin
    server.stop()


# --------------------------------------------------------------------------------------------
# What a page must look like once loaded
# --------------------------------------------------------------------------------------------
JS_MATH_DONE = """(() => {
  const math = document.querySelectorAll('.math');
  if (math.length === 0) return true;
  if (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) return false;
  return Array.from(math).every(el => el.querySelector('mjx-container'));
})()"""

JS_WIDGETS_DONE = """(() => {
  const views = document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]');
  return Array.from(views).every(v => {
    const area = v.previousElementSibling;
    return area && area.classList.contains('widget-subarea') && area.children.length > 0;
  });
})()"""

JS_REPORT = """(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  await document.fonts.ready;
  for (const img of document.images) img.loading = 'eager';  // lazy ones load off screen too
  await Promise.all(Array.from(document.images).map(img => img.complete ? null :
      Promise.race([new Promise(done => { img.addEventListener('load', done);
                                          img.addEventListener('error', done); }),
                    new Promise(done => setTimeout(done, 10000))])));
  const views = document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]');
  return {
    math: document.querySelectorAll('.math').length,
    mjx: document.querySelectorAll('mjx-container').length,
    untypeset: Array.from(document.querySelectorAll('.math'))
        .filter(el => !el.querySelector('mjx-container')).map(el => el.textContent.slice(0, 80)),
    merrors: Array.from(document.querySelectorAll('mjx-merror'))
        .map(el => el.getAttribute('data-mjx-error') || el.textContent),
    images: Array.from(document.images).map(img => ({src: img.currentSrc || img.src,
                                                      width: img.naturalWidth})),
    widget_views: views.length,
    widget_errors: Array.from(document.querySelectorAll('.jupyter-widgets-error-widget'))
        .map(el => el.textContent.slice(0, 200)),
    fonts_failed: Array.from(document.fonts).filter(f => f.status === 'error')
        .map(f => f.family),
    // Figures (images in cell outputs) must be opaque: a transparent one puts black text on the
    // dark theme's background. The images are same-origin, so a canvas can read their pixels.
    transparent_figures: Array.from(document.querySelectorAll('.cell_output img'))
        .filter(img => img.naturalWidth > 0).filter(img => {
          const c = document.createElement('canvas');
          c.width = img.naturalWidth; c.height = img.naturalHeight;
          const ctx = c.getContext('2d');
          ctx.drawImage(img, 0, 0);
          const corners = [[0, 0], [c.width - 1, 0], [0, c.height - 1], [c.width - 1, c.height - 1]];
          // Pages opened from file:// taint the canvas (no pixels to read): checked when served over HTTP.
          try { return corners.some(([x, y]) => ctx.getImageData(x, y, 1, 1).data[3] < 255); }
          catch (error) { if (error.name === 'SecurityError') return false; throw error; }
        }).map(img => img.currentSrc || img.src),
    // Nothing may make the whole page scroll sideways (a wide table or figure must scroll in its box).
    page_width: document.documentElement.scrollWidth,
    viewport_width: document.documentElement.clientWidth,
    title: document.title,
  };
})()"""


def check_page(browser: Chromium, url: str, screenshot: Path, dark_screenshot: Path | None = None) -> dict:
    """Load ``url``, wait until it settled, take the screenshot(s), return what went wrong.

    ``dark_screenshot``: also switch the page to the theme's dark mode and take a second one.
    """
    started = time.monotonic()
    browser.open(url)
    math_ok = browser.wait_for(JS_MATH_DONE, PAGE_TIMEOUT_S)
    widgets_ok = browser.wait_for(JS_WIDGETS_DONE, PAGE_TIMEOUT_S)
    report = browser.evaluate(JS_REPORT)
    browser.wait_network_idle()
    browser.screenshot(screenshot)
    if dark_screenshot is not None:
        browser.evaluate("document.documentElement.dataset.theme = 'dark'; true")
        browser.pump(0.3)
        browser.screenshot(dark_screenshot)
        browser.evaluate("document.documentElement.dataset.theme = 'light'; true")
    report.update(
        math_ok=math_ok, widgets_ok=widgets_ok, seconds=round(time.monotonic() - started, 2),
        blocked=list(browser.blocked), errors=list(browser.errors), failed=list(browser.failed))
    return report


def assert_page_ok(page: str, r: dict):
    problems = []
    if r["blocked"]:
        problems.append("requests to another host (blocked):\n    " + "\n    ".join(r["blocked"]))
    if r["failed"]:
        problems.append("failed local requests:\n    " + "\n    ".join(r["failed"]))
    if r["errors"]:
        problems.append("console errors / uncaught exceptions:\n    " + "\n    ".join(r["errors"]))
    if not r["math_ok"] or r["untypeset"]:
        problems.append(f"MathJax did not typeset {len(r['untypeset'])} of {r['math']} formulas "
                        f"within {PAGE_TIMEOUT_S} s: {r['untypeset'][:5]}")
    if r["math"] and not r["mjx"]:
        problems.append("no mjx-container on a page with math")
    if r["merrors"]:
        problems.append(f"MathJax errors (mjx-merror): {r['merrors']}")
    broken = [img["src"] for img in r["images"] if not img["width"]]
    if broken:
        problems.append("images that did not load (naturalWidth == 0):\n    " + "\n    ".join(broken))
    if not r["widgets_ok"] or r["widget_errors"]:
        problems.append(f"ipywidgets not rendered ({r['widget_views']} views): {r['widget_errors']}")
    if r["fonts_failed"]:
        problems.append(f"web fonts that failed to load: {r['fonts_failed']}")
    if r["transparent_figures"]:
        problems.append("figures with a transparent background (unreadable in the dark theme):\n    "
                        + "\n    ".join(r["transparent_figures"]))  # fmt: skip
    if r["page_width"] > r["viewport_width"]:
        problems.append(f"the page scrolls sideways: {r['page_width']} px wide in a "
                        f"{r['viewport_width']} px window")  # fmt: skip
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES)
def test_page_works_offline(page, book_html, site, chromium):
    assert (book_html / page.split("?")[0]).is_file(), f"{page} was not built"
    shot = SCREENSHOTS / f"{screenshot_name(page)}.png"
    report = check_page(chromium, f"{site}/{page}", shot, shot.with_name(f"{shot.stem}-dark.png"))
    print(f"\n[browser] {page}: {report['seconds']} s, {report['mjx']} formulas, "
          f"{len(report['images'])} images, {report['widget_views']} widgets -> {shot}")
    assert_page_ok(page, report)
    if page.split("?")[0] == "search.html":
        found = chromium.wait_for("document.querySelectorAll('#search-results li').length > 0",
                                  timeout=PAGE_TIMEOUT_S)
        assert found, "the search page found nothing for 'scale' (search index not loaded?)"


@pytest.mark.parametrize("page", toc_pages())
def test_page_works_from_disk(page, book_html, chromium, tmp_path):
    """The same checks with the page opened as a file:// URL, as `make book` suggests.

    (The search page from disk, its ranking and excerpts, is tests/test_site.py's.)
    """
    report = check_page(chromium, (book_html / page).as_uri(), tmp_path / "page.png")
    assert_page_ok(f"{page} (file://)", report)


def test_harness_blocks_and_reports_other_hosts(tmp_path, chromium):
    """The checks above can fail: a page loading from other hosts is caught, nothing leaves."""
    (tmp_path / "index.html").write_text("""<!doctype html><html><head>
        <script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>
        <link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">
        </head><body><img src="http://example.org/figure.png"><img src="missing.png">
        <script>throw new Error("boom")</script></body></html>""", encoding="utf8")
    server = StaticServer(tmp_path)
    try:
        report = check_page(chromium, f"{server.origin}/index.html", tmp_path / "shot.png")
    finally:
        server.stop()
    assert sorted(report["blocked"]) == sorted([
        "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js",
        "https://fonts.googleapis.com/css?family=Roboto", "http://example.org/figure.png"])
    assert any("missing.png: HTTP 404" in f for f in report["failed"]), report["failed"]
    assert any("boom" in e for e in report["errors"]), report["errors"]
    with pytest.raises(AssertionError, match="another host"):
        assert_page_ok("index.html", report)


def _widget_notebook(path: Path):
    """A notebook whose outputs are standard ipywidgets 8 views, with the widget state saved."""
    import ipywidgets as w
    import nbformat
    from ipywidgets.embed import embed_data

    slider = w.IntSlider(value=3, min=0, max=10, description="GPUs")
    text = w.IntText(description="copy")
    w.jslink((slider, "value"), (text, "value"))  # a link that runs in the page, not in a kernel
    box = w.VBox([
        slider, text,
        w.Dropdown(options=["data", "tensor", "pipeline"], value="tensor", description="parallel"),
        w.Button(description="Run", icon="check", button_style="success"),
        w.FloatProgress(value=0.6, max=1.0, description="loss"),
        w.Checkbox(value=True, description="bf16"),
        w.HTML("<b>offline</b> widget"),
        w.HTMLMath(r"typeset by MathJax 3: \(C \approx 6ND\)"),
    ])
    data = embed_data(views=[box])
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": data["manager_state"]}
    cell = nbformat.v4.new_code_cell("box")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": data["view_specs"][0],
        "text/plain": "VBox(...)"})]
    nb.cells = [nbformat.v4.new_markdown_cell("# Widgets\n\nInline math $6ND$."), cell]
    nbformat.write(nb, path)


@pytest.fixture(scope="session")
def widget_site(tmp_path_factory, build_book):
    """A one-page book (this repo's _config.yml) holding an ipywidgets notebook, served locally."""
    src = tmp_path_factory.mktemp("widget-book")
    _widget_notebook(src / "widgets.ipynb")
    (src / "_toc.yml").write_text("format: jb-book\nroot: widgets\n", encoding="utf8")
    shutil.copy(REPO / "_config.yml", src / "_config.yml")
    shutil.copytree(REPO / "book" / "_ext", src / "book" / "_ext")  # the config's local extensions
    html = build_book(src, tmp_path_factory.mktemp("widget-build"), {
        "bibtex_bibfiles": [str(REPO / "book" / "references.bib")],
        "sphinx_config": {"html_static_path": [str(REPO / "book" / d) for d in ("_vendor/static", "_static")]},
    })
    server = StaticServer(html)
    yield server.origin
    server.stop()


def test_ipywidgets_render_offline(widget_site, chromium):
    page = "widgets.html"
    shot = SCREENSHOTS / "widgets-offline.png"
    report = check_page(chromium, f"{widget_site}/{page}", shot)
    print(f"\n[browser] {page}: {report['seconds']} s -> {shot}")
    assert report["widget_views"] == 1, "myst-nb did not embed the widget view"
    assert_page_ok(page, report)
    counts = chromium.evaluate("""({
        slider: document.querySelectorAll('.widget-slider').length,
        dropdown: document.querySelectorAll('.widget-dropdown select').length,
        button: document.querySelectorAll('button.jupyter-button').length,
        progress: document.querySelectorAll('.widget-hprogress').length,
        checkbox: document.querySelectorAll('.widget-checkbox input').length,
        htmlmath: document.querySelectorAll('.widget-htmlmath').length,
    })""")
    assert all(counts.values()), f"some standard controls did not render: {counts}"
    # HTMLMath goes through ipywidgets' MathJax 2 call, bridged to MathJax 3 (html-manager-offline.js).
    typeset = chromium.wait_for(
        "document.querySelector('.widget-htmlmath mjx-container') !== null", timeout=PAGE_TIMEOUT_S)
    assert typeset, "the HTMLMath widget's formula was not typeset by MathJax"
    # The jslink runs in the page (no kernel): a key press on the slider updates the text box.
    chromium.evaluate("document.querySelector('.widget-slider .noUi-handle').focus()")
    for kind in ("keyDown", "keyUp"):
        chromium.call("Input.dispatchKeyEvent", {"type": kind, "key": "ArrowRight",
                                                 "code": "ArrowRight", "windowsVirtualKeyCode": 39})
    linked = chromium.wait_for(
        "document.querySelector('.widget-text input').value === '4'", timeout=5)
    value = chromium.evaluate("document.querySelector('.widget-text input').value")
    assert linked, f"moving the slider 3 -> 4 left the jslinked IntText at {value!r}"
    assert not chromium.errors, f"errors after interacting: {chromium.errors}"


def test_harness_catches_transparent_figures_and_sideways_scrolling(tmp_path, chromium):
    """A figure saved with a transparent background, and a table wider than the window, are reported."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [0, 1])
    fig.savefig(tmp_path / "clear.png", transparent=True)
    fig.savefig(tmp_path / "opaque.png", facecolor="white")
    plt.close(fig)
    (tmp_path / "index.html").write_text("""<!doctype html><html><body>
        <div class="cell_output"><img src="clear.png"><img src="opaque.png"></div>
        <table style="width: 3000px"><tr><td>wide</td></tr></table></body></html>""", encoding="utf8")
    server = StaticServer(tmp_path)
    try:
        report = check_page(chromium, f"{server.origin}/index.html", tmp_path / "shot.png")
    finally:
        server.stop()
    assert [Path(urlsplit(src).path).name for src in report["transparent_figures"]] == ["clear.png"]
    with pytest.raises(AssertionError, match="transparent background") as caught:
        assert_page_ok("index.html", report)
    assert "scrolls sideways" in str(caught.value)
