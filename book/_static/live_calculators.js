// The book's live calculators (book/_ext/live_calculators.py writes their forms and _static/live/).
//
// Nothing loads until the reader changes an input or presses "Make it live": then Pyodide starts with
// scalebook's pure-Python modules, and every change calls scalebook.widgets.calculator_html(name, form),
// the function the notebooks' ipywidgets use too, and shows the HTML it returns (a rejected input shows
// Python's error message). If Pyodide cannot start, the form goes back to the inputs of the values the
// book was built with, and a note says why.
//
// Pyodide fetch()es its WebAssembly module and standard library, and Chromium's fetch() refuses file://
// URLs; scripts load from file:// though, so each binary file comes as a script that assigns its base64
// text to self.scalebookLiveFiles, and fetch() of its URL is answered from there while Pyodide starts.
(function () {
  "use strict";

  const base = new URL("live/", document.currentScript.src).href;
  const scripts = ["pyodide.js", "pyodide.asm.js", "pyodide.asm.wasm.js", "python_stdlib.zip.js",
    "pyodide-lock.json.js", "scalebook.zip.js"];
  const contentTypes = { "pyodide.asm.wasm": "application/wasm", "python_stdlib.zip": "application/zip" };
  let runtime = null; // a Promise of scalebook.widgets.calculator_html and the Pyodide API, once started

  function loadScript(name) {
    return new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = base + name;
      script.onload = resolve;
      script.onerror = () => reject(new Error(`could not load ${script.src}`));
      document.head.appendChild(script);
    });
  }

  function decode(base64) {
    const text = atob(base64);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    return bytes;
  }

  function take(name) { // the bytes of an embedded file, freeing its text
    const files = self.scalebookLiveFiles;
    const bytes = decode(files[name]);
    delete files[name];
    return bytes;
  }

  async function start() {
    if (typeof WebAssembly !== "object") throw new Error("this browser cannot run WebAssembly");
    await Promise.all(scripts.map(loadScript));
    const pageFetch = self.fetch;
    self.fetch = function (resource, init) {
      const url = String(resource instanceof Request ? resource.url : resource);
      const name = url.startsWith(base) ? url.slice(base.length) : "";
      if (name in contentTypes && name in self.scalebookLiveFiles) {
        const headers = { "Content-Type": contentTypes[name] };
        return Promise.resolve(new Response(take(name), { status: 200, headers }));
      }
      return pageFetch.call(this, resource, init);
    };
    let pyodide;
    try {
      const lock = JSON.parse(new TextDecoder().decode(take("pyodide-lock.json")));
      pyodide = await self.loadPyodide({ indexURL: base, lockFileContents: lock, stdout: () => {} });
    } finally {
      self.fetch = pageFetch;
    }
    pyodide.unpackArchive(take("scalebook.zip"), "zip", { extractDir: "/home/pyodide/scalebook-live" });
    pyodide.runPython("import sys; sys.path.insert(0, '/home/pyodide/scalebook-live')");
    return { pyodide, calculatorHtml: pyodide.pyimport("scalebook.widgets").calculator_html };
  }

  function formValues(form) {
    const values = {};
    for (const field of form.elements) {
      if (field.name) values[field.name] = field.type === "checkbox" ? String(field.checked) : field.value;
    }
    return values;
  }

  function nextPaint() {
    return new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
  }

  function wire(form) {
    const status = form.querySelector(".live-status");
    const result = form.querySelector(".live-result");
    const button = form.querySelector(".live-start");
    let queued = false;

    function show(state, message) {
      form.dataset.state = state;
      result.setAttribute("aria-busy", String(state === "loading" || state === "computing"));
      status.textContent = message;
    }

    async function update() {
      if (queued || form.dataset.state === "failed") return;
      queued = true;
      let python;
      try {
        if (!runtime) {
          show("loading", "Loading the calculator: starting Python in this page…");
          runtime = start();
        }
        python = await runtime;
      } catch (error) {
        queued = false;
        form.reset(); // the static result is for the built-in inputs
        show("failed", `The calculator could not start (${error.message}); the values shown are the ones ` +
          "computed when the book was built, for the inputs shown.");
        button.remove();
        return;
      }
      show("computing", "Computing…");
      await nextPaint();
      queued = false;
      const started = performance.now();
      const form_ = python.pyodide.toPy(formValues(form));
      try {
        result.innerHTML = python.calculatorHtml(form.dataset.calculator, form_);
        show("live", "Live: computed in this page by the book's own Python " +
          `(scalebook.widgets, on Pyodide) in ${Math.round(performance.now() - started)} ms.`);
      } catch (error) { // a bug, not a rejected input: those come back as HTML
        const lines = String(error.message).trim().split("\n");
        show("live", `Python raised ${lines[lines.length - 1]}`);
      } finally {
        form_.destroy();
      }
      form.dataset.computed = String(Number(form.dataset.computed) + 1);
    }

    form.addEventListener("change", update);
    form.addEventListener("submit", (event) => { event.preventDefault(); update(); });
    button.addEventListener("click", () => { button.remove(); update(); });
  }

  document.querySelectorAll("form.live-calculator").forEach(wire);
})();
