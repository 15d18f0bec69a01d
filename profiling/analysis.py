"""Where a step's time goes, read from torch.profiler traces: compute, communication, overlap.

    from profiling.analysis import analyse_runs, read_logdir, rank_average
    rows = rank_average(analyse_runs(read_logdir("runs/compare")))

`python -m profiling.compare` runs the main job and prints these figures; this module only
reads. Everything below `read_logdir` is a pure function of the trace JSON (the dict in a
`*.pt.trace.json.gz` file), so the tests can feed it hand-built traces.

What a trace holds (torch 2.13, Gloo on CPU; see docs/profiling.md):

- The main thread: one `ProfilerStep#N` span per traced step (N is the training step,
  counted from 0), our `record_function` spans inside it (`forward`, `backward`,
  `finish gradient synchronization`, `optimizer`, `allreduce bucket i (N B)`,
  `allreduce <param> (N B)`, `wait for communication`), and the operators (`cpu_op`:
  aten ops, autograd nodes, `c10d::allreduce_` launching a collective).
- Gloo's worker threads: one `gloo:all_reduce` (or `gloo:broadcast`, ...) event per
  collective, from the moment Gloo starts running it to the moment it completes, with
  the tensor's shape and dtype in its args. torch's DDP's collectives appear the same way.
- GPU traces instead carry kernels (`cat: kernel`); NCCL's have "nccl" in their names.

Definitions, per traced step of one rank:

- step time: the `ProfilerStep#N` span, from one `profiler.step()` to the next. It holds
  the whole loop iteration (making the batch, logging scalars too), not just the timed
  part the loop prints, so compare step times with each other, not with that table.
- communication time: the length of the union of all collective intervals in the step
  (Gloo events on any thread; NCCL kernels on GPU traces), i.e. the wall time during which
  at least one collective is in flight. Two collectives in flight at once count once.
- compute time (CPU traces): the length of the union of main-thread operator intervals
  (`cpu_op` events) inside the `forward`, `backward` and `optimizer` spans, minus
  everything inside main-thread communication spans: our `allreduce ...` spans (blocking
  in naive and bucketed, a launch in overlapped), `wait for communication`, and `c10d::*`
  operators (torch DDP's launches). Operators, not whole spans: torch's DDP waits for its
  last bucket inside `backward` with no span of its own, and only the absence of
  operators shows that wait. The price: Python time between operators (5-10% of
  forward/backward here, half of the small optimizer span) counts as neither.
  GPU traces: the union of non-NCCL kernels and memory copies in the step.
- hidden communication: the length of (communication ∩ compute): collective time during
  which this rank was computing.
- communication not hidden: communication - hidden. With compute and the rest (other), it
  splits the step exactly: step = (compute - hidden) + hidden + not hidden + other.
- exposed communication: step time minus the `compute_only` run's step time, same rank.
  It includes what the trace does not call communication (bucket copies, launch
  overhead, waiting for the slower rank, a shared CPU) and is noisy: two medians.
- overlap: hidden / communication.
- collectives per step: collective events (Gloo events or NCCL kernels) that start in the
  step; bytes per step: their payload (tensor bytes, from the shapes and dtypes Gloo
  records, `record_shapes=True`), or, where those are missing, the `(N B)` in our
  `allreduce ...` span labels. Payload bytes, not bytes on the wire: a ring all-reduce
  sends 2(W-1)/W times its payload per rank.

Per (run, rank) the figures come from one traced step, the median one by step time (the
lower median for an even count), so they describe a real step and add up. The
rank-averaged row takes the mean over ranks, and its overlap is mean hidden / mean
communication.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ddp.spans import ALLREDUCE_BYTES

Interval = tuple[float, float]  # (start, end) in microseconds, the traces' unit

COMPUTE_ONLY = "compute_only"  # the run every other run's exposed communication refers to
COMPUTE_SPANS = ("forward", "backward", "optimizer")  # ddp/train.py's record_function names
# Main-thread spans and operators that are communication, not compute.
COMMUNICATION_SPAN_PREFIXES = ("allreduce ", "wait for communication", "c10d::", "gloo:", "nccl:")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
DTYPE_BYTES = {  # the dtype names torch's profiler writes in "Input type"
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
}
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")


# ---------------------------------------------------------------------------------------
# Intervals: merged lists of disjoint, sorted (start, end) pairs.


def merge(intervals) -> list[Interval]:
    """The union of any intervals, as a sorted list of disjoint ones (empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    """Total length of merged intervals."""
    return sum(end - start for start, end in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a ∩ b for two merged lists (one pass over both)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:  # the one that ends first can meet nothing further on
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a minus b for two merged lists."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if end > start:
            out.append((start, end))
    return out


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    """Merged intervals cut to [lo, hi]."""
    return intersect(intervals, [(lo, hi)]) if hi > lo else []


# ---------------------------------------------------------------------------------------
# Events.


def complete_events(trace: dict) -> list[dict]:
    """The trace's complete events (ph "X"): the only kind with a duration."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def span(event: dict) -> Interval:
    return (float(event["ts"]), float(event["ts"]) + float(event["dur"]))


def is_collective(event: dict) -> bool:
    """A collective in flight: a Gloo event (any thread), or an NCCL kernel on a GPU."""
    name = event.get("name", "")
    if event.get("cat") == "kernel":
        return "nccl" in name.lower()
    return name.startswith("gloo:")


def collective_bytes(event: dict) -> int | None:
    """Payload bytes of a collective event, from the shapes and dtypes in its args."""
    args = event.get("args", {})
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types or len(dims) != len(types):
        return None
    total = 0
    for shape, dtype in zip(dims, types, strict=True):
        if dtype not in DTYPE_BYTES or not isinstance(shape, list):
            return None
        numel = 1
        for size in shape:
            numel *= int(size)
        total += numel * DTYPE_BYTES[dtype]
    return total


def main_thread(events: list[dict]) -> tuple[object, object]:
    """(pid, tid) of the thread that ran the training loop: the one with ProfilerStep spans."""
    for e in events:
        if PROFILER_STEP.match(e.get("name", "")):
            return e["pid"], e["tid"]
    raise ValueError(
        "no ProfilerStep#N span in this trace; was it written by torch.profiler with a "
        "schedule and profiler.step() once per step (as ddp/train.py does)?"
    )


# ---------------------------------------------------------------------------------------
# One rank's trace.


@dataclass
class StepBreakdown:
    """One traced step of one rank. Times in ms; see the module docstring."""

    step: int  # the training step (N of ProfilerStep#N)
    start_us: float  # trace clock
    step_ms: float
    compute_ms: float
    communication_ms: float
    hidden_ms: float
    collectives: int
    bytes: int | None  # payload bytes of the collectives started in this step
    bytes_source: str | None  # "collective args" | "span labels" | None (unknown)
    collectives_by_name: dict[str, int] = field(default_factory=dict)
    bytes_by_name: dict[str, int | None] = field(default_factory=dict)

    @property
    def not_hidden_ms(self) -> float:
        return self.communication_ms - self.hidden_ms

    @property
    def other_ms(self) -> float:
        return self.step_ms - self.compute_ms - self.not_hidden_ms

    @property
    def overlap(self) -> float | None:
        return self.hidden_ms / self.communication_ms if self.communication_ms > 0 else None


@dataclass
class _Parsed:
    steps: list[tuple[int, Interval]]
    compute: list[Interval]  # whole trace, merged
    communication: list[Interval]  # whole trace, merged
    collectives: list[dict]
    main_spans: list[dict]  # the main thread's events
    is_gpu: bool


# --8<-- [start:definitions]
def _parse(trace: dict) -> _Parsed:
    events = complete_events(trace)
    pid_tid = main_thread(events)
    on_main = [e for e in events if (e.get("pid"), e.get("tid")) == pid_tid]
    steps = sorted(
        (int(m.group(1)), span(e)) for e in on_main if (m := PROFILER_STEP.match(e.get("name", "")))
    )
    # Communication: every collective in flight, on any thread (Gloo) or stream (NCCL).
    collectives = sorted((e for e in events if is_collective(e)), key=lambda e: e["ts"])
    communication = merge(span(e) for e in collectives)
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if gpu:  # compute is the GPU's: its other kernels and copies
        compute = merge(span(e) for e in gpu if not is_collective(e))
    else:  # the main thread's operators in forward/backward/optimizer, less its waits
        inside = merge(span(e) for e in on_main if e.get("name") in COMPUTE_SPANS)
        operators = merge(span(e) for e in on_main if e.get("cat") == "cpu_op")
        waiting = merge(
            span(e) for e in on_main if e.get("name", "").startswith(COMMUNICATION_SPAN_PREFIXES)
        )
        compute = subtract(intersect(operators, inside), waiting)
    return _Parsed(steps, compute, communication, collectives, on_main, bool(gpu))


# --8<-- [end:definitions]


def analyse_trace(trace: dict) -> list[StepBreakdown]:
    """Every traced step of one rank's trace, in order."""
    parsed = _parse(trace)
    out = []
    for number, (lo, hi) in parsed.steps:
        compute = clip(parsed.compute, lo, hi)
        communication = clip(parsed.communication, lo, hi)
        started = [e for e in parsed.collectives if lo <= e["ts"] < hi]
        by_name: dict[str, int] = {}
        bytes_by_name: dict[str, int | None] = {}
        for e in started:
            name, nbytes = e["name"], collective_bytes(e)
            by_name[name] = by_name.get(name, 0) + 1
            before = bytes_by_name.get(name, 0)
            bytes_by_name[name] = None if before is None or nbytes is None else before + nbytes
        nbytes: int | None = None
        source: str | None = None
        if started and all(v is not None for v in bytes_by_name.values()):
            nbytes, source = sum(bytes_by_name.values()), "collective args"
        else:
            labelled = [
                int(m.group(1))
                for e in parsed.main_spans
                if lo <= e["ts"] < hi and (m := ALLREDUCE_BYTES.match(e.get("name", "")))
            ]
            if labelled:
                nbytes, source = sum(labelled), "span labels"
            elif not started:
                nbytes, source = 0, "collective args"  # nothing sent
        out.append(
            StepBreakdown(
                step=number,
                start_us=lo,
                step_ms=(hi - lo) / 1e3,
                compute_ms=length(compute) / 1e3,
                communication_ms=length(communication) / 1e3,
                hidden_ms=length(intersect(compute, communication)) / 1e3,
                collectives=len(started),
                bytes=nbytes,
                bytes_source=source,
                collectives_by_name=by_name,
                bytes_by_name=bytes_by_name,
            )
        )
    return out


def median_step(steps: list[StepBreakdown]) -> StepBreakdown:
    """The traced step with the median step time (the lower one for an even count)."""
    if not steps:
        raise ValueError("no traced step: was --profile-steps at least 1 and --steps as many?")
    ordered = sorted(steps, key=lambda s: s.step_ms)
    return ordered[(len(ordered) - 1) // 2]


def step_timeline(trace: dict, step: int) -> dict:
    """What one step's timeline chart draws, in ms from the step's start: the main
    thread's compute intervals by span (forward, backward, optimizer), its communication
    spans (waits, blocking all-reduces, launches), and the collectives in flight."""
    parsed = _parse(trace)
    windows = dict(parsed.steps)
    if step not in windows:
        raise ValueError(f"step {step} is not traced here; traced: {sorted(windows)}")
    lo, hi = windows[step]

    def rel(intervals: list[Interval]) -> list[Interval]:
        return [((s - lo) / 1e3, (e - lo) / 1e3) for s, e in clip(intervals, lo, hi)]

    compute = {
        name: rel(
            intersect(
                parsed.compute, merge(span(e) for e in parsed.main_spans if e.get("name") == name)
            )
        )
        for name in COMPUTE_SPANS
    }
    if parsed.is_gpu:  # GPU kernels do not sit inside the CPU's spans
        compute = {"compute": rel(parsed.compute)}
    waiting = merge(
        span(e)
        for e in parsed.main_spans
        if e.get("name", "").startswith(COMMUNICATION_SPAN_PREFIXES)
    )
    return {
        "step": step,
        "step_ms": (hi - lo) / 1e3,
        "compute": compute,
        "waiting": rel(waiting),
        "communication": rel(parsed.communication),
    }


# ---------------------------------------------------------------------------------------
# Runs and ranks.


@dataclass
class RankResult:
    """One run (stage) on one rank: every traced step, the median one, and its exposed
    communication against the compute_only run on the same rank (None without one)."""

    run: str
    rank: int
    steps: list[StepBreakdown]
    median: StepBreakdown
    exposed_ms: float | None


def analyse_runs(traces: dict[str, dict[int, dict]]) -> list[RankResult]:
    """traces[run][rank] -> one RankResult per (run, rank), runs in the given order."""
    results = []
    for run, by_rank in traces.items():
        for rank in sorted(by_rank):
            steps = analyse_trace(by_rank[rank])
            results.append(RankResult(run, rank, steps, median_step(steps), None))
    floor = {r.rank: r.median.step_ms for r in results if r.run == COMPUTE_ONLY}
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
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# Reading a log directory (the only I/O here).

TRACE_FILE = re.compile(r"^rank(\d+)\.(\d+)\.pt\.trace\.json(\.gz)?$")


def load_trace(path: str | Path) -> dict:
    """One trace file, gzip'd or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def trace_files(logdir: str | Path) -> dict[str, dict[int, Path]]:
    """files[run][rank]: the newest trace of each rank in each run folder of `logdir`
    (ddp/train.py writes <logdir>/<run>/rank<r>.<time ns>.pt.trace.json.gz). Runs come in
    the order they were traced (the main job's order: compute_only, the stages, torch_ddp)."""
    found: dict[str, dict[int, tuple[int, Path]]] = {}
    for path in Path(logdir).glob("*/rank*.pt.trace.json*"):
        m = TRACE_FILE.match(path.name)
        if not m:
            continue
        rank, stamp = int(m.group(1)), int(m.group(2))
        by_rank = found.setdefault(path.parent.name, {})
        if rank not in by_rank or stamp > by_rank[rank][0]:
            by_rank[rank] = (stamp, path)
    order = sorted(found, key=lambda run: min(stamp for stamp, _ in found[run].values()))
    return {run: {rank: p for rank, (_, p) in sorted(found[run].items())} for run in order}


def read_logdir(logdir: str | Path) -> dict[str, dict[int, dict]]:
    """traces[run][rank] for every run folder under `logdir` (see trace_files)."""
    files = trace_files(logdir)
    if not files:
        raise FileNotFoundError(
            f"no rank*.pt.trace.json[.gz] under {logdir}/<run>/; produce them with "
            "--profile-dir (python -m profiling.compare does)"
        )
    return {run: {rank: load_trace(p) for rank, p in ranks.items()} for run, ranks in files.items()}
