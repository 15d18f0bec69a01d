"""`profiling.simulate pace`: what an estimate of the compute misses of a later median,
worked out by hand on made-up steps; no rank is started."""

from __future__ import annotations

import json

import pytest

from profiling.simulate import pace

# One step a second: 1.0 s up to t = 99, then 1.2 s (the machine slows at t = 100).
POINTS = [(float(t), 1.0 if t < 100 else 1.2) for t in range(200)]


def test_rows_become_each_repeats_start():
    rows = [[0.0, "mlp", [0.5, 0.25]], [1.0, "cnn", [0.1]], [2.0, "mlp", [0.5]]]
    assert pace.series(rows) == {
        "mlp": [(0.0, 0.5), (0.5, 0.25), (2.0, 0.5)],
        "cnn": [(1.0, 0.1)],
    }


def test_an_estimate_in_a_row_against_the_median_after_a_gap_by_hand():
    # At 99: the last three steps (1.0) against 99..109, one 1.0 and ten 1.2: 1/6 short.
    assert pace.miss_at(POINTS, 99, 0, 0, repeats=3, bench_s=10) == pytest.approx(1 / 6)
    # The same after a 100 s gap: still 1/6; with no slow-down after it, no miss.
    assert pace.miss_at(POINTS, 99, 100, 0, repeats=3, bench_s=10) == pytest.approx(1 / 6)
    assert pace.miss_at(POINTS, 50, 10, 0, repeats=3, bench_s=10) == 0


def test_an_estimate_spread_over_a_window_by_hand():
    # Three steps evenly spaced from the window's first to its last. At 140 over 60 s:
    # 80, 110, 140 -> 1.0, 1.2, 1.2, median 1.2 against 1.2 after it, no miss. At 120:
    # 60, 90, 120 -> 1.0, 1.0, 1.2, median 1.0: 1/6 short, where the last three in a
    # row (118, 119, 120) are all 1.2 and miss nothing.
    assert pace.miss_at(POINTS, 140, 0, 60, repeats=3, bench_s=10) == 0
    assert pace.miss_at(POINTS, 120, 0, 60, repeats=3, bench_s=10) == pytest.approx(1 / 6)
    assert pace.miss_at(POINTS, 120, 0, 0, repeats=3, bench_s=10) == 0


def test_no_steps_to_measure_is_refused():
    with pytest.raises(ValueError, match="no steps"):
        pace.miss_at(POINTS, 199, 60, 0)


def test_render_summarises_every_model_gap_and_window(tmp_path, capsys):
    from profiling.simulate import cli

    rows = [[t, "mlp", [1.0 if t < 200 else 1.1]] for t in range(400)]
    data = {
        "command": "python -m profiling.simulate pace (by hand)",
        "nproc": 2,
        "seconds": 400,
        "machine": {"cpu": "made up", "date_utc": "2026-11-25 00:00"},
        "rows": rows,
    }
    path, md = tmp_path / "pace.json", tmp_path / "pace.md"
    path.write_text(json.dumps(data))
    cli.main(["pace", "--render", str(path), "--markdown", str(md)])
    summary = pace.summary(data)
    assert len(summary) == len(pace.GAPS_S) * len(pace.WINDOWS_S)
    assert max(r["max_pct"] for r in summary) == pytest.approx(100 / 11)  # 1.0 against 1.1
    lines = [ln for ln in md.read_text().splitlines() if ln.startswith("| mlp")]
    assert len(lines) == len(summary) and capsys.readouterr().out.strip() == md.read_text().strip()


@pytest.mark.parametrize(
    "argv, message",
    [(["--seconds", "100"], "--seconds must be at least 360"), (["--nproc", "0"], "--nproc")],
)
def test_bad_arguments_name_the_problem(argv, message):
    from profiling.simulate import cli

    with pytest.raises(SystemExit, match=message):
        cli.main(["pace", *argv])


def test_the_committed_table_renders_again(tmp_path):
    from pathlib import Path

    from profiling.simulate import cli

    results = Path(__file__).resolve().parent.parent / "docs" / "results"
    out = tmp_path / "pace.md"
    cli.main(["pace", "--render", str(results / "simulate-pace.json"), "--markdown", str(out)])
    assert out.read_text() == (results / "simulate-pace.md").read_text()


def test_the_worker_times_both_models_in_turn_and_stops(tmp_path):
    # The ranks themselves, 2 over loopback, for 2 s: rank 0's clock ends the loop for
    # both, and its rows alternate the models, 5 slowest-rank steps each, in time order.
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "rows.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "profiling.simulate.pace",
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        pace.ENV: json.dumps({"seconds": 2.0, "out": str(out)}),
    }
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) >= 2 and [m for _, m, _ in rows[:2]] == ["mlp", "cnn"]
    assert all(len(steps) == 5 and min(steps) > 0 for _, _, steps in rows)
    assert [t for t, _, _ in rows] == sorted(t for t, _, _ in rows)
