"""Publishing the book: the GitHub Actions workflows, `make site` and what the built folder holds.

The workflows are checked without running them: they parse, every action is pinned to a major version,
every `make` target they call exists in the Makefile and every file they run exists. The built site (the
session's ``book_html``, the same build as `make site` but for the base URL) must hold a 404 page and no
absolute path of the machine it was built on (/work, /tmp, /root, file:///), which would be dead links or a
leak once published.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"
# A local absolute path: one of the machine's folders, or a file URL with a path. Vendored JavaScript may
# mention the bare scheme ("file://") in code that handles such URLs; a path after it is a leak.
LOCAL_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root)/[\w.-]|file:///")
TEXT_SUFFIXES = {".html", ".js", ".css", ".json", ".txt", ".xml"}


def workflow(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf8"))


def make_targets() -> set[str]:
    """The targets the Makefile defines (``name:`` at the start of a line, ``:=`` excluded)."""
    text = (REPO / "Makefile").read_text(encoding="utf8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.MULTILINE)}


def steps(doc: dict) -> list[dict]:
    return [step for job in doc["jobs"].values() for step in job.get("steps", [])]


def run_commands(doc: dict) -> list[list[str]]:
    """Each shell command of the workflow's ``run:`` steps, split into words (``sudo``/``env`` prefixes off)."""
    commands = []
    for step in steps(doc):
        for line in step.get("run", "").splitlines():
            words = shlex.split(line.split(" #")[0]) if line.strip() else []
            while words and (words[0] in ("sudo", "env") or words[0].startswith("-") or "=" in words[0]):
                words = words[1:]
            if words:
                commands.append(words)
    return commands


@pytest.mark.parametrize("name", ["ci.yml", "pages.yml"])
def test_workflow_parses_and_calls_only_what_exists(name):
    doc = workflow(name)
    # YAML 1.1 reads the key `on` as True.
    triggers = doc.get("on", doc.get(True))
    assert triggers and doc["jobs"], f"{name}: no trigger or no job"
    targets = make_targets()
    for words in run_commands(doc):
        program, args = words[0], words[1:]
        if program == "make":
            called = [a for a in args if "=" not in a and not a.startswith("-")]
            missing = [t for t in called if t not in targets]
            assert not missing, f"{name} runs `make {' '.join(args)}`, but the Makefile has no target {missing}"
        elif program in ("bash", "sh", "python", "python3"):
            assert (REPO / args[0]).is_file(), f"{name} runs {program} {args[0]}, which does not exist"
        else:
            pytest.fail(f"{name} runs {program!r}: check it here (make target or script) before using it")
    for step in steps(doc):
        if "uses" in step:
            assert re.fullmatch(r"[\w-]+/[\w-]+@v\d+", step["uses"]), f"{name}: pin {step['uses']} to a major version"


def test_ci_runs_the_readme_test_command_on_pushes_and_pull_requests():
    doc = workflow("ci.yml")
    triggers = doc.get("on", doc.get(True))
    assert {"push", "pull_request"} <= set(triggers), f"ci.yml runs on {triggers}"
    assert ["bash", ".ci/run"] in run_commands(doc), "ci.yml must run `bash .ci/run`"


def test_pages_builds_with_make_site_and_deploys_that_folder():
    doc = workflow("pages.yml")
    uses = [step.get("uses", "").split("@")[0] for step in steps(doc)]
    assert "actions/upload-pages-artifact" in uses and "actions/deploy-pages" in uses, uses
    assert any(words[:2] == ["make", "site"] for words in run_commands(doc)), "pages.yml must build with make site"
    (upload,) = [s for s in steps(doc) if s.get("uses", "").startswith("actions/upload-pages-artifact")]
    assert upload["with"]["path"] == "_build/site", "the artifact must be the folder `make site` writes"
    assert "_build/site" in (REPO / "Makefile").read_text(encoding="utf8")
    assert doc["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}


def _build_site_module():
    spec = importlib.util.spec_from_file_location("build_site", REPO / "book" / "build_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_site_builds_from_the_committed_outputs_with_the_given_base_url():
    config = _build_site_module().site_config(REPO, "https://owner.github.io/repo")
    assert config["execute"]["execute_notebooks"] == "off", "make site must not execute the notebooks"
    assert config["html"]["baseurl"] == "https://owner.github.io/repo/"
    assert all(Path(path).is_absolute() for path in config["sphinx"]["local_extensions"].values())


def test_the_config_sets_a_base_url_and_the_404_page():
    config = yaml.safe_load((REPO / "_config.yml").read_text(encoding="utf8"))
    assert re.fullmatch(r"https://[^/]+/([^/]+/)*", config["html"]["baseurl"]), config["html"].get("baseurl")
    assert "not_found_page" in config["sphinx"]["config"]["extensions"]


def local_paths(site: Path) -> list[str]:
    """``path: excerpt`` for every absolute local path in the site's text files."""
    found = []
    for path in sorted(site.rglob("*")):
        if path.suffix in TEXT_SUFFIXES and path.is_file():
            text = path.read_text(encoding="utf8", errors="replace")
            found += [f"{path.relative_to(site)}: ...{text[max(0, m.start() - 60):m.end() + 40]!r}..."
                      for m in LOCAL_PATH.finditer(text)]  # fmt: skip
    return found


def test_the_built_site_has_a_404_page_and_no_local_paths(book_html):
    page = (book_html / "404.html").read_text(encoding="utf8")
    base = yaml.safe_load((REPO / "_config.yml").read_text(encoding="utf8"))["html"]["baseurl"]
    assert f'href="{base}index.html"' in page, "the 404 page must link to the book's first page absolutely"
    assert "<script" not in page and 'href="_static' not in page, "the 404 page must stand alone at any depth"
    leaks = local_paths(book_html)
    assert not leaks, "absolute local paths in the built site:\n  " + "\n  ".join(leaks[:20])


def test_the_local_path_check_finds_paths_and_passes_code_that_names_the_scheme(tmp_path):
    (tmp_path / "a.html").write_text("<pre>Chrome traces in /tmp/scalebook-profile-x1</pre>", encoding="utf8")
    (tmp_path / "b.js").write_text('u.startsWith("file://") && load("file:///work/main/x.js")', encoding="utf8")
    (tmp_path / "c.css").write_text("/* ok: ./tmp/x, ~/root/x */ a { color: red }", encoding="utf8")
    found = local_paths(tmp_path)
    assert {f.split(":")[0] for f in found} == {"a.html", "b.js"}, found
