"""Which bucket_cap_mb: torch's default layout against uniform caps, predicted.

    python -m profiling.simulate buckets --model mypackage.models:build \\
        --input-shape 3,224,224 --batch-size 32 --iteration-ms 180 --cluster dgx_a100

For `--model` (a preset or yours, `usermodel`) on a cluster (`clusters`), at each of
--gpus: the step of torch's DDP at its default layout (`layouts.torch_buckets`: 25 MiB
after a 1 MiB first bucket) and of the stages' layout at each cap the automatic stage
tries (`ddp.buckets.CANDIDATES_MB`), both rebuilt in ready order as they are
after the first step, overlapped; the fastest cap and its gain. A cap is recommended
only where it beats torch's default by more than TIE_PCT; otherwise the row says no cap
does. (Neither is `scale`'s layout: `scale`'s "25 MiB" is uniform 25 MiB buckets by the
stages' rule in reverse parameter order, with no 1 MiB first bucket, so its step at 25
differs from both columns here.) One GPU is left out: it all-reduces nothing, so every
layout is the same. The same question on the virtual CPU cluster, for some MLPs:
`python -m profiling.simulate.cpu_cluster buckets`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ddp.buckets import CANDIDATES_MB
from profiling.common.report import command_line, markdown_table, produced_by
from profiling.simulate import accuracy, clusters, model_args, outputs
from profiling.simulate.layouts import torch_buckets, uniform_buckets
from profiling.simulate.scale import numbers
from profiling.simulate.schedule import StageSchedule, Workload, simulate
from profiling.simulate.topology import cost_model

# Differences under this many percent of torch's default step count as ties: no cap is
# recommended for them. Not accuracy's figures: those are errors of E against published
# runs, mostly a loss common to every layout at one GPU count (`accuracy_note`), which
# cancels between two layouts. 1% is about the gap the simulator's own check calls
# noise: on the virtual CPU cluster the cap it picks measures within the noise of the
# fastest (docs/simulator.md, "How well it predicts").
TIE_PCT = 1.0


# --8<-- [start:on_cluster]
def caps_on_cluster(
    workload: Workload, topo, algorithm: str, gpus: Sequence[int], caps_mb: Sequence[float]
) -> list[dict]:
    """At each GPU count: torch's default layout's step, each cap's, the fastest cap (of
    caps that build the same layout, the largest), its gain in percent of torch's, and
    the cap to use (`recommended_mb`): the fastest where its gain exceeds TIE_PCT, else
    None (keep torch's default)."""
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
        rows[-1]["recommended_mb"] = (
            rows[-1]["best_cap_mb"] if rows[-1]["gain_pct"] > TIE_PCT else None
        )
    return rows


# --8<-- [end:on_cluster]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    model_args.add_arguments(parser)
    clusters.add_arguments(parser)
    parser.add_argument(
        "--gpus", default="8,16,32,64,128,256",
        help="GPU counts, comma-separated; 1 is left out: it all-reduces nothing, so "
        "every layout is the same (default: %(default)s)",
    )  # fmt: skip
    outputs.add_arguments(parser, docs=False)  # no page includes its table
    parser.add_argument("--markdown", help="write the table here too")


def run(args: argparse.Namespace) -> None:
    """The table of `caps_on_cluster`, its assumptions first."""
    try:
        cluster, custom = clusters.from_args(args)
        given = sorted(set(numbers(args.gpus, "gpus", int)))
        gpus = [p for p in given if p >= 2]  # 1 GPU: nothing to all-reduce, no choice
        if not gpus or min(given) < 1:
            raise ValueError(f"--gpus {args.gpus}: GPU counts of 2 or more (1 GPU all-reduces "
                             "nothing: every layout is the same)")  # fmt: skip
        clusters.check_gpus(cluster.topology, args.algorithm, gpus)
        workload, lines, _ = model_args.from_args(args, cluster.gpu, cluster.memory_bytes_per_s)
    except ValueError as error:
        raise SystemExit(f"buckets: {error}") from None
    name = args.cluster + (" (modified)" if custom else "")
    lines += clusters.describe(cluster, name, args.algorithm)
    rows = caps_on_cluster(workload, cluster.topology, args.algorithm, gpus, CANDIDATES_MB)
    body = [
        [str(r["gpus"]), f"{workload.compute_s * 1e3:.1f}", f"{r['default_s'] * 1e3:.1f}",
         f"{r['best_cap_mb']:g}: {r['best_s'] * 1e3:.1f}", f"{r['gain_pct']:.1f}%",
         verdict(r)]
        for r in rows
    ]  # fmt: skip
    header = ["GPUs", "compute ms", "torch's default layout ms",
              "fastest uniform cap (MiB): ms", "gain", "use"]  # fmt: skip
    table = markdown_table(header, body)
    layout = layouts_line(given)
    record = accuracy_note()
    text = "\n".join([produced_by([command_line("profiling.simulate")]), "", "```text",
                      *lines, "```", "", layout, "", table, "", record, ""])  # fmt: skip
    print("\n".join(lines) + "\n\n" + layout + "\n\n" + table + "\n\n" + record)
    paths = [Path(args.markdown)] if args.markdown else []
    if not args.no_files:
        results, _ = outputs.folders(args)
        paths.append(results / f"buckets-{outputs.stem(args.model)}-{args.cluster}.md")
    for path in paths:
        path.write_text(text)
        print(f"wrote {path}")


def layouts_line(given: Sequence[int]) -> str:
    """What the rows compare, above the table: which layout each column uses, the tie
    rule, and a 1 GPU left out."""
    caps = ", ".join(f"{c:g}" for c in CANDIDATES_MB)
    out = (f"Rows: torch's default layout (a 1 MiB first bucket, then 25 MiB, in ready "
           f"order) against uniform caps by the stages' rule, also in ready order ({caps} MiB); "
           f"a cap is named under 'use' only where it beats torch's default by more than "
           f"{TIE_PCT:g}% (TIE_PCT): smaller differences are ties.")  # fmt: skip
    if 1 in given:
        out += " 1 GPU left out: it all-reduces nothing, every layout the same."
    return out


def verdict(row: dict) -> str:
    """The 'use' cell: the cap to set, or why none."""
    if row["recommended_mb"] is not None:
        return f"bucket_cap_mb={row['recommended_mb']:g}"
    return f"torch's default: no cap beats it by more than {TIE_PCT:g}%"


def accuracy_note() -> str:
    """The model's published error record, under the table: its steps are the bare
    model's; the loss `scale` adds is the same for every layout at one GPU count, so it
    moves no choice of the fastest cap, but the gain and the tie rule are on bare steps."""
    return ("Steps are the bare model's, which runs high: " + accuracy.header()
            + ". That loss is the same for every layout at one GPU count: it changes no "
            "fastest cap; the gain and the tie rule use the bare steps (with the loss "
            "added to both, each gain would be a little smaller).")  # fmt: skip
