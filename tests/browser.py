"""Headless Chromium for the browser tests (TensorBoard, the docs site): Debian's
system Chromium driven by Playwright (never `playwright install`, which downloads one),
kept on loopback."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

from profiling.course.tensorboard_screenshot import launched_chromium


def unavailable(reason: str) -> NoReturn:
    """CI runs as root, where `make test` installs everything: there a missing piece is a
    failure. Elsewhere (no root for apt) the browser tests skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the browser tests)")
    pytest.skip(reason)


def chromium():
    """A launched Playwright Chromium browser, closed afterwards (the docs' command's
    launcher, skipping, or failing in CI, where a piece is missing)."""
    return launched_chromium(missing=unavailable)
