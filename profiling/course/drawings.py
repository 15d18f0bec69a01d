"""Three schematic drawings for the course, of events no trace can show: a rank that waits
forever, a rank that runs out of batches, and a job killed, restarted and resumed.

    python -m profiling.course.drawings --out docs/images

- `missing-gradient.png`: two ranks, one of which never gets a gradient of one bucket.
  With the overlapped stage, the other waits for that bucket's all-reduce until the
  process group's timeout; with missing_grads, the bucket completes with zeros, the
  status says a gradient was missing, and every rank raises the same error.
- `uneven-inputs.png`: rank 1 has two batches, rank 0 four. With round_robin, rank 0's
  third step waits in an all-reduce rank 1 never joins; with join, rank 1 shadows the
  steps it has no batch for (the same collectives, zeros) and every rank ends together.
- `kill-restart-resume.png`: a run checkpointing every 7 steps, a worker killed at
  step 10, torchrun restarting every worker, and the run resuming from step 7's
  checkpoint to the same final parameters.

Schematic: the lengths are chosen to read, not measured (the stage pages show traced
steps). Every label names the code that does it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from profiling.common import report

COLOURS = {"compute": "#4c72b0", "comm": "#dd8452", "wait": "#c44e52", "status": "#55a868",
           "restart": "#cccccc", "checkpoint": "#8172b2"}  # fmt: skip


def two_ranks(ax, bars: list, title: str, width: float) -> None:
    """Rank 0 above rank 1, each a compute lane over a communication lane; `bars` are
    (rank lane y, start, length, kind, label) in the drawing's arbitrary time units."""
    for y, start, length, kind, label in bars:
        lane = y + (0.2 if kind == "compute" else -0.2)
        ax.broken_barh([(start, length)], (lane - 0.17, 0.34), color=COLOURS[kind])
        if label:
            ax.text(start + 0.12, lane, label, va="center", color="white")
    ax.set_yticks([1, 0], ["rank 0", "rank 1"])
    ax.set_xlim(0, width)
    ax.set_ylim(-0.75, 1.55)
    ax.set_xticks([])
    ax.set_title(title, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def missing_gradient(path: Path) -> None:
    matplotlib.use("Agg")
    plt.rcParams.update({"font.size": report.FIGURE_FONT_PT})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(report.FIGURE_WIDTH_IN, 4.4))
    # (lane y, start, length, colour, label) in arbitrary time units
    overlapped = [
        (1, 0, 6, "compute", "backward"), (1, 2, 2, "comm", "bucket 0"),
        (1, 4.5, 7.5, "wait", "bucket 1: waits for rank 1 until the timeout"),
        (0, 0, 6, "compute", "backward, layer B skipped"), (0, 2, 2, "comm", "bucket 0"),
    ]  # fmt: skip
    stage = [
        (1, 0, 6, "compute", "backward"), (1, 2, 2, "comm", "bucket 0"),
        (1, 4.5, 2, "comm", "bucket 1"), (1, 6.5, 1.3, "status", "status"),
        (0, 0, 6, "compute", "backward, layer B skipped"), (0, 2, 2, "comm", "bucket 0"),
        (0, 6, 0.5, "comm", ""), (0, 6.5, 1.3, "status", "status"),
    ]  # fmt: skip
    for ax, bars, title, end in (
        (top, overlapped, "overlapped: rank 1 never launches bucket 1, rank 0 hangs", None),
        (bottom, stage, "missing_grads: rank 1 fills bucket 1 with zeros; the status "
         "tells every rank", "both ranks raise:\nlayer B's gradient\nmissing on rank 1"),
    ):  # fmt: skip
        two_ranks(ax, bars, title, width=12)
        if end:
            ax.text(8.1, 0.5, end, va="center")
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)


def uneven_inputs(path: Path) -> None:
    matplotlib.use("Agg")
    plt.rcParams.update({"font.size": report.FIGURE_FONT_PT})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(report.FIGURE_WIDTH_IN, 4.0))

    # (rank lane y, start, length, kind, label) in arbitrary time units; a step is 3 wide
    def steps(y: int, count: int) -> list:
        return [bar for k in range(count)
                for bar in ((y, 3 * k, 2, "compute", f"step {k + 1}"),
                            (y, 3 * k + 2, 0.8, "comm", ""))]  # fmt: skip

    without = [*steps(1, 2), *steps(0, 2), (1, 6, 2, "compute", "step 3"),
               (1, 8, 4.5, "wait", "waits for rank 1 until the timeout")]  # fmt: skip
    shadowed = [*steps(1, 4), *steps(0, 2),
                (0, 8, 0.8, "status", ""), (0, 11, 0.8, "status", "")]  # fmt: skip
    for ax, bars, title in (
        (top, without, "round_robin: rank 1 is out of batches after step 2; rank 0 hangs"),
        (bottom, shadowed, "join: rank 1 joins rank 0's collectives with zeros until both "
         "are done"),
    ):  # fmt: skip
        two_ranks(ax, bars, title, width=12.6)
    handles = [matplotlib.patches.Patch(color=COLOURS[k], label=label) for k, label in
               (("compute", "forward, backward, step"), ("comm", "all-reduce"),
                ("status", "rank 1 shadows: zeros into rank 0's all-reduces"))]  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncols=3, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    report.save_figure(fig, path)
    plt.close(fig)


def kill_restart_resume(path: Path, steps: int = 20, every: int = 7, killed_at: int = 10) -> None:
    matplotlib.use("Agg")
    plt.rcParams.update({"font.size": report.FIGURE_FONT_PT})
    fig, ax = plt.subplots(figsize=(report.FIGURE_WIDTH_IN, 2.6))
    last_checkpoint = killed_at // every * every
    first = [(s, 0.9) for s in range(killed_at)]
    restart = killed_at + 1.5  # the restart's time, in steps' widths
    second = [(restart + 1 + i, 0.9) for i in range(steps - last_checkpoint)]
    ax.broken_barh(first, (1.6, 0.6), color=COLOURS["compute"])
    ax.broken_barh([(killed_at, 1.5)], (1.6, 0.6), color=COLOURS["restart"])
    ax.broken_barh([(restart, 1)], (0.6, 0.6), color=COLOURS["checkpoint"])
    ax.broken_barh(second, (0.6, 0.6), color=COLOURS["compute"])
    for s in range(every, killed_at, every):
        ax.plot([s, s], [1.5, 2.3], color=COLOURS["checkpoint"], linewidth=2)
        ax.text(s, 2.4, f"checkpoint\nafter step {s}", ha="center", va="bottom")
    ax.text(
        killed_at + 0.75, 2.4, "worker\nkilled", ha="center", va="bottom", color=COLOURS["wait"]
    )
    ax.text(restart + 0.5, 0.45, f"restore\nstep {last_checkpoint}", ha="center", va="top")
    ax.text(second[-1][0] + 1, 0.9, "same final\nparameters", va="center")
    ax.set_yticks([1.9, 0.9], ["first workers", "restarted\n(torchrun)"])
    ax.set_xticks([])
    ax.set_xlim(-0.5, second[-1][0] + 4)
    ax.set_ylim(-0.5, 3.4)
    ax.set_xlabel(f"steps: {killed_at} run, {killed_at - last_checkpoint} redone, "
                  f"{steps - killed_at} more")  # fmt: skip
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.course.drawings",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the PNGs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    missing_gradient(args.out / "missing-gradient.png")
    uneven_inputs(args.out / "uneven-inputs.png")
    kill_restart_resume(args.out / "kill-restart-resume.png")
    print(
        f"wrote {args.out}/missing-gradient.png, {args.out}/uneven-inputs.png, "
        f"{args.out}/kill-restart-resume.png"
    )


if __name__ == "__main__":
    main()
