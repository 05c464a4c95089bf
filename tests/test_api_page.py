"""The API page (book/api.md) documents every module of the package, and names none that is gone."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "code" / "scalebook"


def package_modules() -> set[str]:
    modules = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__" or any(part.startswith("_") and part != "__init__" for part in parts):
            continue
        modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def test_api_page_lists_every_module_and_only_existing_ones():
    listed = set(re.findall(r"\.\. automodule:: (\S+)", (REPO / "book" / "api.md").read_text(encoding="utf8")))
    assert sorted(package_modules() - listed) == [], "modules missing from book/api.md"
    assert sorted(listed - package_modules()) == [], "book/api.md names modules that do not exist"
