"""Runs and ranks: every rank's median step per run, the rank-averaged row, and reading
a log directory of traces (the only I/O of the analysis)."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from profiling.analysis.formats import (
    COMPUTE_ONLY,
    COMPUTE_ONLY_AGAIN,
    PROFILER_STEP,
    TraceFormatError,
)
from profiling.analysis.steps import StepBreakdown
from profiling.analysis.trace import analyse_trace, is_gpu_trace, median_step


@dataclass
class RankResult:
    """One run (stage) on one rank: every traced step, the median one, and its exposed
    communication against the compute_only run on the same rank (None without one)."""

    run: str
    rank: int
    steps: list[StepBreakdown]
    median: StepBreakdown
    exposed_ms: float | None
    device: str = "cpu"  # "gpu" where the trace recorded GPU work


def analyse_runs(traces: dict[str, dict[int, dict]]) -> list[RankResult]:
    """traces[run][rank] -> one RankResult per (run, rank), runs in the given order."""
    results = []
    for run, by_rank in traces.items():
        for rank in sorted(by_rank):
            trace = by_rank[rank]
            steps = analyse_trace(trace)
            device = "gpu" if is_gpu_trace(trace) else "cpu"
            results.append(RankResult(run, rank, steps, median_step(steps), None, device))
    floor = {r.rank: r.median.step_ms for r in results if r.run == COMPUTE_ONLY}
    again = {r.rank: r.median.step_ms for r in results if r.run == COMPUTE_ONLY_AGAIN}
    floor = {rank: (ms + again[rank]) / 2 if rank in again else ms for rank, ms in floor.items()}
    for r in results:
        if r.rank in floor:
            r.exposed_ms = r.median.step_ms - floor[r.rank]
    return results


@dataclass
class RunSummary:
    """One run, averaged over its ranks (the table's row)."""

    run: str
    ranks: int
    step_ms: float
    compute_ms: float
    communication_ms: float
    hidden_ms: float
    not_hidden_ms: float
    other_ms: float
    exposed_ms: float | None
    overlap_pct: float | None  # 100 * mean hidden / mean communication
    collectives_per_step: float
    bytes_per_step: float | None
    bytes_source: str | None
    device: str = "cpu"  # "gpu", "cpu" or "mixed" over the ranks


def rank_average(results: list[RankResult]) -> list[RunSummary]:
    """One RunSummary per run, in first-seen order: the mean over ranks of each rank's
    median step."""
    runs: dict[str, list[RankResult]] = {}
    for r in results:
        runs.setdefault(r.run, []).append(r)

    def mean(values):
        values = list(values)
        return None if any(v is None for v in values) else sum(values) / len(values)

    out = []
    for run, ranks in runs.items():
        steps = [r.median for r in ranks]
        communication = mean(s.communication_ms for s in steps)
        hidden = mean(s.hidden_ms for s in steps)
        sources = {s.bytes_source for s in steps}
        devices = {r.device for r in ranks}
        out.append(
            RunSummary(
                run=run,
                ranks=len(ranks),
                step_ms=mean(s.step_ms for s in steps),
                compute_ms=mean(s.compute_ms for s in steps),
                communication_ms=communication,
                hidden_ms=hidden,
                not_hidden_ms=mean(s.not_hidden_ms for s in steps),
                other_ms=mean(s.other_ms for s in steps),
                exposed_ms=mean(r.exposed_ms for r in ranks),
                overlap_pct=100 * hidden / communication if communication > 0 else None,
                collectives_per_step=mean(s.collectives for s in steps),
                bytes_per_step=mean(s.bytes for s in steps),
                bytes_source=sources.pop() if len(sources) == 1 else "mixed",
                device=devices.pop() if len(devices) == 1 else "mixed",
            )
        )
    return out


# Reading a log directory (the only I/O here).

TRACE_SUFFIXES = (".json", ".json.gz")
RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)")  # rank0.<ns>.pt.trace.json.gz, rank-3.json.gz


def load_trace(path: str | Path) -> dict:
    """One trace file, gzip'd or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (ValueError, EOFError, OSError) as e:  # not JSON, not gzip, cut short
        raise TraceFormatError(f"{path}: not a JSON trace ({e})") from e


def trace_files(logdir: str | Path) -> dict[str, list[Path]]:
    """files[run]: the files that may hold each run's traces, whatever their names: every
    *.json and *.json.gz directly in a folder LOGDIR/<run>/ (ddp/train.py writes
    rank<r>.<ns>.pt.trace.json.gz, torch's tensorboard_trace_handler by default
    <host>_<pid>.<ms>.pt.trace.json.gz, other tools rank-<r>.json.gz). A LOGDIR with no such
    folder but such files of its own is a single run, named after it."""
    logdir = Path(logdir)
    if not logdir.is_dir():
        return {}

    def candidates(folder: Path) -> list[Path]:
        return sorted(
            p for p in folder.iterdir() if p.name.endswith(TRACE_SUFFIXES) and p.is_file()
        )

    runs = {
        d.name: files for d in sorted(logdir.iterdir()) if d.is_dir() and (files := candidates(d))
    }
    if not runs and (files := candidates(logdir)):
        runs = {logdir.resolve().name: files}
    return runs


def trace_rank(trace: dict, path: Path, alone: bool) -> int:
    """The rank a trace was recorded on: its distributedInfo (torch writes it whenever a
    process group exists), else a rank<r> in its file name, else 0 for a run's only file."""
    info = trace.get("distributedInfo") or {}
    if isinstance(info.get("rank"), int):
        return info["rank"]
    if m := RANK_IN_NAME.search(path.name):
        return int(m.group(1))
    if alone:
        return 0
    raise TraceFormatError(
        f"{path}: no distributedInfo.rank in the trace and no rank<r> in its name, so its "
        "rank is unknown; rename it rank<r>.json.gz"
    )


def trace_start_us(trace: dict) -> float:
    """When the trace's first step began, in µs since the epoch: kineto writes `ts` since
    the epoch, or since `baseTimeNanoseconds` where the trace has one."""
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    starts = [
        float(e["ts"])
        for e in trace.get("traceEvents", [])
        if isinstance(e, dict) and PROFILER_STEP.match(str(e.get("name", ""))) and "ts" in e
    ]
    return base_us + min(starts, default=0.0)


def read_logdir(logdir: str | Path) -> dict[str, dict[int, dict]]:
    """traces[run][rank] for every run under `logdir` (see trace_files), runs in the order
    they were traced (the main job's: compute_only, the stages, torch_ddp). JSON files
    without traceEvents (profile.json, ...) are not traces; of two traces of one rank in
    one run, the newer counts (a second run into the same folder)."""
    found: dict[str, dict[int, tuple[float, dict]]] = {}
    not_traces: list[str] = []
    for run, paths in trace_files(logdir).items():
        traces = []
        for path in paths:
            trace = load_trace(path)
            if isinstance(trace, dict) and "traceEvents" in trace:
                traces.append((path, trace))
            else:
                not_traces.append(path.name)
        sizes = {
            str(path.name): (t.get("distributedInfo") or {}).get("world_size") for path, t in traces
        }
        if len({size for size in sizes.values() if size is not None}) > 1:
            raise TraceFormatError(
                f"{paths[0].parent} holds traces of jobs of different world sizes "
                f"({sizes}); put each job's traces in a folder of its own"
            )
        newest: dict[int, tuple[float, dict]] = {}
        for path, trace in traces:
            rank, start = trace_rank(trace, path, alone=len(traces) == 1), trace_start_us(trace)
            if rank not in newest or start > newest[rank][0]:
                newest[rank] = (start, trace)
        if newest:
            found[run] = newest
    if not found:
        raise FileNotFoundError(
            f"no trace (*.json or *.json.gz with traceEvents) in {logdir}/<run>/"
            + (f"; these are not traces: {not_traces}" if not_traces else "")
            + "; produce them with --profile-dir (python -m profiling.compare does)"
        )
    order = sorted(found, key=lambda run: min(start for start, _ in found[run].values()))
    return {run: {rank: t for rank, (_, t) in sorted(found[run].items())} for run in order}
