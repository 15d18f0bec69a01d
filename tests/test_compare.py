"""The compare command (profiling/compare.py) on the main job's traces, its charts
(profiling/common/charts.py), the course's timelines drawn from the same traces, and its
warnings where its figures are noise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from profiling import compare
from profiling.analysis import median_step, rank_average
from stages import STAGES

# ---------------------------------------------------------------------------------------
# The command: --analyse-only on a copy (it writes scalars into the logdir).


def test_compare_analyse_only_writes_table_files_charts_and_scalars(
    profile_logdir, results, tmp_path, capsys
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "runs"
    shutil.copytree(profile_logdir, logdir)
    out = tmp_path / "out"
    for _ in range(2):  # the second analysis replaces the first's scalars
        rows = compare.main(["--analyse-only", str(logdir), "--out", str(out)])
    printed = capsys.readouterr().out
    assert [r.run for r in rows] == ["compute_only", *STAGES, "torch_ddp"]
    for row in rows:
        assert row.run in printed
    data = json.loads((out / "profile.json").read_text())
    assert [r["run"] for r in data["runs"]] == [r.run for r in rows]
    assert len(data["ranks"]) == 2 * len(rows)
    csv_lines = (out / "profile.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + 3 * len(rows)  # header, 2 ranks and the mean per run
    for name in ("profile-breakdown.png", "profile-timeline.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) < 150_000

    folder = logdir / "naive" / "scalars-rank0"
    assert len(list(folder.glob("*.analysis"))) == 1
    events = EventAccumulator(str(folder)).Reload()
    assert "step time ms" in events.Tags()["scalars"]  # the loop's own, still there
    exposed = events.Scalars("exposed communication ms")
    floor = results["compute_only", 0].median.step_ms
    naive = results["naive", 0]
    assert [e.step for e in exposed] == [s.step for s in naive.steps]
    for e, s in zip(exposed, naive.steps, strict=True):
        assert e.value == pytest.approx(s.step_ms - floor, rel=1e-5)


def test_compare_charts_are_legible_at_page_width(profile_logdir, tmp_path, monkeypatch):
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    compare.main(["--analyse-only", str(profile_logdir), "--out", str(tmp_path), "--no-scalars"])
    for name in ("profile-breakdown.png", "profile-timeline.png"):
        assert_legible(tmp_path / name, sizes)


def test_compare_will_not_overwrite_traces_without_being_asked(profile_logdir):
    with pytest.raises(SystemExit, match="already holds traced runs"):
        compare.main(["--logdir", str(profile_logdir)])


def test_course_timelines_draw_two_lanes_per_rank_at_10_pt(profile_logdir, tmp_path):
    import re

    from profiling.course import timelines

    written = timelines.draw(profile_logdir, tmp_path)
    assert [p.name for p in written] == [f"timeline-{s}.svg" for s in timelines.STAGES]
    for path in written:
        svg = path.read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg
        for lane in ("rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"):
            assert lane in svg, (path.name, lane)
        # Drawn 576 pt wide (8 in), shown at about the page's width: 10 pt text stays 10 pt.
        assert 'width="576pt"' in svg
        sizes = [float(s) for s in re.findall(r"font-size: ([\d.]+)px", svg)]
        assert sizes and min(sizes) >= 10, (path.name, sorted(set(sizes)))


def _rank(run: str, step_ms: list[float], exposed: float | None):
    from profiling.analysis import RankResult, StepBreakdown

    steps = [StepBreakdown(i, 0.0, ms, ms / 2, 1.0, 0.5, 1, 4, "collective args")
             for i, ms in enumerate(step_ms)]  # fmt: skip
    return RankResult(run, 0, steps, median_step(steps), exposed)


def test_compare_warns_where_its_figures_are_noise():
    # overlapped timed faster than compute alone: a negative exposed time.
    results = [_rank("compute_only", [100, 101, 102], None),
               _rank("overlapped", [95, 96, 97], -5.0),
               _rank("bucketed", [140, 141, 142], 40.0)]  # fmt: skip
    warnings = compare.noise_warnings(rank_average(results), results)
    assert "overlapped timed faster than compute_only" in warnings[0]
    assert "python -m profiling.bench" in warnings[-1]
    # Steps that spread over 30 ms, against exposed times of 5 and 40 ms.
    results[2] = _rank("bucketed", [110, 140, 170], 40.0)
    results[1] = _rank("overlapped", [90, 105, 120], 5.0)
    results[0] = _rank("compute_only", [70, 100, 130], None)
    (spread, bench) = compare.noise_warnings(rank_average(results), results)
    assert "spread over 60.0 ms" in spread and "smallest exposed time shown (5.0 ms)" in spread
    # Steps that agree and a positive exposed time: nothing to warn about.
    quiet = [_rank("compute_only", [100, 100.1], None), _rank("bucketed", [140, 140.1], 40.0)]
    assert compare.noise_warnings(rank_average(quiet), quiet) == []


def test_course_pairs_stack_collectives_in_flight_at_once():
    from profiling.analysis import step_timeline

    def event(name: str, ts: float, dur: float, tid: int) -> dict:
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    # One step from 1000 to 2000 us on the main thread (tid 1); Gloo collectives on
    # threads 2 and 3: two at once, then a third after the first, a fourth cut by the
    # step's end, and one after the step.
    trace = {"traceEvents": [
        event("ProfilerStep#7", 1000, 1000, 1),
        event("gloo:all_reduce", 1100, 400, 2),
        event("gloo:all_reduce", 1200, 400, 3),
        event("gloo:all_reduce", 1550, 100, 2),
        event("gloo:all_reduce", 1700, 500, 3),
        event("gloo:all_reduce", 2100, 100, 2),
    ]}  # fmt: skip
    rows = step_timeline(trace, 7)["collective_rows"]
    assert rows == [[(0.1, 0.5), (0.55, 0.65), (0.7, 1.0)], [(0.2, 0.6)]]


def test_course_pairs_draw_each_page_at_10_pt(profile_logdir, tmp_path):
    import html
    import re

    from profiling.course import pairs

    logdir = tmp_path / "runs"
    logdir.mkdir()
    for name, variant in pairs.VARIANTS.items():  # every variant: its stage's traces
        (logdir / name).symlink_to(profile_logdir / variant.stage, target_is_directory=True)
    written = pairs.draw(logdir, tmp_path)
    assert [p.name for p in written] == [f"pair-{page}.svg" for page in pairs.PAGES]
    for path, variants in zip(written, pairs.PAGES.values(), strict=True):
        svg = path.read_text()
        for v in variants:
            label = html.escape(pairs.VARIANTS[v].label, quote=False)
            assert label in svg, (path.name, label)
        assert 'width="576pt"' in svg
        sizes = [float(s) for s in re.findall(r"font-size: ([\d.]+)px", svg)]
        assert sizes and min(sizes) >= 10, (path.name, sorted(set(sizes)))


def test_compare_refuses_a_network_rate_before_removing_anything(profile_logdir, tmp_path):
    logdir = tmp_path / "runs"
    shutil.copytree(profile_logdir / "naive", logdir / "naive")
    with pytest.raises(SystemExit, match="--network: rate 'fast' not understood"):
        compare.main(["--network", "fast", "--overwrite", "--logdir", str(logdir)])
    assert list((logdir / "naive").glob("*.pt.trace.json*")), "--overwrite removed traces"


@pytest.mark.parametrize(
    ("runs", "again"),
    [([], True), (["--runs", "compute_only,naive"], True), (["--runs=naive"], False)],
)
def test_compare_traces_the_baseline_again_after_the_runs(tmp_path, monkeypatch, runs, again):
    from contextlib import contextmanager

    launched = []

    @contextmanager
    def fake_launcher(nproc, network):
        def launch(job, env, note):
            launched.append(job)
            profile_dir = Path(job[job.index("--profile-dir") + 1])
            (profile_dir / "compute_only").mkdir(parents=True, exist_ok=True)
            return 0

        yield launch

    monkeypatch.setattr(compare, "launcher", fake_launcher)
    logdir = tmp_path / "runs"
    compare.run_main_job(2, "mlp", ["--steps", "3", *runs], logdir, overwrite=False)
    job = ["-m", "stages", "--model", "mlp", "--steps", "3", *runs, "--profile-dir", str(logdir)]
    assert launched[0] == job
    assert len(launched) == (2 if again else 1)
    if again:  # the same job, compute_only alone, into a scratch folder moved into place
        second = launched[1]
        assert second[:6] == job[:6] and second[-2:] == ["--runs", "compute_only"]
        assert not any(a.startswith("--runs=") or a == "compute_only,naive" for a in second)
        assert (logdir / "compute_only_again").is_dir()
