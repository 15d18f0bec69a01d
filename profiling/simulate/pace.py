"""How steady the machine's pace is: what the compute, timed now as a calibration
times it, misses of the median over the next two minutes (one model's benchmark's
span), with no benchmark run.

    python -m profiling.simulate pace --nproc 4 --seconds 560 \\
        --json docs/results/simulate-pace.json --markdown docs/results/simulate-pace.md
    python -m profiling.simulate pace --render docs/results/simulate-pace.json \\
        --markdown docs/results/simulate-pace.md      # the table again, nothing run

It runs this module under `torchrun --standalone` (loopback; no link is shaped, the
compute only barriers): every rank times the validation's compute repeats as the
calibration does (`inputs.time_repeats`, each repeat from a barrier, the slowest rank's
step kept), the MLP and the CNN in turn, five at a time, for --seconds. Then, at every
calibration time T (every 5 s), each estimate of the compute at T against the median of
the steps from T + gap to T + gap + BENCH_S (the span of one model's benchmark):

- in a row: the last 15 repeats before T, as the calibration timed the compute up to
  run V;
- spread over W s: 15 repeats evenly spaced over the W seconds before T: what the
  spells (`calibrate.Spells`, 15 in a row and four spells of 5 through the
  calibration's 11-42 s) approach.

The table gives each estimate's miss, |estimate / median - 1|, over all T: median, 90th
percentile and largest. The gaps are 0 (a model benchmarked right after its
calibration), 60 and 150 s (the second model of a cluster, behind the first's benchmark,
as up to run V).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_S = 115.0  # one model's benchmark on a cluster: 7 rounds of its 14 variants
EVERY_S = 5.0
REPEATS = 15  # the calibration's repeats in a row
GAPS_S = (0.0, 60.0, 150.0)
WINDOWS_S = (0.0, 40.0, 90.0)  # 0: in a row
ENV = "SIMULATE_PACE"


def series(rows: list) -> dict[str, list[tuple[float, float]]]:
    """The worker's rows ([seconds from the start, model, [step s, ...]]: a block of
    repeats) -> per model, (when, step s) of each repeat, in order."""
    out: dict[str, list[tuple[float, float]]] = {}
    for at, model, steps in rows:
        for step in steps:
            out.setdefault(model, []).append((at, step))
            at += step
    return out


def miss_at(
    points: list[tuple[float, float]],
    at_s: float,
    gap_s: float,
    window_s: float,
    *,
    repeats: int = REPEATS,
    bench_s: float = BENCH_S,
) -> float:
    """|estimate / measured - 1| of an estimate made at `at_s` (the median of `repeats`
    steps: the last ones before it where window_s is 0, else evenly spaced from the
    first step of the window_s seconds before it to the last) against the median step
    from at_s + gap_s to at_s + gap_s + bench_s."""
    if window_s == 0:
        sample = [s for t, s in points if t <= at_s][-repeats:]
    else:  # `repeats` evenly spaced from the window's first step to its last
        window = [s for t, s in points if at_s - window_s <= t <= at_s]
        last = len(window) - 1
        step = last / max(1, repeats - 1)
        sample = [window[round(k * step)] for k in range(repeats)] if window else []
    later = [s for t, s in points if at_s + gap_s <= t <= at_s + gap_s + bench_s]
    if not sample or not later:
        raise ValueError(f"no steps to estimate at {at_s} s or to measure after it")
    return abs(statistics.median(sample) / statistics.median(later) - 1)


def summary(data: dict) -> list[dict]:
    """Each (model, gap, window): the misses at every T from where the widest window
    fits to where the latest benchmark ends, as percentages."""
    out = []
    for model, points in series(data["rows"]).items():
        end = points[-1][0]
        for gap in GAPS_S:
            times = []
            at = max(WINDOWS_S) + EVERY_S
            while at + gap + BENCH_S <= end:
                times.append(at)
                at += EVERY_S
            for window in WINDOWS_S:
                misses = sorted(100 * miss_at(points, t, gap, window) for t in times)
                out.append(
                    {
                        "model": model,
                        "gap_s": gap,
                        "window_s": window,
                        "points": len(misses),
                        "median_pct": statistics.median(misses),
                        "p90_pct": misses[min(len(misses) - 1, int(0.9 * len(misses)))],
                        "max_pct": misses[-1],
                    }
                )
    return out


def markdown(data: dict) -> str:
    """The table of `data["summary"]` (`summary`), with what was run."""
    from profiling.report import markdown_table, produced_by

    body = [
        [
            r["model"],
            f"{r['gap_s']:.0f}",
            "15 in a row" if r["window_s"] == 0 else f"15 spread over {r['window_s']:.0f} s",
            f"{r['median_pct']:.1f}%",
            f"{r['p90_pct']:.1f}%",
            f"{r['max_pct']:.1f}%",
            str(r["points"]),
        ]
        for r in data["summary"]
    ]
    steps = {m: statistics.median(s for _, s in p) for m, p in series(data["rows"]).items()}
    header = ["model", "gap s", "the compute timed as", "median miss", "90th pct", "largest",
              "estimates"]  # fmt: skip
    return "\n".join(
        [
            produced_by([data["command"]], ", from the repository root"),
            "",
            f"Machine: {data['machine']['cpu']}; {data['nproc']} ranks, {data['seconds']:.0f} s "
            f"of repeats, ended {data['machine']['date_utc']} UTC; median step "
            + ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in steps.items())
            + f"; each against the median of the next {BENCH_S:.0f} s after the gap.",
            "",
            markdown_table(header, body, left=3),
            "",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="ranks, as the cluster's")
    parser.add_argument("--seconds", type=float, default=560.0, help="how long to time")
    parser.add_argument("--json", help="write the repeats and the table's figures here")
    parser.add_argument("--markdown", help="write the table as a fragment for the docs")
    parser.add_argument("--render", metavar="JSON", help="run nothing: the table from this JSON")


def run(args: argparse.Namespace) -> None:
    from profiling.report import command_line, machine, read_json, write_json

    if args.render:
        data = read_json(args.render, "profiling.simulate pace", "rows")
    else:
        least = max(WINDOWS_S) + EVERY_S + max(GAPS_S) + BENCH_S
        if args.seconds < least:
            raise SystemExit(f"profiling.simulate pace: --seconds must be at least {least:.0f}")
        if args.nproc < 1:
            raise SystemExit(
                f"profiling.simulate pace: --nproc must be at least 1, got {args.nproc}"
            )
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            env = {**os.environ, ENV: json.dumps({"seconds": args.seconds, "out": str(out)})}
            command = [
                *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
                *(f"--nproc-per-node={args.nproc}", "-m", "profiling.simulate.pace"),
            ]
            code = subprocess.run(command, env=env).returncode
            if code != 0:
                raise SystemExit(f"profiling.simulate pace: the ranks failed (exit {code})")
            rows = json.loads(out.read_text())
        data = {
            "command": command_line("profiling.simulate", sys.argv[1:]),
            "nproc": args.nproc,
            "seconds": args.seconds,
            "machine": machine(),
            "rows": rows,
        }
    data["summary"] = summary(data)
    text = markdown(data)
    print(text)
    if args.json and not args.render:
        write_json(args.json, data)
    if args.markdown:
        Path(args.markdown).write_text(text)


def worker(settings: dict) -> None:
    """On every rank: the two models' compute, five repeats at a time, for the seconds
    asked; rank 0 writes each block's start and its slowest-rank steps."""
    import torch
    import torch.distributed as dist

    from ddp.config import Config
    from ddp.dist import setup_process_group, teardown_process_group
    from ddp.heap import steady_heap
    from profiling.simulate.inputs import slowest_repeats, time_repeats
    from profiling.simulate.validate import MODELS

    steady_heap()  # the heap as the benchmark's and the calibration's ranks hold it
    setup_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        configs = {m: Config(**MODELS[m]) for m in MODELS}
        rows, start = [], time.perf_counter()
        going = torch.ones(1)
        while True:
            # Rank 0's clock decides for every rank, so that none leaves while the others
            # wait for it at a barrier.
            going.fill_(float(time.perf_counter() - start < settings["seconds"]))
            dist.broadcast(going, src=0)
            if not going.item():
                break
            for model, cfg in configs.items():
                at = time.perf_counter() - start
                _, repeats = time_repeats(
                    cfg, world, repeats=5, warmup=1, rank=rank, before_repeat=dist.barrier
                )
                gathered: list = [None] * world
                dist.all_gather_object(gathered, repeats)
                rows.append([at, model, [r.step_s for r in slowest_repeats(gathered)]])
        if rank == 0:
            Path(settings["out"]).write_text(json.dumps(rows))
    finally:
        teardown_process_group()


if __name__ == "__main__":
    worker(json.loads(os.environ[ENV]))
