"""Which bucket_cap_mb: torch's default layout against uniform caps, predicted.

    python -m profiling.simulate buckets --model mypackage.models:build \\
        --input-shape 3,224,224 --batch-size 32 --iteration-ms 180 --cluster dgx_a100

For `--model` (a preset or yours, `usermodel`) on a cluster (`clusters`), at each of
--gpus: the step of torch's DDP at its default layout (`layouts.torch_buckets`: 25 MiB
after a 1 MiB first bucket) and of the stages' layout at each cap the automatic stage
tries (`ddp.buckets.CANDIDATES_MB`), both rebuilt in ready order as they are
after the first step, overlapped; the fastest cap and its gain. The same question on
the virtual CPU cluster, for some MLPs: `python -m profiling.simulate.cpu_cluster buckets`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ddp.buckets import CANDIDATES_MB
from profiling.common.report import command_line, markdown_table, produced_by
from profiling.simulate import clusters, model_args, outputs
from profiling.simulate.layouts import torch_buckets, uniform_buckets
from profiling.simulate.scale import _numbers
from profiling.simulate.schedule import StageSchedule, Workload, simulate
from profiling.simulate.topology import cost_model


# --8<-- [start:on_cluster]
def caps_on_cluster(
    workload: Workload, topo, algorithm: str, gpus: Sequence[int], caps_mb: Sequence[float]
) -> list[dict]:
    """At each GPU count: torch's default layout's step, each cap's, the fastest cap (of
    caps that build the same layout, the largest) and its gain in percent of torch's."""
    layouts = {cap: uniform_buckets(workload, cap, ready_order=True) for cap in caps_mb}
    default = torch_buckets(workload)
    rows = []
    for p in gpus:
        cost = cost_model(topo.with_gpus(p), algorithm)

        def step_s(buckets, cost=cost) -> float:
            return simulate(workload, buckets, cost, StageSchedule(overlap=True)).step_s

        caps = {cap: step_s(buckets) for cap, buckets in layouts.items()}
        best_s = min(caps.values())
        default_s = step_s(default)
        rows.append({
            "gpus": p, "default_s": default_s, "caps_s": caps, "best_s": best_s,
            "best_cap_mb": max(c for c, s in caps.items() if s == best_s),
            "gain_pct": (1 - best_s / default_s) * 100,
        })  # fmt: skip
    return rows


# --8<-- [end:on_cluster]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    model_args.add_arguments(parser)
    clusters.add_arguments(parser)
    parser.add_argument(
        "--gpus", default="8,16,32,64,128,256",
        help="GPU counts, comma-separated (default: %(default)s)",
    )  # fmt: skip
    outputs.add_arguments(parser, docs=False)  # no page includes its table
    parser.add_argument("--markdown", help="write the table here too")


def run(args: argparse.Namespace) -> None:
    """The table of `caps_on_cluster`, its assumptions first."""
    try:
        cluster, custom = clusters.from_args(args)
        gpus = _numbers(args.gpus, "gpus", int)
        for p in gpus:
            cluster.topology.with_gpus(p)
        workload, lines, _ = model_args.from_args(args, cluster.gpu, cluster.memory_bytes_per_s)
    except ValueError as error:
        raise SystemExit(f"buckets: {error}") from None
    name = args.cluster + (" (modified)" if custom else "")
    lines += clusters.describe(cluster, name, args.algorithm)
    rows = caps_on_cluster(workload, cluster.topology, args.algorithm, gpus, CANDIDATES_MB)
    body = [
        [str(r["gpus"]), f"{workload.compute_s * 1e3:.1f}", f"{r['default_s'] * 1e3:.1f}",
         f"{r['best_cap_mb']:g}: {r['best_s'] * 1e3:.1f}", f"{r['gain_pct']:.1f}%"]
        for r in rows
    ]  # fmt: skip
    header = ["GPUs", "compute ms", "torch's default ms", "fastest cap (MiB): ms", "gain"]
    table = markdown_table(header, body)
    text = "\n".join([produced_by([command_line("profiling.simulate")]), "", "```text",
                      *lines, "```", "", table, ""])  # fmt: skip
    print("\n".join(lines) + "\n\n" + table)
    paths = [Path(args.markdown)] if args.markdown else []
    if not args.no_files:
        results, _ = outputs.folders(args)
        paths.append(results / f"buckets-{outputs.stem(args.model)}-{args.cluster}.md")
    for path in paths:
        path.write_text(text)
        print(f"wrote {path}")
