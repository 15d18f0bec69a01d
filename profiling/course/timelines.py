"""One step of each of the first four stages, drawn from its own trace on a shaped network.

    sudo .venv/bin/python -m profiling.course.timelines               # run, then draw
    .venv/bin/python -m profiling.course.timelines --analyse-only     # draw from runs/course

Each stage trains the same MLP on the 1 Gbit/s virtual cluster (`profiling.cluster`: two
network namespaces, so Gloo waits on a shaped link as between machines), traced with
`--profile-dir`. The figure of a stage shows that stage's median traced step, per rank, as
two lanes: compute (forward, backward, optimizer ops on the main thread) and
communication (the collectives in flight on Gloo's threads). So the reader sees each idea
happen: communication after backward, one bar per parameter (naive); fewer, larger bars
(bucketed); bars under backward (overlapped); k micro-batches, then one synchronisation
(skip_sync). The figures are SVG, drawn at the page's width with 10 pt text or larger.

Running needs root (network namespaces) and removes the cluster when it ends, even on
an error. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from profiling.analysis import analyse_runs, read_logdir, step_timeline
from profiling.common import report
from profiling.common.charts import COLOURS

# The workload: the benchmarks page's MLP (25.2M parameters, 96 MiB of gradients), at
# half its batch so that four stages trace in a few minutes.
WORKLOAD = ["--model", "mlp", "--width", "2048", "--depth", "7", "--batch-size", "128"]
TRACING = ["--steps", "4", "--warmup-steps", "2", "--profile-steps", "2"]
ACCUMULATION_STEPS = 4  # skip_sync: micro-batches per synchronisation
STAGES = {  # stage -> its own options
    "naive": [],
    "bucketed": [],
    "overlapped": [],
    "skip_sync": ["--accumulation-steps", str(ACCUMULATION_STEPS)],
}
CAPTIONS = {
    "naive": "naive: after backward, one blocking all-reduce per parameter",
    "bucketed": "bucketed: after backward, one all-reduce per 25 MiB bucket",
    "overlapped": "overlapped: each bucket's all-reduce starts inside backward",
    "skip_sync": f"skip_sync: {ACCUMULATION_STEPS} micro-batches, only the last synchronises",
}
RATE = "1gbit"
WIDTH_IN = 8.0  # the docs' content column is about 770 px: 8 in at 96 px/in
FONT_PT = 10


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.course.timelines", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--logdir", type=Path, default=Path("runs/course"), help="traces")
    parser.add_argument(
        "--out", type=Path, default=Path("docs/images"), help="where timeline-<stage>.svg go"
    )
    parser.add_argument(
        "--analyse-only", action="store_true", help="draw from traces already in --logdir"
    )
    args = parser.parse_args(argv)
    if not args.analyse_only:
        run(args.logdir)
    draw(args.logdir, args.out)


def run(logdir: Path) -> None:
    """Trace every stage of STAGES on a fresh 2-rank cluster, removed at the end."""
    cluster = [sys.executable, "-m", "profiling.cluster"]
    subprocess.run([*cluster, "up", "--ranks", "2", "--rate", RATE], check=True)
    try:
        for stage, options in STAGES.items():
            print(f"tracing {stage} ...", file=sys.stderr, flush=True)
            job = ["-m", f"stages.{stage}", *WORKLOAD, *TRACING, *options]
            # Kineto's USDT start/stop lines stay out of the console (as profiling.compare).
            env = {"KINETO_LOG_LEVEL": "6", **os.environ}
            command = [*cluster, "run", "--", *job, "--profile-dir", str(logdir)]
            subprocess.run(command, check=True, env=env)
    finally:
        subprocess.run([*cluster, "down"], check=True)


def draw(logdir: Path, out: Path) -> list[Path]:
    matplotlib.use("Agg")
    plt.rcParams.update({"font.size": FONT_PT, "svg.fonttype": "none"})  # text stays text
    traces = read_logdir(logdir)
    missing = [s for s in STAGES if s not in traces]
    if missing:
        raise SystemExit(f"{logdir}: no traces for {missing}; run without --analyse-only")
    results = analyse_runs({s: traces[s] for s in STAGES})
    written = []
    for stage in STAGES:
        ranks = sorted((r for r in results if r.run == stage), key=lambda r: r.rank)
        drawn = [(r, step_timeline(traces[stage][r.rank], r.median.step)) for r in ranks]
        rows = sum(1 + len(t["collective_rows"]) for _, t in drawn)  # compute + comm rows
        fig, ax = plt.subplots(figsize=(WIDTH_IN, 0.55 * rows + 1.5))
        ticks, labels, y = [], [], 0.0
        for r, t in drawn:
            for phase, intervals in t["compute"].items():
                ax.broken_barh(report.bars(intervals), (y - 0.35, 0.7), color=COLOURS[phase])
            ticks.append(y)
            labels.append(f"rank {r.rank} compute")
            # Each launch, a mark under the compute lane; each collective its own bar,
            # a second row where Gloo ran two at once.
            ax.plot(t["launches"], [y - 0.5] * len(t["launches"]), "v", color="black",
                    markersize=5, linestyle="none")  # fmt: skip
            y -= 1
            for row, name in zip(t["collective_rows"], comm_labels(len(t["collective_rows"])),
                                 strict=True):  # fmt: skip
                ax.broken_barh(report.bars(row), (y - 0.35, 0.7), color=COLOURS["gloo"],
                               edgecolor="white", linewidth=0.8)  # fmt: skip
                ticks.append(y)
                labels.append(f"rank {r.rank} {name}")
                y -= 1
            y -= 0.4
        ax.set_yticks(ticks, labels)
        ax.set_xlabel("ms from the start of the step (each rank's median traced step)")
        ax.set_title(CAPTIONS[stage], loc="left")
        ax.grid(axis="x", alpha=0.3)
        written.append(
            save_lanes(fig, out / f"timeline-{stage}.svg", "all-reduce in flight", launches=True)
        )
    return written


def comm_labels(rows: int) -> list[str]:
    """The communication rows' labels: `comm`, or `comm 1`, `comm 2` where Gloo ran two
    collectives at once and their bars take two rows."""
    return ["comm"] if rows == 1 else [f"comm {i + 1}" for i in range(rows)]


def save_lanes(fig, path: Path, communication: str, launches: bool = False) -> Path:
    """The lanes' legend under `fig` (the phases, and `communication` for its bars),
    then `fig` saved to `path` and closed."""
    handles = [Patch(color=COLOURS[k], label=k) for k in ("forward", "backward", "optimizer")] + [
        Patch(color=COLOURS["gloo"], label=communication)
    ]
    if launches:
        handles.append(Line2D([], [], marker="v", color="black", linestyle="none",
                              label="launched"))  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncols=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))  # room for the legend
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path


if __name__ == "__main__":
    main()
