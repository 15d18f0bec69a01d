"""The ring all-reduce drawn step by step: which chunk each rank sends, and how many
ranks' contributions each chunk holds after the step.

    python -m profiling.course.ring_figure --out docs/images/ring.png

The schedule is `ddp.collectives`' ring (`_ring`): in reduce-scatter step s, rank r
sends chunk r - s to its right neighbour, which adds it into its own copy; in
all-gather step s, rank r sends chunk r + 1 - s, which the neighbour takes as it is.
Here the chunks carry the set of ranks whose values they hold instead of numbers, so
the drawing is the algorithm's bookkeeping, not a picture of it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from profiling.common import report

Held = list[list[frozenset[int]]]  # held[rank][chunk]: the ranks summed into it


def ring_steps(p: int) -> list[tuple[str, list[int], Held]]:
    """(label, the chunk each rank sends, what every rank holds after the step), for the
    2(p - 1) steps of the ring on p ranks, after the start (nothing sent). Each phase
    numbers its steps from 0, as `_ring`'s loops and the all_reduce page's table do."""
    held: Held = [[frozenset({r}) for _ in range(p)] for r in range(p)]
    steps: list[tuple[str, list[int], Held]] = [("start", [], held)]
    for s in range(p - 1):  # reduce-scatter: the right neighbour adds what arrives
        sent = [(r - s) % p for r in range(p)]
        held = [[held[r][c] | (held[(r - 1) % p][c] if c == sent[(r - 1) % p] else frozenset())
                 for c in range(p)] for r in range(p)]  # fmt: skip
        steps.append((f"reduce-scatter {s}", sent, held))
    for s in range(p - 1):  # all-gather: the right neighbour takes what arrives
        sent = [(r + 1 - s) % p for r in range(p)]
        held = [[held[(r - 1) % p][c] if c == sent[(r - 1) % p] else held[r][c]
                 for c in range(p)] for r in range(p)]  # fmt: skip
        steps.append((f"all-gather {s}", sent, held))
    return steps


def draw(p: int, path: Path) -> None:
    """One panel per step: ranks across, chunks down; a cell's shade and number are how
    many ranks it holds, an outlined cell is the one its rank sends to the right."""
    matplotlib.use("Agg")
    steps = ring_steps(p)
    plt.rcParams.update({"font.size": report.FIGURE_FONT_PT})
    cols = p  # start + (p - 1) reduce-scatter steps on the first row, all-gather below
    fig, axes = plt.subplots(2, cols, figsize=(report.FIGURE_WIDTH_IN, 4.6))
    cmap = plt.cm.Blues
    for k, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if k >= len(steps):
            continue
        label, sent, held = steps[k]
        for r in range(p):
            for c in range(p):
                n = len(held[r][c])
                outline = bool(sent) and sent[r] == c
                ax.add_patch(Rectangle((r, p - 1 - c), 0.92, 0.92,
                             facecolor=cmap(0.15 + 0.8 * n / p),
                             edgecolor="#c44e52" if outline else "white",
                             linewidth=2.5 if outline else 0.5))  # fmt: skip
                ax.text(r + 0.46, p - 1 - c + 0.46, str(n), ha="center", va="center",
                        color="white" if n > p / 2 else "black")  # fmt: skip
        ax.set_xlim(-0.1, p)
        ax.set_ylim(-0.6, p + 0.1)
        ax.set_title(label)
        ax.text(p / 2, -0.35, "ranks " + " ".join(map(str, range(p))), ha="center", va="center")
    fig.suptitle(
        f"Ring all-reduce on {p} ranks: rows are chunks, the number is how many ranks a "
        "chunk sums;\noutlined: sent to the right neighbour this step"
    )
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.course.ring_figure",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=4, help="ranks in the ring")
    parser.add_argument("--out", type=Path, default=Path("ring.png"), help="the figure")
    args = parser.parse_args(argv)
    if not 2 <= args.ranks <= 8:
        parser.error(f"--ranks {args.ranks}: draw 2 to 8 ranks")
    draw(args.ranks, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
