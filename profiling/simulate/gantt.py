"""One simulated step, drawn in the stage pages' two lanes: compute and communication.

    python -m profiling.simulate gantt --model resnet50 --cluster li2020 --gpus 32

One overlapped step of `--model` (a preset or yours, `usermodel`) on a cluster
(`clusters`) at --gpus and --bucket-cap-mb. The course's drawings of four stages on
the virtual CPU cluster are `python -m profiling.course.simulated_steps`, which draws with
`draw` below.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from profiling.common.charts import COLOURS
from profiling.simulate import clusters, model_args, outputs
from profiling.simulate.layouts import uniform_buckets
from profiling.simulate.schedule import StageSchedule, Step, simulate
from profiling.simulate.topology import cost_model

WIDTH_IN = 8.0  # as the traced timelines: the docs' content column
FONT_PT = 10
COPY_COLOUR = "#9e9e9e"  # the stage moving gradients into and out of its buckets


def draw(step: Step, caption: str, path: Path) -> None:
    """Two lanes, compute and communication, in ms from the step's start."""
    matplotlib.use("Agg")
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
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    model_args.add_arguments(parser)
    clusters.add_arguments(parser)
    parser.add_argument("--gpus", type=int, default=32, help="(default: 32)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="(default: 25)")
    outputs.add_arguments(parser)


def run(args: argparse.Namespace) -> None:
    """One overlapped step at --gpus, drawn, its assumptions printed."""
    try:
        cluster, custom = clusters.from_args(args)
        clusters.check_gpus(cluster.topology, args.algorithm, [args.gpus])
        topo = cluster.topology.with_gpus(args.gpus)
        workload, lines, _ = model_args.from_args(args, cluster.gpu, cluster.memory_bytes_per_s)
        buckets = uniform_buckets(workload, args.bucket_cap_mb, ready_order=True)
    except ValueError as error:
        raise SystemExit(f"gantt: {error}") from None
    name = args.cluster + (" (modified)" if custom else "")
    print("\n".join(lines + clusters.describe(cluster, name, args.algorithm)))
    step = simulate(workload, buckets, cost_model(topo, args.algorithm), StageSchedule(True))
    print(
        f"\n{args.gpus} GPUs, bucket_cap_mb {args.bucket_cap_mb:g} ({len(buckets)} buckets), "
        f"overlapped: step {step.step_s * 1e3:.1f} ms, compute {step.compute_s * 1e3:.1f} ms, "
        f"exposed communication {step.exposed_comm_s * 1e3:.1f} ms"
    )
    if args.no_files:
        return
    _, images = outputs.folders(args)
    path = images / f"gantt-{outputs.stem(args.model)}-{args.cluster}-{args.gpus}gpus.svg"
    caption = (
        f"simulated: {args.model.rpartition(':')[2]} on {args.gpus} GPUs of {name}, "
        f"{args.bucket_cap_mb:g} MiB buckets"
    )
    draw(step, caption, path)
    print(f"wrote {path}")
