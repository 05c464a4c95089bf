#!/usr/bin/env bash
# Re-vendor the JavaScript the built book loads, from the npm registry, at pinned versions.
#
#   bash book/_vendor/update.sh
#
# Needs `npm` (only `npm pack` is used: nothing is installed and no package script runs).
# static/mathjax, static/requirejs and static/html-manager are replaced; _config.yml points at them
# (html_static_path, mathjax_path, nb_ipywidgets_js), so keep the layout when bumping a version,
# then rebuild the book and run `pytest tests/test_book.py tests/test_browser.py`.
# pyodide/ (the live calculators' Python runtime) is not copied as is: book/_ext/live_calculators.py
# writes it into the site at build time; after bumping it run `pytest tests/test_live_calculators.py`.
set -euo pipefail

MATHJAX=mathjax@3.2.2
REQUIREJS=requirejs@2.3.8
HTML_MANAGER=@jupyter-widgets/html-manager@1.0.15
# Same monorepo (jupyter-widgets/ipywidgets) and licence as html-manager; html-manager's tarball has
# no LICENSE file; @jupyter-widgets/base 6.0.11 does (6.0.12, the one bundled in html-manager
# 1.0.15, does not).
WIDGETS_LICENSE_FROM=@jupyter-widgets/base@6.0.11
# 0.29.x is the last line with a classic-script pyodide.asm.js; from 314.0 on it is an ES module
# (pyodide.asm.mjs), which Chromium refuses to import on a page opened from file://.
PYODIDE=pyodide@0.29.5

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/static"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

unpack() {  # unpack PACKAGE@VERSION DIR: fetch the registry tarball and extract it into DIR
    local spec="$1" dir="$2" tgz
    tgz="$(cd "$tmp" && npm pack --silent "$spec" 2>/dev/null | tail -n 1)"
    mkdir -p "$dir"
    tar -xzf "$tmp/$tgz" -C "$dir" --strip-components=1
}

unpack "$MATHJAX" "$tmp/mathjax"
unpack "$REQUIREJS" "$tmp/requirejs"
unpack "$HTML_MANAGER" "$tmp/html-manager"
unpack "$WIDGETS_LICENSE_FROM" "$tmp/widgets-base"
unpack "$PYODIDE" "$tmp/pyodide"

# Only the vendored package folders are replaced; static/html-manager-offline.js is ours.
rm -rf "$out/mathjax" "$out/requirejs" "$out/html-manager"
mkdir -p "$out/mathjax/output/chtml/fonts" "$out/requirejs" "$out/html-manager"

# MathJax 3: the single combined component with every TeX extension built in (so nothing is
# autoloaded at run time) and the CommonHTML output, plus the web fonts CHTML loads from
# [mathjax]/output/chtml/fonts/woff-v2 (relative to the script's own URL).
cp "$tmp/mathjax/es5/tex-chtml-full.js" "$out/mathjax/"
cp -r "$tmp/mathjax/es5/output/chtml/fonts/woff-v2" "$out/mathjax/output/chtml/fonts/"
cp "$tmp/mathjax/LICENSE" "$out/mathjax/LICENSE"

# RequireJS: the npm package ships only the unminified require.js (86 kB) and no LICENSE file;
# its header states the licence (MIT), so LICENSE is written from that header.
cp "$tmp/requirejs/require.js" "$out/requirejs/"
{
    echo "RequireJS ${REQUIREJS#requirejs@} (npm package \"requirejs\"), licence as stated in the header of require.js:"
    echo
    sed -n '2,3p' "$tmp/requirejs/require.js" | sed 's/^ *\* \{0,1\}//'
    cat <<'EOF'

MIT License

Copyright jQuery Foundation and other contributors, https://jquery.org/

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in
all copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN
THE SOFTWARE.
EOF
} > "$out/requirejs/LICENSE"

# @jupyter-widgets/html-manager 1.x: embed-amd.js bundles the ipywidgets 8 models and views
# (@jupyter-widgets/base 2.0.0, controls 2.0.0, output 1.0.0 protocol versions; also the
# ipywidgets 7 ones) and renders the widget state that myst-nb writes into notebook pages.
# The webpack-hashed Font Awesome 5 files next to it are only used by widgets with icons; the
# woff2 ones are kept (every browser picks woff2 first).
cp "$tmp/html-manager/dist/embed-amd.js" "$out/html-manager/"
cp "$tmp/html-manager/dist/"*.woff2 "$out/html-manager/"
cp "$tmp/widgets-base/LICENSE" "$out/html-manager/LICENSE"
cp "$tmp/html-manager/dist/embed.js.LICENSE.txt" "$out/html-manager/THIRD-PARTY-NOTICES.txt"

# Pyodide: the runtime of the live calculators, only the files that start Python with its standard
# library (no packages: the calculators need only the standard library and scalebook's pure-Python
# modules). The tarball has no LICENSE file; pyodide/LICENSE (MPL-2.0, written once) is kept.
mkdir -p "$here/pyodide"
rm -f "$here/pyodide/"pyodide* "$here/pyodide/python_stdlib.zip"
for f in pyodide.js pyodide.asm.js pyodide.asm.wasm python_stdlib.zip pyodide-lock.json; do
    cp "$tmp/pyodide/$f" "$here/pyodide/"
done

echo "Vendored into $out and $here/pyodide:"
(cd "$out" && find . -type f | sort && du -sh .)
(cd "$here/pyodide" && ls -l && du -sh .)
