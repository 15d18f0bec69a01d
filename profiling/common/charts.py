"""`profiling.compare`'s charts: the breakdown of each run's step into compute, hidden and
exposed communication, and the timeline of each run's median step, lane by lane."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from profiling.analysis import COMPUTE_ONLY, GLOO_LANE, RankResult, RunSummary, step_timeline
from profiling.common import report

COLOURS = {
    "compute": "#4c72b0",
    "forward": "#8fb3de",
    "backward": "#4c72b0",
    "optimizer": "#8172b2",
    "hidden": "#55a868",
    "not hidden": "#c44e52",
    "waiting": "#c44e52",
    "gloo": "#dd8452",
    "gpu compute": "#4c72b0",
    "nccl": "#dd8452",
    "other": "#cccccc",
}
LEGEND = {  # what each colour of the timeline stands for
    "forward": "forward ops (CPU)",
    "backward": "backward ops (CPU)",
    "optimizer": "optimizer ops (CPU)",
    "waiting": "main thread in a collective / waiting",
    "gloo": "collective in flight (Gloo threads)",
    "gpu compute": "compute kernels, copies, memsets (GPU)",
    "nccl": "NCCL kernels (GPU)",
}
OTHER = {  # what the breakdown's rest of the step is, by the runs' device
    "cpu": "other (Python between ops, data, logging)",
    "gpu": "other (none of the step's own GPU work running)",
    "mixed": "other (CPU: between ops; GPU: none of the step's work running)",
}


def breakdown_title(heading: str) -> str:
    """The breakdown chart's title: the main job's options where the command is known,
    else where the traces came from (the heading's first line)."""
    command = heading.splitlines()[0]
    command = re.sub(r" --profile-dir \S+| +\(re-analysed .*", "", command)
    if "-m stages" in command:
        return command[command.find("-m stages") :][:110]
    return command[:110]


def plot_breakdown(path: Path, rows: list[RunSummary], title: str) -> None:
    """One stacked bar per run; the segments add up to its step time."""
    matplotlib.use("Agg")
    devices = {r.device for r in rows}
    device = devices.pop() if len(devices) == 1 else "mixed"
    font = report.FIGURE_FONT_PT
    # Horizontal bars, first run on top: sixteen run names stay legible at 10 pt.
    fig, ax = plt.subplots(figsize=(report.FIGURE_WIDTH_IN, 0.42 * len(rows) + 2.2))
    names = [r.run for r in rows][::-1]
    rows = rows[::-1]
    segments = [
        ("compute, no communication in flight", [r.compute_ms - r.hidden_ms for r in rows],
         COLOURS["compute"]),
        ("communication hidden behind compute", [r.hidden_ms for r in rows],
         COLOURS["hidden"]),
        ("communication not hidden", [r.not_hidden_ms for r in rows], COLOURS["not hidden"]),
        (OTHER[device], [max(r.other_ms, 0) for r in rows], COLOURS["other"]),
    ]  # fmt: skip
    left = [0.0] * len(rows)
    for label, values, colour in segments:
        ax.barh(names, values, left=left, label=label, color=colour, height=0.7)
        left = [b + v for b, v in zip(left, values, strict=True)]
    floor = next((r.step_ms for r in rows if r.run == COMPUTE_ONLY), None)
    if floor is not None:
        ax.axvline(floor, color="black", linestyle="--", linewidth=1, zorder=1)
        ax.text(floor, len(rows) - 0.4, " compute-only step", va="bottom", fontsize=font)
    for y, r in enumerate(rows):
        if r.exposed_ms is not None and r.run != COMPUTE_ONLY:
            noise = " (noise: faster than compute alone)" if r.exposed_ms < 0 else ""
            ax.text(max(left[y], r.step_ms), y, f" exposed {r.exposed_ms:+.1f} ms{noise}",
                    va="center", fontsize=font)  # fmt: skip
    ax.set_xlabel("ms per step (mean over ranks of the median step)", fontsize=font)
    ax.set_xlim(0, max(left + [r.step_ms for r in rows]) * 1.3)
    ax.set_ylim(-0.6, len(rows) + 0.4)
    ax.tick_params(labelsize=font)
    ax.set_title(title, fontsize=font, wrap=True)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(fontsize=font, loc="lower center", ncols=2)
    fig.tight_layout(rect=(0, 0.8 / fig.get_figheight(), 1, 1))
    report.save_figure(fig, path)
    plt.close(fig)


@dataclass
class Lane:
    """One row of the timeline: coloured intervals (ms from the step's start on the CPU)."""

    label: str
    bars: list[tuple[str, list[tuple[float, float]]]]  # (COLOURS key, intervals)
    step_ms: float | None = None  # the step's ProfilerStep length, drawn under the lane


def timeline_lanes(traces: dict, results: list[RankResult], ranks: list[int] | None) -> list[Lane]:
    """The lanes of each run's median step on each rank in `ranks` (None: every rank).
    A CPU run: the main thread (compute by phase, and its waits), then the collectives in
    flight on Gloo's threads. A GPU run: each CUDA stream the step used, compute streams
    first, each named by what ran on it (compute, NCCL, or both)."""
    lanes = []
    for r in results:
        if ranks is not None and r.rank not in ranks:
            continue
        t = step_timeline(traces[r.run][r.rank], r.median.step)
        head = f"{r.run}, rank {r.rank}, step {r.median.step}"
        if t["gpu"]:
            for stream, (compute, nccl) in sorted(t["streams"].items(), key=_stream_order):
                if stream == GLOO_LANE:
                    lanes.append(Lane(f"{head}: {GLOO_LANE} (CPU)", [("gloo", nccl)]))
                    continue
                kind = "compute + NCCL" if compute and nccl else "NCCL" if nccl else "compute"
                bars = [("gpu compute", compute), ("nccl", nccl)]
                lanes.append(Lane(f"{head}: stream {stream} ({kind})", bars))
        else:
            main = [*t["compute"].items(), ("waiting", t["waiting"])]
            lanes.append(Lane(f"{head}: main thread", main))
            lanes.append(Lane(f"{head}: Gloo threads", [("gloo", t["communication"])]))
        lanes[-1].step_ms = t["step_ms"]
    return lanes


def timeline_legend(lanes: list[Lane]) -> list[str]:
    """What the timeline's colours stand for, those its lanes use, and its black line."""
    used = {kind for lane in lanes for kind, intervals in lane.bars if intervals}
    return [label for kind, label in LEGEND.items() if kind in used] + ["the step on the CPU"]


def _stream_order(item) -> tuple:
    """Compute streams first, then NCCL streams by number, then Gloo's threads."""
    stream, (compute, _) = item
    return (stream == GLOO_LANE, not compute, int(stream) if stream.isdigit() else 0, stream)


def plot_timeline(
    path: Path, traces: dict, results: list[RankResult], ranks: list[int] | None
) -> None:
    """The lanes of timeline_lanes, one run's lanes above the next; a black line under each
    run's last lane marks its step on the CPU (GPU work may run past it)."""
    matplotlib.use("Agg")
    lanes = timeline_lanes(traces, results, ranks)
    if not lanes:
        raise SystemExit(f"--timeline-ranks {ranks}: no such rank in the traces")
    font = report.FIGURE_FONT_PT
    # Each run's heading (run, rank, step) written above its lanes, and the lanes named
    # short, so the labels leave the width to the bars at 10 pt.
    y, ys, names, heads = 0.0, [], [], []
    for lane in lanes:
        head, _, name = lane.label.rpartition(": ")
        if not heads or heads[-1][0] != head:
            heads.append((head, y))
            y -= 0.85
        ys.append(y)
        names.append(name)
        y -= 1
        if lane.step_ms is not None:
            y -= 0.6  # room for the black line and a gap before the next run
    height_in = 0.26 * -y + 1.4
    fig, ax = plt.subplots(figsize=(report.FIGURE_WIDTH_IN, height_in))
    for lane, lane_y in zip(lanes, ys, strict=True):
        for kind, intervals in lane.bars:
            ax.broken_barh(report.bars(intervals), (lane_y - 0.4, 0.8), color=COLOURS[kind])
        if lane.step_ms is not None:
            ax.plot([0, lane.step_ms], [lane_y - 0.55] * 2, color="black", linewidth=0.8)
    for head, head_y in heads:
        ax.text(0, head_y, head, fontsize=font, va="center", fontweight="bold")
    ax.set_yticks(ys, names, fontsize=font)
    ax.set_ylim(y + 0.4, 0.45)
    ax.tick_params(axis="x", labelsize=font)
    ax.set_xlabel("ms from the start of the step on the CPU (each rank's median traced step)",
                  fontsize=font)  # fmt: skip
    colour = {label: COLOURS[kind] for kind, label in LEGEND.items()}
    *patches, line = timeline_legend(lanes)
    handles = [Patch(color=colour[label], label=label) for label in patches]
    handles.append(Line2D([], [], color="black", linewidth=0.8, label=line))
    legend_in = 0.22 * -(-len(handles) // 2) + 0.1
    fig.legend(handles=handles, fontsize=font, loc="upper center", ncols=2)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 1 - legend_in / fig.get_figheight()))
    report.save_figure(fig, path)
    plt.close(fig)
