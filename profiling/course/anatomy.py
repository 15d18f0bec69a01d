"""The data behind "Anatomy of a step", the docs' page with sliders, and its figure.

    python -m profiling.course.anatomy             # under runs/anatomy
    python -m profiling.course.anatomy --docs      # the docs' own: docs/js/anatomy-workload.js
                                            # and docs/images/bucket-curve.png
    python -m profiling.course.anatomy --docs --from-page   # the same from the compute
                                            # in the page's data, its layouts laid out again

The page draws one optimizer step of naive, bucketed, overlapped or skip_sync on two
ranks, for either of two MLPs and any bandwidth, per-message latency, `bucket_cap_mb`
and number of micro-batches. It computes the step in the browser (docs/js/anatomy.js) with the step
model's event loop (`profiling.simulate.schedule.simulate`, with no sharing: backward
runs at its own speed whatever is in flight), from what this command writes: two MLPs at
128 samples per rank (the course's, 2048 x 7, 14 gradients in 96 MiB; and 1024 x 24, 48
gradients in 92 MiB, about the same compute), their compute as `profiling.course.numbers`
measured it (forward, backward, each gradient's ready time, optimizer; read from
--numbers, so the sliders and every page quote one measurement), and the stages' bucket
layout at each cap. `step` below is the
same computation in Python; the docs' browser test checks the page against it on a grid.

The cost of one all-reduce on 2 ranks (a ring): 2(p - 1) = 2 messages, each paying the
per-message latency, and 2(p - 1)/p = 1 times its bytes through each rank's link.

The figure: step time against `bucket_cap_mb` for bucketed and overlapped, with and
without per-message latency, on the 48-gradient MLP. It measures nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from profiling.common import report
from profiling.course import quoted
from profiling.simulate.cpu_cluster.inputs import workload_from_json
from profiling.simulate.layouts import uniform_buckets
from profiling.simulate.outputs import repository_docs
from profiling.simulate.schedule import (
    Grad,
    Segment,
    StageSchedule,
    Step,
    Workload,
    linear_cost,
    simulate,
)
from stages.auto_bucket import CANDIDATES_MB

# The course's MLP (course_timelines'), and one of about the same gradient bytes and
# compute cut into 48 gradients instead of 14, where per-message latency shows.
MODELS = {
    "mlp_2048x7": quoted.MLP,
    "mlp_1024x24": {"model": "mlp", "width": 1024, "depth": 24, "batch_size": 128},
}
CURVE_MODEL = "mlp_1024x24"
RANKS = 2
# The caps laid out, MiB: the automatic stage's candidates (`CANDIDATES_MB`) up to one
# bucket for either MLP (96 MiB of gradients at most), and 16 and 40, around where the
# course's MLP changes layout: up to 16 MiB each 16 MiB weight and each bias is a bucket
# of its own (12), from 17 MiB a weight takes a bias along (6), from 33 MiB two weights
# share a bucket (3), from 49 MiB three (2).
CAPS_MB = tuple(sorted({cap for cap in CANDIDATES_MB if cap <= 100.0} | {16.0, 40.0}))
STAGES = ("naive", "bucketed", "overlapped", "skip_sync")


def allreduce_cost(gbit_s: float, message_latency_s: float):
    """bytes -> Cost of one ring all-reduce over RANKS ranks at `gbit_s` per link."""
    messages = 2 * (RANKS - 1)
    bytes_on_link = 2 * (RANKS - 1) / RANKS  # times the gradient bytes
    return linear_cost(messages * message_latency_s, bytes_on_link * 8 / (gbit_s * 1e9))


def layouts(workload: Workload) -> dict[str, list[list[int]]]:
    """naive's layout (one gradient per collective, parameter order, as it sends them),
    one gradient per bucket in the bucketed stages' reverse order, and theirs at each of
    CAPS_MB."""
    n = len(workload.grads)
    return {
        "naive": [[i] for i in range(n)],
        "per_parameter": [[i] for i in reversed(range(n))],
        **{f"{cap:g}": uniform_buckets(workload, cap) for cap in CAPS_MB},
    }


# --8<-- [start:step]
def step(
    workload: Workload,
    buckets: list[list[int]],
    stage: str,
    gbit_s: float,
    message_latency_s: float,
    micro_batches: int,
) -> Step:
    """One optimizer step of `micro_batches` micro-batches, with `buckets` the stage's
    layout (the caller's pick: naive's, one per gradient in parameter order, or a cap's).
    skip_sync synchronises only the last (no_sync on the others); the other stages
    synchronise every one, so the step is that many synchronised micro-batches, then the
    optimizer."""
    cost = allreduce_cost(gbit_s, message_latency_s)
    overlap = stage in ("overlapped", "skip_sync")
    if stage == "skip_sync":
        return simulate(workload, buckets, cost, StageSchedule(overlap, 1, micro_batches))
    one = simulate(workload, buckets, cost, StageSchedule(overlap))
    micro_s = one.step_s - workload.optimizer_s  # the optimizer is last, after the rest
    out = Step(compute_s=micro_batches * (one.compute_s - workload.optimizer_s)
               + workload.optimizer_s)  # fmt: skip
    for m in range(micro_batches):
        shift = m * micro_s
        out.segments += [
            Segment(s.lane, s.label, s.start_s + shift, s.end_s + shift)
            for s in one.segments
            if s.label != "optimizer"
        ]
    t = micro_batches * micro_s
    out.segments.append(Segment("compute", "optimizer", t, t + workload.optimizer_s))
    out.step_s = t + workload.optimizer_s
    return out


def bound_s(
    workload: Workload, buckets: list[list[int]], stage: str, gbit_s: float,
    message_latency_s: float, micro_batches: int,
) -> float:  # fmt: skip
    """The step no schedule can beat: each synchronised micro-batch takes at least its
    forward and then the longer of its backward and its all-reduces back to back (they
    cannot start before backward does); the others, forward and backward; then the
    optimizer."""
    cost = allreduce_cost(gbit_s, message_latency_s)
    comm_s = sum(cost(sum(workload.grads[i].nbytes for i in b)).seconds for b in buckets)
    synced = 1 if stage == "skip_sync" else micro_batches
    f, b = workload.forward_s, workload.backward_s
    return (micro_batches - synced) * (f + b) + synced * (f + max(b, comm_s)) + workload.optimizer_s


# --8<-- [end:step]


def cap_groups(layout_at: dict[str, list[list[int]]]) -> list[dict]:
    """The cap slider's positions after one parameter per bucket: CAPS_MB cut into runs of
    caps that give the same layout, so that every position changes it. Each names its
    layout (its first cap's) and the caps it stands for."""
    groups: list[dict] = []
    for cap in CAPS_MB:
        if groups and layout_at[groups[-1]["layout"]] == layout_at[f"{cap:g}"]:
            groups[-1]["caps_mb"].append(cap)
        else:
            groups.append({"layout": f"{cap:g}", "caps_mb": [cap]})
    return groups


def to_json(workloads: dict[str, Workload]) -> dict:
    return {
        "ranks": RANKS,
        "caps_mb": list(CAPS_MB),
        "models": {name: model_json(MODELS[name], w) for name, w in workloads.items()},
    }


def model_json(model: dict, workload: Workload) -> dict:
    layout_at = layouts(workload)
    return {
        "model": model,
        "grads": [
            {"name": g.name, "bytes": g.nbytes, "ready_s": g.ready_s} for g in workload.grads
        ],
        "forward_s": workload.forward_s,
        "backward_s": workload.backward_s,
        "optimizer_s": workload.optimizer_s,
        "layouts": layout_at,
        "cap_groups": cap_groups(layout_at),
    }


def from_json(data: dict) -> Workload:
    """One model's workload from the page's data (`data["models"][name]`)."""
    grads = tuple(Grad(g["name"], g["bytes"], g["ready_s"]) for g in data["grads"])
    return Workload(grads, data["forward_s"], data["backward_s"], data["optimizer_s"])


def read_page_data(path: Path) -> dict:
    """The JSON inside docs/js/anatomy-workload.js (`window.ANATOMY = {...};`)."""
    text = path.read_text()
    return json.loads(text[text.index("{") : text.rindex("}") + 1])


def draw_curve(workload: Workload, data: dict, path: Path) -> None:
    """Step time against bucket_cap_mb for bucketed and overlapped at 1 and 10 Gbit/s,
    with no per-message latency and with 2 ms: `workload` and its layouts in `data`."""
    matplotlib.use("Agg")
    plt.rcParams.update({"font.size": report.FIGURE_FONT_PT})
    fig, axes = plt.subplots(1, 2, figsize=(report.FIGURE_WIDTH_IN, 4.0))
    for ax, gbit in zip(axes, (1.0, 10.0), strict=True):
        for stage, style in (("bucketed", "--"), ("overlapped", "-")):
            for latency_ms, colour in ((0.0, "#4c72b0"), (2.0, "#c44e52")):
                ys = [
                    step(workload, data["layouts"][f"{cap:g}"], stage, gbit, latency_ms / 1e3, 1)
                    .step_s * 1e3
                    for cap in CAPS_MB
                ]  # fmt: skip
                ax.plot(CAPS_MB, ys, style, color=colour, marker="o", markersize=3,
                        label=f"{stage}, {latency_ms:g} ms per message")  # fmt: skip
        ax.axhline(workload.compute_s * 1e3, color="grey", linewidth=0.8, label="compute alone")
        ax.set_xscale("log")
        ticks = (0.25, 1.0, 5.0, 25.0, 100.0)
        ax.set_xticks(ticks, [f"{c:g}" for c in ticks])
        ax.minorticks_off()
        ax.set_title(f"simulated, {gbit:g} Gbit/s", loc="left")
        ax.set_xlabel("bucket_cap_mb (MiB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("simulated step (ms)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=2, frameon=False)
    fig.tight_layout(rect=(0, 0.24, 1, 1))
    report.save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.course.anatomy",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/anatomy"),
        help="folder for the data and the figure (default: runs/anatomy)",
    )  # fmt: skip
    parser.add_argument(
        "--docs", action="store_true", help="refresh the docs' own data and figure instead"
    )
    parser.add_argument(
        "--numbers", type=Path, default=quoted.DATA,
        help="the measured compute: profiling.course.numbers' file (default: the docs' own)",
    )  # fmt: skip
    parser.add_argument(
        "--from-page", action="store_true",
        help="take the compute in the docs' page data instead, and lay out its buckets "
        "again (with --docs, rewriting the page data in place)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    docs = repository_docs() if args.docs or args.from_page else None
    scripts, images = (docs / "js", docs / "images") if args.docs else (args.out, args.out)
    if args.from_page:
        page = read_page_data(docs / "js" / "anatomy-workload.js")["models"]
        workloads = {name: from_json(page[name]) for name in MODELS}
    else:
        measured = quoted.load(args.numbers, "workloads")["workloads"]
        workloads = {name: workload_from_json(measured[name]) for name in MODELS}
    data = to_json(workloads)
    scripts.mkdir(parents=True, exist_ok=True)
    script = scripts / "anatomy-workload.js"
    script.write_text(
        "// Written by python -m profiling.course.anatomy --docs: two MLPs' measured compute\n"
        "// and the stages' bucket layouts, for docs/js/anatomy.js.\n"
        f"window.ANATOMY = {json.dumps(data, separators=(',', ':'))};\n"
    )
    print(f"wrote {script}")
    images.mkdir(parents=True, exist_ok=True)
    curve = images / "bucket-curve.png"
    model = data["models"][CURVE_MODEL]
    draw_curve(from_json(model), model, curve)
    print(f"wrote {curve}")


if __name__ == "__main__":
    main()
