"""Build the deployable site into one folder, from the notebooks' committed outputs (`make site`).

Nothing is executed: the notebooks are rendered with the outputs they were committed with, as the book
build of the tests does (tests/conftest.py, ``_build_book``: execution off, warnings are errors, nitpicky).
The result is a plain folder of static files that any host serves as it is, for GitHub Pages the artifact
of .github/workflows/pages.yml:

    python book/build_site.py _build/site [--baseurl https://<owner>.github.io/<repository>/]

``--baseurl`` overrides ``html.baseurl`` of _config.yml (the canonical links and the 404 page's links).

Source: Jupyter Book 1, "Build your book" and "Publish your book online with GitHub Pages".
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def site_config(src: Path, baseurl: str | None = None) -> dict:
    """``src``'s _config.yml with execution off, local extensions as absolute paths and ``baseurl`` if given."""
    config = yaml.safe_load((src / "_config.yml").read_text(encoding="utf8"))
    config.setdefault("execute", {})["execute_notebooks"] = "off"
    if baseurl is not None:
        # Sphinx joins page names to it with urljoin, which drops a last path part without its "/".
        config.setdefault("html", {})["baseurl"] = baseurl.rstrip("/") + "/"
    # Jupyter Book resolves local extension paths against the config file's folder, which is not `src`.
    local = config.get("sphinx", {}).get("local_extensions") or {}
    config["sphinx"]["local_extensions"] = {name: str((src / path).resolve()) for name, path in local.items()}
    return config


def build_site(out: Path, baseurl: str | None = None, src: Path = REPO) -> Path:
    """Build the book in ``src`` into ``out`` (replaced) and return it; raise if the build fails."""
    work = out.with_name(out.name + "-build")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config_path = work / "_config.site.yml"
    config_path.write_text(yaml.safe_dump(site_config(src, baseurl), sort_keys=False), encoding="utf8")
    jupyter_book = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(jupyter_book), "build", str(src), "--config", str(config_path), "--path-output", str(work),
           "-W", "-n", "--keep-going"]  # fmt: skip
    if subprocess.run(cmd, cwd=src).returncode != 0:
        raise SystemExit(f"jupyter-book build failed (its log is above): {' '.join(cmd)}")
    html = work / "_build" / "html"
    if not (html / "index.html").is_file() or not (html / "404.html").is_file():
        raise SystemExit(f"the build in {work} has no index.html or 404.html")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(html, out, ignore=shutil.ignore_patterns(".buildinfo", ".doctrees"))
    # Served as it is: no Jekyll pass (GitHub Pages would otherwise hide the folders starting with "_").
    (out / ".nojekyll").touch()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write the site into (replaced)")
    parser.add_argument("--baseurl", help="the address the site is published at (overrides html.baseurl)")
    args = parser.parse_args(argv)
    site = build_site(args.out.resolve(), args.baseurl)
    print(f"The site is in {site}; open {site / 'index.html'} or publish the folder.")


if __name__ == "__main__":
    main()
