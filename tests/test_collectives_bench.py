"""The all-reduce benchmark (`python -m profiling.collectives`): its cost model against
hand-worked counts, its fit against data made from known constants, and one small
sweep end to end on loopback."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from profiling.collectives import model

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "p, steps",
    # Powers of two: lg p up and lg p down. p = 3: ranks 1 and 2 both send to 0 at
    # once (1 step), 0 sends to 2 then to 1 (2 steps). p = 6: up, 5 -> 4 and 3 -> 2,
    # then 4 -> 0 and 2 -> 0 (2 steps); down, 0 -> 4, 2, 1 one after the other (3).
    [(2, 2), (4, 4), (8, 6), (16, 8), (3, 3), (6, 5)],
)
def test_tree_steps_by_hand(p: int, steps: int) -> None:
    assert model.tree_steps(p) == steps


def test_fit_recovers_known_constants() -> None:
    """Times made up from alpha 150 us, beta 8 ns/B, free 256 KiB and gamma 0.2 ns/B
    with the ring's counts written out here; the fit must find alpha, beta and the
    free bytes again, and predict the held-out sizes within rounding."""
    alpha, beta, free, gamma = 150e-6, 8e-9, 256 * 2**10, 0.2e-9
    rows = []
    for p in (2, 3, 4, 8):
        for k in range(9):
            n = 4 * 2**10 * 4**k
            sent = 2 * (p - 1) / p * n
            t = 2 * (p - 1) * alpha + max(0.0, sent - free) * beta + (p - 1) / p * n * gamma
            rows.append({"delay_ms": 0, "world_size": p, "algorithm": "ring", "size_bytes": n,
                         "median_s": t})  # fmt: skip
    fit = model.fit(rows, gamma)["ring"]
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fit["free_bytes"] == free
    assert fit["held_out"]["worst_pct"] < 1e-6


def test_fit_on_the_fastest_calls_and_a_capped_free_bytes() -> None:
    """The same made-up ring, its fastest call per size exact (free 512 KiB), its median
    3 ms slow at the small sizes, as Gloo's two paces make it: fitted on the fastest
    calls (`key="min_s"`), alpha, beta and free come back; on the medians they do not.
    With free_bytes capped at 256 KiB, the fit keeps the cap and can no longer predict
    within rounding."""
    alpha, beta, free, gamma = 150e-6, 8e-9, 512 * 2**10, 0.2e-9
    rows = []
    for p in (2, 4):
        for k in range(9):
            n = 4 * 2**10 * 4**k
            sent = 2 * (p - 1) / p * n
            t = 2 * (p - 1) * alpha + max(0.0, sent - free) * beta + (p - 1) / p * n * gamma
            slow = 3e-3 if n <= 64 * 2**10 else 0.0  # the slow pace, at the small sizes
            rows.append({"delay_ms": 0, "world_size": p, "algorithm": "ring", "size_bytes": n,
                         "min_s": t, "median_s": t + slow})  # fmt: skip
    fastest = model.fit(rows, gamma, key="min_s")["ring"]
    assert fastest["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fastest["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fastest["free_bytes"] == free
    assert fastest["held_out"]["worst_pct"] < 1e-6
    on_medians = model.fit(rows, gamma)["ring"]
    assert on_medians["alpha_s"] != pytest.approx(alpha, rel=0.1)
    capped = model.fit(rows, gamma, key="min_s", max_free_bytes=256 * 2**10)["ring"]
    assert capped["free_bytes"] <= 256 * 2**10
    assert capped["held_out"]["worst_pct"] > 1


def test_beta_no_faster_than_the_link() -> None:
    """A made-up ring whose 1 MiB calls come through the token bucket at 4x the link's
    rate (0.25 of their wire time, as a deep enough bucket lets them): fitted freely,
    beta comes out faster than the link; with the link's 8 ns/B as the least beta it is
    exactly that, and the large sizes, whose bytes all cross at the link's rate, are
    predicted within 2%."""
    alpha, beta, gamma = 150e-6, 8e-9, 0.0
    rows = []
    for p in (2, 4):
        for k in range(9):
            n = 4 * 2**10 * 4**k
            wire = 2 * (p - 1) / p * n * beta * (0.25 if n == 2**20 else 1.0)
            rows.append({"delay_ms": 0, "world_size": p, "algorithm": "ring", "size_bytes": n,
                         "min_s": 2 * (p - 1) * alpha + wire})  # fmt: skip
    free = model.fit(rows, gamma, key="min_s", max_free_bytes=0)["ring"]
    assert free["beta_s_per_byte"] < 0.95 * beta
    floored = model.fit(rows, gamma, key="min_s", max_free_bytes=0, min_beta_s_per_byte=beta)
    assert floored["ring"]["beta_s_per_byte"] == pytest.approx(beta, rel=1e-9)
    large = [r for r in rows if r["size_bytes"] >= 16 * 2**20]
    for r in large:
        got = model.predict(floored["ring"], "ring", r["world_size"], r["size_bytes"])
        assert got == pytest.approx(r["min_s"], rel=0.02)


def test_model_crossover_of_ring_and_tree() -> None:
    """On 4 ranks, with no free bytes and no reduction cost, the tree (4 steps, 4n
    through rank 0's link) and the ring (6 steps, 1.5n) take equal time where
    2 alpha = 2.5 n beta."""
    fit = {"alpha_s": 100e-6, "beta_s_per_byte": 8e-9, "gamma": 0.0, "free_bytes": 0}
    fits = {"ring": fit, "tree": fit}
    expected = 2 * 100e-6 / (2.5 * 8e-9)
    assert model.model_crossover(fits, "tree", "ring", 4) == pytest.approx(expected, rel=1e-3)


def test_the_docs_figure_redrawn_from_its_json_is_legible(tmp_path, monkeypatch) -> None:
    from profiling.collectives import cli
    from profiling.common import report
    from tests.figures import assert_legible, record_font_sizes

    sizes = record_font_sizes(monkeypatch)
    saved = []  # the figure, as it is saved: where its legend lies
    real_save = report.save_figure

    def save(fig, path):
        fig.canvas.draw()
        saved.append(
            (
                fig.legends[0].get_window_extent(),
                [a.get_window_extent() for a in fig.axes if a.get_visible()],
            )
        )
        return real_save(fig, path)

    monkeypatch.setattr(report, "save_figure", save)
    png, md = tmp_path / "c.png", tmp_path / "c.md"
    results = ROOT / "docs" / "results"
    cli.main(
        ["--render", str(results / "collectives.json"), "--markdown", str(md), "--plot", str(png)]
    )
    assert_legible(png, sizes)
    assert md.read_text() == (results / "collectives.md").read_text()  # the numbers unchanged
    # One legend for the many panels, above the first: a reader meets it before the plots.
    ((legend, panels),) = saved
    assert legend.y0 >= max(panel.y1 for panel in panels)


def test_a_small_sweep_on_loopback(tmp_path: Path) -> None:
    out = {k: tmp_path / f"c.{k}" for k in ("json", "md", "png")}
    command = [sys.executable, "-m", "profiling.collectives", "--network", "loopback",
               "--world-sizes", "2", "--max-size", "1MiB", "--max-repeats", "3",
               "--seconds-per-size", "0.1", "--json", str(out["json"]),
               "--markdown", str(out["md"]), "--plot", str(out["png"])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out["json"].read_text())["runs"]
    cells = {(c["algorithm"], c["size_bytes"]) for c in run["cells"]}
    sizes = [4 * 2**10 * 4**k for k in range(5)]  # 4 KiB .. 1 MiB: three sizes to fit on
    algorithms = ["naive", "ring", "halving_doubling", "tree", "gloo"]
    assert cells == {(a, s) for a in algorithms for s in sizes}
    assert all(len(c["seconds"]) == 3 and min(c["seconds"]) > 0 for c in run["cells"])
    for algorithm in algorithms:  # the fit's line for every algorithm
        assert any(line.strip().startswith(f"{algorithm}:") for line in done.stdout.splitlines())
    assert "### The fitted model" in out["md"].read_text() and out["png"].stat().st_size > 0
    assert not math.isnan(run["seconds_of_rounds"])
