"""Headless Chromium for the browser tests (TensorBoard, the docs site): Debian's
system Chromium driven by Playwright (never `playwright install`, which downloads one),
kept on loopback."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from profiling.tensorboard_screenshot import CHROMIUM_FLAGS  # the one list of flags


def unavailable(reason: str) -> None:
    """CI runs as root, where `make test` installs everything: there a missing piece is a
    failure. Elsewhere (no root for apt) the browser tests skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the browser tests)")
    pytest.skip(reason)


@contextmanager
def chromium() -> Iterator:
    """A launched Playwright Chromium browser, closed afterwards."""
    executable = shutil.which("chromium")
    if executable is None:
        unavailable("Chromium not found: `apt-get install chromium` (make test does as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("Playwright not installed: pip install -e '.[test]'")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        try:
            yield launched
        finally:
            launched.close()
