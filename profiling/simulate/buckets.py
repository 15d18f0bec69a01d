"""Where a bucket layout can win: torch's default layout against uniform caps, predicted.

torch's `bucket_cap_mb=None` is 25 MiB with a 1 MiB first bucket, tuned for large
models. A model of a few tens of MiB gets one small bucket and one holding the rest,
which cannot start before backward ends. This command asks the validated model, before
anything is measured on the cluster, which MLP shapes lose most to that layout: for each
one it predicts drop_in's step at torch's default and at each uniform cap the automatic
stage would try (`stages.auto_bucket.CANDIDATES_MB`), and prints the gain of the best.

    python -m profiling.simulate buckets --shapes 1024x5x256 512x20x512
    python -m profiling.simulate buckets --network 4gbit --markdown /tmp/buckets.md

A shape is width x depth x per-rank batch. Each shape's compute is measured here on one
process with one thread (`inputs.measure_workload`); the collective cost and the
slowdowns are a validation's calibration (its JSON, `validate --json`), at the rate and
world size asked; nothing else is run. The slowdowns are those calibrated for the
validation's MLP, the nearest kind of model.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_SHAPES = ("2048x7x256", "1024x5x256", "1024x8x512", "1024x12x256", "512x20x512")
CALIBRATION = "docs/results/simulate-validate.json"


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
def default_against_caps(workload, calibration, caps_mb, model: str = "mlp") -> dict:
    """drop_in's predicted step (ms) with `workload` as `model`'s compute: at torch's
    default layout, and at each uniform cap (no smaller first bucket, as an explicit cap
    is); the best cap and its gain on the default, in percent of the default's step."""
    from profiling.simulate.validate import Run, predict

    calibration = replace(calibration, workloads={**calibration.workloads, model: workload})

    def step_ms(cap_mb: float | None) -> float:
        run = Run(model, calibration.rate, calibration.world_size, "drop_in", cap_mb)
        return predict(run, calibration)["predicted_ms"]

    default = step_ms(None)
    caps = {cap: step_ms(cap) for cap in caps_mb}
    best = min(caps, key=caps.get)
    return {
        "default_ms": default,
        "caps_ms": caps,
        "best_cap_mb": best,
        "best_ms": caps[best],
        "gain_pct": (1 - caps[best] / default) * 100,
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
    parser.add_argument("--network", default="1gbit", help="the calibration's rate")
    parser.add_argument("--nproc", type=int, default=2, help="the calibration's world size")
    parser.add_argument(
        "--calibration",
        default=CALIBRATION,
        metavar="JSON",
        help="a validation's JSON (validate --json) holding that calibration",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per shape")
    parser.add_argument("--markdown", help="write the table as a fragment for the docs")


def run(args: argparse.Namespace) -> None:
    from ddp.config import Config
    from profiling.report import command_line, markdown_table, produced_by
    from profiling.simulate.calibrate import Calibration
    from profiling.simulate.inputs import measure_workload
    from stages.auto_bucket import CANDIDATES_MB

    try:
        shapes = [parse_shape(s) for s in args.shapes]
    except ValueError as e:
        sys.exit(f"profiling.simulate buckets: {e}")
    path = Path(args.calibration)
    if not path.is_file():
        sys.exit(
            f"profiling.simulate buckets: no calibration file {path}; run "
            "`python -m profiling.simulate validate --json FILE` and pass --calibration FILE"
        )
    found = [
        c
        for c in json.loads(path.read_text())["calibrations"]
        if c["rate"] == args.network and c["world_size"] == args.nproc
    ]
    if not found:
        sys.exit(
            f"profiling.simulate buckets: {path} has no calibration at {args.network} on "
            f"{args.nproc} ranks; pick --network and --nproc from the validation's grid"
        )
    calibration = Calibration.from_json(found[0])
    body = []
    for shape in shapes:
        cfg = Config(model="mlp", width=shape.width, depth=shape.depth, batch_size=shape.batch_size)
        workload = measure_workload(cfg, args.nproc, repeats=args.repeats, warmup=2)
        r = default_against_caps(workload, calibration, CANDIDATES_MB)
        mib = sum(g.nbytes for g in workload.grads) / 2**20
        body.append(
            [
                shape.label,
                f"{mib:.0f}",
                f"{workload.compute_s * 1e3:.0f}",
                f"{r['default_ms']:.1f}",
                f"{r['best_cap_mb']:g}: {r['best_ms']:.1f}",
                f"{r['gain_pct']:.1f}%",
            ]
        )
        print(f"{shape.label}: " + ", ".join(body[-1][1:]), flush=True)
    header = [
        f"MLP ({args.network}, {args.nproc} ranks)",
        "gradients MiB",
        "compute ms",
        "torch's default ms",
        "best uniform cap: ms",
        "predicted gain",
    ]
    text = "\n".join(
        [
            produced_by([command_line("profiling.simulate")], ", from the repository root"),
            "",
            markdown_table(header, body),
            "",
        ]
    )
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
        print(f"wrote {args.markdown}")
