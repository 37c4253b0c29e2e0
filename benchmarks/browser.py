"""Headless Chromium for the inspector's browser test and benchmark: Debian's `chromium` package driven by
Playwright through ``executable_path`` (no browser is ever downloaded), with a fresh profile each time and the
flags this sandbox's closed network needs (without them Chromium keeps trying its background connections)."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM = os.environ.get("KVSERVE_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def missing() -> str | None:
    """Why no browser can run here (None: it can): `.ci/run` installs both."""
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; KVSERVE_CHROMIUM points elsewhere)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright; no browser download needed)"
    return None


@contextmanager
def chromium(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A Playwright browser context (``new_page()`` opens a tab) on a fresh profile, closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright, tempfile.TemporaryDirectory(prefix="kvserve-chromium-") as profile:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=FLAGS, headless=True, viewport={"width": width, "height": height})
        try:
            yield context
        finally:
            context.close()


def open_inspector(context: Any, base_url: str, key: str | None, route: str = "/sessions") -> tuple[Any, float]:
    """Open the inspector page on ``route`` (``/sessions/ID``, ``/requests/ID``, ``/cache``) with ``key``; returns the
    page and how long it took to load: ms from navigation start until its first view was rendered and painted."""
    page = context.new_page()
    page.goto(f"{base_url}/ui#key={key or ''}&{route}")
    page.wait_for_selector("html[data-ready]")
    return page, page.evaluate("window.inspectorReadyMs")
