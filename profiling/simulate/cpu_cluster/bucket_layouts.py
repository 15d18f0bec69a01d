"""Where a bucket layout can win, on the virtual CPU cluster: torch's default layout
against uniform caps for some MLPs, predicted by the validated model.

torch's `bucket_cap_mb=None` is 25 MiB after a 1 MiB first bucket, tuned for large
models. A model of a few tens of MiB gets a first bucket of its last layer or two and
a second holding the rest, which cannot start before backward ends. This command asks
the validated model, before anything is measured on the cluster, how much each of
some MLP shapes loses to that layout: for each it predicts torch's DDP step at its
default layout and the drop-in's at each uniform cap the automatic stage would try
(`ddp.buckets.CANDIDATES_MB`), and prints the gain of the best.

    python -m profiling.simulate.cpu_cluster buckets --shapes 1024x5x256 512x20x512
    python -m profiling.simulate.cpu_cluster buckets --rate 4gbit --markdown /tmp/buckets.md

A shape is width x depth x per-rank batch; the default five are the benchmarks' MLP
(2048 x 7), the validation's (1024 x 5) and three more spanning 19 to 44 MiB of
gradients. Each shape's compute is measured here on one process with one thread
(`inputs.measure_workload`); the collective cost and the slowdowns are a validation's
calibration (its JSON, `validate --json`), at the rate and world size asked; nothing
else is run. The slowdowns, and the cost per byte of a pass over the gradients, are
those calibrated for the validation's MLP (16 MiB), the nearest kind of model; a larger
model's pass may cost more per byte.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

from ddp.buckets import CANDIDATES_MB
from ddp.config import Config
from ddp.heap import steady_heap
from profiling.common.report import command_line, markdown_table, produced_by, read_json
from profiling.simulate import outputs
from profiling.simulate.cpu_cluster.calibration import Calibration, calibration_path
from profiling.simulate.cpu_cluster.inputs import measure_workload
from profiling.simulate.cpu_cluster.predict import (
    Run,
    asynchronous_schedule,
    buffer_broadcast_s,
    calibration_for,
    predict,
)
from profiling.simulate.layouts import torch_buckets
from profiling.simulate.outputs import folders
from profiling.simulate.schedule import Workload, simulate

DEFAULT_SHAPES = ("2048x7x256", "1024x5x256", "1024x8x512", "1024x12x256", "512x20x512")


@dataclass(frozen=True)
class Shape:
    width: int
    depth: int
    batch_size: int  # per rank

    @property
    def label(self) -> str:
        return f"{self.width}x{self.depth}, batch {self.batch_size}/rank"


def parse_shape(text: str) -> Shape:
    """`WIDTHxDEPTHxBATCH`, e.g. `512x20x512`."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"shape {text!r}: give width x depth x per-rank batch as three positive "
            "integers, e.g. 512x20x512"
        )
    return Shape(*map(int, parts))


# --8<-- [start:against]
def default_against_caps(
    workload: Workload, calibration: Calibration, caps_mb: Sequence[float], model: str = "mlp"
) -> dict:
    """Predicted steps (ms) with `workload` as `model`'s compute: torch's DDP at its
    default layout (`layouts.torch_buckets`), and the drop-in at each uniform cap, both
    with the drop-in's schedule (one lane, launched as buckets fill, copies in and out);
    the best cap (of caps that build the same layout, the largest) and its gain on
    torch's default, in percent of torch's step."""
    calibration = replace(
        calibration,
        workloads={**calibration.workloads, model: workload},
        # A stage's own time was timed on the calibration's shape, not on this one.
        own_steps_s={},
    ).for_model(model)  # the copies too: torch's step and the drop-in's alike
    # torch's DDP broadcasts buffers before forward, as the drop-in does; it exchanges no
    # status rows (the drop-in's predict adds both).
    broadcast_s = buffer_broadcast_s(calibration, model)
    schedule, copies = asynchronous_schedule(calibration)
    torch_step = simulate(
        replace(workload, forward_s=workload.forward_s + broadcast_s),
        torch_buckets(workload),
        calibration.cost,
        schedule,
        replace(copies, **calibration.contention(model)),
    )
    world = calibration.world_size
    caps = {
        cap: predict(Run(model, calibration.rate, world, "drop_in", cap), calibration)[
            "predicted_ms"
        ]
        for cap in caps_mb
    }
    best_ms = min(caps.values())
    ties = [cap for cap, ms in caps.items() if ms == best_ms]  # the same layout, to the bit
    default_ms = torch_step.step_s * 1e3
    return {
        "default_ms": default_ms,
        "caps_ms": caps,
        "best_cap_mb": max(ties),
        "tied_caps_mb": sorted(ties),
        "best_ms": best_ms,
        "gain_pct": (1 - best_ms / default_ms) * 100,
    }


# --8<-- [end:against]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=list(DEFAULT_SHAPES),
        metavar="WxDxB",
        help="MLP shapes: width x depth x per-rank batch (default: %(default)s)",
    )
    parser.add_argument("--rate", default="1gbit", help="the calibration's rate (default: 1gbit)")
    parser.add_argument(
        "--nproc", type=int, default=2, help="the calibration's world size (default: 2)"
    )
    parser.add_argument(
        "--calibration", type=Path, metavar="JSON",
        help="a validation's JSON (validate --json) holding that calibration (default: the "
        "docs' own in this checkout)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per shape (default: 5)")
    parser.add_argument("--markdown", help="write the table here too")
    outputs.add_arguments(parser)


def run(args: argparse.Namespace) -> None:
    def fail(why: str) -> NoReturn:
        sys.exit(f"profiling.simulate.cpu_cluster buckets: {why}")

    try:
        shapes = [parse_shape(s) for s in args.shapes]
    except ValueError as e:
        fail(str(e))
    if args.repeats < 1:
        fail(f"--repeats must be at least 1, got {args.repeats}")
    path = calibration_path(args.calibration)
    data = read_json(
        path,
        "profiling.simulate.cpu_cluster buckets",
        "calibrations",
        "profiling.simulate validate",
    )
    try:
        found = calibration_for(data["calibrations"], args.rate, args.nproc, "mlp")
    except KeyError as e:
        fail(f"{path}: {e.args[0]}; pick --rate and --nproc from the validation's grid")
    calibration = Calibration.from_json(found)
    steady_heap()  # the heap as the benchmark's and the calibration's ranks hold it
    body = []
    for shape in shapes:
        cfg = Config(model="mlp", width=shape.width, depth=shape.depth, batch_size=shape.batch_size)
        workload = measure_workload(cfg, args.nproc, repeats=args.repeats, warmup=2)
        r = default_against_caps(workload, calibration, CANDIDATES_MB)
        ties = r["tied_caps_mb"]
        caps = f"{ties[0]:g}" if len(ties) == 1 else f"{ties[0]:g} to {ties[-1]:g}"
        body.append(
            [
                shape.label,
                f"{sum(g.nbytes for g in workload.grads) / 2**20:.1f}",
                f"{workload.compute_s * 1e3:.1f}",
                f"{r['default_ms']:.1f}",
                f"{caps}: {r['best_ms']:.1f}",
                f"{r['gain_pct']:.1f}%",
            ]
        )
        print(f"{shape.label}: " + ", ".join(body[-1][1:]), flush=True)
    header = [
        f"MLP ({args.rate}, {args.nproc} ranks)",
        "gradients MiB",
        "compute ms",
        "torch's default ms",
        "best uniform caps (MiB): ms",
        "predicted gain",
    ]
    text = "\n".join(
        [
            produced_by(
                [command_line("profiling.simulate.cpu_cluster")],
                ". Caps that build the same layout share a row: "
                "below a weight's size, each weight has its own bucket",
            ),
            "",
            markdown_table(header, body),
            "",
        ]
    )
    print(text)
    paths = [Path(args.markdown)] if args.markdown else []
    if not args.no_files:
        name = "simulate-buckets.md" if args.docs else f"buckets-mlp-{args.rate}-{args.nproc}.md"
        paths.append(folders(args)[0] / name)
    for path in paths:
        path.write_text(text)
        print(f"wrote {path}")
