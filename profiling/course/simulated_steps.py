"""The course's drawings: the simulated step of naive, bucketed, overlapped and skip_sync
on the virtual CPU cluster, in the two lanes the stage pages draw the traced step in.

    python -m profiling.course.simulated_steps --docs      # docs/images/gantt-<stage>.svg

The workload is the one `profiling.course.timelines` traces (the benchmarks' MLP,
2048 x 7, at 128 samples per rank; skip_sync with 4 micro-batches per step), its compute
as `profiling.course.numbers` measured it on one process with one thread (read from
--numbers), so each page can set the model's step beside the measured one. The
collective cost, the slowdowns and the cost per byte of a pass over the gradients (the
validation MLP's 16 MiB; this one has 96 MiB) come from a validation's calibration on
the same cluster (1 Gbit/s, 2 ranks), read from its JSON (`validate --json`); nothing
is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from profiling.common.report import read_json
from profiling.course import quoted
from profiling.simulate import outputs
from profiling.simulate.cpu_cluster.calibration import Calibration, calibration_path
from profiling.simulate.cpu_cluster.inputs import workload_from_json
from profiling.simulate.cpu_cluster.predict import calibration_for, layout
from profiling.simulate.gantt import draw
from profiling.simulate.schedule import Step, simulate

MODEL = quoted.MLP
BUCKET_CAP_MB = 25.0  # the stages' default, as the traced runs used
ACCUMULATION_STEPS = 4
STAGES = ("naive", "bucketed", "overlapped", "skip_sync")
CAPTIONS = {
    "naive": "simulated naive: after backward, one blocking all-reduce per parameter",
    "bucketed": "simulated bucketed: after backward, one all-reduce per 25 MiB bucket",
    "overlapped": "simulated overlapped: each bucket's all-reduce starts inside backward",
    "skip_sync": f"simulated skip_sync: {ACCUMULATION_STEPS} micro-batches, the last synchronises",
}


def simulate_stages(workload, calibration) -> dict[str, Step]:
    """Each of STAGES' simulated step on `workload` with `calibration`'s cost and
    slowdowns (the MLP's)."""
    # Its copies and its call after backward too, where measured (both timed on the
    # validation's MLP, 1024 x 5, not on this trace's 2048 x 7).
    calibration = calibration.for_model("mlp")

    def plan(stage: str):  # the validation's layout, schedule and stage's work
        return layout(stage, workload, BUCKET_CAP_MB, calibration)

    buckets, overlap, work = plan("overlapped")
    plans = {
        "naive": plan("naive"),
        "bucketed": plan("bucketed"),
        "overlapped": (buckets, overlap, work),
        "skip_sync": (
            buckets,
            dataclasses.replace(overlap, accumulation_steps=ACCUMULATION_STEPS),
            work,
        ),
    }
    contention = calibration.contention("mlp")
    return {
        stage: simulate(workload, buckets, calibration.cost, schedule,
                        dataclasses.replace(work, **contention))
        for stage, (buckets, schedule, work) in plans.items()
    }  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument(
        "--calibration", type=Path,
        help="a validation's JSON (validate --json): its calibration at --rate, --world-size "
        "(default: the docs' own in this checkout)",
    )  # fmt: skip
    parser.add_argument(
        "--numbers", type=Path, default=quoted.DATA,
        help="the measured compute: profiling.course.numbers' file (default: the docs' own)",
    )  # fmt: skip
    parser.add_argument("--rate", default="1gbit", help="(default: 1gbit)")
    parser.add_argument("--world-size", type=int, default=2, help="(default: 2)")
    outputs.add_arguments(parser)


def run(args: argparse.Namespace) -> None:
    path = calibration_path(args.calibration)
    data = read_json(
        path, "profiling.course.simulated_steps", "calibrations", "profiling.simulate validate"
    )
    try:
        found = calibration_for(data["calibrations"], args.rate, args.world_size, MODEL["model"])
    except KeyError as e:
        raise SystemExit(f"{path}: {e.args[0]}; pass --rate and --world-size") from None
    calibration = Calibration.from_json(found)
    measured = quoted.load(args.numbers, "workloads")["workloads"]
    workload = workload_from_json(measured["mlp_2048x7"])
    steps = simulate_stages(workload, calibration)
    if args.no_files:  # print only
        for stage, step in steps.items():
            print(f"{stage}: simulated step {step.step_s * 1e3:.0f} ms")
        return
    _, images = outputs.folders(args)
    for stage, step in steps.items():
        path = images / f"gantt-{stage}.svg"
        draw(step, CAPTIONS[stage], path)
        print(f"{stage}: simulated step {step.step_s * 1e3:.0f} ms, wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m profiling.course.simulated_steps")
    add_arguments(parser)
    run(parser.parse_args())
