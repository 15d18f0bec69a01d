"""The simulated step of naive, bucketed, overlapped and skip_sync, drawn in two lanes.

As the stage pages draw the traced step: a compute lane and a communication lane.

    python -m profiling.simulate gantt      # docs/images/gantt-<stage>.svg

The workload is the one `profiling.course_timelines` traces (the benchmarks' MLP,
2048 x 7, at 128 samples per rank; skip_sync with 4 micro-batches per step), its compute
measured here on one process with one thread (`inputs.measure_workload`), so each page
can set the model's step beside the measured one. The collective cost, the slowdowns
and the cost per byte of a pass over the gradients (the validation MLP's 16 MiB; this
one has 96 MiB) come from a validation's calibration on the same cluster (1 Gbit/s,
2 ranks), read from its JSON (`validate --json`); nothing else is run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from profiling.report import read_json
from profiling.simulate.schedule import Step

MODEL = {"model": "mlp", "width": 2048, "depth": 7, "batch_size": 128}
BUCKET_CAP_MB = 25.0  # the stages' default, as the traced runs used
ACCUMULATION_STEPS = 4
STAGES = ("naive", "bucketed", "overlapped", "skip_sync")
CAPTIONS = {
    "naive": "simulated naive: after backward, one blocking all-reduce per parameter",
    "bucketed": "simulated bucketed: after backward, one all-reduce per 25 MiB bucket",
    "overlapped": "simulated overlapped: each bucket's all-reduce starts inside backward",
    "skip_sync": f"simulated skip_sync: {ACCUMULATION_STEPS} micro-batches, the last synchronises",
}
WIDTH_IN = 8.0  # as the traced timelines: the docs' content column
FONT_PT = 10
COPY_COLOUR = "#9e9e9e"  # the stage moving gradients into and out of its buckets


def simulate_stages(workload, calibration) -> dict[str, Step]:
    """Each of STAGES' simulated step on `workload` with `calibration`'s cost and
    slowdowns (the MLP's)."""
    import dataclasses

    from profiling.simulate.schedule import simulate
    from profiling.simulate.validate import layout

    # Its copies and its call after backward too, where measured (both timed on the
    # validation's MLP, 1024 x 5, not on this trace's 2048 x 7).
    calibration = calibration.for_model("mlp")

    def plan(stage: str):  # the validation's layout and schedule of each stage
        return layout(stage, workload, BUCKET_CAP_MB, calibration)

    buckets, overlap = plan("overlapped")
    plans = {
        "naive": plan("naive"),
        "bucketed": plan("bucketed"),
        "overlapped": (buckets, overlap),
        "skip_sync": (
            buckets,
            dataclasses.replace(overlap, accumulation_steps=ACCUMULATION_STEPS),
        ),
    }
    return {
        stage: simulate(
            workload, layout, calibration.cost, schedule, **calibration.contention("mlp")
        )
        for stage, (layout, schedule) in plans.items()
    }


def draw(step: Step, caption: str, path: Path) -> None:
    """Two lanes, compute and communication, in ms from the step's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from profiling.compare import COLOURS

    plt.rcParams.update({"font.size": FONT_PT, "svg.fonttype": "none"})  # text stays text
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 2.6))
    colours = {**COLOURS, "copy": COPY_COLOUR}
    for s in step.lane("compute"):
        phase = s.label.split()[0]  # "backward (no_sync 1)" is backward too
        ax.broken_barh(
            [(s.start_s * 1e3, (s.end_s - s.start_s) * 1e3)], (0.65, 0.7), color=colours[phase]
        )
    comm = [s for s in step.segments if s.lane.startswith("comm")]
    ax.broken_barh(
        [(s.start_s * 1e3, (s.end_s - s.start_s) * 1e3) for s in comm],
        (-0.35, 0.7),
        color=COLOURS["gloo"],
        edgecolor="white",  # back-to-back all-reduces show as separate bars
        linewidth=0.8,
    )
    ax.set_yticks([1, 0], ["compute", "comm"])
    ax.set_xlabel(f"ms from the start of the step (simulated: {step.step_s * 1e3:.0f} ms)")
    ax.set_title(caption, loc="left")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=COLOURS[k], label=k) for k in ("forward", "backward", "optimizer")]
    if any(s.label.startswith("copy") for s in step.segments):
        handles.append(Patch(color=COPY_COLOUR, label="gradient copies"))
    handles.append(Patch(color=COLOURS["gloo"], label="all-reduce in flight"))
    fig.legend(handles=handles, loc="lower center", ncols=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))  # room for the legend
    fig.savefig(path)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--calibration",
        type=Path,
        default=Path("docs/results/simulate-validate.json"),
        help="a validation's JSON (validate --json): its calibration at --rate, --world-size",
    )
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/images"), help="gantt-<stage>.svg")


def run(args: argparse.Namespace) -> None:
    from ddp.config import Config
    from ddp.heap import steady_heap
    from profiling.simulate.calibrate import Calibration
    from profiling.simulate.inputs import measure_workload
    from profiling.simulate.validate import calibration_for

    data = read_json(
        args.calibration, "profiling.simulate gantt", "calibrations", "profiling.simulate validate"
    )
    try:
        found = calibration_for(data["calibrations"], args.rate, args.world_size, MODEL["model"])
    except KeyError as e:
        raise SystemExit(f"{args.calibration}: {e.args[0]}; pass --rate and --world-size") from None
    calibration = Calibration.from_json(found)
    print("measuring the workload's compute ...", file=sys.stderr, flush=True)
    steady_heap()  # the heap as the benchmark's and the calibration's ranks hold it
    workload = measure_workload(Config(**MODEL), args.world_size)
    for stage, step in simulate_stages(workload, calibration).items():
        path = args.out / f"gantt-{stage}.svg"
        draw(step, CAPTIONS[stage], path)
        print(f"{stage}: simulated step {step.step_s * 1e3:.0f} ms, wrote {path}")
