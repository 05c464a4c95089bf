"""The live calculators of the built book compute what the package computes, in the reader's browser, offline.

The calculators (Chapter 7 memory, Chapter 8 training time, Chapter 14 layout planner) run
``scalebook.widgets`` on Pyodide (book/_ext/live_calculators.py). Here: the modules they ship import
with nothing but the standard library (no torch); a form's text gives what the keyword values give;
the build-time form labels every input and shows the Python result for its defaults; and, in headless
Chromium with the network cut off, each chapter page opened from file:// (and Chapter 7's from a local web
server as well) answers changed inputs with the numbers ``accounting`` gives in Python, and an impossible input with the
message Python raises, in the form's words (labels, units, the number typed). Pyodide loads only on demand:
nothing under _static/live/ is requested before the reader touches a calculator. Keyboard focus stays in the
form when it goes live; with JavaScript off the form is read-only and a note says why.
"""

from __future__ import annotations

import functools
import html
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from scalebook import accounting, configs, planner, widgets

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "book" / "_ext"))
import live_calculators  # noqa: E402 - book/_ext is not a package

GB = 1e9

# Run in a fresh interpreter: refuse every import that is not the standard library or scalebook, as
# in Pyodide where nothing else is installed; then import what the calculators import and run each.
STDLIB_ONLY = """
import sys

class RefuseNonStdlib:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top != "scalebook" and top not in sys.stdlib_module_names:
            raise ImportError(f"{name} is not in the standard library")

sys.meta_path.insert(0, RefuseNonStdlib())
import scalebook.accounting, scalebook.configs, scalebook.planner, scalebook.system, scalebook.widgets
from scalebook import widgets
for name in ("memory", "training-time"):
    calculator = widgets.CALCULATORS[name]()
    assert "GB" in calculator.html(**calculator.defaults) or "days" in calculator.html(**calculator.defaults)
assert "<table>" in widgets.plan_table_html("llama-3-8b", "h100-sxm", 1, 8192, 2**22)  # the planner's default takes s
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "numpy", "ipywidgets")))
"""


def run_stdlib_only(*sys_path: str) -> str:
    """Run STDLIB_ONLY with ``sys_path`` first on the path and no site-packages; return its stdout."""
    code = f"import sys; sys.path[:0] = {list(sys_path)!r}\n" + STDLIB_ONLY
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_calculator_modules_import_without_torch():
    assert run_stdlib_only(str(REPO / "code")) == "[]"


def test_the_shipped_zip_runs_the_calculators_on_the_standard_library_alone(tmp_path):
    archive = tmp_path / "scalebook.zip"
    archive.write_bytes(live_calculators.pure_python_zip())
    with zipfile.ZipFile(archive) as zipped:
        names = zipped.namelist()
    assert "scalebook/widgets.py" in names and "scalebook/accounting/memory.py" in names
    assert not any("torch" in name or name.startswith("scalebook/parallel") for name in names)
    assert run_stdlib_only(str(archive)) == "[]"  # the zip alone, imported as Pyodide will


# The planner's default search (405B on 16,384 GPUs) takes seconds; one node of a small model, a fraction of one.
SMALL = {"layout-planner": {"model": "llama-3-8b", "nodes": 1}}


@pytest.mark.parametrize("name", widgets.CALCULATORS)
def test_form_text_gives_the_same_html_as_the_values(name):
    calculator = widgets.CALCULATORS[name]()
    values = calculator.defaults | SMALL.get(name, {})
    form = {key: str(value).lower() if isinstance(value, bool) else str(value) for key, value in values.items()}
    assert widgets.calculator_html(name, form) == calculator.html(**values)


# What a reader can type, and what the calculator says: the field as labelled, the value as typed, in its unit.
BAD_FORM_TEXT = [
    ("memory", "tp", "3", "tp must be one of 1, 2, 4, 8, 16, 32, 64, 128, got 3"),
    ("memory", "pp", "1024", "pp (1024) must be at most the number of layers (96) of gpt3-175b"),
    ("training-time", "gpus", "10.5", "GPUs must be a whole number, got 10.5"),
    ("training-time", "gpus", "0", "GPUs must be at least 1, got 0"),
    ("training-time", "mfu_percent", "150", "MFU (%) must be at most 100, got 150 %"),
    ("training-time", "mfu_percent", "0", "MFU (%) must be more than 0, got 0 %"),
    ("training-time", "mfu_percent", "lots", "MFU (%) must be a number, got lots"),
    ("training-time", "mfu_percent", "", "MFU (%) needs a number: the field is empty or holds something that is not"),
    ("training-time", "tokens_billions", "-5", "tokens (billions) must be more than 0, got -5 billion"),
    ("training-time", "tokens_billions", "inf", "tokens (billions) must be a finite number, got inf"),
    ("training-time", "deadline_days", "-0.5", "deadline (days) must be more than 0, got -0.5 days"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "field", "text", "message"), BAD_FORM_TEXT)
def test_bad_form_text_shows_which_input_to_change(name, field, text, message):
    calculator = widgets.CALCULATORS[name]()
    form = {key: str(value) for key, value in calculator.defaults.items()} | {field: text}
    shown = widgets.calculator_html(name, form)
    assert shown.startswith(f"<b>{calculator.error_title}:</b> ") and html.escape(message) in shown


@pytest.mark.parametrize("name", ["memory", "training-time"])
def test_no_form_input_reaches_the_package_error_in_package_words(name):
    # Every number out of range and every choice of every input, one at a time from the defaults: an error names
    # a label of the form, never the package's argument names or its units (a fraction for a percentage, tokens
    # for billions of tokens).
    calculator = widgets.CALCULATORS[name]()
    labels = [control.label for control in calculator.controls.values()]
    package_words = ("n_devices", "mfu ", "tokens must", "days must", "peak_flops", "seq_len must", "fraction")
    for field, control in calculator.controls.items():
        texts = [str(option) for option in control.options] or ["0", "-5", "150", "1e30", "0.5", "", "x"]
        for text in texts:
            form = {key: str(value) for key, value in calculator.defaults.items()} | {field: text}
            shown = widgets.calculator_html(name, form)
            if shown.startswith(f"<b>{calculator.error_title}:</b>"):
                message = html.unescape(shown.split("</b> ", 1)[1])
                assert any(message.startswith(label) for label in labels), (field, text, message)
                assert not any(word in message for word in package_words), (field, text, message)


def test_a_run_shorter_than_a_day_reads_in_hours_and_one_gpu_is_singular():
    # GPT-2 on 10B tokens: 8.5e18 FLOPs, 2.4 hours on 8 A100s at 40 % (not "0.0 days"), and 1 GPU meets 30 days.
    text = widgets.training_time_html("gpt2", "a100-sxm4-80gb", "bf16", 1024, 10, 8, 40, 30)
    days = accounting.training_days(configs.get_model("gpt2"), 10e9, 8, 312e12, 0.4, seq_len=1024)
    assert days < 1 and f"<b>{days * 24:.1f} hours</b>" in text and "<b>1 GPU</b>." in text


def test_the_training_time_panel_recomputes_when_a_control_changes():
    grid, result = widgets.training_time_calculator().children
    controls = {control.description: control for control in grid.children}
    controls["GPUs"].value = 2048
    values = widgets.training_time_inputs().defaults | {"gpus": 2048}
    assert result.value == widgets.training_time_html(**values)
    days = accounting.training_days(configs.get_model("gpt3-175b"), 300e9, 2048, 312e12, 0.4, seq_len=2048)
    assert f"{days:,.1f} days" in result.value
    controls["MFU (%)"].value = 120.0  # the panel shows the error in the form's words, it does not raise
    assert result.value == "<b>Cannot estimate:</b> MFU (%) must be at most 100, got 120 %"


def test_unknown_calculator_is_a_value_error():
    with pytest.raises(ValueError, match="unknown calculator 'memroy'"):
        widgets.calculator_html("memroy", {})


def test_a_form_without_an_input_names_what_it_lacks():
    assert "the form has no input named model, gpu, precision" in widgets.calculator_html("memory", {"dp": "2"})


@pytest.mark.parametrize("name", widgets.CALCULATORS)
def test_the_built_form_labels_every_input_and_shows_the_default_result(name, monkeypatch):
    # The build renders the defaults; for the planner a stand-in here (the browser test checks the real one).
    monkeypatch.setattr(widgets, "plan_table_html", lambda **inputs: f"<p>plan for {inputs['model']}</p>")
    form = live_calculators.calculator_form(name)
    calculator = widgets.CALCULATORS[name]()
    for field in calculator.controls:
        field_id = f"live-calculator-{name}-{field}"
        assert f'<label for="{field_id}">' in form and f'id="{field_id}" name="{field}"' in form
    assert form.endswith(
        f'<div class="live-result" aria-live="polite">{calculator.html(**calculator.defaults)}</div></form>'
    )


# ------------------------------------------------------------------------------------------- in the browser

PAGES = {
    "memory": "notebooks/07_where_the_memory_goes.html",
    "training-time": "notebooks/08_compute_time_and_gpus.html",
    "layout-planner": "notebooks/14_beyond_three_dimensions.html",
}
LOAD_TIMEOUT_S = 120  # Pyodide's first start from file:// took 7 s on the loaded 2-core machine
FCP = "performance.getEntriesByName('first-contentful-paint')[0]?.startTime ?? null"


def memory_case(**inputs):
    """The memory calculator's inputs and the texts ``accounting`` says it must show."""
    values = widgets.memory_calculator_inputs().defaults | inputs
    cfg, device = configs.get_model(values["model"]), configs.get_hardware(values["gpu"])
    states = accounting.model_state_bytes(
        cfg, zero_stage=values["zero_stage"], dp=values["dp"], tp=values["tp"], pp=values["pp"],
        precision=values["precision"], optimizer="adam",
    )  # fmt: skip
    attention = values["attention"]
    if attention == "auto":  # what the model trained with: GPT-3 and Megatron's GPTs explicit, the others fused
        attention = "explicit" if cfg.arch == "gpt" else "fused"
    activations = accounting.activation_bytes(
        cfg, seq_len=values["seq_len"], micro_batch=values["micro_batch"], tp=values["tp"], sp=values["sp"],
        recompute=values["recompute"], attention=attention,
        dtype_bytes=4 if values["precision"] == "fp32" else 2, dropout=cfg.arch == "gpt",
    )  # fmt: skip
    rows = {"parameters": states.params, "gradients": states.grads, "optimizer states": states.optimizer,
            "activations": activations}  # fmt: skip
    total = sum(rows.values())
    texts = [f"{what}\t{nbytes / GB:,.1f} GB" for what, nbytes in rows.items()]
    verdict = "fits" if total <= device.hbm_bytes else "does not fit"
    return inputs, [*texts, f"total\t{total / GB:,.1f} GB", verdict]


def training_time_case(**inputs):
    values = widgets.training_time_inputs().defaults | inputs
    cfg = configs.get_model(values["model"])
    peak = configs.get_hardware(values["gpu"]).peak(values["dtype"])
    tokens, mfu = values["tokens_billions"] * 1e9, values["mfu_percent"] / 100
    days = accounting.training_days(cfg, tokens, values["gpus"], peak, mfu, seq_len=values["seq_len"])
    gpus = accounting.devices_needed(cfg, tokens, values["deadline_days"], peak, mfu, seq_len=values["seq_len"])
    return inputs, [f"{days:,.1f} days", f"{gpus:,} GPUs"]


def planner_case(**inputs):
    values = widgets.layout_planner_inputs().defaults | inputs
    cluster = planner.Cluster(gpu=values["gpu"], nodes=values["nodes"])
    result = planner.plan(values["model"], seq_len=values["seq_len"], global_batch_tokens=values["batch_tokens"],
                          cluster=cluster)  # fmt: skip
    best = planner.layout_table(result.ranked[:1])[0]
    return inputs, ["\t".join(str(cell) for cell in best)]


def error_case(function, **inputs):
    """Inputs the Python code rejects, and its message (the calculator must show it)."""
    with pytest.raises(ValueError) as error:
        function(**inputs)
    return inputs, [str(error.value)]


@functools.cache
def cases():
    """(calculator, inputs, texts the result must contain), several per calculator, some impossible."""
    memory = [
        memory_case(model="llama-3-70b", precision="mixed", zero_stage=3, dp=64),
        memory_case(
            model="llama-3-70b",
            seq_len=8192,
            tp=8,
            pp=4,
            sp=True,
            recompute="selective",
            zero_stage=1,
            dp=2,
            attention="fused",
            gpu="h200",
        ),  # fmt: skip
        error_case(widgets.memory_per_gpu, model="gpt3-175b", tp=64),
        error_case(widgets.memory_per_gpu, model="llama-3-70b", pp=1024),  # more stages than its 80 layers
    ]
    training = [
        training_time_case(
            model="llama-3.1-405b", gpu="h100-sxm", tokens_billions=15600.0, gpus=16384, mfu_percent=40.0, seq_len=8192
        ),  # fmt: skip
        training_time_case(
            model="llama-3-8b", gpu="h100-sxm", dtype="fp8", gpus=64, mfu_percent=35.5, deadline_days=7.0
        ),
        error_case(
            widgets.training_time_html,
            **widgets.training_time_inputs().defaults | {"gpu": "v100-sxm2-32gb", "dtype": "fp8"},
        ),  # fmt: skip
        ({"mfu_percent": 150.0}, ["MFU (%) must be at most 100, got 150 %"]),  # the form's words, not the package's
    ]
    plans = [
        planner_case(model="llama-3-8b", nodes=4, seq_len=8192, batch_tokens=2**22),
        planner_case(model="gpt3-175b", nodes=64, seq_len=2048, batch_tokens=2**21),
        error_case(
            widgets.plan_table_html,
            model="llama-3.1-405b",
            gpu="v100-sxm2-32gb",
            nodes=1,
            seq_len=8192,
            batch_tokens=2**19,
        ),  # fmt: skip
    ]
    return {"memory": memory, "training-time": training, "layout-planner": plans}


def form_js(name: str) -> str:
    return f"document.querySelector('form.live-calculator[data-calculator={name}]')"


def set_inputs(browser, name: str, inputs: dict) -> None:
    """Set the form's inputs as a reader would, then fire one change event (what a reader's last edit fires)."""
    browser.evaluate(f"""(() => {{
      const form = {form_js(name)};
      for (const [key, value] of Object.entries({json.dumps(inputs)})) {{
        const field = form.elements[key];
        if (field.type === 'checkbox') field.checked = value; else field.value = String(value);
        if (field.value !== String(value) && field.type !== 'checkbox') throw new Error(key + ' has no ' + value);
      }}
      form.elements[Object.keys({json.dumps(inputs)})[0]].dispatchEvent(new Event('change', {{bubbles: true}}));
    }})()""")


def as_the_browser_writes(browser, markup: str) -> str:
    """``markup`` as the browser serializes it back (entities decoded, attributes requoted), to compare."""
    reserialize = "(m => { const d = document.createElement('div'); d.innerHTML = m; return d.innerHTML; })"
    return browser.evaluate(f"{reserialize}({json.dumps(markup)})")


def computed(browser, name: str) -> int:
    return int(browser.evaluate(f"{form_js(name)}.dataset.computed"))


def answer(browser, name: str, inputs: dict) -> str:
    """Change the inputs, wait for the calculator to answer, return the result's text."""
    before = computed(browser, name)
    set_inputs(browser, name, inputs)
    assert browser.wait_for(f"Number({form_js(name)}.dataset.computed) > {before}", LOAD_TIMEOUT_S), (
        browser.evaluate(f"{form_js(name)}.querySelector('.live-status').textContent"),
        browser.errors,
    )
    assert browser.evaluate(f"{form_js(name)}.dataset.state") == "live"
    return browser.evaluate(f"{form_js(name)}.querySelector('.live-result').innerText")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from test_browser import Chromium, require_chromium

    require_chromium()
    chromium = Chromium(tmp_path_factory.mktemp("chromium-live"))
    yield chromium
    chromium.close()


@pytest.fixture(scope="module")
def origins(book_html):
    """The built book as a file:// URL and served from 127.0.0.1."""
    from test_browser import StaticServer

    server = StaticServer(book_html)
    yield {"file": book_html.as_uri(), "http": server.origin}
    server.stop()


@pytest.mark.browser
# Every calculator offline from file://; from a web server one of them (the page's loader is the same script on
# all three pages, so the origin is checked once: each case starts Pyodide afresh, 10-40 s on 2 busy cores).
@pytest.mark.parametrize(("name", "scheme"), [*((name, "file") for name in PAGES), ("memory", "http")])
def test_the_live_calculator_answers_what_accounting_computes(browser, origins, name, scheme):
    # The network is cut: every request to another origin is failed by the browser fixture, no host
    # name resolves, and from file:// the whole network is emulated offline.
    browser.call(
        "Network.emulateNetworkConditions",
        {"offline": scheme == "file", "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
    )
    try:
        browser.open(f"{origins[scheme]}/{PAGES[name]}")
        browser.wait_network_idle()
        assert browser.evaluate(f"{form_js(name)}.dataset.state") == "static"
        assert not [url for url in browser.urls.values() if "/_static/live/" in url], "Pyodide loaded before use"
        calculator = widgets.CALCULATORS[name]()
        static = browser.evaluate(f"{form_js(name)}.querySelector('.live-result').innerHTML")
        assert static == as_the_browser_writes(
            browser, calculator.html(**calculator.defaults)
        )  # the build's Python result, before any script

        started = time.monotonic()
        # Every case offline from file:// (no server, no network); over http the first, to show it goes live.
        for inputs, texts in cases()[name] if scheme == "file" else cases()[name][:1]:
            text = answer(browser, name, calculator.defaults | inputs)  # each case from the defaults
            missing = [t for t in texts if t not in text]
            assert not missing, f"{name} {inputs}: {missing} not in {text!r}"
            # And the whole result is what CPython's calculator_html gives for the same form.
            form = {key: browser.evaluate(f"{form_js(name)}.elements['{key}'].value") for key in calculator.controls}
            for key, control in calculator.controls.items():
                if control.kind == "checkbox":
                    form[key] = "true" if browser.evaluate(f"{form_js(name)}.elements['{key}'].checked") else "false"
            shown = browser.evaluate(f"{form_js(name)}.querySelector('.live-result').innerHTML")
            assert shown == as_the_browser_writes(browser, widgets.calculator_html(name, form))
            if started is not None:
                print(f"\n[live] {name} from {scheme}: first answer {time.monotonic() - started:.1f} s after a change")
                started = None
        assert browser.blocked == [] and browser.failed == [] and browser.errors == []
    finally:
        browser.call(
            "Network.emulateNetworkConditions",
            {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
        )


@pytest.mark.browser
def test_the_form_fits_a_narrow_window_and_reads_in_dark_theme(browser, origins):
    browser.call("Emulation.setDeviceMetricsOverride", {"width": 380, "height": 800, "deviceScaleFactor": 1,
                                                        "mobile": False})  # fmt: skip
    try:
        browser.open(f"{origins['http']}/{PAGES['memory']}")
        widths = browser.evaluate(f"[{form_js('memory')}.scrollWidth, {form_js('memory')}.clientWidth]")
        assert widths[0] <= widths[1], f"the form overflows a 380 px window: {widths}"
        # Text and field colours follow the theme: light text on the dark theme's dark background.
        luminance = (
            """(c => { const [r, g, b] = c.match(/[\\d.]+/g).map(Number); return 0.2126*r + 0.7152*g + 0.0722*b; })"""
        )
        for theme, text_is_lighter in (("light", False), ("dark", True)):
            browser.evaluate(f"document.documentElement.dataset.theme = '{theme}'")
            text, background = browser.evaluate(f"""(() => {{
              const select = {form_js("memory")}.querySelector('select');
              const style = getComputedStyle(select);
              return [{luminance}(style.color), {luminance}(style.backgroundColor)];
            }})()""")
            assert (text > background) == text_is_lighter, f"{theme}: text {text}, background {background}"
    finally:
        from test_browser import VIEWPORT

        browser.call("Emulation.setDeviceMetricsOverride", {"width": VIEWPORT[0], "height": VIEWPORT[1],
                                                            "deviceScaleFactor": 1, "mobile": False})  # fmt: skip


@pytest.mark.browser
def test_first_paint_with_and_without_the_calculator_script(browser, origins):
    """Chapter 7 paints its static values with its calculator script and with it refused; the time to first
    contentful paint of each is printed, one sample (a report, not a benchmark: README quotes the measured values)."""
    url = f"{origins['http']}/{PAGES['memory']}"
    paints = {}
    for label in ("with", "without"):
        refuse = label == "without"
        original = browser._is_local
        if refuse:
            browser._is_local = lambda u, local=original: "live_calculators.js" not in u and local(u)
        try:
            browser.open(url)
            browser.wait_network_idle()
            paints[label] = browser.evaluate(FCP)
            assert browser.evaluate(f"{form_js('memory')}.dataset.state") == "static"
        finally:
            browser._is_local = original
    print(
        f"\n[live] first contentful paint, Chapter 7: {paints['with']:.0f} ms with the calculator "
        f"script, {paints['without']:.0f} ms without"
    )
    assert all(value is not None for value in paints.values())


@pytest.mark.browser
def test_if_pyodide_cannot_load_the_static_values_stay_with_a_note(browser, origins):
    original = browser._is_local
    browser._is_local = lambda u: "pyodide.asm.wasm" not in u and original(u)  # as if the file were missing
    try:
        browser.open(f"{origins['http']}/{PAGES['memory']}")
        static = browser.evaluate(f"{form_js('memory')}.querySelector('.live-result').innerHTML")
        browser.evaluate(f"{form_js('memory')}.elements.model.focus()")  # a keyboard reader's focus is on an input
        set_inputs(browser, "memory", {"model": "llama-3-70b"})
        assert browser.wait_for(f"{form_js('memory')}.dataset.state === 'failed'", LOAD_TIMEOUT_S)
        note = browser.evaluate(f"{form_js('memory')}.querySelector('.live-status').textContent")
        assert "could not start" in note and "pyodide.asm.wasm.js" in note
        # The form is back at the inputs that the static values are for.
        assert browser.evaluate(f"{form_js('memory')}.elements.model.value") == "gpt3-175b"
        assert browser.evaluate(f"{form_js('memory')}.querySelector('.live-result').innerHTML") == static
        state = f"[{form_js('memory')}.querySelector('.live-inputs').disabled, document.activeElement.className]"
        assert browser.evaluate(state) == [True, "live-status"]  # read-only again; focus on the note, not the top
    finally:
        browser._is_local = original


@pytest.mark.browser
def test_make_it_live_keeps_focus_in_the_form_and_a_typed_non_number_is_named(browser, origins):
    name, form = "training-time", form_js("training-time")
    browser.open(f"{origins['http']}/{PAGES[name]}")
    # With the script running, the form is editable, offers the button and has no no-JavaScript note.
    assert browser.evaluate(f"[{form}.querySelector('.live-inputs').disabled, !!{form}.querySelector('.live-nojs'), "
                            f"{form}.querySelector('.live-offer').hidden]") == [False, False, False]  # fmt: skip
    browser.evaluate(f"{form}.querySelector('.live-start').focus()")
    for kind in ("keyDown", "keyUp"):  # Enter on "Make it live": the button goes, focus must not go to the page's top
        key = {"type": kind, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "text": "\r"}
        browser.call("Input.dispatchKeyEvent", key)
    assert browser.wait_for(f"Number({form}.dataset.computed) > 0", LOAD_TIMEOUT_S), browser.errors
    focused = "(e => e === document.body ? 'the page' : e.closest('form.live-calculator') ? e.name : e.outerHTML)"
    assert browser.evaluate(f"{focused}(document.activeElement)") == "model"  # the form's first input
    # A reader types "1e" into the MFU field: a number field then holds no number and the form sends "".
    browser.evaluate(f"(f => {{ f.value = ''; f.focus(); }})({form}.elements.mfu_percent)")
    browser.call("Input.insertText", {"text": "1e"})
    assert browser.evaluate(f"{form}.elements.mfu_percent.validity.badInput") is True
    before = computed(browser, name)
    browser.evaluate(f"{form}.elements.mfu_percent.dispatchEvent(new Event('change', {{bubbles: true}}))")
    assert browser.wait_for(f"Number({form}.dataset.computed) > {before}", LOAD_TIMEOUT_S), browser.errors
    text = browser.evaluate(f"{form}.querySelector('.live-result').innerText")
    assert text == "Cannot estimate: MFU (%) needs a number: the field is empty or holds something that is not a number"
    assert browser.errors == []


@pytest.mark.browser
def test_with_javascript_off_the_form_is_read_only_and_says_why(browser, origins):
    browser.call("Emulation.setScriptExecutionDisabled", {"value": True})
    try:
        browser.open(f"{origins['http']}/{PAGES['memory']}")
        note, shown, disabled, offer_hidden = browser.evaluate(f"""(f => {{
          const note = f.querySelector('.live-nojs');
          return [note ? note.innerText : null, note ? note.getBoundingClientRect().height > 0 : false,
                  f.querySelector('.live-inputs').disabled, f.querySelector('.live-offer').hidden];
        }})({form_js("memory")})""")
    finally:
        browser.call("Emulation.setScriptExecutionDisabled", {"value": False})
    assert shown and "computed when the book was built" in note and "needs JavaScript" in note, note
    assert disabled and offer_hidden  # nothing to edit, no button that would do nothing
