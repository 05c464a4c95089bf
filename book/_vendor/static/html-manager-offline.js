/*
 * Glue for the vendored @jupyter-widgets/html-manager (html-manager/embed-amd.js) in this book.
 * Written for this repository (it is not from npm; book/_vendor/update.sh leaves it alone).
 * myst-nb loads it on pages that embed ipywidgets, after require.js and before embed-amd.js
 * (nb_ipywidgets_js in _config.yml). It fixes two things that would otherwise break offline:
 *
 * 1. embed-amd.js sets the webpack public path of each bundled module to the folder of the URL
 *    RequireJS derives from the module's name, i.e. <page folder>/@jupyter-widgets/..., where
 *    nothing is served: the Font Awesome 5 files of the widget CSS (button icons) 404. Mapping
 *    the bundled module names into _static/html-manager/ makes them load from there.
 * 2. ipywidgets' typeset() (widget descriptions, HTMLMath) calls the MathJax 2 API
 *    MathJax.Hub.Queue(["Typeset", MathJax.Hub, element]) whenever window.MathJax exists; the
 *    book loads MathJax 3, which has no Hub, so every described widget threw a TypeError on a
 *    page with math. A minimal Hub.Queue forwards those calls to MathJax 3's typesetPromise.
 */
(function () {
  "use strict";
  var folder = new URL("html-manager/", document.currentScript.src).href;

  // 1. Module name -> URL of the vendored folder (the modules are defined inside embed-amd.js;
  //    these paths only decide the URL, and so the public path, RequireJS gives them).
  var bundled = ["base", "controls", "base7", "controls7", "html-manager",
                 "html-manager/dist/libembed-amd"];
  var paths = {};
  bundled.forEach(function (name) {
    paths["@jupyter-widgets/" + name] = folder + name.split("/").pop();
  });
  window.requirejs.config({ paths: paths });

  // 2. MathJax 2 -> 3 bridge for ipywidgets.
  function installHub() {
    var mj = window.MathJax;
    if (!mj || mj.Hub || !mj.startup || !mj.startup.promise) {
      return; // no MathJax 3 on this page (then ipywidgets skips typesetting), or already done
    }
    mj.Hub = {
      Queue: function () {
        Array.prototype.forEach.call(arguments, function (command) {
          if (Array.isArray(command) && command[0] === "Typeset") {
            var elements = command[2] ? [command[2]] : undefined;
            mj.startup.promise
              .then(function () { return mj.typesetPromise(elements); })
              .catch(function (err) { console.warn("MathJax could not typeset a widget:", err); });
          }
        });
      },
    };
  }
  // MathJax 3 is a deferred script: it has replaced window.MathJax (the configuration object)
  // before the load event, and embed-amd.js renders the widgets on load, after this listener.
  installHub();
  window.addEventListener("DOMContentLoaded", installHub);
  window.addEventListener("load", installHub);
})();
