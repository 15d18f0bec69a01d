"""Profile every stage on one workload and show where each step's time goes.

    python -m profiling.compare --nproc 2 --model cnn --logdir runs/compare
    python -m profiling.compare --analyse-only runs/compare      # traces already there

The first form runs the main job (`python -m stages`, under torch.distributed.run with
--nproc ranks) with `--profile-dir LOGDIR`, so compute_only, every stage and torch's DDP
train on the same workload one after another, each traced into its own TensorBoard run
(LOGDIR/<run>/rank<r>.*.pt.trace.json.gz). Every option it does not know itself
(--bucket-cap-mb, --batch-size, --steps, --profile-steps, --runs NAMES to train only
some runs, ...) goes to the main job. `--network 1gbit` runs it on a virtual cluster
whose links are shaped to that rate (`profiling.cluster`, as root), where communication
is waiting on a network rather than CPU work on loopback:

    sudo .venv/bin/python -m profiling.compare --network 1gbit --model mlp --width 2048 \
        --depth 7 --batch-size 128 --runs compute_only,naive,bucketed,overlapped,drop_in,torch_ddp

The table warns where its differences cannot be trusted: a run timed faster than
compute_only (a negative exposed time), or differences smaller than the steps' spread.
Each run is traced once, one after the other; for step times to compare, the benchmark
(python -m profiling.bench) interleaves the runs and prints ratios.

`--analyse-only LOGDIR` reads traces recorded any way, CPU (Gloo) or GPU (NCCL): every
*.json[.gz] trace in LOGDIR/<run>/, whatever its name, its rank read from the trace.

Then it reads the traces (profiling/analysis/steps.py has the definitions) and writes:

- a table on stdout, one row per run, averaged over ranks (each rank's median step);
- profile.json (per run, and per rank with every traced step), profile.csv (per rank and
  the rank mean) and profile.md (the table) under --out (default: LOGDIR);
- profile-breakdown.png (per run: compute, hidden and not-hidden communication, the rest;
  the compute-only step as a line) and profile-timeline.png (the median step of every run
  on each rank in --timeline-ranks: for a CPU run its main thread's compute and waits and
  the collectives in flight; for a GPU run each CUDA stream's compute and NCCL kernels)
  under --figures (default: --out);
- TensorBoard scalars beside the loop's own (loss, learning rate, step time ms) in
  LOGDIR/<run>/scalars-rank<r>: exposed communication ms, communication ms, hidden
  communication ms and compute ms for every traced step. Re-analysing replaces them.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from profiling.analysis import (
    COMPUTE_ONLY,
    COMPUTE_ONLY_AGAIN,
    RankResult,
    RunSummary,
    TraceFormatError,
    analyse_runs,
    rank_average,
    read_logdir,
)
from profiling.cluster.network import available, parse_rate
from profiling.cluster.virtual_cluster import VirtualCluster
from profiling.common import report
from profiling.common.charts import breakdown_title, plot_breakdown, plot_timeline

COLUMNS = [  # (header, RunSummary field, format)
    ("step ms", "step_ms", "{:.1f}"),
    ("compute ms", "compute_ms", "{:.1f}"),
    ("comm ms", "communication_ms", "{:.1f}"),
    ("hidden ms", "hidden_ms", "{:.1f}"),
    ("not hidden ms", "not_hidden_ms", "{:.1f}"),
    ("exposed ms", "exposed_ms", "{:+.1f}"),
    ("overlap %", "overlap_pct", "{:.1f}"),
    ("collectives/step", "collectives_per_step", "{:g}"),
    ("KiB/step", "bytes_per_step", "{:.1f}"),
]
COMMAND_FILE = "main-job.txt"  # in the logdir: the command that made the traces
SCALARS = {  # TensorBoard tag -> per traced step (ms)
    "communication ms": lambda step, floor: step.communication_ms,
    "hidden communication ms": lambda step, floor: step.hidden_ms,
    "compute ms": lambda step, floor: step.compute_ms,
    "exposed communication ms": lambda step, floor: step.step_ms - floor,
}


def main(argv: list[str] | None = None) -> list[RunSummary]:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation must not swallow a main-job option
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) to run")
    parser.add_argument("--model", default="cnn", help="mlp | cnn | transformer | frozen")
    parser.add_argument(
        "--network", default="loopback", metavar="RATE",
        help="loopback, or a rate (1gbit, 500mbit): each rank in a network namespace of its "
        "own, linked at that rate (profiling.cluster; needs root) (default: loopback)",
    )  # fmt: skip
    parser.add_argument("--logdir", default="runs/compare", help="where the traces go")
    parser.add_argument("--analyse-only", metavar="LOGDIR", help="skip running; read LOGDIR")
    parser.add_argument("--overwrite", action="store_true", help="replace runs in --logdir")
    parser.add_argument("--out", help="profile.json/.csv/.md go here (default: the logdir)")
    parser.add_argument("--figures", help="the two PNGs go here (default: --out)")
    parser.add_argument("--no-scalars", action="store_true", help="write no TensorBoard scalars")
    parser.add_argument(
        "--timeline-ranks",
        default="0",
        metavar="R[,R...]|all",
        help="the ranks whose median step the timeline draws (default: 0)",
    )
    args, stage_options = parser.parse_known_args(argv)
    if args.network != "loopback" and not args.analyse_only:
        check_network(args.network)  # before --overwrite removes anything
    timeline_ranks = parse_ranks(parser, args.timeline_ranks)
    if args.analyse_only:
        if stage_options:
            parser.error(f"--analyse-only runs nothing; unexpected options {stage_options}")
        logdir = Path(args.analyse_only)
        command = None
    else:
        logdir = Path(args.logdir)
        command = run_main_job(
            args.nproc, args.model, stage_options, logdir, args.overwrite, args.network
        )
    out = Path(args.out or logdir)
    figures = Path(args.figures or out)

    print(f"reading the traces under {logdir}", file=sys.stderr, flush=True)  # can take a while
    try:
        traces = read_logdir(logdir)
        results = analyse_runs(traces)
    except (FileNotFoundError, TraceFormatError) as e:
        raise SystemExit(f"profiling.compare: {e}") from e
    rows = rank_average(results)
    heading = describe(logdir, results, command)
    table = format_table(rows)
    warnings = noise_warnings(rows, results)
    print("\n" + heading + "\n" + table + "".join(f"\nWARNING: {w}" for w in warnings))
    out.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    write_json(out / "profile.json", rows, results, heading, command, warnings)
    write_csv(out / "profile.csv", rows, results)
    (out / "profile.md").write_text(markdown_table(rows) + "\n")
    plot_breakdown(figures / "profile-breakdown.png", rows, breakdown_title(heading))
    plot_timeline(figures / "profile-timeline.png", traces, results, timeline_ranks)
    if not args.no_scalars:
        write_scalars(logdir, results)
    print(f"\nwrote {out}/profile.{{json,csv,md}} and {figures}/profile-{{breakdown,timeline}}.png")
    if not args.no_scalars:
        print(f"TensorBoard: tensorboard --logdir {logdir} --host 127.0.0.1")
    return rows


def noise_warnings(rows: list[RunSummary], results: list[RankResult]) -> list[str]:
    """Where the table's differences cannot be trusted: a run that communicates timed
    faster than compute alone (a negative exposed time: the machine's pace moved between
    runs), and differences smaller than the steps' own spread. One traced run each, one
    after the other, cannot tell those apart; profiling.bench interleaves the runs and
    prints ratios with their spread."""
    out = []
    base = {r.run: r.step_ms for r in rows if r.run in (COMPUTE_ONLY, COMPUTE_ONLY_AGAIN)}
    exposed_shown = [abs(r.exposed_ms) for r in rows if r.exposed_ms is not None
                     and r.run not in (COMPUTE_ONLY, COMPUTE_ONLY_AGAIN)]  # fmt: skip
    if len(base) == 2 and exposed_shown:
        gap = abs(base[COMPUTE_ONLY] - base[COMPUTE_ONLY_AGAIN])
        if gap > min(exposed_shown):
            out.append(
                f"{COMPUTE_ONLY} took {base[COMPUTE_ONLY]:.1f} ms a step before the other runs "
                f"and {base[COMPUTE_ONLY_AGAIN]:.1f} ms after them: the machine's pace moved "
                f"by more ({gap:.1f} ms) than the smallest exposed time shown"
            )
    negative = [r.run for r in rows if r.exposed_ms is not None and r.exposed_ms < 0
                and r.run not in (COMPUTE_ONLY, COMPUTE_ONLY_AGAIN)]  # fmt: skip
    if negative:
        out.append(
            f"{', '.join(negative)} timed faster than {COMPUTE_ONLY}, which does the same "
            "compute and no communication: a negative exposed time is the machine's noise "
            "(other work, a pace that moved between runs), not a measurement"
        )
    # The spread of each run's traced steps on each rank, against the exposed times shown.
    spreads = [max(s.step_ms for s in r.steps) - min(s.step_ms for s in r.steps)
               for r in results if len(r.steps) > 1]  # fmt: skip
    spread = sorted(spreads)[len(spreads) // 2] if spreads else 0.0  # the median
    if exposed_shown and spread > min(exposed_shown):
        out.append(
            f"the traced steps of a run spread over {spread:.1f} ms (median over runs and "
            f"ranks), more than the smallest exposed time shown ({min(exposed_shown):.1f} ms): "
            "differences that small are within the noise"
        )
    if out:
        out.append(
            "for step times to compare, use python -m profiling.bench, which interleaves "
            "the runs in rounds and prints ratios with their spread"
        )
    return out


def parse_ranks(parser: argparse.ArgumentParser, text: str) -> list[int] | None:
    """--timeline-ranks: "all" (None) or a comma-separated list of ranks."""
    if text == "all":
        return None
    try:
        return [int(r) for r in text.split(",")]
    except ValueError:
        parser.error(f"--timeline-ranks takes ranks like 0,1 or 'all', not {text!r}")


def traced_runs(logdir: Path) -> list[str]:
    """The run folders in `logdir` that hold traces the main job writes (torch's
    tensorboard_trace_handler names them *.pt.trace.json.gz): those --overwrite replaces."""
    if not logdir.is_dir():
        return []
    return sorted(
        d.name for d in logdir.iterdir() if d.is_dir() and any(d.glob("*.pt.trace.json*"))
    )


def run_main_job(
    nproc: int,
    model: str,
    stage_options: list[str],
    logdir: Path,
    overwrite: bool,
    network: str = "loopback",
) -> list[str]:
    """Run `python -m stages` on `nproc` ranks (under torch.distributed.run, or on a
    shaped cluster), tracing into `logdir`."""
    if any(o.split("=")[0] == "--profile-dir" for o in stage_options):
        raise SystemExit("--profile-dir is --logdir here")
    existing = traced_runs(logdir)
    if existing and not overwrite:
        raise SystemExit(
            f"{logdir} already holds traced runs ({', '.join(existing)}); pick another "
            "--logdir, pass --overwrite to replace them, or --analyse-only to read them"
        )
    for run in existing:  # only folders that hold our traces, never the logdir itself
        shutil.rmtree(logdir / run)
    job = ["-m", "stages", "--model", model, *stage_options, "--profile-dir", str(logdir)]
    # What is recorded: the line that reruns the job as it ran.
    command = torchrun(nproc, job)
    if network != "loopback":
        command = [sys.executable, "-m", "profiling.compare", "--network", network,
                   "--nproc", str(nproc), "--model", model, *stage_options,
                   "--logdir", str(logdir)]  # fmt: skip
    # Kineto logs a USDT start and stop line for every traced step of every run and rank;
    # level 6 keeps them out of the progress (set KINETO_LOG_LEVEL to see them).
    env = {"KINETO_LOG_LEVEL": os.environ.get("KINETO_LOG_LEVEL", "6")}
    with launcher(nproc, network) as launch:
        if (code := launch(job, env, "")) != 0:
            raise SystemExit(f"the main job failed (exit code {code})")
        # The baseline again, after every other run, as the benchmark interleaves it: the
        # exposed times subtract the mean of the two, and their gap says how far the pace
        # moved.
        runs = next((o.split("=", 1)[1] for o in stage_options if o.startswith("--runs=")), None)
        if "--runs" in stage_options[:-1]:
            runs = stage_options[stage_options.index("--runs") + 1]
        if runs is None or COMPUTE_ONLY in runs.split(","):
            with tempfile.TemporaryDirectory() as scratch:
                again = [*job[: job.index("--profile-dir")], "--profile-dir", scratch]
                if "--runs" in again:  # --runs NAMES as two words: the names go too
                    i = again.index("--runs")
                    del again[i : i + 2]
                again = [*(a for a in again if not a.startswith("--runs=")), "--runs", COMPUTE_ONLY]
                if launch(again, env, "the baseline again") == 0:
                    shutil.move(str(Path(scratch) / COMPUTE_ONLY), logdir / COMPUTE_ONLY_AGAIN)
                else:
                    print(f"{COMPUTE_ONLY} again failed: the baseline is its first run alone")
    (logdir / COMMAND_FILE).write_text(typed(command) + "\n")
    return command


def torchrun(nproc: int, job: list[str]) -> list[str]:
    """`job` (`-m module ...`) on `nproc` ranks of this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), *job]  # fmt: skip


def check_network(network: str) -> None:
    """Refuse, naming --network, a rate tc cannot read or a machine without namespaces."""
    try:
        parse_rate(network)
    except ValueError as e:
        raise SystemExit(f"--network: {e}") from None
    ok, why = available()
    if not ok:
        raise SystemExit(f"--network {network}: no shaped network here ({why})")


@contextmanager
def launcher(nproc: int, network: str) -> Iterator[Callable[[list[str], dict, str], int]]:
    """A function that prints and runs `-m module ...` on `nproc` ranks with `env` added
    (and a note after the printed command) and returns its exit code: under
    torch.distributed.run on loopback, or on a virtual cluster of `network`'s rate, made
    here and removed at the end."""
    if network == "loopback":

        def run(job: list[str], env: dict, note: str) -> int:
            command = torchrun(nproc, job)
            print(f"$ {shlex.join(command)}" + (f"  # {note}" if note else ""), flush=True)
            return subprocess.run(command, env={**os.environ, **env}).returncode

        yield run
        return
    check_network(network)
    with VirtualCluster(ranks=nproc, rate=network) as cluster:

        def on_cluster(job: list[str], env: dict, note: str) -> int:
            typed_line = [sys.executable, "-m", "profiling.cluster", "run", "--", *job]
            where = f"on {nproc} ranks at {network}" + (f", {note}" if note else "")
            print(f"$ {shlex.join(typed_line)}  # {where}", flush=True)
            return cluster.run(job, env=env).returncode

        yield on_cluster


def describe(logdir: Path, results: list[RankResult], command: list[str] | None) -> str:
    per_run: dict[str, int] = {}
    for r in results:
        per_run[r.run] = per_run.get(r.run, 0) + 1
    ranks = "/".join(map(str, sorted(set(per_run.values()))))
    traced = sorted({len(r.steps) for r in results})
    if command:
        ran = typed(command)
    elif (logdir / COMMAND_FILE).is_file():
        ran = (logdir / COMMAND_FILE).read_text().strip() + f"  (re-analysed {logdir})"
    else:
        ran = f"traces in {logdir}, command unknown"
    m = report.machine()
    where = "" if command or (logdir / COMMAND_FILE).is_file() else "analysed on "
    gpu = sorted({r.run for r in results if r.device == "gpu"})
    return (
        f"{ran}\n{where}{platform.node()}: {platform.machine()}, {m['cores']} CPUs, "
        f"Python {m['python']}\n"
        f"{ranks} ranks, {'/'.join(map(str, traced))} traced steps per run; each "
        "row: mean over ranks of each rank's median traced step. exposed = step - "
        f"{COMPUTE_ONLY} step (same rank; with {COMPUTE_ONLY_AGAIN} traced after the other "
        "runs, their mean); overlap = hidden / comm."
        + (
            f"\nGPU runs ({', '.join(gpu)}): a step's work is the GPU work it launched, "
            "wherever it ran; compute = its other kernels and copies, comm = its NCCL kernels."
            if gpu
            else ""
        )
    )


def typed(command: list[str]) -> str:
    """`[sys.executable, "-m", module, *args]` as one would type it."""
    return report.command_line(command[2], command[3:])


def _cell(row: RunSummary, fieldname: str, fmt: str) -> str:
    value = getattr(row, fieldname)
    if value is None:
        return "n/a"
    if fieldname == "bytes_per_step":
        value /= 1024
    return fmt.format(value)


def format_table(rows: list[RunSummary]) -> str:
    width = max(len(r.run) for r in rows) + 1
    lines = [f"{'run':<{width}}" + "".join(f"{h:>{len(h) + 2}}" for h, _, _ in COLUMNS)]
    for row in rows:
        lines.append(
            f"{row.run:<{width}}"
            + "".join(f"{_cell(row, f, fmt):>{len(h) + 2}}" for h, f, fmt in COLUMNS)
        )
    return "\n".join(lines)


def markdown_table(rows: list[RunSummary]) -> str:
    return report.markdown_table(
        ["run", *(h for h, _, _ in COLUMNS)],
        [[row.run, *(_cell(row, f, fmt) for _, f, fmt in COLUMNS)] for row in rows],
    )


def _step_dict(step) -> dict:
    return {
        **dataclasses.asdict(step),
        "not_hidden_ms": step.not_hidden_ms,
        "other_ms": step.other_ms,
        "overlap": step.overlap,
    }


def write_json(path: Path, rows, results, heading: str, command, warnings=()) -> None:
    data = {
        "heading": heading,
        "command": command,
        "warnings": list(warnings),
        "runs": [dataclasses.asdict(r) for r in rows],
        "ranks": [
            {
                "run": r.run,
                "rank": r.rank,
                "device": r.device,
                "exposed_ms": r.exposed_ms,
                "median_step": r.median.step,
                "steps": [_step_dict(s) for s in r.steps],
            }
            for r in results
        ],
    }
    report.write_json(path, data)


def write_csv(path: Path, rows: list[RunSummary], results: list[RankResult]) -> None:
    fields = [f for _, f, _ in COLUMNS] + ["other_ms"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "rank", *fields])
        for r in results:
            m = r.median
            values = {
                **{k: getattr(m, k, None) for k in fields},
                "not_hidden_ms": m.not_hidden_ms,
                "other_ms": m.other_ms,
                "exposed_ms": r.exposed_ms,
                "overlap_pct": None if m.overlap is None else 100 * m.overlap,
                "collectives_per_step": m.collectives,
                "bytes_per_step": m.bytes,
            }
            writer.writerow([r.run, r.rank, *(values[k] for k in fields)])
        for row in rows:
            writer.writerow([row.run, "mean", *(getattr(row, k) for k in fields)])


def write_scalars(logdir: Path, results: list[RankResult]) -> None:
    """Per traced step, beside the loop's scalars, so TensorBoard shows the exposed
    communication next to the step time of the same run and rank."""
    # The baseline the table subtracts: exposed = median step - exposed_ms, per rank.
    floor = {r.rank: r.median.step_ms - r.exposed_ms for r in results if r.run == COMPUTE_ONLY
             and r.exposed_ms is not None}  # fmt: skip
    for r in results:
        folder = logdir / r.run / f"scalars-rank{r.rank}"
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("events.out.tfevents.*.analysis"):
            old.unlink()  # an earlier analysis of these same traces
        writer = SummaryWriter(str(folder), filename_suffix=".analysis")
        for step in r.steps:
            for tag, value in SCALARS.items():
                if tag.startswith("exposed") and r.rank not in floor:
                    continue
                writer.add_scalar(tag, value(step, floor.get(r.rank)), step.step)
        writer.close()


if __name__ == "__main__":
    main()
