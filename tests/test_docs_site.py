"""The docs as a reader sees them: the site built with `mkdocs build --strict`, served on
127.0.0.1 and opened in headless Chromium (Debian's, driven by Playwright, as
tests/test_tensorboard.py does; every request off loopback is aborted).

- On every stage page, the final class's page, the benchmark pages, the scaling page and
  Anatomy of a step: every image loaded, no snippet marker, placeholder or Markdown
  source left in the rendered text (a list that did not parse shows `- **`, or a
  paragraph holding `- ` lines), and no admonition cut short (one whose last paragraph
  stops mid-sentence, or one that did not parse and shows `!!!` as text).
- Anatomy of a step: its JavaScript computes profiling/course/anatomy.py's step on a grid, bar
  by bar, and a slider moved redraws it.
- The course's reading path (every page but the appendix): at most 6,000 words, no
  run of the project's history named, and no request that fails with the network
  blocked; the core path's Next links go page to page along it; every stage page
  shows its picture before any code and folds the answers of its exercises.

Skips where Chromium or Playwright is missing; in CI (CI set) that is a failure, as in
the TensorBoard tests.
"""

from __future__ import annotations

import functools
import http.server
import itertools
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.browser import chromium

ROOT = Path(__file__).resolve().parent.parent
STAGE_PAGES = sorted(p.stem for p in (ROOT / "docs/stages").glob("*.md"))
PAGES = [
    *(f"stages/{name}/" for name in STAGE_PAGES),
    "final_class/",
    "benchmarks/",
    *(f"bench/{p.stem}/" for p in sorted((ROOT / "docs/bench").glob("*.md"))),
    "scaling/",
    "accuracy/",
    "anatomy/",
    "the-rest/",
]
# Source that should have been rendered: snippet includes, the hooks' placeholders, a
# bullet or an admonition that Markdown took for a paragraph.
RAW = {
    "snippet marker": re.compile(r"--8<--"),
    "placeholder": re.compile(r"\{\{|\bstage_diff\("),
    "Markdown bullet": re.compile(r"(^|\s)- \*\*"),
    "Markdown bold": re.compile(r"\*\*\w[^*\n]*\w\*\*"),
    "admonition source": re.compile(r"(^|\n)\s*(!!!|\?\?\?\+?) \w"),
}
SENTENCE_END = re.compile(r"[.!?:)]\s*$")

# The page's article text outside code (code may hold `**options` or `--8<--` rightly),
# and each admonition's (or collapsible block's) last paragraph, when it ends in one.
ARTICLE_TEXT = """() => {
  const article = document.querySelector("article").cloneNode(true);
  article.querySelectorAll("pre, code, .headerlink").forEach(e => e.remove());
  return article.innerText;
}"""
ADMONITION_ENDS = """() => [...document.querySelectorAll("article .admonition, article details")]
  .map(box => {
    const last = box.lastElementChild;
    const title = box.querySelector(".admonition-title, summary");
    return {
      title: title ? title.innerText : "",
      tag: last ? last.tagName : "",
      text: last && last.tagName === "P" ? last.innerText : "",
      children: box.children.length,
    };
  })"""
# A paragraph whose source still holds a list item: Markdown did not see the list (a
# bullet right after a paragraph, or continuation lines indented too little).
LIST_IN_PARAGRAPH = """() => [...document.querySelectorAll("article p")]
  .map(p => p.textContent).filter(t => /(^|\\n)\\s*([-*+]|\\d+\\.) \\S/.test(t))"""
BROKEN_IMAGES = """() => [...document.images]
  .filter(img => !(img.complete && img.naturalWidth > 0)).map(img => img.src)"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    return out


def test_the_site_builds_in_strict_mode(site: Path) -> None:
    """`make test`'s docs build: any warning (a broken link, a missing snippet) fails it."""
    assert (site / "index.html").is_file()


@pytest.fixture(scope="module")
def served(site: Path):
    """The built site over HTTP on 127.0.0.1 (a free port), from a thread of this process."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def page(served: str):
    """A Chromium tab with the network blocked: a request off the site is aborted, and
    it and any request that failed (`tab.failed`, cleared by the tests that read it)
    are what a reader offline would see fail."""
    failed: list[str] = []

    def site_only(route) -> None:
        if route.request.url.startswith(served):
            route.continue_()
        else:
            failed.append(route.request.url)
            route.abort()

    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.route("**/*", site_only)
        tab = context.new_page()
        tab.failed = failed
        # A request a navigation cancels (the page before still loading) is not one that
        # failed: net::ERR_ABORTED.
        tab.on(
            "requestfailed",
            lambda r: None if r.failure == "net::ERR_ABORTED" else failed.append(r.url),
        )
        tab.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
        tab.set_default_timeout(300_000)  # only a hang waits it out, not a busy machine
        yield tab
        context.close()


@pytest.mark.parametrize("path", PAGES)
def test_page_renders_whole(page, served: str, path: str) -> None:
    response = page.goto(served + path, wait_until="load")
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    assert page.evaluate(BROKEN_IMAGES) == [], f"{path}: images that did not load"
    text = page.evaluate(ARTICLE_TEXT)
    for what, pattern in RAW.items():
        found = pattern.search(text)
        assert found is None, f"{path}: {what} in the rendered text: {_around(text, found)!r}"
    unparsed = page.evaluate(LIST_IN_PARAGRAPH)
    assert unparsed == [], f"{path}: a list rendered as a paragraph: {unparsed[0][:200]!r}"
    for box in page.evaluate(ADMONITION_ENDS):
        assert box["children"] >= 2, f"{path}: admonition {box['title']!r} has no body"
        if box["text"]:
            assert SENTENCE_END.search(box["text"]), (
                f"{path}: admonition {box['title']!r} ends mid-sentence: {box['text'][-80:]!r}"
            )


def _around(text: str, found: re.Match) -> str:
    return text[max(found.start() - 60, 0) : found.end() + 60]


# "Anatomy of a step": the page's JavaScript against profiling/course/anatomy.py's step model.
ANATOMY_GRID = [
    (model, stage, layout, gbit_s, latency_s, micro)
    for model in ("mlp_2048x7", "mlp_1024x24")
    for stage in ("naive", "bucketed", "overlapped", "skip_sync")
    for layout in ("per_parameter", "1", "25", "40", "100")
    for gbit_s in (0.1, 1.0, 10.0, 100.0)
    for latency_s in (0.0, 5e-6, 0.5e-3, 2e-3)
    for micro in (1, 3, 20)
]


def test_anatomy_page_computes_the_step_model(page, served: str) -> None:
    from profiling.course import anatomy

    data = anatomy.read_page_data(ROOT / "docs/js/anatomy-workload.js")
    page.goto(served + "anatomy/", wait_until="load")
    steps = page.evaluate(
        "grid => grid.map(args => window.anatomyStep(...args))", [list(g) for g in ANATOMY_GRID]
    )
    for args, js in zip(ANATOMY_GRID, steps, strict=True):
        model, stage, layout, gbit_s, latency_s, micro = args
        m = data["models"][model]
        workload = anatomy.from_json(m)
        buckets = m["layouts"]["naive" if stage == "naive" else layout]
        py = anatomy.step(workload, buckets, stage, gbit_s, latency_s, micro)
        where = args
        assert js["step_s"] == pytest.approx(py.step_s, rel=1e-9), where
        assert js["compute_s"] == pytest.approx(py.compute_s, rel=1e-9), where
        bound = anatomy.bound_s(workload, buckets, stage, gbit_s, latency_s, micro)
        assert js["bound_s"] == pytest.approx(bound, rel=1e-9), where
        assert py.step_s >= bound * (1 - 1e-9), where
        for lane in ("compute", "comm"):  # every bar, where it starts and ends
            bars = sorted((s["start"], s["end"]) for s in js["segments"] if s["lane"] == lane)
            expected = sorted((s.start_s, s.end_s) for s in py.segments if s.lane == lane)
            flat, flat_expected = ([t for bar in b for t in bar] for b in (bars, expected))
            assert flat == pytest.approx(flat_expected, rel=1e-9), (where, lane)


def test_anatomy_page_redraws_when_a_slider_moves(page, served: str) -> None:
    page.goto(served + "anatomy/", wait_until="load")
    summary = page.locator(".anatomy [data-out=summary]")
    bars = page.locator(".anatomy svg rect[data-lane=comm]")
    before, drawn = summary.inner_text(), page.locator(".anatomy svg").inner_html()
    assert before.startswith("step ") and bars.count() == 6  # 25 MiB: six buckets
    page.locator("#anatomy-bandwidth").fill("20")  # 1 -> 10 Gbit/s
    assert summary.inner_text() != before
    assert page.locator(".anatomy svg").inner_html() != drawn
    assert "10 Gbit/s" in page.locator(".anatomy [data-out=bandwidth]").inner_text()
    cap = page.locator("#anatomy-cap")
    cap.fill(cap.get_attribute("max"))  # the last position: one bucket
    assert bars.count() == 1
    page.locator("#anatomy-stage").select_option("naive")  # one all-reduce per parameter
    assert bars.count() == 14 and page.locator("#anatomy-cap").is_disabled()


def test_anatomy_page_reads_off_its_sliders(page, served: str) -> None:
    """What the questions ask can be set and read: latency in microseconds, question 5's
    k = 20 on the micro-batch slider with the time per micro-batch and its ratio to
    compute alone (as profiling/course/anatomy.py computes them), a new layout at every
    cap, and the time axis inside the drawing."""
    from profiling.course import anatomy

    page.goto(served + "anatomy/", wait_until="load")
    summary = page.locator(".anatomy [data-out=summary]")
    page.locator("#anatomy-latency").fill("3")
    assert page.locator(".anatomy [data-out=latency]").inner_text() == "5 µs"
    page.locator("#anatomy-latency").fill("0")
    page.locator("#anatomy-stage").select_option("skip_sync")
    page.locator("#anatomy-micro").fill("20")
    data = anatomy.read_page_data(ROOT / "docs/js/anatomy-workload.js")
    model = data["models"]["mlp_2048x7"]
    s = anatomy.step(anatomy.from_json(model), model["layouts"]["25"], "skip_sync", 1.0, 0.0, 20)
    per_micro_batch = f"{s.step_s / 20 * 1e3:,.0f} ms per micro-batch"
    ratio = f"{s.step_s / s.compute_s:.2f}x compute alone"
    assert per_micro_batch in summary.inner_text() and ratio in summary.inner_text()
    cap, out = page.locator("#anatomy-cap"), page.locator(".anatomy [data-out=cap]")
    for name in ("mlp_2048x7", "mlp_1024x24"):
        page.locator("#anatomy-model").select_option(name)
        shown = []
        for position in range(int(cap.get_attribute("max")) + 1):
            cap.fill(str(position))
            shown.append(out.inner_text())
        counts = [text[text.rindex("(") :] for text in shown]
        assert all(a != b for a, b in itertools.pairwise(counts)), (name, shown)
    box = page.evaluate(
        "() => { const svg = document.querySelector('.anatomy svg'); const view ="
        " svg.viewBox.baseVal; return [...svg.querySelectorAll('text')].every(t =>"
        " { const b = t.getBBox(); return b.x >= view.x && b.x + b.width <= view.width"
        " + 0.5; }); }"
    )
    assert box, "a label of the drawing runs past its edge"


# The course's reading path: every page but the appendix (run histories) and the
# fragments the pages include.
TEACHING_PAGES = sorted(
    str(p.relative_to(ROOT / "docs").with_suffix("")) + "/"
    for p in (ROOT / "docs").rglob("*.md")
    if p.relative_to(ROOT / "docs").parts[0] not in ("appendix", "results")
)
RUN_ID = re.compile(r"\b[Rr]uns? [A-Z]\d?\b")  # "run C's calibration", "runs A to Z3"
MAX_WORDS = 6000


@pytest.mark.parametrize("path", TEACHING_PAGES)
def test_teaching_page_is_short_and_names_no_run(page, served: str, path: str) -> None:
    url = served + ("" if path == "index/" else path)
    page.failed.clear()
    response = page.goto(url, wait_until="networkidle")
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    # Offline, with the network blocked: nothing the page asks for fails.
    assert page.failed == [], f"{path}: requests that failed offline: {page.failed}"
    text = page.evaluate(ARTICLE_TEXT)
    words = len(text.split())
    assert words <= MAX_WORDS, f"{path}: {words} words, over {MAX_WORDS}"
    found = RUN_ID.search(text)
    assert found is None, f"{path}: names a run of the project's history: {_around(text, found)!r}"


@pytest.mark.parametrize("name", STAGE_PAGES)
def test_stage_page_shows_its_picture_first_and_folds_its_answers(name: str) -> None:
    text = (ROOT / "docs/stages" / f"{name}.md").read_text()
    picture = text.find("![")
    assert picture >= 0, f"{name}: no picture"
    code = min((i for i in (text.find("```"), text.find("--8<--")) if i >= 0), default=len(text))
    assert picture < code, f"{name}: the first picture comes after the first code"
    assert picture < text.find("\n## "), f"{name}: the picture is not under the summary"
    assert "\n## Try it" in text, f"{name}: no Try it section"
    exercises = text[text.index("\n## Try it") :]
    assert '??? "Answer"' in exercises, f"{name}: no folded answer in Try it"


# The core path, in the order its pages' Next links go (mkdocs.yml's nav): a reader
# who follows them meets no optional page before its end.
CORE_PATH = [
    "index.html",
    "all_reduce/index.html",
    *(f"stages/{name}/index.html" for name in ("naive", "bucketed", "overlapped", "skip_sync")),
    "anatomy/index.html",
    "the-rest/index.html",
]
NEXT_LINK = re.compile(r"<a\b[^>]*\bmd-footer__link--next\b[^>]*>")
HREF = re.compile(r'\bhref="([^"]*)"')


def test_next_follows_the_core_path(site: Path) -> None:
    for here, following in itertools.pairwise(CORE_PATH):
        link = NEXT_LINK.search((site / here).read_text())
        assert link, f"{here}: no Next link"
        href = HREF.search(link.group(0)).group(1)
        target = (site / here).parent / href
        target = target / "index.html" if href.endswith("/") else target
        assert target.resolve() == (site / following).resolve(), (
            f"{here}: Next goes to {href}, not {following}"
        )


# What a browser fetches by itself: a stylesheet, font, script, image or frame; a link a
# reader clicks (<a href>) is not a request.
FETCHED_OFF_SITE = re.compile(
    r"<(?:link|script|img|iframe|source)\b[^>]*\b(?:src|href)=\"(?:https?:)?//"
)


def test_the_site_fetches_nothing_off_itself(site: Path) -> None:
    # Offline, a request to another host fails (the theme's web font did, on every page).
    fetched = {str(p.relative_to(site)): FETCHED_OFF_SITE.findall(p.read_text())
               for p in sorted(site.rglob("*.html"))}  # fmt: skip
    assert {page: tags for page, tags in fetched.items() if tags} == {}
