"""Debian's chromium driven by Playwright, for the viewer's browser tests. Importing this
module skips the importing test module when either is missing, except in CI, where it
fails (.ci/run installs both)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

CHROMIUM = shutil.which("chromium")
try:
    from playwright.sync_api import Browser, Page, expect, sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None

if sync_playwright is None or CHROMIUM is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs Playwright and Debian's chromium for the viewer tests "
                           "(.ci/run installs both)")
    pytest.skip("chromium or playwright is not installed", allow_module_level=True)

__all__ = ["Browser", "Page", "expect", "launched"]


@contextmanager
def launched() -> Iterator[Browser]:
    """A Chromium for a module's tests. Start it after the module's site: Playwright's
    sync API keeps an event loop running in this thread, and a site's setup (migrations,
    export) runs loops of its own."""
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()
