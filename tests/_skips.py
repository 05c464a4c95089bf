"""The one rule for tests that need something outside Python (Chromium, SLURM): skip on a reader's machine,
fail in CI.

CI (``.ci/run``, which sets ``CI=true``) installs Chromium and SLURM, so there a missing one is a broken
machine, not a reason to go green: the test fails and says what to install. Elsewhere it skips with the
same message. Not a conftest: imported by name (``from _skips import require``), as pytest puts tests/ on
``sys.path``.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """Whether this run is CI's: ``CI`` set to true (GitHub Actions, GitLab and ``.ci/run`` set ``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require(condition: bool, what: str, install_hint: str) -> None:
    """Go on if ``condition``; otherwise skip (outside CI) or fail (under ``CI=true``), saying that ``what`` is
    missing and how to install it (``install_hint``)."""
    if condition:
        return
    message = f"{what} is missing: {install_hint}"
    if in_ci():
        pytest.fail(f"CI=true and {message} (.ci/run installs it; a skip here would hide the tests)", pytrace=False)
    pytest.skip(message)
