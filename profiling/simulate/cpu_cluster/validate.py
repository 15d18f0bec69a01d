"""Predictions against the virtual cluster: predict a grid of runs, then measure them.

    python -m profiling.simulate validate --quick      # 13 runs, about 3 minutes
    python -m profiling.simulate validate --json docs/results/simulate-validate.json \\
        --markdown docs/results/simulate-validate.md     # the whole grid
    python -m profiling.simulate validate --render docs/results/simulate-validate.json \\
        --markdown docs/results/simulate-validate.md     # the table again, nothing run
    python -m profiling.simulate validate --render docs/results/simulate-validate.json \\
        --known-compute     # and each run again with the compute measured (after the fact)

In order, for every (rate, world size) of the grid and every model: calibrate that
model on a fresh cluster (`calibration.calibrate`: the all-reduce cost, whether two collectives
overlap, the model's compute and its slowdown under communication, and what each stage
of its runs takes beyond the compute with nothing communicated); then predict its
runs there and print the predictions; only then measure them, with one
`profiling.bench` invocation: every stage at every bucket cap interleaved in the same
rounds (`--variants compute_only,naive,bucketed,overlapped,drop_in --sweep
bucket_cap_mb=...`). Each model is calibrated just before its own runs are measured,
not every cluster first, nor both models of a cluster together: on a shared machine
the compute's pace drifts over minutes (docs/appendix/simulator-runs.md,
"Calibration"), and a model benchmarked second would be predicted from a compute timed
minutes before.
The table compares each run's predicted step with its measured median; the last line
sums it up:

    prediction error: median M%, worst W% over N runs;
    best bucket within the noise of the fastest: yes|no

Its targets: median <= 10%, worst <= 20% over >= 12 runs, and on every slice (model,
rate, world size, stage) the bucket cap the model picks measures within the noise of
the fastest cap measured.

A run is a (model, rate, world size, stage, bucket cap). naive has no buckets: the
benchmark builds it once per cap anyway, and its copies, the same run interleaved in the
same rounds, are pooled into one. compute_only is shown against the calibrated compute,
as a check of the compute input, and is not counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp.config import Config
from profiling.common.report import command_line, load_average, machine, read_json, write_json
from profiling.simulate.cpu_cluster import calibration
from profiling.simulate.cpu_cluster.analyse import (
    analyse,
    bench_command,
    known_compute_lines,
    measurements,
    ranking_line,
    summary_line,
)
from profiling.simulate.cpu_cluster.calibration import Calibration
from profiling.simulate.cpu_cluster.predict import (
    CAPS_MB,
    FLOOR,
    MODELS,
    QUICK,
    RATES,
    WORLD_SIZES,
    Run,
    grid,
    predict,
)
from profiling.simulate.cpu_cluster.validation_tables import markdown, text_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the MLP at 1gbit on 2 ranks: 13 runs in about 3 minutes (the whole "
        "grid, without it: 104 runs, about 25 minutes)",
    )
    parser.add_argument("--json", help="write calibration, predictions, measurements here")
    parser.add_argument("--markdown", help="write the table as a fragment for the docs")
    parser.add_argument(
        "--render", metavar="JSON", help="run nothing: the table and --markdown from this JSON"
    )
    parser.add_argument(
        "--known-compute",
        action="store_true",
        help="also predict every run again with compute_only's measured step as the compute "
        "(after the fact): how much of the error is the compute's input",
    )


def run(args: argparse.Namespace) -> None:
    if args.render:
        data = read_json(args.render, "profiling.simulate validate", "predictions")
        return _report(data, args)
    spec = (
        QUICK
        if args.quick
        else {"models": tuple(MODELS), "rates": RATES, "world_sizes": WORLD_SIZES}
    )
    runs = grid(spec["models"], spec["rates"], spec["world_sizes"])
    started = time.perf_counter()
    data = {
        "command": command_line("profiling.simulate", sys.argv[1:]),
        "grid": {
            **spec,
            "caps_mb": {m: CAPS_MB[m] for m in spec["models"]},
            "models_config": {m: MODELS[m] for m in spec["models"]},
        },
        "load_average_before": load_average(),
    }

    data["calibrations"], data["predictions"], data["bench"] = [], [], []
    configs = {m: Config(**MODELS[m]) for m in spec["models"]}
    calibrating_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for rate in spec["rates"]:
            for world in spec["world_sizes"]:
                for model in sorted(spec["models"]):
                    # 1. Calibrate this cluster for this model, just before its runs.
                    print(f"calibrating {model} at {rate} on {world} ranks ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    t0 = time.perf_counter()
                    cfg = {model: configs[model]}
                    mine = [r for r in runs if r.group == (model, rate, world)]
                    # and every stage's step of its runs with no communication
                    layouts = {model: [(r.stage, r.cap_mb) for r in mine]}
                    # (`calibration.calibrate` looked up here, where a test stands in for it)
                    calibrated = _twice(calibration.calibrate, rate, world, cfg, layouts=layouts)
                    data["calibrations"].append(calibrated)
                    calibrating_s += time.perf_counter() - t0
                    fitted = Calibration.from_json(data["calibrations"][-1])

                    # 2. Predict its runs, and show the predictions before any is measured.
                    predictions = [
                        {**r.to_json(), **predict(r, fitted)}
                        for r in sorted(
                            [Run(model, rate, world, FLOOR, None), *mine],
                            key=lambda r: r.table_order,
                        )
                    ]
                    print(f"predicted step times of {model} at {rate} on {world} ranks, "
                          "before measuring:")  # fmt: skip
                    for p in predictions:
                        print(f"  {Run.from_json(p).label:<40} {p['predicted_ms']:8.1f} ms")
                    sys.stdout.flush()
                    data["predictions"] += predictions
                    if args.json:  # kept as it grows: a later failure leaves what was done
                        write_json(args.json, data)

                    # 3. Measure: one benchmark, all its runs interleaved.
                    path = str(Path(tmp) / f"{model}-{rate}-{world}.json")
                    command = bench_command(model, rate, world, path)
                    print(f"measuring {model} at {rate} on {world} ranks ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    data["bench"] += _twice(_bench, command, path)
                    if args.json:
                        write_json(args.json, data)
    data["predictions"].sort(key=lambda p: Run.from_json(p).table_order)
    finished = time.perf_counter()
    data["machine"] = machine()
    data["elapsed_s"] = {
        "calibration": calibrating_s,
        "benchmark": finished - started - calibrating_s,
        "total": finished - started,
    }
    _report(data, args)


def _bench(command: list[str], path: str) -> list[dict]:
    code = subprocess.run(command).returncode
    if code != 0:
        raise SystemExit(
            f"profiling.simulate: the benchmark failed (exit {code}): {' '.join(command)}"
        )
    return json.loads(Path(path).read_text())["workloads"]


def _twice(measure, *args, **kwargs):
    """`measure(*args, **kwargs)`, and once more if it fails: on a machine shared with
    others' jobs, a cluster's run now and then dies of something not its own (a node
    killed from outside). A second failure stops the command."""
    try:
        return measure(*args, **kwargs)
    except SystemExit as failure:
        print(f"{failure}; trying once more", file=sys.stderr, flush=True)
        return measure(*args, **kwargs)


def _report(data: dict, args: argparse.Namespace) -> None:
    """Analyse, print the table, write --json and --markdown; the summary line last."""
    predicted = {Run.from_json(p): p["predicted_ms"] for p in data["predictions"]}
    measured = measurements(data["bench"])
    data["analysis"] = analyse(predicted, measured)
    print(text_table(data["analysis"]))
    for b in data["analysis"]["best_bucket"]:
        same = b["predicted_best_mb"] == b["measured_best_mb"]
        print(
            f"best cap {b['model']} {b['rate']} x{b['world_size']} {b['stage']}: predicted "
            f"{b['predicted_best_mb']:g}, measured {b['measured_best_mb']:g} MiB"
            + ("" if same or b["beyond_noise"] else "; measured, the two are within the noise")
            + ("" if b["ok"] else "; measured, the model's is slower in every round (missed)")
        )
    for r in data["analysis"]["ranking"]:
        if not r["ok"]:
            print(
                f"ranked differently: {r['a']} / {r['b']}, measured {r['ratio_min']:.2f}-"
                f"{r['ratio_max']:.2f} per round; predicted faster: {r['predicted_faster']}"
            )
    if "elapsed_s" in data:
        e = data["elapsed_s"]
        print(
            f"took {e['total']:.0f} s ({e['calibration']:.0f} s calibrating, "
            f"{e['benchmark']:.0f} s measuring)"
        )
    if args.json and not args.render:
        write_json(args.json, data)
    if args.markdown:
        open(args.markdown, "w").write(markdown(data))
    if getattr(args, "known_compute", False):  # a Namespace built by hand may lack it
        print("\n".join(known_compute_lines(data, measured)))
    print(ranking_line(data["analysis"]))
    print(summary_line(data["analysis"]))
