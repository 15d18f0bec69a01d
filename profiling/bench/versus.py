"""One variant against another and against the best value of a sweep, read from results
that `python -m profiling.bench --json` wrote: one row per workload. The automatic
bucket layout's page uses it to compare `drop_in_auto` with torch's default and with
the best uniform cap of a `bucket_cap_mb` sweep run in the same rounds.

    python -m profiling.bench.versus docs/results/bench-auto-buckets.json \
        --variant drop_in_auto --against torch_ddp_default --best-of drop_in \
        --markdown docs/results/bench-auto-versus.md

The rounds of a benchmark interleave every variant, so each ratio is also given per
round: both medians from the same round, then the median and range of the ratio over
rounds, as the benchmark's own "per round" columns. The best of a sweep is the value
whose variant has the lowest median over all its steps.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from profiling.bench.output import describe_network
from profiling.common.report import command_line, markdown_table, produced_by, read_json


def round_medians(variant: dict) -> dict[int, float]:
    """Round -> the median of the variant's steps in it (ms)."""
    by_round: dict[int, list[float]] = {}
    for ms, k in zip(variant["step_times_ms"], variant["step_rounds"], strict=True):
        by_round.setdefault(k, []).append(ms)
    return {k: statistics.median(v) for k, v in by_round.items()}


def paired(mine: dict, base: dict) -> tuple[float, float, float]:
    """(median, min, max) over rounds of mine's median / base's median in that round."""
    a, b = round_medians(mine), round_medians(base)
    ratios = [a[k] / b[k] for k in a if k in b]
    return statistics.median(ratios), min(ratios), max(ratios)


def _ratio_text(mine: dict, base: dict) -> str:
    median, low, high = paired(mine, base)
    return f"{mine['median_ms'] / base['median_ms']:.3f}x ({median:.3f}x, {low:.2f}-{high:.2f})"


def _layout_text(choice: dict | None) -> str:
    if not choice:
        return "n/a"
    sizes = choice.get("bucket_sizes_bytes")
    if sizes is None:  # a record from before the cut: the cap only
        return f"uniform {choice['bucket_cap_mb']:g} MiB"
    mib = (  # every bucket, or the range where there are many
        "/".join(f"{b / 2**20:.2g}" for b in sizes)
        if len(sizes) <= 8
        else f"{min(sizes) / 2**20:.2g} to {max(sizes) / 2**20:.2g}"
    )
    kind = "cut" if choice.get("layout") == "cut" else f"uniform {choice['bucket_cap_mb']:g}"
    return f"{kind}: {len(sizes)} buckets, {mib} MiB"


def row(record: dict, variant: str, against: str, best_of: str) -> list[str]:
    s = record["settings"]
    by_name = {v["name"]: v for v in record["variants"] if v["sweep_value"] is None}
    mine, base = by_name[variant], by_name[against]
    swept = [v for v in record["variants"] if v["name"] == best_of and v["sweep_value"] is not None]
    best = min(swept, key=lambda v: v["median_ms"])
    shape = f" {s['width']}x{s['depth']}" if "width" in s else ""
    rate = s.get("network", {"rate": "loopback"})["rate"]
    return [
        f"{s['model']}{shape}, batch {s['per_rank_batch']}/rank, {rate}",
        f"{mine['steps']} ({mine['rounds']})",
        f"{mine['median_ms']:.1f} ({mine['min_ms']:.0f}-{mine['max_ms']:.0f})",
        f"{base['median_ms']:.1f}",
        _ratio_text(mine, base),
        f"{best['sweep_value']:g}: {best['median_ms']:.1f}",
        _ratio_text(mine, best),
        _layout_text(mine.get("auto_bucket_choice")),
    ]


def table(records: list[dict], variant: str, against: str, best_of: str) -> str:
    header = [
        "workload",
        "steps (rounds)",
        f"{variant} ms (min-max)",
        f"{against} ms",
        f"vs {against} (per round: median, range)",
        f"best {best_of} cap: ms",
        f"vs best {best_of} (per round)",
        f"{variant}'s layout",
    ]
    body = [row(r, variant, against, best_of) for r in records]
    networks = sorted({describe_network(r["settings"].get("network")) for r in records})
    return "\n".join(
        [
            produced_by([r["command"] for r in records] + [command_line("profiling.bench.versus")])
            + " Networks: "
            + "; ".join(networks)
            + ".",
            "",
            markdown_table(header, body),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench.versus", description=__doc__)
    parser.add_argument("json", help="results as profiling.bench --json wrote them")
    parser.add_argument("--variant", default="drop_in_auto")
    parser.add_argument("--against", default="torch_ddp_default")
    parser.add_argument("--best-of", default="drop_in", help="the variant swept over values")
    parser.add_argument("--markdown", default="", help="write the table here too")
    args = parser.parse_args(argv)
    data = read_json(args.json, "profiling.bench.versus", "workloads", writer="profiling.bench")
    records = data["workloads"]
    text = table(records, args.variant, args.against, args.best_of)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
