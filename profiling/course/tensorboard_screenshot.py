"""A screenshot of TensorBoard's Scalars dashboard over traced runs, for the docs.

    .venv/bin/python -m profiling.course.tensorboard_screenshot --logdir runs/compare-1gbit \\
        --out docs/images/tensorboard-scalars.png

Starts TensorBoard on a free port of 127.0.0.1, opens its Scalars dashboard in headless
Chromium (Debian's `chromium`, driven by Playwright, every request off loopback
aborted: the dashboard needs none), shows the charts of the tags matching `--tags`,
waits until every shown chart has drawn its lines, saves a PNG and stops TensorBoard by
its process group. `--logdir` is what `python -m profiling.compare` or the main job's
`--profile-dir` wrote. About 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager, suppress
from pathlib import Path
from typing import NoReturn

# Chromium tries Google hosts even with the first flags; the resolver rule keeps it on
# loopback.
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]  # fmt: skip
STARTUP_S = 600  # on a busy machine TensorBoard takes minutes to list its runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.course.tensorboard_screenshot",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--logdir", type=Path, required=True, help="TensorBoard's log dir")
    parser.add_argument("--out", type=Path, default=Path("tensorboard-scalars.png"))
    parser.add_argument(
        "--tags", default="step time ms|exposed communication ms",
        help="a regular expression: the scalar tags whose charts are shown",
    )  # fmt: skip
    args = parser.parse_args(argv)
    screenshot(args.logdir, args.out, args.tags)
    print(f"wrote {args.out}")


def screenshot(logdir: Path, out: Path, tags: str, browser=None) -> None:
    """TensorBoard over `logdir` on a free loopback port, its Scalars dashboard shown for
    `tags` and saved to `out`, TensorBoard stopped. `browser`: a launched Playwright
    browser to use (the tests' own); by default one is launched and closed here."""
    if not logdir.is_dir():
        raise SystemExit(f"--logdir {logdir}: no such folder")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        try:
            with ExitStack() as stack:
                if browser is None:
                    browser = stack.enter_context(launched_chromium())
                context = stack.enter_context(closing(browser.new_context(
                    viewport={"width": 1280, "height": 820})))  # fmt: skip
                context.route(
                    "**/*",
                    lambda r: r.continue_() if r.request.url.startswith(url) else r.abort(),
                )
                shoot(context.new_page(), url, tags, out, server)
        except SystemExit as e:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"{e}\nTensorBoard's log ends:\n{tail}") from None
        finally:
            stop(server)


def refuse(reason: str) -> NoReturn:
    """The command's answer to a missing piece: stop, saying which."""
    raise SystemExit(reason)


@contextmanager
def launched_chromium(missing: Callable[[str], NoReturn] = refuse) -> Iterator:
    """Debian's Chromium under Playwright, on loopback; closed afterwards. Where
    Chromium or Playwright is missing, `missing(reason)` (the tests skip there)."""
    executable = shutil.which("chromium")
    if executable is None:
        missing("Chromium not found: `apt-get install chromium` (make test does as root)")
    try:
        # here: Playwright is optional (the test extras); the command says so when absent
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("Playwright not installed: pip install -e '.[test]'")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


def stop(server: subprocess.Popen) -> None:
    """TensorBoard and the helper processes its plugins start: its process group."""
    with suppress(ProcessLookupError):  # it may have exited already
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def shoot(page, url: str, tags: str, out: Path, server: subprocess.Popen) -> None:
    """The Scalars dashboard filtered to `tags`, once every chart has drawn its lines."""
    deadline = time.monotonic() + STARTUP_S
    while True:  # until TensorBoard answers and lists scalar tags (it loads in the background)
        if server.poll() is not None:
            raise SystemExit(f"TensorBoard exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/data/plugin/scalars/tags", timeout=5) as r:
                if json.load(r):
                    break
        except (OSError, ValueError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise SystemExit(f"TensorBoard listed no scalars in {STARTUP_S} s")
        time.sleep(1)
    page.goto(f"{url}/#scalars", wait_until="load")
    left_ms = max(10.0, deadline - time.monotonic()) * 1e3
    page.wait_for_selector("tf-scalar-card path.line", state="attached", timeout=left_ms)
    page.locator("tf-tag-filterer input").first.fill(tags)
    matching = page.locator("tf-category-paginated-view").first  # "Tags matching ..."
    drawn = "paths => paths.filter(p => (p.getAttribute('d') || '').includes('L')).length"
    deadline = time.monotonic() + 300
    while True:  # every matching chart has drawn lines
        cards = matching.locator("tf-scalar-card").all()
        if cards and all(c.locator("path.line").evaluate_all(drawn) > 0 for c in cards):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"no chart for tags matching {tags!r} drew a line in 300 s")
        time.sleep(0.5)
    time.sleep(2)  # the lines fade in
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out))


if __name__ == "__main__":
    main()
