"""A real browser for the web console's tests: Debian's chromium (installed on first use, as root),
driven by Playwright's sync API; Playwright's own browser downloads are never used.

`launch_browser()` starts a headless Chromium with the flags a closed network needs (no background
networking, no component updates); `screenshot(page, name)` writes a PNG under the artefacts folder
(`PDSERVE_TEST_ARTIFACTS`, default `<repo>/.artifacts`), which the tests keep.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testing.debian import require_package

REPO_ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def chromium_binary() -> str:
    def find() -> str | None:
        return shutil.which("chromium") or shutil.which("chromium-browser")
    return require_package("chromium", find, "the chromium browser")


def artifacts_dir() -> Path:
    path = Path(os.environ.get("PDSERVE_TEST_ARTIFACTS") or REPO_ROOT / ".artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def screenshot(page: Any, name: str) -> Path:
    """A full-page PNG of `page` as <artefacts>/console/<name>.png."""
    out = artifacts_dir() / "console" / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out), full_page=True)
    return out


@contextlib.contextmanager
def launch_browser() -> Iterator[Any]:
    """A headless Debian chromium under Playwright (skips the calling test when there is none)."""
    executable = chromium_binary()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
