"""What a user sees in TensorBoard over the main job's --profile-dir: the PyTorch Profiler
plugin's runs, workers and communication numbers (over HTTP), the Scalars dashboard and the
Trace view (in headless Chromium, offline).

    make test                                   # installs Chromium (as root) and the polyfill
    .venv/bin/pytest tests/test_tensorboard.py

The browser tests drive Debian's `chromium` through Playwright, kept on loopback: every
request that leaves 127.0.0.1 is aborted, so they pass or fail the same with or without
internet. Offline, the profiler tab shows only a spinner: it waits for Google Charts before it
draws any view. Its Trace view also needs `webcomponents.min.js` 0.7.24 from a CDN. The
trace test serves that file from npm (`make test` fetches it into .vendor/) and loads the
Trace view's page the way the tab does. docs/tensorboard.md says what an offline user sees.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ddp.models import build_model
from stages import STAGES
from tests.browser import chromium, unavailable
from tests.cases import STATUS, status_width

ROOT = Path(__file__).resolve().parent.parent
RUNS = ["compute_only", *STAGES, "torch_ddp"]  # one TensorBoard run each (tests/conftest.py)
COMMUNICATING = [run for run in RUNS if run != "compute_only"]
RANKS = ["rank0", "rank1"]
TAGS = {"loss", "learning rate", "step time ms"}  # ddp/train.py Tracing.step
PLUGIN = "/data/plugin/pytorch_profiler"
WEBCOMPONENTS = ROOT / ".vendor/webcomponents.js-0.7.24/webcomponents.min.js"  # Makefile
# Limits that only a hang reaches; every wait polls for what it waits for, and ends as soon
# as that is there. The plugin parses these traces in 5 s, 20 s on a busy 2-core machine.
STARTUP_S = 1800  # TensorBoard up, every run loaded: its profiler spawns a process per run
ANSWER_S = 300  # one HTTP answer (a view the plugin computes on first request)
PAGE_S = 300  # a page to load, a chart to draw


class TensorBoard:
    """`python -m tensorboard.main` on a free loopback port, in its own process group so
    that stopping it also stops the plugin's helper processes."""

    def __init__(self, logdir: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [
            sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def get(self, path: str, timeout: float = ANSWER_S):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return json.load(response)

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=ANSWER_S) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    def wait_until_loaded(self) -> None:
        """Until the profiler plugin has parsed every run's traces and the scalars plugin
        lists every rank's event file: both load in background threads after start-up."""
        scalar_runs = {f"{run}/scalars-{rank}" for run in RUNS for rank in RANKS}
        seen = "nothing (not answering yet)"
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"TensorBoard exited with {self.process.returncode}:\n{self.tail()}")
            try:
                runs = self.get(f"{PLUGIN}/runs", timeout=60)
                tags = self.get("/data/plugin/scalars/tags", timeout=60)
                seen = f"profiler runs {runs}, scalar runs {sorted(tags)}"
                if sorted(runs["runs"]) == sorted(RUNS) and not runs["loading"]:
                    if scalar_runs <= set(tags):
                        return
            except (OSError, ValueError):
                pass  # not listening yet, or a partial answer during start-up
            time.sleep(0.25)
        pytest.fail(
            f"TensorBoard did not load the log dir in {STARTUP_S} s; it last served {seen}. "
            f"Its log:\n{self.tail()}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tensorboard(profile_logdir: Path, tmp_path_factory):
    server = TensorBoard(profile_logdir, tmp_path_factory.mktemp("tensorboard") / "log.txt")
    try:
        server.wait_until_loaded()
        yield server
    finally:
        server.stop()


# The profiler plugin over HTTP: the same JSON its page draws from.


def test_profiler_lists_every_run_with_one_worker_per_rank(tensorboard: TensorBoard) -> None:
    assert tensorboard.get(f"{PLUGIN}/runs")["runs"] == sorted(RUNS)
    for run in RUNS:
        views = tensorboard.get(f"{PLUGIN}/views?run={run}")
        expected = ["Overview", "Operator", "Trace"]
        if run in COMMUNICATING:  # the plugin shows Distributed only where ranks communicate
            expected.append("Distributed")
        assert views == expected, f"{run}: views {views}"
        for view in ["Overview", "Trace"]:
            workers = tensorboard.get(f"{PLUGIN}/workers?run={run}&view={view}")
            assert workers == RANKS, f"{run}, {view} view: workers {workers}, expected one per rank"


def overlap(tensorboard: TensorBoard, run: str) -> dict:
    """Per profiled step ("all" for their sum) and rank: computation, overlapping,
    communication and other time, in microseconds."""
    [span] = tensorboard.get(f"{PLUGIN}/spans?run={run}&worker=rank0")  # one trace per rank
    answer = tensorboard.get(f"{PLUGIN}/distributed/overlap?run={run}&span={span}")
    assert answer["metadata"]["legends"] == ["Computation", "Overlapping", "Communication", "Other"]
    assert answer["metadata"]["units"] == "us"
    return answer["data"]


@pytest.mark.parametrize("run", COMMUNICATING)
def test_distributed_overlap_shows_communication(tensorboard: TensorBoard, run: str) -> None:
    steps = overlap(tensorboard, run)
    assert len(steps) >= 2, f"{run}: expected 'all' and at least one profiled step, got {steps}"
    for step, ranks in steps.items():
        assert sorted(ranks) == RANKS, f"{run}, step {step}: ranks {sorted(ranks)}"
        for rank, times in ranks.items():
            computation, overlapping, communication, other = times
            assert all(t >= 0 and math.isfinite(t) for t in times), f"{run} {step} {rank}: {times}"
            assert computation > 0, f"{run}, step {step}, {rank}: no computation in {times}"
            # On loopback a short all-reduce can hide entirely behind computation, so only
            # the sum is sure to be positive.
            assert overlapping + communication > 0, f"{run}, step {step}, {rank}: {times}"


def test_compute_only_has_no_distributed_view(tensorboard: TensorBoard) -> None:
    [span] = tensorboard.get(f"{PLUGIN}/spans?run=compute_only&worker=rank0")
    assert tensorboard.status(f"{PLUGIN}/distributed/overlap?run=compute_only&span={span}") == 404


@pytest.mark.parametrize("run", COMMUNICATING)
def test_all_reduced_bytes_are_the_gradients(tensorboard: TensorBoard, run: str) -> None:
    """Every profiled step all-reduces each float32 gradient once: the plugin's byte count
    must match the model's parameters, whatever the stage's bucketing."""
    [span] = tensorboard.get(f"{PLUGIN}/spans?run={run}&worker=rank0")
    steps = len(overlap(tensorboard, run)) - 1  # less "all"
    model = build_model("cnn")
    grad_bytes = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)  # float32
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())  # BatchNorm stats
    order = [*STAGES, "torch_ddp"]
    later = lambda stage: order.index(run) >= order.index(stage)  # noqa: E731
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    # The stages that declare it also sum a status, one 4-byte number a column: in the
    # last bucket's all-reduce (float32), as the default options have it.
    declared = getattr(STAGES.get(run), "collectives", ())
    status = STATUS in declared
    status_bytes = 4 * status_width(STAGES[run], n_params, {}) if status else 0
    expected = {"gloo:all_reduce": steps * (grad_bytes + status_bytes)}
    # torch DDP, and the stages from buffers on, also broadcast rank 0's buffers at every
    # forward (broadcast_buffers=True); the earlier stages leave each rank's BatchNorm
    # statistics alone.
    if later("buffers"):
        expected["gloo:broadcast"] = steps * buffer_bytes
    ops = tensorboard.get(f"{PLUGIN}/distributed/commops?run={run}&span={span}")["data"]
    for rank in RANKS:
        columns = [c["name"] for c in ops[rank]["columns"]]
        rows = [dict(zip(columns, row, strict=True)) for row in ops[rank]["rows"]]
        total = {row["Name"]: row["Total Size (bytes)"] for row in rows}
        assert total == expected, f"{run}, {rank}, bytes over {steps} profiled steps: {total}"


# The scalars plugin: loss, learning rate and step time for each rank of each run.


def scalars(tensorboard: TensorBoard, run: str, rank: str, tag: str) -> list[float]:
    query = urllib.parse.urlencode({"run": f"{run}/scalars-{rank}", "tag": tag})
    return [value for _, _, value in tensorboard.get(f"/data/plugin/scalars/scalars?{query}")]


def test_scalars_list_every_tag_for_every_rank(tensorboard: TensorBoard) -> None:
    tags = tensorboard.get("/data/plugin/scalars/tags")
    for run in RUNS:
        for rank in RANKS:
            assert set(tags[f"{run}/scalars-{rank}"]) == TAGS, f"{run}/scalars-{rank}: {tags}"


def test_loss_curves_match_torch_ddp(tensorboard: TensorBoard) -> None:
    """Each stage's loss curves, as TensorBoard serves them, are torch DDP's; compute_only's
    are not (its replicas drift apart), so the comparison can tell."""
    for rank in RANKS:
        reference = scalars(tensorboard, "torch_ddp", rank, "loss")
        assert len(reference) >= 2 and all(map(math.isfinite, reference)), reference
        for run in STAGES:
            loss = scalars(tensorboard, run, rank, "loss")
            assert loss == pytest.approx(reference, rel=1e-5), f"{run}, {rank} vs torch_ddp"
        drifting = scalars(tensorboard, "compute_only", rank, "loss")
        assert drifting != pytest.approx(reference, rel=1e-5), f"compute_only, {rank}"


# In the browser: headless Chromium on loopback only.


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


class OfflinePage:
    """A page in a fresh browser context (its own empty profile) whose requests off
    127.0.0.1 are aborted and recorded in `blocked`; `served` answers chosen URLs from
    local content instead (keyword arguments of Playwright's `route.fulfill`)."""

    def __init__(self, browser, tensorboard: TensorBoard):
        self.blocked: list[str] = []
        self.served: dict[str, dict] = {}
        self.context = browser.new_context(viewport={"width": 1600, "height": 1000})
        self.context.route("**/*", self._route)
        self.loopback = tensorboard.url + "/"
        self.page = self.context.new_page()
        self.page.set_default_timeout(PAGE_S * 1000)

    def _route(self, route) -> None:
        url = route.request.url
        if url in self.served:
            route.fulfill(**self.served[url])
        elif url.startswith(self.loopback):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()


@pytest.fixture
def offline(browser, tensorboard: TensorBoard):
    page = OfflinePage(browser, tensorboard)
    yield page
    page.context.close()


def wait_for(page, condition, what: str, timeout_s: float = PAGE_S):
    deadline = time.monotonic() + timeout_s
    while (value := condition()) is None or value is False:
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s} s")
        page.wait_for_timeout(250)
    return value


def rgb_pixels(png: bytes):
    """A screenshot as an (H, W, 3) array of int16 levels."""
    import numpy as np  # both come with matplotlib
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def visible_colour(rgb):
    """Where pixels are of visible colour: chart lines and trace slices, not the grey of
    axes, text and background (whose channels differ by a few levels at most).
    TensorBoard draws some runs' lines in muted colours (a teal of (116, 162, 160) was
    seen on top of a chart whose runs all had the same values), so the bar is a spread
    of 30 levels."""
    return rgb.max(axis=-1) - rgb.min(axis=-1) > 30


def colored_pixels(png: bytes) -> int:
    """Pixels of visible colour (`visible_colour`)."""
    return int(visible_colour(rgb_pixels(png)).sum())


def ink_on_lines(chart) -> int:
    """Pixels of a chart's screenshot, within the box its line paths span, that are ink:
    a visible colour, or darker than the light grey of the grid. Not colour alone:
    where every run logs the same values (the learning rate), the lines lie on top of
    one another and the one on top may be one of TensorBoard's grey runs."""
    rgb = rgb_pixels(chart.screenshot())
    # Both in the page's CSS pixels: the chart's box, and each drawn line's.
    c = chart.bounding_box()
    lines = chart.locator("path.line").evaluate_all(
        "paths => paths.map(p => p.getBoundingClientRect())"
        ".filter(b => b.width > 0).map(b => [b.left, b.top, b.right, b.bottom])"
    )
    if not lines:
        return 0
    scale = rgb.shape[1] / c["width"]  # screenshot pixels per CSS pixel
    left, top = (
        round((min(b[k] for b in lines) - c[xy]) * scale) for k, xy in ((0, "x"), (1, "y"))
    )
    right, bottom = (
        round((max(b[k] for b in lines) - c[xy]) * scale) for k, xy in ((2, "x"), (3, "y"))
    )
    pad = round(2 * scale)  # the stroke's width around the path's box
    area = rgb[max(0, top - pad) : bottom + pad + 1, max(0, left - pad) : right + pad + 1]
    return int((visible_colour(area) | (area.max(axis=-1) < 200)).sum())


def test_scalars_dashboard_draws_a_line_per_run(offline, tensorboard, tmp_path) -> None:
    page = offline.page
    page.goto(f"{tensorboard.url}/#scalars")
    # One category per tag; TensorBoard opens the first two, so open the rest.
    categories = page.locator("tf-category-paginated-view")  # Playwright's CSS reaches
    names = "views => views.map(view => view.category.name).filter(Boolean)"  # into shadow roots
    wait_for(page, lambda: set(categories.evaluate_all(names)) == TAGS, "no category per tag")
    for category in categories.all():
        if category.evaluate("view => view.category.name && !view.opened"):
            category.locator(".heading").first.click()
    cards = page.locator("tf-scalar-card")
    lines = len(RUNS) * len(RANKS)  # at least; TensorBoard adds a smoothed line to each

    def drawn_lines() -> list[int] | None:
        # Per card, its lines with at least one segment; None until every tag's card has
        # one per run and rank.
        counts = [
            card.locator("path.line").evaluate_all(
                "paths => paths.filter(p => (p.getAttribute('d') || '').includes('L')).length"
            )
            for card in cards.all()
        ]
        return counts if len(counts) == len(TAGS) and min(counts) >= lines else None

    counts = wait_for(page, drawn_lines, "no scalar chart drew a line per run (and rank)")
    page.screenshot(path=tmp_path / "scalars.png")
    tags = [card.evaluate("card => card.tag") for card in cards.all()]
    assert sorted(tags) == sorted(TAGS), f"charts for tags {tags} ({counts} lines drawn)"
    for tag, card in zip(tags, cards.all(), strict=True):
        chart = card.locator("vz-line-chart2")
        chart.screenshot(path=tmp_path / f"{tag}.png")
        # A chart scrolled into view may still be fading in from a redraw: look again.
        what = f"ink on the lines of the {tag!r} chart (see {tmp_path})"
        wait_for(page, lambda chart=chart: ink_on_lines(chart) > 100, what)
    assert offline.blocked == [], f"TensorBoard's page reached off loopback: {offline.blocked}"


def trace_host(run: str, worker: str, span: str) -> str:
    """What the plugin's Trace view does (its index.html, TraceView): load
    trace_embedding.html in an iframe, wait for its 'ready', post it the trace JSON."""
    return f"""<!doctype html><html><body style="margin:0">
<iframe id="trace" src="./trace_embedding.html" style="border:0;width:100vw;height:100vh">
</iframe><script>
window.addEventListener("message", async (event) => {{
  if ((event.data || {{}}).msg !== "ready") return;
  const answer = await fetch("trace?run={run}&worker={worker}&span={span}");
  const trace = await answer.json();
  document.getElementById("trace").contentWindow.postMessage({{msg: "data", data: trace}}, "*");
}});
</script></body></html>"""


# Slice titles in the viewer's model, once the trace is imported (null before).
TITLES = """() => {
  const viewer = document.getElementById("trace-viewer");
  if (!viewer || !viewer.model) return null;
  const titles = new Set();
  for (const thread of viewer.model.getAllThreads())
    for (const slice of thread.sliceGroup.slices) titles.add(slice.title);
  return [...titles];
}"""


def test_trace_view_renders_offline(offline, tensorboard, tmp_path) -> None:
    if not WEBCOMPONENTS.exists():
        unavailable(f"{WEBCOMPONENTS.relative_to(ROOT)} missing: `make test` fetches it from npm")
    run, worker = "overlapped", "rank0"
    [span] = tensorboard.get(f"{PLUGIN}/spans?run={run}&worker={worker}")
    base = f"{tensorboard.url}{PLUGIN}/"
    cdn = "https://cdnjs.cloudflare.com/ajax/libs/webcomponentsjs/0.7.24/webcomponents.min.js"
    host = trace_host(run, worker, span)
    offline.served[cdn] = {"path": WEBCOMPONENTS, "content_type": "application/javascript"}
    offline.served[base + "trace_host.html"] = {"body": host, "content_type": "text/html"}
    page = offline.page
    page.goto(base + "trace_host.html")
    frame = page.locator("#trace").element_handle().content_frame()
    titles = wait_for(page, lambda: frame.evaluate(TITLES), "the Trace view imported no trace")
    tracks = frame.locator("tr-ui-timeline-track-view")
    wait_for(page, lambda: tracks.count() > 0, "the Trace view drew no timeline")

    def painted() -> bool:  # the timeline paints on the next animation frames
        return colored_pixels(page.screenshot(path=tmp_path / "trace.png")) > 20_000

    wait_for(page, painted, f"the timeline looks blank: see {tmp_path / 'trace.png'}")

    # The profiler steps, the training loop's spans and the stage's own, and Gloo's op.
    for expected in ["forward", "backward", "optimizer", "wait for communication"]:
        assert expected in titles, f"{expected!r} not among the trace's slices {sorted(titles)}"
    assert any(re.fullmatch(r"ProfilerStep#\d+", t) for t in titles), sorted(titles)
    assert any(re.fullmatch(r"allreduce bucket \d+ \(\d+ B\)", t) for t in titles), sorted(titles)
    assert "gloo:all_reduce" in titles, sorted(titles)
    text = frame.evaluate("document.body.innerText")
    assert "pt_gloo_runloop" in text, "no Gloo thread in the timeline's track names"
    assert offline.blocked == [], f"the Trace view reached off loopback: {offline.blocked}"


def test_profiler_tab_offline_waits_for_google_charts(offline, tensorboard) -> None:
    """Pins down what docs/tensorboard.md tells offline users: the profiler page waits for
    Google Charts' loader before it shows any view, the Trace view included, so offline it
    keeps its spinner. If a plugin upgrade changes that, update the docs."""
    page = offline.page
    page.goto(f"{tensorboard.url}{PLUGIN}/index.html")
    page.get_by_role("button", name="Overview").click()  # the Views menu, once runs load
    page.get_by_role("option", name="Trace").click()
    loader = "https://www.gstatic.com/charts/loader.js"
    wait_for(page, lambda: loader in offline.blocked, f"no request for {loader}")
    wait_for(page, lambda: page.get_by_role("progressbar").count() == 1, "no spinner")
    page.wait_for_timeout(2000)  # time to render the view, were it to render without the loader
    assert page.get_by_role("progressbar").count() == 1, "expected the page's spinner"
    assert page.locator("iframe").count() == 0, "the Trace view rendered without Google Charts"


def test_the_docs_screenshot_command_draws_the_scalars(browser, profile_logdir, tmp_path) -> None:
    from profiling.course import tensorboard_screenshot

    out = tmp_path / "scalars.png"
    tags = "step time ms|loss"
    tensorboard_screenshot.screenshot(profile_logdir, out, tags, browser=browser)
    rgb = rgb_pixels(out.read_bytes())
    assert rgb.shape[:2] == (820, 1280)
    charts = rgb[180:, 340:]  # right of the runs list, below the header and the filter
    assert visible_colour(charts).sum() > 2000, "the charts drew no coloured line"
