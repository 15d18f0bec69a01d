"""The course's numbers: every figure the pages quote about the course's MLP, measured by
one command, and the time each command the pages give takes.

    sudo .venv/bin/python -m profiling.course.numbers                  # measure, print
    sudo .venv/bin/python -m profiling.course.numbers --out docs/results/course-numbers.json
    sudo .venv/bin/python -m profiling.course.numbers --time all \
        --out docs/results/course-numbers.json     # time the pages' commands instead

A page writes `{{ number("overlapped_step_ms") }}` or `{{ duration("check_skip_sync") }}`;
the docs build (docs/hooks.py) renders it from docs/results/course-numbers.json, rounded
the same way everywhere (`profiling.course.quoted`, where each name is defined). So no two
pages can quote two figures for one quantity, and tests/test_docs_numbers.py fails on a
figure a page writes by hand.

The workload is the course's: the MLP 2048 x 7 (25.2M parameters, 96 MiB of gradients
in 14 tensors) at 128 samples per rank, on 2 ranks. What one run measures, in order:

1. compute: forward, backward and optimizer timed on one process with one thread and no
   profiler (`measure_workload`, each run the median of 10 steps), and the same for the
   1024 x 24 MLP of the sliders; the run with the median compute is kept whole (each
   gradient's ready time), for the sliders and the simulated drawings;
2. on a 2-rank virtual cluster at 1 Gbit/s (`profiling.cluster`, root): the cost of one
   call, a 4 KB all-reduce of Gloo (the slowest rank's, from a barrier), and the link's
   rate, a 25 MB all-reduce;
3. the stages' steps on the same cluster (`profiling.bench`, interleaved rounds, the
   slowest rank): compute-only, communication alone, naive, bucketed, overlapped, and
   skip_sync with 4 micro-batches per synchronisation;
4. the four stages traced (`profiling.course.timelines`' run, into --traces), and the
   compute lane of each traced step: the profiler records every operator and Gloo's
   threads run beside backward, so it is longer than the untraced compute.

Each figure keeps its median, range and count. With `--out` the file is written; a
command never writes a tracked file unless told. The run records its own time in the
file (`durations.numbers`), as `--time` does for the pages' commands.

After a new run, the drawings follow it, measuring nothing: `python -m
profiling.course.anatomy --docs` (the sliders' data and the bucket curve; a test fails
until it runs), `python -m profiling.course.timelines --analyse-only --out docs/images`
(the traced steps just made) and `python -m profiling.course.simulated_steps --docs`.

`--time NAMES` (comma-separated names of `quoted.COMMANDS`, or all) measures nothing of the above:
it runs each of the pages' commands once, one after the other, and records its wall time
(merged into --out, keeping the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from ddp.config import Config
from ddp.heap import steady_heap
from profiling.analysis import analyse_runs, read_logdir
from profiling.cluster.virtual_cluster import VirtualCluster
from profiling.common import report
from profiling.course import anatomy, timelines
from profiling.course.quoted import (
    ACCUMULATION_STEPS,
    CAP,
    COMMANDS,
    GBIT_S,
    MLP,
    QUANTITIES,
    RATE,
    load,
    render,
    write,
)
from profiling.simulate.cpu_cluster.inputs import (
    measure_workload,
    workload_from_json,
    workload_to_json,
)
from profiling.simulate.layouts import uniform_buckets


def simulated(data: dict) -> dict[str, float]:
    """The sliders' figures for the 14-gradient MLP, from the measured workload; the
    command stores them with it (`simulated`), so rendering imports no torch."""

    workload = workload_from_json(data["workloads"]["mlp_2048x7"])
    buckets = uniform_buckets(workload, float(CAP))
    naive = [[i] for i in range(len(workload.grads))]

    def step(stage: str, layout) -> float:
        return anatomy.step(workload, layout, stage, GBIT_S, 0.0, 1).step_s * 1e3

    def per_micro_batch(k: int) -> float:  # skip_sync with k micro-batches
        return anatomy.step(workload, buckets, "skip_sync", GBIT_S, 0.0, k).step_s * 1e3 / k

    bucketed, overlapped = step("bucketed", buckets), step("overlapped", buckets)
    return {
        "sim_naive_ms": step("naive", naive),
        "sim_bucketed_ms": bucketed,
        "sim_overlapped_ms": overlapped,
        "sim_bound_ms": anatomy.bound_s(workload, buckets, "overlapped", GBIT_S, 0.0, 1) * 1e3,
        "sim_hidden_ms": bucketed - overlapped,
        "sim_skip_sync_16_ms": per_micro_batch(16),
    }


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def measure_compute(runs: int) -> tuple[dict, dict]:
    """(figures, workloads): each MLP timed `runs` times on this process."""

    steady_heap()  # as the benchmark's ranks hold the heap
    found: dict[str, list] = {name: [] for name in anatomy.MODELS}
    for _ in range(runs):
        for name, model in anatomy.MODELS.items():
            found[name].append(measure_workload(Config(**model), 2))
    course = found["mlp_2048x7"]
    figures = {
        "compute_ms": summary([w.compute_s * 1e3 for w in course]),
        "backward_ms": summary([w.backward_s * 1e3 for w in course]),
    }

    def median_run(ws):
        return sorted(ws, key=lambda w: w.compute_s)[len(ws) // 2]

    return figures, {name: workload_to_json(median_run(ws)) for name, ws in found.items()}


def measure_calls(runs: int) -> dict:
    """One call's cost and the link's rate, on a 2-rank cluster at RATE."""

    calls, rates = [], []
    with VirtualCluster(ranks=2, rate=RATE) as cluster:
        for _ in range(runs):
            small = cluster.probe(megabytes=0.004, iterations=100)
            calls.append(statistics.median(small["seconds"]) * 1e6)
            rates.append(cluster.probe(megabytes=25.0, iterations=3)["MBps"])
    return {"allreduce_call_us": summary(calls), "link_MBps": summary(rates)}


def bench(args: list[str], runs: int) -> list[dict]:
    """The variants of one `profiling.bench` run on the 1 Gbit/s cluster."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        command = [sys.executable, "-m", "profiling.bench", "--nproc", "2", "--network", RATE,
                   "--model", "mlp", "--width", str(MLP["width"]), "--depth", str(MLP["depth"]),
                   "--batch-size", str(MLP["batch_size"]), "--rounds", str(runs),
                   "--warmup-steps", "2", "--json", str(out), *args]  # fmt: skip
        subprocess.run(command, check=True)
        return json.loads(out.read_text())["workloads"][0]["variants"]


def measure_steps(runs: int) -> dict:
    def figure(v: dict) -> dict:
        per = v["per_micro_batch_ms"] / v["median_ms"]  # 1, or 1/k micro-batches
        return summary([t * per for t in v["step_times_ms"]])

    first = bench(["--steps", "2", "--variants",
                   "compute_only,communication_alone,naive,bucketed,overlapped"], runs)  # fmt: skip
    by_name = {v["name"]: v for v in first}
    second = bench(["--steps", "1", "--accumulation-steps", str(ACCUMULATION_STEPS),
                    "--variants", "compute_only,skip_sync"], runs)  # fmt: skip
    skip_sync = next(v for v in second if v["name"] == "skip_sync")
    return {
        "compute_only_2_ranks_ms": figure(by_name["compute_only"]),
        "communication_alone_ms": figure(by_name["communication_alone"]),
        **{f"{s}_step_ms": figure(by_name[s]) for s in ("naive", "bucketed", "overlapped")},
        "skip_sync_step_ms": figure(skip_sync),
    }


def measure_traced(traces: Path, trace: bool) -> dict:

    if trace:
        timelines.run(traces)
    found = read_logdir(traces)
    stages = ("naive", "bucketed", "overlapped")
    results = analyse_runs({s: found[s] for s in stages})
    compute = [r.median.compute_ms for r in results]
    steps = {r.run: r.median.step_ms for r in results if r.rank == 0}
    return {
        "traced_compute_ms": summary(compute),
        **{f"traced_{s}_step_ms": summary([steps[s]]) for s in stages},
    }


def time_commands(names: list[str], data: dict, out: Path | None) -> None:
    """Each command's wall time into data["durations"], written to `out` after each, so
    a failed or interrupted command loses only its own."""

    durations = data.setdefault("durations", {})
    for name in names:
        command = COMMANDS[name]
        if command.junit:
            seconds = junit_seconds(command.junit)
            print(f"{name}: {seconds:.0f} s in {command.junit}", file=sys.stderr, flush=True)
        else:
            print(f"timing {name}: {command.line}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            done = subprocess.run(shlex.split(command.line), stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - start
            if done.returncode != 0:
                print(f"  {name} failed (exit {done.returncode}): not timed", file=sys.stderr)
                continue
        durations[name] = {"command": command.line, "seconds": round(seconds, 1),
                           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                           "load_average_end": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
        print(f"  {seconds:.1f} s", file=sys.stderr, flush=True)
        if out:
            write(out, data)


def junit_seconds(paths: tuple[str, ...]) -> float:
    """The time pytest's JUnit files record for their test suites, summed."""

    total = 0.0
    for path in paths:
        root = ET.parse(path).getroot()
        suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
        total += sum(float(suite.get("time", 0)) for suite in suites)
    return total


def run(args, argv: list[str] | None, durations: dict) -> dict:
    """Everything the pages quote, measured once (`args`: numbers' command line), with
    the commands' times kept from `durations` and this run's own added."""
    started = time.perf_counter()
    print("timing the compute on one process ...", file=sys.stderr, flush=True)
    compute, workloads = measure_compute(args.runs)
    print("one call and the link, on the cluster ...", file=sys.stderr, flush=True)
    calls = measure_calls(args.runs)
    steps = measure_steps(args.runs)
    traced = measure_traced(args.traces, trace=not args.reuse_traces)
    data = {
        "command": report.command_line("profiling.course.numbers", argv),
        "machine": report.machine(),
        "runs": args.runs,
        "seconds": round(time.perf_counter() - started, 1),
        "measured": {**compute, **calls, **steps, **traced},
        "workloads": workloads,
        "durations": durations,
    }
    data["simulated"] = simulated(data)
    durations["numbers"] = {
        "command": data["command"], "seconds": data["seconds"],
        "date_utc": data["machine"]["date_utc"],
        "load_average_end": data["machine"]["load_average_end"],
    }  # fmt: skip
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.course.numbers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, help="write the numbers here (default: print only)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement (default: 3)")
    parser.add_argument("--traces", type=Path, default=Path("runs/course"),
                        help="where the traced steps go (default: runs/course)")  # fmt: skip
    parser.add_argument("--reuse-traces", action="store_true",
                        help="read the traces already in --traces instead of tracing")  # fmt: skip
    parser.add_argument("--time", metavar="NAMES",
                        help="time these of the pages' commands instead (comma-separated, or "
                        "all): " + ", ".join(COMMANDS))  # fmt: skip
    args = parser.parse_args(argv)
    names = []
    if args.time:
        every = [n for n in COMMANDS if n != "numbers"]  # this command's run times itself
        names = every if args.time == "all" else args.time.split(",")
        unknown = [n for n in names if n not in COMMANDS]
        if unknown:
            parser.error(f"--time: no command {unknown}; choose from {list(COMMANDS)}")
    old = load(args.out, "durations") if args.out and args.out.exists() else {}
    if names:
        data = old
        time_commands(names, data, args.out)
    else:
        data = run(args, argv, old.get("durations", {}))
    for name in QUANTITIES:
        if name in data.get("measured", {}) or name in data.get("simulated", {}):
            print(f"{name}: {render(name, data)}")
    for name, timed in data.get("durations", {}).items():
        print(f"{name}: {timed['seconds']} s")
    if args.out:
        write(args.out, data)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
