// The book's live calculators (book/_ext/live_calculators.py writes their forms and _static/live/).
//
// Nothing loads until the reader changes an input or presses "Make it live": then Pyodide starts, in a
// Web Worker so that the page never freezes, with scalebook's pure-Python modules, and every change
// calls scalebook.widgets.calculator_html(name, form), the function the notebooks' ipywidgets use too,
// and shows the HTML it returns (a rejected input shows Python's error message). If Pyodide cannot
// start, the form goes back to the inputs of the values the book was built with, read-only, and a note says
// why. The built form is read-only with a note that it needs JavaScript; wire() enables it. Focus stays in
// the form: pressing "Make it live" moves it to the first input, a failure to the status note.
//
// A page opened from file:// can neither fetch() a file nor start a worker from one, but it can load
// scripts: each file comes as a script that assigns its text (base64 for binary files) to
// self.scalebookLiveFiles. The worker is built from a Blob of Pyodide's two scripts and WORKER below,
// and answers Pyodide's fetch() of its WebAssembly module and standard library from the bytes it is
// sent. The same path serves a book opened from disk and one on a web server.
(function () {
  "use strict";

  const base = new URL("live/", document.currentScript.src).href;
  const scripts = ["pyodide.js", "pyodide.asm.js"];
  const binaries = ["pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json", "scalebook.zip"];
  let runtime = null; // a Promise of the started worker's compute function

  const WORKER = `
  const contentTypes = { "pyodide.asm.wasm": "application/wasm", "python_stdlib.zip": "application/zip" };
  let pyodide, calculatorHtml;

  async function start({ base, files }) {
    const pageFetch = self.fetch;
    self.fetch = (resource, init) => {
      const url = String(resource instanceof Request ? resource.url : resource);
      const name = url.startsWith(base) ? url.slice(base.length) : "";
      if (name in contentTypes) {
        return Promise.resolve(new Response(files[name], { headers: { "Content-Type": contentTypes[name] } }));
      }
      return pageFetch(resource, init);
    };
    try {
      const lockFileContents = JSON.parse(new TextDecoder().decode(files["pyodide-lock.json"]));
      pyodide = await loadPyodide({ indexURL: base, lockFileContents, stdout: () => {} });
    } finally {
      self.fetch = pageFetch;
    }
    pyodide.unpackArchive(files["scalebook.zip"], "zip", { extractDir: "/home/pyodide/scalebook-live" });
    pyodide.runPython("import sys; sys.path.insert(0, '/home/pyodide/scalebook-live')");
    calculatorHtml = pyodide.pyimport("scalebook.widgets").calculator_html;
  }

  function compute({ name, values }) {
    const form = pyodide.toPy(values);
    try {
      return calculatorHtml(name, form);
    } finally {
      form.destroy();
    }
  }

  self.onmessage = async ({ data }) => {
    try {
      const html = data.start ? await start(data.start) : compute(data);
      self.postMessage({ id: data.id, html });
    } catch (error) { // a bug, not a rejected input: those come back as HTML
      const lines = String(error.message || error).trim().split("\\n");
      self.postMessage({ id: data.id, error: lines[lines.length - 1] });
    }
  };`;

  function loadScript(name) {
    return new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = base + name + ".js";
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

  async function start() {
    if (typeof WebAssembly !== "object" || typeof Worker !== "function") {
      throw new Error("this browser cannot run WebAssembly in a worker");
    }
    await Promise.all([...scripts, ...binaries].map(loadScript));
    const embedded = self.scalebookLiveFiles;
    const source = new Blob([...scripts.map((name) => embedded[name] + "\n"), WORKER], { type: "text/javascript" });
    const files = Object.fromEntries(binaries.map((name) => [name, decode(embedded[name])]));
    delete self.scalebookLiveFiles; // the worker has its own copy now
    const worker = new Worker(URL.createObjectURL(source));
    const pending = new Map();
    let nextId = 0;
    const ask = (message, transfer = []) => new Promise((resolve, reject) => {
      const id = nextId++;
      pending.set(id, { resolve, reject });
      worker.postMessage({ ...message, id }, transfer);
    });
    worker.onmessage = ({ data }) => {
      const { resolve, reject } = pending.get(data.id);
      pending.delete(data.id);
      if ("error" in data) reject(new Error(data.error)); else resolve(data.html);
    };
    worker.onerror = (event) => {
      for (const { reject } of pending.values()) reject(new Error(event.message || "the worker failed"));
      pending.clear();
    };
    await ask({ start: { base, files } }, Object.values(files).map((bytes) => bytes.buffer));
    return (name, values) => ask({ name, values });
  }

  function formValues(form) {
    const values = {};
    for (const field of form.elements) {
      if (field.name) values[field.name] = field.type === "checkbox" ? String(field.checked) : field.value;
    }
    return values;
  }

  function wire(form) {
    const status = form.querySelector(".live-status");
    const result = form.querySelector(".live-result");
    const button = form.querySelector(".live-start");
    const inputs = form.querySelector(".live-inputs");
    let busy = false;
    let again = false;

    // As built, the inputs are disabled and a note says the form needs JavaScript; it runs now.
    form.querySelector(".live-nojs").remove();
    form.querySelector(".live-offer").hidden = false;
    inputs.disabled = false;

    function dropButton() { // removing the focused button would send focus to the top of the page
      const hadFocus = document.activeElement === button;
      button.remove();
      if (hadFocus) inputs.querySelector("input, select").focus();
    }

    function show(state, message) {
      form.dataset.state = state;
      result.setAttribute("aria-busy", String(state === "loading" || state === "computing"));
      status.textContent = message;
    }

    async function computeOnce() {
      let compute;
      try {
        if (!runtime) {
          show("loading", "Loading the calculator: starting Python in this page…");
          runtime = start();
        }
        compute = await runtime;
      } catch (error) {
        const hadFocus = form.contains(document.activeElement);
        form.reset(); // the static result is for the built-in inputs
        show("failed", `The calculator could not start (${error.message}); the values shown are the ones ` +
          "computed when the book was built, for the inputs shown.");
        if (button.isConnected) button.remove();
        inputs.disabled = true; // changing them would do nothing now
        if (hadFocus) status.focus(); // the note, not the top of the page
        return;
      }
      show("computing", "Computing…");
      const started = performance.now();
      try {
        result.innerHTML = await compute(form.dataset.calculator, formValues(form));
        show("live", "Live: computed in this page by the book's own Python " +
          `(scalebook.widgets, on Pyodide) in ${Math.round(performance.now() - started)} ms.`);
      } catch (error) {
        show("live", `Python raised ${error.message}`);
      }
      form.dataset.computed = String(Number(form.dataset.computed) + 1);
    }

    async function update() { // one computation at a time; the last change always gets one
      if (form.dataset.state === "failed") return;
      if (busy) {
        again = true;
        return;
      }
      busy = true;
      try {
        do {
          again = false;
          await computeOnce();
        } while (again && form.dataset.state !== "failed");
      } finally {
        busy = false;
      }
    }

    form.addEventListener("change", update);
    form.addEventListener("submit", (event) => { event.preventDefault(); update(); });
    button.addEventListener("click", () => { dropButton(); update(); });
  }

  document.querySelectorAll("form.live-calculator").forEach(wire);
})();
