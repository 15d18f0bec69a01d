"""profiling.simulate.accuracy: the loss the step model leaves out, fitted on published
efficiencies, its record, and the range `scale` prints; validated on series held out of
the fit (profiling.simulate.published.crossval)."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import pytest

from profiling.simulate import accuracy, scale
from profiling.simulate.accuracy import Loss, Point
from profiling.simulate.published import crossval
from profiling.simulate.schedule import Grad, Workload
from profiling.simulate.topology import Topology

MiB = 2**20


@pytest.fixture(scope="module")
def data():
    return crossval.series()  # the bare model on every published series, once


def test_the_record_the_core_holds_is_what_published_recomputes(data):
    # Change the model or the rows and this fails: regenerate accuracy.py's figures
    # from `python -m profiling.simulate accuracy`.
    assert crossval.rounded(crossval.fitted(data)) == accuracy.FITTED
    assert crossval.record(data) == accuracy.RECORD
    assert crossval.measured_margin(data) == accuracy.MEASURED_MARGIN


def test_the_fitted_loss_takes_the_bias_out_of_the_held_out_rows(data):
    table = crossval.leave_one_series_out(data)
    bare = sorted(abs(c.bare - c.published) for c in table)
    central = sorted(abs(c.error) for c in table)
    assert all(c.bare > c.published for c in table)  # the bare model runs high everywhere
    assert central[len(central) // 2] <= 0.03 < bare[len(bare) // 2]
    # Held out, the central figure is no longer high on most rows.
    assert sum(c.error > 0 for c in table) < len(table) * 0.8


def test_leave_one_series_out_covers_80_percent_with_median_width_under_a_tenth(data):
    table = crossval.leave_one_series_out(data)
    assert len(table) == 17  # 4 models x 4 GPU counts, and Goyal et al.'s E(256)
    covered = sum(c.covered for c in table)
    widths = sorted(c.width for c in table)
    assert covered / len(table) >= 0.8
    assert widths[len(widths) // 2] <= 0.10


def test_a_held_out_series_is_not_in_its_own_fit(data):
    # Moving a series' published figures must not move its own central figures.
    before = crossval.leave_one_series_out(data)
    moved = dict(data, resnet50=[replace(pt, published=0.5) for pt in data["resnet50"]])
    after = crossval.leave_one_series_out(moved)
    mine = [i for i, c in enumerate(before) if c.what.startswith("resnet50,")]
    assert [after[i].central for i in mine] == pytest.approx([before[i].central for i in mine])
    assert [(after[i].lo, after[i].hi) for i in mine] == [(before[i].lo, before[i].hi)
                                                          for i in mine]  # fmt: skip
    others = [i for i in range(len(before)) if i not in mine]
    assert any(after[i].central != pytest.approx(before[i].central) for i in others)


def test_the_range_holds_the_central_figure_and_has_width(data):
    assert accuracy.RECORD.lo < 0 < accuracy.RECORD.hi
    for c in crossval.leave_one_series_out(data) + crossval.measure_small_predict_large(data):
        assert c.lo < 0 < c.hi and c.width > 0, c
    small = crossval.measure_small_predict_large(data)
    assert [abs(c.error) <= 0.02 for c in small[:4]] == [True] * 4  # E(16) from 1-8 GPUs


# A hand-made model: 100 gradients of 1 MiB over a 1 s backward, on servers of 8 GPUs.
HUNDRED = Workload(tuple(Grad(f"w{i}", MiB, (100 - i) / 100) for i in range(100)), 0.1, 1.0, 0)
SERVERS = Topology(nodes=4, gpus_per_node=8, intra_bytes_per_s=100e9,
                   inter_bytes_per_s=10e9, intra_latency_s=1e-5, inter_latency_s=3e-5)  # fmt: skip
GPUS = [1, 2, 4, 8, 16, 32]


def measured_args(text: str) -> argparse.Namespace:
    return argparse.Namespace(measured=text, bucket_cap_mb=25.0, algorithm="ring",
                              slowdown=0.0)  # fmt: skip


def synthetic_times(loss: Loss, counts) -> str:
    """ms per step at `counts`, made by the model itself with `loss` added."""
    bare = scale.sweep(HUNDRED, SERVERS, "ring", GPUS, 25.0, [])["scaling"]
    step = {r["gpus"]: r["step_s"] for r in bare}
    return ",".join(f"{p}:{loss.step_s(step[p], HUNDRED.compute_s, p) * 1e3!r}" for p in counts)


def test_measured_recovers_a_known_loss_from_the_models_own_times():
    known = Loss(0.03, 0.01)
    loss, spread, lines = scale.fitted_term(
        measured_args(synthetic_times(known, (1, 2, 4, 8))), GPUS, HUNDRED, SERVERS, True
    )
    assert (loss.multi, loss.per_doubling) == pytest.approx((0.03, 0.01), abs=1e-9)
    assert "loss_multi 0.0300 (fitted)" in lines[0] and "0.0100 (fitted)" in lines[0]
    # A perfect fit: the range is the margin, one per doubling beyond 8 GPUs.
    m = accuracy.MEASURED_MARGIN
    assert spread(8) == pytest.approx((-m, m), abs=1e-9)
    assert spread(32) == pytest.approx((-2 * m, 2 * m), abs=1e-9)
    # One ratio from one GPU: only the loss at 2+ GPUs, the other kept.
    loss, _, lines = scale.fitted_term(
        measured_args(synthetic_times(known, (1, 2))), GPUS, HUNDRED, SERVERS, True
    )
    assert loss.per_doubling == accuracy.FITTED.per_doubling and "(kept" in lines[0]
    assert loss.multi == pytest.approx(0.03 + 0.0, abs=1e-9)  # log2(2 / 2) = 0
    # The central E from the fit is the synthetic runs' own E.
    result = scale.sweep(HUNDRED, SERVERS, "ring", GPUS, 25.0, [], loss=known)
    times = dict(scale.parse_measured(synthetic_times(known, GPUS), GPUS))
    assert [r["efficiency"] for r in result["scaling"]] == pytest.approx(
        [times[1] / times[p] for p in GPUS]
    )


@pytest.mark.parametrize("text", ["1:100,2", "a:100,2:110", "1:100,12:110", "2:100,4:110",
                                  "1:0,2:100", "1:100,2:-5", "1:100", "1:100,1:101",
                                  "1:100,2:nan"])  # fmt: skip
def test_measured_refuses_bad_input_in_one_line_naming_the_flag(text):
    with pytest.raises(SystemExit) as refused:
        scale.fitted_term(measured_args(text), GPUS, HUNDRED, SERVERS, True)
    message = str(refused.value)
    assert "--measured" in message and "\n" not in message


def test_measured_counts_need_not_be_among_gpus():
    # --gpus 1,16,32 with runs at 1, 2 and 8 GPUs: the fit computes its own bare steps.
    known = Loss(0.03, 0.01)
    loss, _, lines = scale.fitted_term(
        measured_args(synthetic_times(known, (1, 2, 8))), [1, 16, 32], HUNDRED, SERVERS, True
    )
    assert (loss.multi, loss.per_doubling) == pytest.approx((0.03, 0.01), abs=1e-9)
    assert lines[0].startswith("bare model checked against 17 published measurements")
    assert "central figure includes" not in "".join(lines)  # not the published fit's


def test_a_fit_below_zero_is_held_at_zero_with_a_note():
    # Runs that scale better than the bare model: no loss below 0.
    bare_loss = Loss(0.0, 0.0)
    times = synthetic_times(bare_loss, (1, 2, 4, 8))
    faster = ",".join(f"{p}:{float(ms) * (0.9 if p != '1' else 1.0)!r}"
                      for p, ms in (item.split(":") for item in times.split(",")))  # fmt: skip
    loss, _, lines = scale.fitted_term(measured_args(faster), GPUS, HUNDRED, SERVERS, True)
    assert loss.multi == 0.0 and loss.per_doubling >= 0.0
    assert "(--measured): loss_multi 0.0000 (held at 0: the fit put it below 0" in lines[0]
    assert "check --iteration-ms and --measured" in lines[0]
    # Each parameter alone below 0: both kept at 0 or more.
    points = [Point(2, 1, 1.0, 1.0, 1.05), Point(4, 1, 1.0, 1.0, 1.1)]
    loss, free = accuracy.fit_measured(points)
    assert loss == Loss(0.0, 0.0) and free == ("multi", "per_doubling")


def test_fit_measured_without_points_says_so():
    with pytest.raises(ValueError, match="fewer than two GPU counts"):
        accuracy.fit_measured([])


def test_the_range_top_is_at_most_the_bare_efficiency_and_one():
    result = scale.sweep(HUNDRED, SERVERS, "ring", GPUS, 25.0, [], loss=accuracy.FITTED)
    for r in result["scaling"]:
        lo, hi = r["range"]
        assert lo <= r["efficiency"] <= hi <= min(r["bare_efficiency"], 1.0) + 1e-12
        assert r["central_step_s"] == pytest.approx(r["step_s"] + r["loss_s"])
        assert r["efficiency"] == pytest.approx(result["scaling"][0]["central_step_s"]
                                                / r["central_step_s"])  # fmt: skip


def test_scale_prints_a_range_next_to_every_efficiency(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    scale.run(parser.parse_args(["--model", "resnet50", "--gpus", "1,2,8,16", "--bucket-caps",
                                 "25", "--out", str(tmp_path), "--measured",
                                 "1:300,2:318,8:325"]))  # fmt: skip
    printed = capsys.readouterr().out
    assert "checked against 17 published measurements" in printed
    assert "fitted on your runs at 1, 2, 8 GPUs (--measured)" in printed
    rows = [line for line in printed.splitlines() if re.match(r"\s+\d+\s+\d+\s+[\d.]+\s", line)]
    assert len(rows) == 4 and all(re.search(r"\[\d\.\d{3}, \d\.\d{3}\]", r) for r in rows)
    md = (tmp_path / "scale-resnet50-li2020.md").read_text()
    table = [line for line in md.splitlines() if re.match(r"\| \d+ \| \d+ \|", line)]
    assert len(table) == 4 and all("[" in line for line in table)
    assert "checked against 17 published measurements" in md


def test_scales_central_figure_is_the_bare_one_less_the_fitted_loss():
    result = scale.sweep(HUNDRED, SERVERS, "ring", [8, 16, 32], 25.0, [],
                         loss=accuracy.FITTED)  # fmt: skip
    rows = result["scaling"]
    assert rows[0]["efficiency"] == 1.0 and rows[0]["range"] == [1.0, 1.0]
    for r in rows[1:]:
        assert r["efficiency"] < r["bare_efficiency"] - 0.01  # per doubling, 1.7%
        lo, hi = r["range"]
        assert lo < r["efficiency"] < hi
        # The top capped at the bare model's E (an upper bound on every published row).
        top = min(accuracy.RECORD.hi, r["bare_efficiency"] - r["efficiency"])
        assert (lo - r["efficiency"], hi - r["efficiency"]) == pytest.approx(
            (accuracy.RECORD.lo, top)
        )


def test_fit_by_hand():
    # Two points against one GPU at bare steps of exactly compute: E = 1 / (1 + L(p)).
    pts = [Point(2, 1, 1.0, 1.0, 1 / 1.05), Point(8, 1, 1.0, 1.0, 1 / (1.05 + 2 * 0.02))]
    assert accuracy.fit(pts) == Loss(pytest.approx(0.05), pytest.approx(0.02))
    # Against 8 GPUs only the per-doubling part moves E.
    goyal = Point(256, 8, 1.0, 1.0, (1 + 0.05 + 0.04) / (1 + 0.05 + 0.14))
    assert accuracy.fit([goyal], ("per_doubling",), Loss(0.05)).per_doubling == pytest.approx(0.02)
