"""The validation: each run's prediction from a calibration (built by hand or loaded from
its JSON), the benchmark's records read back, the checks, the tables and the command,
against references worked out by hand; no cluster, a few seconds in all."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from profiling.simulate.cpu_cluster.analyse import (
    analyse,
    best_bucket,
    measurements,
    ranking,
    summary_line,
)
from profiling.simulate.cpu_cluster.calibration import Calibration, cost_model, model_fits
from profiling.simulate.cpu_cluster.contention import latency_slowdowns, model_trickle
from profiling.simulate.cpu_cluster.inputs import workload_to_json
from profiling.simulate.cpu_cluster.predict import (
    BUCKETED_STAGES,
    CAPS_MB,
    RATES,
    WORLD_SIZES,
    Run,
    calibration_for,
    predict,
)
from profiling.simulate.schedule import Grad, Workload, linear_cost

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


# - the validation report ------------------------------------------------------------------

CAPS = (1e-6, 5.0, 10.0, 1e6)


def variant(name, cap, times_ms):
    return {"name": name, "sweep_value": cap, "step_times_ms": times_ms}


def bench_record(variants):
    """A benchmark record as `profiling.bench --json` writes one, cut to what is read."""
    settings = {"model": "mlp", "network": {"rate": "1gbit"}, "world_size": 2, "steps_per_round": 2}
    return {"settings": settings, "variants": variants}


# Two rounds of two steps each. naive was built once per cap: its copies pool.
RECORD = bench_record(
    [variant("compute_only", None, [100, 100, 100, 100])]
    + [variant("naive", c, [200, 210, 220, 230]) for c in CAPS]
    + [variant("bucketed", c, [190, 190, 200, 200]) for c in CAPS]
    + [
        variant("overlapped", c, t)
        for c, t in zip(
            CAPS,
            [
                [150, 150, 160, 160],
                [140, 140, 145, 145],
                [170, 170, 180, 180],
                [195, 195, 205, 205],
            ],
            strict=True,
        )
    ]
)


def run(stage, cap=None):
    return Run("mlp", "1gbit", 2, stage, cap)


PREDICTED = {
    run("compute_only"): 90.0,
    run("naive"): 236.5,  # measured 215 (median of 200,210,220,230, 4 copies): 10% off
    **{run("bucketed", c): 195.0 * 1.1 for c in CAPS},  # measured 195: 10% off
    run("overlapped", 1e-6): 155.0,  # measured 155: 0%
    run("overlapped", 5.0): 150.0,  # measured 142.5: 5.263% off
    run("overlapped", 10.0): 140.0,  # measured 175: 20% off
    run("overlapped", 1e6): 200.0,  # measured 200: 0%
}


def test_measured_runs_pool_naive_and_split_rounds():
    m = measurements([RECORD])
    assert set(m) == set(PREDICTED)  # one naive, compute_only, one per stage and cap
    assert m[run("naive")].median_ms == 215
    assert m[run("naive")].round_ms == {0: 205, 1: 225}
    assert m[run("overlapped", 5.0)].round_ms == {0: 140, 1: 145}


def test_table_and_last_line_from_a_hand_written_bench_json(tmp_path, capsys):
    from profiling.simulate.cpu_cluster.validate import run as validate_run

    data = {
        "command": "python -m profiling.simulate validate (by hand)",
        "predictions": [
            {
                "model": r.model,
                "rate": r.rate,
                "world_size": r.world_size,
                "stage": r.stage,
                "cap_mb": r.cap_mb,
                "predicted_ms": ms,
            }
            for r, ms in PREDICTED.items()
        ],
        "bench": [RECORD],
    }
    path = tmp_path / "validate.json"
    path.write_text(json.dumps(data))
    validate_run(argparse.Namespace(render=str(path), json=None, markdown=None))
    lines = capsys.readouterr().out.strip().splitlines()
    # 9 runs counted (compute_only is not): errors 10, 10 x4, 0, 5.263, 20, 0;
    # sorted 0, 0, 5.263, 10, 10, 10, 10, 10, 20: median 10, worst 20. The best
    # overlapped cap is 10 predicted, 5 measured: one grid step apart, but 10 MiB
    # measured slower in both rounds (170, 180 against 140, 145): beyond the noise, no.
    assert lines[-1] == (
        "prediction error: median 10.0%, worst 20.0% over 9 runs; "
        "best bucket within the noise of the fastest: no"
    )
    row = next(ln for ln in lines if ln.startswith("mlp 1gbit x2 overlapped cap 10 "))
    assert row.split()[-3:] == ["175.0", "6", "20.0"]  # measured, noise %, error %


def test_best_bucket_more_than_one_grid_step_apart():
    m = measurements([RECORD])
    # Predict the one-bucket cap best for overlapped: 3 steps from the measured 5 MiB.
    wrong = {**PREDICTED, run("overlapped", 1e6): 100.0}
    checks = {b["stage"]: b for b in best_bucket(wrong, m)}
    assert checks["overlapped"]["predicted_best_mb"] == 1e6
    assert checks["overlapped"]["measured_best_mb"] == 5.0
    assert checks["overlapped"]["grid_steps"] == 2 and not checks["overlapped"]["ok"]
    assert summary_line(analyse(wrong, m)).endswith("within the noise of the fastest: no")


def test_best_bucket_within_the_noise_however_many_grid_steps_apart():
    # The model picks 1e6, two grid steps from the measured fastest (5 MiB),
    # but the rounds cannot tell the two apart: 1e6 faster in round 0, slower in round 1.
    record = bench_record(
        [
            variant("overlapped", c, t)
            for c, t in zip(
                CAPS,
                [[300] * 4, [140, 140, 151, 151], [300] * 4, [146, 146, 146, 146]],
                strict=True,
            )
        ]  # fmt: skip
    )
    m = measurements([record])
    predicted = {run("overlapped", c): ms for c, ms in zip(CAPS, [300, 300, 300, 100], strict=True)}
    (check,) = best_bucket(predicted, m)
    assert (check["predicted_best_mb"], check["measured_best_mb"]) == (1e6, 5.0)
    assert check["grid_steps"] == 2 and check["ok"] and not check["beyond_noise"]
    assert summary_line(analyse(predicted, m)).endswith("within the noise of the fastest: yes")


def test_ranking_only_where_rounds_agree():
    m = measurements([RECORD])
    pairs = {(r["a"], r["b"]): r for r in ranking(PREDICTED, m)}
    # naive 205/225 against bucketed 190/200: slower in both rounds, predicted so too.
    key = ("mlp 1gbit x2 naive", "mlp 1gbit x2 bucketed cap 10")
    assert pairs[key]["ok"] and pairs[key]["measured_faster"].endswith("bucketed cap 10")
    # overlapped cap 1e6, 195/205 against bucketed 190/200: slower in both, predicted
    # faster (200 against 214.5): ranked wrongly.
    key = ("mlp 1gbit x2 bucketed cap 1e+06", "mlp 1gbit x2 overlapped cap 1e+06")
    assert not pairs[key]["ok"]
    # naive 205/225 against overlapped 1e6 195/205: 1.05 and 1.10, both > 1: counted.
    assert ("mlp 1gbit x2 naive", "mlp 1gbit x2 overlapped cap 1e+06") in pairs


def test_ranking_leaves_out_pairs_within_noise():
    record = bench_record(
        [
            variant("naive", 1e-6, [100, 100, 125, 125]),
            variant("bucketed", 1e-6, [110, 110, 110, 110]),
        ]
    )
    m = measurements([record])
    predicted = {run("naive"): 100.0, run("bucketed", 1e-6): 200.0}
    # Per round 100/110 and 125/110: one each way, within the noise: no pair to rank,
    # though the medians differ by 2%.
    assert ranking(predicted, m) == []


def test_not_counted_without_measurement():
    m = measurements([bench_record([variant("naive", 1e-6, [100, 100])])])
    a = analyse({run("naive"): 110.0, run("bucketed", 5.0): 1.0}, m)
    assert a["runs"] == 1 and a["median_error_pct"] == pytest.approx(10.0)


# - the Gantt charts -------------------------------------------------------------------------


def test_gantt_draws_each_stage_as_its_schedule(tmp_path):
    from profiling.course.simulated_steps import CAPTIONS, simulate_stages
    from profiling.simulate.gantt import draw

    MiB = 2**20
    # Three 10 MiB gradients: the stages' 25 MiB cap makes buckets [2, 1] and [0].
    workload = Workload(
        (Grad("w0", 10 * MiB, 3.0), Grad("w1", 10 * MiB, 2.0), Grad("w2", 10 * MiB, 1.0)),
        forward_s=1.0,
        backward_s=3.0,
        optimizer_s=1.0,
    )
    cost = linear_cost(0.0, 1.0 / (10 * MiB))  # 1 s per 10 MiB
    calibration = Calibration("1gbit", 2, cost, {"mlp": workload}, {"mlp": 0.0})
    steps = simulate_stages(workload, calibration)
    comm = {stage: [s.label for s in step.lane("comm")] for stage, step in steps.items()}
    assert comm["naive"] == ["w0", "w1", "w2"]
    assert comm["bucketed"] == ["bucket 0", "w0"] == comm["overlapped"]
    # naive and bucketed: 1 + 3 + 3 + 1; overlapped: bucket 0 (20 MiB) 3-5 after w1 at
    # backward's 2 s, w0 5-6, optimizer 6-7; skip_sync: 3 more micro-batches of 4 s first.
    assert [steps[s].step_s for s in ("naive", "bucketed", "overlapped", "skip_sync")] == [
        8.0, 8.0, 7.0, 19.0,
    ]  # fmt: skip
    path = tmp_path / "gantt.svg"
    draw(steps["overlapped"], CAPTIONS["overlapped"], path)
    assert CAPTIONS["overlapped"] in path.read_text()
    # The MLP's own call after backward, 1 s more a call, for every stage: naive's three
    # calls and bucketed's two pay it; overlapped's bucket 0 goes 3-6, w0 6-8, then the
    # optimizer: 9 s; skip_sync 12 + 9.
    dearer = dataclasses.replace(
        calibration, model_costs={"mlp": linear_cost(1.0, 1.0 / (10 * MiB))}
    )
    steps = simulate_stages(workload, dearer)
    assert [steps[s].step_s for s in ("naive", "bucketed", "overlapped", "skip_sync")] == [
        11.0, 10.0, 9.0, 21.0,
    ]  # fmt: skip


def calibration_json(workload, models: dict[str, dict], **fields) -> dict:
    """A calibration as `calibrate` returns one, cut to what `Calibration.from_json`
    reads: a fit that costs nothing, no slowdowns, and each model of `models` (name ->
    its own figures) on `workload`; `fields` at the top (call_s, copy_s_per_byte)."""
    return {
        "rate": "1gbit",
        "world_size": 2,
        "fit": {"alpha_s": 0.0, "beta_s_per_byte": 0.0, "gamma": 0.0, "free_bytes": 0},
        **fields,
        "models": {
            name: {"workload": workload_to_json(workload), "slowdown": 0.0, **more}
            for name, more in models.items()
        },
    }


def two_gradients(ready_a: float, ready_b: float, collective_s: float, **fields):
    """A calibration of one model "m": two 100-element gradients ready at these times in
    a 20 ms backward, forward 10 ms, optimizer 5, every collective `collective_s`."""
    workload = Workload(
        (Grad("a", 400, ready_a), Grad("b", 400, ready_b)),
        forward_s=0.010,
        backward_s=0.020,
        optimizer_s=0.005,
    )
    return Calibration(
        rate="1gbit",
        world_size=2,
        cost=linear_cost(collective_s, 0.0),
        workloads={"m": workload},
        slowdowns={"m": 0.0},
        **fields,
    )


def test_drop_in_prediction_adds_buffer_broadcast_and_status_exchange_by_hand():
    # Every collective 1 ms whatever its size; two gradients ready 10 and 20 ms into a
    # 20 ms backward; forward 10, optimizer 5; one bucket (cap 1e6). overlapped:
    # 10 + 20, the bucket 20-21 ms after forward, then the optimizer: 36 ms. drop_in
    # also broadcasts its one buffer dtype before forward (+1) and all-reduces the
    # status rows after the bucket (+1): 38 ms.
    calibration = two_gradients(0.010, 0.020, 0.001, buffer_bytes={"m": [8]})
    step_ms = {
        stage: predict(Run("m", "1gbit", 2, stage, 1e6), calibration)["predicted_ms"]
        for stage in ("overlapped", "drop_in")
    }
    assert step_ms == pytest.approx({"overlapped": 36.0, "drop_in": 38.0})


def test_drop_in_takes_the_measured_buffer_broadcast_by_hand():
    # As above, every collective 1 ms, but the calibration timed the buffers' broadcast
    # at 0.3 ms: drop_in is 36 + 0.3 (before forward) + 1 (the status rows) = 37.3 ms,
    # not 38. A calibration's JSON carries it per model; one made before it was timed
    # costs the broadcast as an all-reduce (38 ms), and a model without it too.
    from profiling.simulate.cpu_cluster.predict import buffer_broadcast_s

    run = Run("m", "1gbit", 2, "drop_in", 1e6)
    timed = two_gradients(
        0.010, 0.020, 0.001, buffer_bytes={"m": [8]}, broadcast_buffers_s={"m": 0.0003}
    )
    assert predict(run, timed)["predicted_ms"] == pytest.approx(37.3)
    workload = timed.workloads["m"]
    data = calibration_json(workload, {"m": {"broadcast_buffers_s": 0.0003}, "old": {}})
    loaded = Calibration.from_json(data)
    assert loaded.broadcast_buffers_s == {"m": 0.0003}
    loaded = dataclasses.replace(loaded, cost=timed.cost, buffer_bytes={"m": [8], "old": [8, 8]})
    assert buffer_broadcast_s(loaded, "m") == pytest.approx(0.0003)
    assert buffer_broadcast_s(loaded, "old") == pytest.approx(0.002)


def test_prediction_takes_the_models_own_copy_where_measured_by_hand():
    # The two 400-byte gradients ready at backward's end; every collective 1 ms; one
    # bucket after backward (bucketed): 10 + 20, then the copy in, the all-reduce and the
    # copy out one after the other, then the optimizer. At 10 us a byte a pass over 800
    # bytes is 8 ms: 30 + 8 + 1 + 8 + 5 = 52 ms; at the cache's 1 us a byte, 37.6 ms.
    # A calibration from before the model's own pass was measured keeps the cache's.
    run = Run("m", "1gbit", 2, "bucketed", 1e6)
    cache = two_gradients(0.020, 0.020, 0.001, copy_s_per_byte=1e-6)
    measured = two_gradients(
        0.020, 0.020, 0.001, copy_s_per_byte=1e-6, model_copy_s_per_byte={"m": 1e-5}
    )
    assert predict(run, measured)["predicted_ms"] == pytest.approx(52.0)
    assert predict(run, cache)["predicted_ms"] == pytest.approx(37.6)
    assert measured.for_model("other") is measured
    # From a calibration's JSON: the models' own figures where they are.
    data = calibration_json(
        cache.workloads["m"], {"m": {"copy_s_per_byte": 1e-5}, "old": {}}, copy_s_per_byte=1e-6
    )
    assert Calibration.from_json(data).model_copy_s_per_byte == {"m": 1e-5}


def test_prediction_takes_each_stages_own_time_beyond_its_copies_by_hand():
    # The two 400-byte gradients ready at backward's end, every collective 1 ms, a pass
    # 1 us a byte (0.8 ms over both gradients); one bucket (bucketed, after backward):
    # 10 + 20, then the copy in, the all-reduce and the copy out, then the optimizer:
    # 30 + 0.8 + 1 + 0.8 + 5 = 37.6 ms. Timed with no communication, the stage's step
    # took 3.6 ms beyond the compute: 2 ms beyond its two passes (1.6 ms), which go
    # after backward: 39.6 ms. A layout timed faster than its copies adds nothing, one
    # not timed nothing either, and naive's copies are one pass (its divide in place).
    workload = two_gradients(0.020, 0.020, 0.0).workloads["m"]
    own = [
        ["bucketed", 1e6, 0.0, 0.0036],
        ["overlapped", 1e6, 0.0, 0.001],
        ["naive", None, 0.0, 0.0028],
    ]
    data = calibration_json(workload, {"m": {"own_steps": {"compute_s": 0.035, "layouts": own}}})
    calibration = dataclasses.replace(
        Calibration.from_json(data), cost=linear_cost(0.001, 0.0), copy_s_per_byte=1e-6
    )
    assert calibration.own_s("m", "bucketed", 1e6) == 0.0036
    assert calibration.own_s("m", "drop_in", 1e6) == 0.0
    assert calibration.own_s("other", "naive", None) == 0.0
    step_ms = {
        (stage, cap): predict(Run("m", "1gbit", 2, stage, cap), calibration)["predicted_ms"]
        for stage, cap in [
            ("bucketed", 1e6),
            ("bucketed", 5.0),
            ("overlapped", 1e6),
            ("naive", None),
        ]
    }
    assert step_ms == pytest.approx({
        ("bucketed", 1e6): 39.6,  # 37.6 + (3.6 - 1.6)
        ("bucketed", 5.0): 37.6,  # not timed
        ("overlapped", 1e6): 37.6,  # 1 ms, less than its copies
        ("naive", None): 35 + 2 + 0.8 + 2.0,  # two calls, one pass, 2.8 - 0.8
    })  # fmt: skip


def test_prediction_takes_the_models_own_call_cost_where_measured_by_hand():
    # Naive on the two 400-byte gradients: 10 + 20 ms of forward and backward, their
    # two all-reduces one after the other, then the optimizer's 5 ms. The cluster's
    # sequence after matmuls put a call at 1 ms (35 + 2 = 37 ms); the model's own,
    # timed right after its backward, at 3 ms (35 + 6 = 41 ms): naive issues its calls
    # there. The fit says 0 for these sizes, so a call costs its call_s. A model without
    # its own keeps the cluster's.
    workload = two_gradients(0.020, 0.020, 0.0).workloads["m"]
    data = calibration_json(workload, {"m": {"call_s": 0.003}, "old": {}}, call_s=0.001)
    calibration = Calibration.from_json(data)
    step_ms = {
        model: predict(Run(model, "1gbit", 2, "naive", None), calibration)["predicted_ms"]
        for model in ("m", "old")
    }
    assert step_ms == pytest.approx({"m": 41.0, "old": 37.0})
    assert calibration.for_model("old") is calibration
    # Overlapped with one bucket pays the model's too, its one call after its last
    # gradient: 10 + 20 + 3 + 5 (this calibration has no trickle: no slowdowns).
    overlapped = predict(Run("m", "1gbit", 2, "overlapped", 1e6), calibration)["predicted_ms"]
    assert overlapped == pytest.approx(38.0)


def trickled_at_half_a_millisecond() -> dict:
    """A cluster's sequence whose one trickle the model made at a call of 0.5 ms and
    slowdowns (0.8, 0.5)."""
    repeats = [model_trickle(16e-3, 16, linear_cost(0.5e-3, 0.0), 0.0, 0.8, 0.5)]
    return {"size_bytes": 4096, "trickle": {"calls": 16, "repeats": repeats}}


def test_a_models_own_call_and_trickle_pair_are_taken_where_kept():
    # The cluster's trickle made by the model at a call of 0.5 ms and slowdowns (0.8,
    # 0.5), as the calibration fitted them. A model whose call after backward costs 1 ms
    # has the two fitted again with its 1 ms, and kept (`model_fits`): they give back the
    # measured compute's end with its call, and with a dearer call the same flights hold
    # less slowdown of the calls. Loaded, it takes its own call and pair; a model without
    # its own keeps the cluster's.
    workload = two_gradients(0.020, 0.020, 0.0).workloads["m"]
    sequence = trickled_at_half_a_millisecond()
    repeats = sequence["trickle"]["repeats"]
    cluster = {"latency_slowdown": 0.8, "comm_latency_slowdown": 0.5}
    data = calibration_json(
        workload, {"m": {"call_s": 1e-3}, "old": {}}, call_s=0.5e-3, sequence=sequence, **cluster
    )
    own = latency_slowdowns(sequence, cost_model(data["fit"], 2, call_s=1e-3), 0.0)
    data["models"]["m"].update(own)
    calibration = Calibration.from_json(data)
    mine = calibration.for_model("m")
    assert mine.cost(4096).seconds == pytest.approx(1e-3)
    assert mine.contention("m") == {"slowdown": 0.0, "comm_slowdown": 0.0, **own}
    end = model_trickle(16e-3, 16, mine.cost, 0.0, *own.values())[0]
    assert end == pytest.approx(repeats[0][0], rel=1e-9)
    assert own["comm_latency_slowdown"] < 0.5
    assert calibration.for_model("old").contention("old") == {
        "slowdown": 0.0,
        "comm_slowdown": 0.0,
        **cluster,
    }


def test_calibrate_keeps_each_models_call_and_its_trickle_pair():
    # `model_fits`, what `calibrate` keeps per model: the call after backward is its
    # sequence's slope (1 and 16 calls in 2 and 47 ms: 3 ms a call) less the fit's cost
    # of 4 KiB (0 here); the trickle's pair is the cluster's trickle fitted again with
    # that 3 ms call, not the cluster's (0.8, 0.5).
    workload = two_gradients(0.020, 0.020, 0.0).workloads["m"]
    sequence = trickled_at_half_a_millisecond()
    calls = {"size_bytes": 4096, "lengths": [1, 16], "seconds": [[2e-3] * 3, [47e-3] * 3]}
    measured = {"calls_after_backward": calls, "comm_with_backward_s": [[3.0, 2.0]]}
    data = calibration_json(workload, {"m": {"comm_alone_s": 2.0, **measured}}, sequence=sequence)
    fits = model_fits(data["models"]["m"], data["fit"], 2, sequence, 0.0)
    assert fits["call_s"] == pytest.approx(3e-3)
    assert fits["comm_slowdown"] == pytest.approx(1.0)
    again = latency_slowdowns(sequence, cost_model(data["fit"], 2, call_s=3e-3), 0.0)
    assert {k: fits[k] for k in again} == pytest.approx(again)
    assert fits["latency_slowdown"] != pytest.approx(0.8, abs=1e-3)


def test_known_compute_predicts_again_with_the_measured_compute_by_hand(tmp_path, capsys):
    # The MLP's compute calibrated at 35 ms a step (forward 10, a 20 ms backward with the
    # gradients ready at 10 and 20 ms, optimizer 5), every collective 1 ms, no copies.
    # compute_only measured 70 ms in the benchmark: every phase and ready time doubles.
    # Predicted again: naive 20 + 40 + two all-reduces + 10 = 72 ms; bucketed with one
    # bucket 71. Measured 80 and 71: errors 10% and 0%. compute_only is not a run.
    from profiling.simulate import cli
    from profiling.simulate.cpu_cluster.analyse import known_compute
    from profiling.simulate.cpu_cluster.predict import with_compute_ms

    workload = two_gradients(0.010, 0.020, 0.001).workloads["m"]
    calibration = calibration_json(workload, {"mlp": {}}, call_s=0.001)
    doubled = with_compute_ms(Calibration.from_json(calibration), "mlp", 70.0).workloads["mlp"]
    assert (doubled.forward_s, doubled.backward_s, doubled.optimizer_s) == pytest.approx(
        (0.020, 0.040, 0.010)
    )
    assert [g.ready_s for g in doubled.grads] == pytest.approx([0.020, 0.040])
    runs = [run("compute_only"), run("naive"), run("bucketed", 1e6)]
    record = bench_record(
        [
            variant("compute_only", None, [70, 70, 70, 70]),
            variant("naive", 1e6, [80, 80, 80, 80]),
            variant("bucketed", 1e6, [71, 71, 71, 71]),
        ]
    )
    data = {
        "calibrations": [calibration],
        "predictions": [{**r.to_json(), "predicted_ms": 35.0} for r in runs],
        "bench": [record],
    }
    again = known_compute(data, measurements([record]))
    assert again == pytest.approx({run("naive"): 72.0, run("bucketed", 1e6): 71.0})
    # The command, from a validate run's JSON.
    path = tmp_path / "validate.json"
    path.write_text(json.dumps(data))
    cli.main(["validate", "--render", str(path), "--known-compute"])
    printed = capsys.readouterr().out
    assert "(after the fact), mlp: median 5.0%, worst 10.0% over 2 runs\n" in printed
    assert "  mlp 1gbit x2 naive: 72.0 against 80.0 ms (10.0%)\n" in printed


def test_a_stage_with_one_process_group_keeps_one_lane_by_hand():
    # Two gradients, the last parameter's ready 10 ms into a 20 ms backward, the first's
    # at its end; 15 ms a collective; one parameter per bucket. After a 10 ms forward,
    # the first bucket flies 20-35 ms; the second, ready at 30, waits for the lane:
    # 35-50, then the optimizer: 55 ms. (Two lanes would end it at 50: 30-45.)
    run = Run("m", "1gbit", 2, "overlapped", 1e-6)
    assert predict(run, two_gradients(0.020, 0.010, 0.015))["predicted_ms"] == pytest.approx(55.0)


def test_torchs_default_layout_against_uniform_caps_by_hand():
    # Gradients ready 2 (d, 0.5 MiB), 5 (c), 10 (b) and 20 ms (a, 2 MiB each) into a
    # 20 ms backward; forward 10, optimizer 5; 5 ms per MiB, no latency. torch's
    # default adds d, then c, and closes its 1 MiB first bucket once past the cap:
    # d+c, 15-27.5 ms; b and a (4 MiB, under 25), ready at 30: 30-50; the optimizer:
    # 55 ms. (Closed before the cap, as the stages do, d would go alone and c, b, a
    # together: 65 ms.) The drop-in at 2 MiB, one each: d 12-14.5, c 15-25, b 25-35,
    # a 35-45: 50 ms, 9.1% under torch's; at 1.5 MiB the same layout; one bucket,
    # ready at 30: 30-62.5, then 67.5.
    from profiling.simulate.cpu_cluster.bucket_layouts import (
        Shape,
        default_against_caps,
        parse_shape,
    )

    MiB = 2**20
    calibration = two_gradients(0.0, 0.0, 0.0, buffer_bytes={"m": []})
    calibration = dataclasses.replace(calibration, cost=linear_cost(0.0, 0.005 / MiB))
    workload = Workload(
        (
            Grad("a", 2 * MiB, 0.020),
            Grad("b", 2 * MiB, 0.010),
            Grad("c", 2 * MiB, 0.005),
            Grad("d", MiB // 2, 0.002),
        ),
        forward_s=0.010,
        backward_s=0.020,
        optimizer_s=0.005,
    )
    r = default_against_caps(workload, calibration, (1.5, 2.0, 1e6), model="m")
    assert r["default_ms"] == pytest.approx(55.0)
    # + the drop-in's 32 bytes of status rows, 0.15 us
    assert r["caps_ms"] == pytest.approx({1.5: 50.0, 2.0: 50.0, 1e6: 67.5}, abs=1e-3)
    assert (r["best_cap_mb"], r["tied_caps_mb"]) == (2.0, [1.5, 2.0])
    assert r["gain_pct"] == pytest.approx(100 / 11, abs=1e-2)
    # A calibration that timed the drop-in's own step at 2 MiB timed it on its own
    # shape, not this one: the caps come out the same.
    timed = dataclasses.replace(calibration, own_steps_s={"m": {("drop_in", 2.0): 0.010}})
    assert default_against_caps(workload, timed, (1.5, 2.0, 1e6), model="m") == r
    assert parse_shape("512x20X512") == Shape(512, 20, 512)
    with pytest.raises(ValueError, match="shape '512x20'"):
        parse_shape("512x20")


def test_buckets_command_reads_the_docs_calibration(tmp_path, capsys):
    from profiling.simulate import cli
    from profiling.simulate.cpu_cluster.__main__ import COMMANDS

    def main(argv: list[str]) -> None:
        cli.main([*argv, "--no-files"], commands=COMMANDS)

    out = tmp_path / "buckets.md"
    main(["buckets", "--shapes", "64x3x16", "--repeats", "1", "--markdown", str(out)])
    row = [line for line in out.read_text().splitlines() if line.startswith("| 64x3")]
    assert len(row) == 1 and row[0].endswith("% |"), out.read_text()
    with pytest.raises(SystemExit, match="no calibration of mlp at 1gbit on 3 ranks"):
        main(["buckets", "--shapes", "64x3x16", "--nproc", "3"])
    with pytest.raises(SystemExit, match="shape '64x3'"):
        main(["buckets", "--shapes", "64x3"])
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        main(["buckets", "--repeats", "0"])


def predicted_again(data: dict) -> dict[Run, float]:
    """Every run of a kept validation predicted again from its kept calibrations."""
    out = {}
    for p in data["predictions"]:
        run = Run.from_json(p)
        c = calibration_for(data["calibrations"], run.rate, run.world_size, run.model)
        out[run] = predict(run, Calibration.from_json(c))["predicted_ms"]
    return out


def test_run_z_predicted_again_is_as_predicted_and_its_stages_own_time_counts():
    # Run Z, the first whose calibrations timed each stage's own step: predicted again
    # from its kept calibrations, every run comes out as it was predicted before it was
    # measured. Without the stages' own time the same measurement scores worse, and the
    # CNN's drop_in, whose own time is the largest part of its step, is predicted short.
    import copy

    data = json.loads((RESULTS / "simulate-validate-z.json").read_text())
    now = predicted_again(data)
    kept = {Run.from_json(p): p["predicted_ms"] for p in data["predictions"]}
    assert now == pytest.approx(kept)
    without = copy.deepcopy(data)
    for c in without["calibrations"]:
        for m in c["models"].values():
            del m["own_steps"]
    less = predicted_again(without)
    measured = measurements(data["bench"])
    with_own, without_own = analyse(now, measured), analyse(less, measured)
    assert with_own["worst_error_pct"] < without_own["worst_error_pct"]
    assert with_own["median_error_pct"] <= without_own["median_error_pct"]
    drop_in = [r for r in now if r.model == "cnn" and r.stage == "drop_in"]
    assert all(less[r] < now[r] for r in drop_in)


def test_each_model_is_calibrated_just_before_its_own_benchmark(tmp_path, monkeypatch, capsys):
    # The whole grid with the calibration and the benchmark stood in for by run V's: on
    # every cluster, each model's calibration (of that model alone) comes right before
    # its benchmark, and its runs are predicted from it, before it is measured.
    import profiling.simulate.cpu_cluster.calibration as calibration_module
    from profiling.simulate import cli
    from profiling.simulate.cpu_cluster import validate

    kept = json.loads((RESULTS / "simulate-validate-v.json").read_text())
    events, made = [], {}

    def calibrate(rate, world_size, configs, *, layouts):
        events.append(("calibrate", rate, world_size, tuple(configs)))
        (model,) = configs  # one model per calibration
        # and every stage's step of its runs, to be timed with no communication
        assert layouts == {model: [("naive", None)] + [
            (stage, cap) for stage in BUCKETED_STAGES for cap in CAPS_MB[model]
        ]}  # fmt: skip
        c = calibration_for(kept["calibrations"], rate, world_size, model)
        made[model, rate, world_size] = {**c, "models": {model: c["models"][model]}}
        return made[model, rate, world_size]

    def bench(command, path):
        opts = dict(a.removeprefix("--").split("=", 1) for a in command if a.startswith("--m"))
        rate, world = (
            command[command.index("--network") + 1],
            int(command[command.index("--nproc") + 1]),
        )
        events.append(("bench", opts["model"], rate, world))
        predicted = {
            Run.from_json(p).group for p in json.loads(Path(out).read_text())["predictions"]
        }
        assert (opts["model"], rate, world) in predicted  # predicted before it is measured
        return [
            r
            for r in kept["bench"]
            if (
                r["settings"]["model"],
                r["settings"]["network"]["rate"].split()[0],
                r["settings"]["world_size"],
            )
            == (opts["model"], rate, world)
        ]

    monkeypatch.setattr(calibration_module, "calibrate", calibrate)
    monkeypatch.setattr(validate, "_bench", bench)
    out = tmp_path / "w.json"
    cli.main(["validate", "--json", str(out)])
    assert events == [
        step
        for rate in RATES
        for world in WORLD_SIZES
        for model in ("cnn", "mlp")
        for step in (("calibrate", rate, world, (model,)), ("bench", model, rate, world))
    ]
    data = json.loads(out.read_text())
    assert len(data["calibrations"]) == 8 and len(data["predictions"]) == 104 + 8
    for p in data["predictions"]:
        run = Run.from_json(p)
        own = Calibration.from_json(made[run.group])
        assert p["predicted_ms"] == pytest.approx(predict(run, own)["predicted_ms"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("prediction error: median ")
