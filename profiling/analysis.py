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

A GPU trace (CUDA activity recorded) adds, on the device's lanes, one event per kernel
(`kernel`), copy (`gpu_memcpy`) and memset (`gpu_memset`), each on its CUDA stream and
with a `correlation` id shared with the CPU-side call that launched it
(`cudaLaunchKernel`, `cat: cuda_runtime`). NCCL's kernels have "nccl" in their names:
`ncclKernel_AllReduce_*`, `ncclDevKernel_Broadcast_*`, `ncclKernel_SendRecv_*` (all-to-all,
send/recv). The launch sits inside a CPU-side `nccl:all_reduce` (`nccl:all_to_all`, ...)
span, which holds the tensor's shape when shapes were recorded; newer NCCL kernels also
carry `In msg nelems` and `dtype` themselves. Older kineto (2021) named the categories
`Operator`, `Runtime`, `Kernel`, `Memcpy` and `Memset`; they are read the same way.

Definitions, per traced step of one rank:

- step time: the `ProfilerStep#N` span, from one `profiler.step()` to the next. It holds
  the whole loop iteration (making the batch, logging scalars too), not just the timed
  part the loop prints, so compare step times with each other, not with that table.
- a step's work (CPU traces): what runs inside its span. GPU traces: the kernels,
  copies and memsets *launched* inside its span (their launch's correlation id), wherever
  they run. The GPU may run a whole step behind the CPU, so cutting its timeline at the
  CPU's step boundaries would time one step's kernels in the next step's window.
  Device work launched before the first traced step belongs to no step.
- communication time: the length of the union of the step's collective intervals (Gloo
  events on any thread; its NCCL kernels on any stream), i.e. the wall time during which
  at least one collective is in flight. Two collectives in flight at once count once.
- compute time (CPU traces): the length of the union of main-thread operator intervals
  (`cpu_op` events) inside the `forward`, `backward` and `optimizer` spans, minus
  everything inside main-thread communication spans: our `allreduce ...` spans (blocking
  in naive and bucketed, a launch in overlapped), `wait for communication`, and `c10d::*`
  operators (torch DDP's launches). Operators, not whole spans: torch's DDP waits for its
  last bucket inside `backward` with no span of its own, and only the absence of
  operators shows that wait. The price: Python time between operators (5-10% of
  forward/backward here, half of the small optimizer span) counts as neither.
  GPU traces: the union of the step's other kernels, copies and memsets.
- hidden communication: the length of (communication ∩ compute): collective time during
  which this rank was computing.
- communication not hidden: communication - hidden. With compute and the rest (other), it
  splits the step exactly: step = (compute - hidden) + hidden + not hidden + other. On a
  GPU, other is the part of a step's length in which none of its own work runs.
- exposed communication: step time minus the `compute_only` run's step time, same rank.
  It includes what the trace does not call communication (bucket copies, launch
  overhead, waiting for the slower rank, a shared CPU) and is noisy: two medians.
- overlap: hidden / communication.
- collectives per step: Gloo events that start in the step, or NCCL kernels launched in
  it. Bytes per step: their payload, from the tensor shapes and dtypes the profiler
  records (`record_shapes=True`): Gloo events' own args; for an NCCL kernel its
  `In msg nelems` and `dtype`, else the shape on the `nccl:*` span around its launch.
  Where those are missing, our `allreduce ...` span labels' `(N B)`. Payload bytes, not
  bytes on the wire: a ring all-reduce sends 2(W-1)/W times its payload per rank.
- GPU lag: how long after the end of its `ProfilerStep` the step's last GPU work ends.

Per (run, rank) the figures come from one traced step, the median one by step time (the
lower median for an even count), so they describe a real step and add up. The
rank-averaged row takes the mean over ranks, and its overlap is mean hidden / mean
communication.
"""

from __future__ import annotations

import bisect
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
OLDER_CATEGORIES = {  # kineto's names before 2022 -> today's
    "Operator": "cpu_op",
    "Runtime": "cuda_runtime",
    "Kernel": "kernel",
    "Memcpy": "gpu_memcpy",
    "Memset": "gpu_memset",
}
# Spans around an NCCL launch that may carry its payload (c10d::* ops list the output
# tensor too, so they would count all-gathers and all-to-alls twice).
NCCL_LAUNCH_SPANS = ("nccl:", "record_param_comms")
DTYPE_BYTES = {
    # the C++ names torch's profiler writes in "Input type"
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "long": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    # the ScalarType names in an NCCL kernel's or record_param_comms' "dtype"
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
GLOO_LANE = "Gloo threads"  # GPU traces: where Gloo's collectives (on CUDA tensors) run
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
# Events, and the trace formats read here.


class TraceFormatError(ValueError):
    """A trace this module would read wrong; the message says what it found instead."""


def complete_events(trace: dict) -> list[dict]:
    """The trace's complete events (ph "X"), the only kind with a duration, with kineto's
    older category names (`Kernel`, `Memcpy`, ...) replaced by today's."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        found = sorted(trace)[:12] if isinstance(trace, dict) else type(trace).__name__
        raise TraceFormatError(
            f"not a torch.profiler (Chrome trace) file: no traceEvents list; found {found}"
        )
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("cat") in OLDER_CATEGORIES:
            e = {**e, "cat": OLDER_CATEGORIES[e["cat"]]}
        out.append(e)
    return out


def check_format(events: list[dict]) -> None:
    """Refuse, saying what was found, a trace whose figures would come out as zeros or
    wrong without a word: device activity of a kind not read here, GPU work with no launch
    to tie it to a step, NCCL collectives recorded without their kernels."""
    on_streams: dict[str, int] = {}  # what runs on a device stream (kineto puts "stream" there)
    gpu: dict[str, int] = {}
    for e in events:
        cat = e.get("cat")
        if "stream" in e.get("args", {}):
            on_streams[cat] = on_streams.get(cat, 0) + 1
        if cat in GPU_CATEGORIES:
            gpu[cat] = gpu.get(cat, 0) + 1
    unknown = {cat: n for cat, n in on_streams.items() if cat not in GPU_CATEGORIES}
    if unknown:
        raise TraceFormatError(
            f"events on GPU streams in categories not read here: {unknown} (read: "
            f"{', '.join(GPU_CATEGORIES)}, and the older {', '.join(OLDER_CATEGORIES)}); "
            "the figures would leave that work out"
        )
    if gpu and not any(is_launch(e) for e in events):
        raise TraceFormatError(
            f"GPU events {gpu} but no CPU-side launch (a cuda_runtime or cuda_driver event "
            "with args.correlation): no kernel can be tied to the step that launched it"
        )
    nccl = sum(1 for e in events if e.get("name", "").startswith("nccl:"))
    if nccl and not gpu:
        raise TraceFormatError(
            f"{nccl} nccl:* collectives on the CPU but no GPU kernels: the trace was recorded "
            "without CUDA activity, so no communication time can be read from it; profile "
            "with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]"
        )


def span(event: dict) -> Interval:
    return (float(event["ts"]), float(event["ts"]) + float(event["dur"]))


def _ts(event: dict) -> float:
    return event["ts"]


def is_collective(event: dict) -> bool:
    """A collective in flight: a Gloo event (any thread), or an NCCL kernel on a GPU,
    all-to-all and send/recv (`ncclKernel_SendRecv_*`) included."""
    name = event.get("name", "")
    if event.get("cat") == "kernel":
        return "nccl" in name.lower()
    return name.startswith("gloo:")


def is_launch(event: dict) -> bool:
    """A CPU-side call that hands work to the GPU (cudaLaunchKernel, cudaMemcpyAsync,
    cuLaunchKernel, ...): the GPU event with the same args.correlation is its work."""
    cat = event.get("cat") or ""
    return cat.endswith(("_runtime", "_driver")) and "correlation" in event.get("args", {})


def collective_bytes(event: dict) -> int | None:
    """Payload bytes of a collective, from the args of its event: an NCCL kernel's (or
    record_param_comms') `In msg nelems` and `dtype`, or the shapes and dtypes of the
    tensors a Gloo event or `nccl:*` span was recorded with. None where they are missing."""
    args = event.get("args", {})
    if "In msg nelems" in args and args.get("dtype") in DTYPE_BYTES:
        return int(args["In msg nelems"]) * DTYPE_BYTES[args["dtype"]]
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
    """(pid, tid) of the thread that ran the training loop: the one with ProfilerStep spans
    (on the CPU: kineto may mirror them on the GPU's lanes)."""
    for e in events:
        if PROFILER_STEP.match(e.get("name", "")) and not e.get("cat", "").startswith("gpu_"):
            return e["pid"], e["tid"]
    categories: dict[str, int] = {}
    for e in events:
        categories[e.get("cat")] = categories.get(e.get("cat"), 0) + 1
    raise TraceFormatError(
        "no ProfilerStep#N span in this trace; was it written by torch.profiler with a "
        "schedule and profiler.step() once per step (as ddp/train.py does)? Found "
        f"{len(events)} complete events, by category: {categories}"
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
    bytes: int | None  # payload bytes of the collectives started (launched) in this step
    bytes_source: str | None  # "collective args" | "span labels" | None (unknown)
    collectives_by_name: dict[str, int] = field(default_factory=dict)
    bytes_by_name: dict[str, int | None] = field(default_factory=dict)
    gpu_end_ms: float | None = None  # GPU traces: when the step's last GPU work ends

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
class _Step:
    number: int
    window: Interval  # its ProfilerStep span, on the CPU's clock
    compute: list[Interval]  # merged
    communication: list[Interval]  # merged
    collectives: list[tuple[str, int | None]]  # (name, payload bytes) of each one it started
    # GPU traces: per CUDA stream (and GLOO_LANE), its (compute, communication), merged
    streams: dict[str, tuple[list[Interval], list[Interval]]] = field(default_factory=dict)
    gpu_end: float | None = None  # GPU traces: when the last GPU work it launched ended


@dataclass
class _Parsed:
    steps: list[_Step]
    main_spans: list[dict]  # the main thread's events
    is_gpu: bool


# --8<-- [start:definitions]
def _parse(trace: dict) -> _Parsed:
    events = complete_events(trace)
    check_format(events)
    pid_tid = main_thread(events)
    on_main = [e for e in events if (e.get("pid"), e.get("tid")) == pid_tid]
    windows = sorted(
        (int(m.group(1)), span(e)) for e in on_main if (m := PROFILER_STEP.match(e.get("name", "")))
    )
    if any(e.get("cat") in GPU_CATEGORIES for e in events):
        return _Parsed(_gpu_steps(events, windows), on_main, True)
    return _Parsed(_cpu_steps(events, on_main, windows), on_main, False)


def _cpu_steps(events: list[dict], on_main: list[dict], windows) -> list[_Step]:
    """Communication: every Gloo collective in flight, on any thread. Compute: the main
    thread's operators in forward/backward/optimizer, less its waits. Each cut at the
    step's boundaries: on the CPU, work runs where it is issued."""
    collectives = sorted((e for e in events if is_collective(e)), key=_ts)
    communication = merge(span(e) for e in collectives)
    inside = merge(span(e) for e in on_main if e.get("name") in COMPUTE_SPANS)
    operators = merge(span(e) for e in on_main if e.get("cat") == "cpu_op")
    waiting = merge(
        span(e) for e in on_main if e.get("name", "").startswith(COMMUNICATION_SPAN_PREFIXES)
    )
    compute = subtract(intersect(operators, inside), waiting)
    return [
        _Step(
            number,
            (lo, hi),
            clip(compute, lo, hi),
            clip(communication, lo, hi),
            [(e["name"], collective_bytes(e)) for e in collectives if lo <= e["ts"] < hi],
        )
        for number, (lo, hi) in windows
    ]


def _gpu_steps(events: list[dict], windows) -> list[_Step]:
    """A step's work is the GPU work it launched (same correlation id as a launch inside
    its ProfilerStep span), wherever on the GPU's clock that work ran. Communication:
    its NCCL kernels, on any stream, and the Gloo collectives it started (Gloo on CUDA
    tensors runs on CPU threads); compute: its other kernels, copies and memsets."""
    launches = {e["args"]["correlation"]: e for e in events if is_launch(e)}
    starts = [lo for _, (lo, _) in windows]
    own: list[list[tuple[dict, dict]]] = [[] for _ in windows]
    for e in events:
        launch = launches.get(e.get("args", {}).get("correlation"))
        if e.get("cat") not in GPU_CATEGORIES or launch is None:
            continue  # not GPU work, or launched before the trace began
        i = bisect.bisect_right(starts, launch["ts"]) - 1
        if i >= 0 and launch["ts"] < windows[i][1][1]:
            own[i].append((e, launch))
    # The CPU-side spans an NCCL launch sits in (nccl:all_reduce, ...), by thread: they name
    # the collective and, when shapes were recorded, hold its tensor.
    around_launch: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("name", "").startswith(NCCL_LAUNCH_SPANS) and not is_launch(e):
            around_launch.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    gloo = sorted((e for e in events if is_collective(e) and e["cat"] != "kernel"), key=_ts)
    steps = []
    for (number, window), work in zip(windows, own, strict=True):
        lanes: dict[str, tuple[list[Interval], list[Interval]]] = {}
        collectives = []
        for e, launch in sorted(work, key=lambda pair: _ts(pair[0])):
            stream = str(e.get("args", {}).get("stream", e.get("tid")))
            compute, nccl = lanes.setdefault(stream, ([], []))
            if not is_collective(e):
                compute.append(span(e))
                continue
            nccl.append(span(e))
            spans = sorted(  # innermost first
                (
                    s
                    for s in around_launch.get((launch.get("pid"), launch.get("tid")), ())
                    if s["ts"] <= launch["ts"] <= s["ts"] + s["dur"]
                ),
                key=lambda s: s["dur"],
            )
            collectives.append((_nccl_name(e, spans), _first_known_bytes([e, *spans])))
        gpu_end = max((end for c, n in lanes.values() for _, end in c + n), default=None)
        started = [e for e in gloo if window[0] <= e["ts"] < window[1]]
        if started:
            lanes[GLOO_LANE] = ([], [span(e) for e in started])
            collectives += [(e["name"], collective_bytes(e)) for e in started]
        streams = {stream: (merge(c), merge(n)) for stream, (c, n) in lanes.items()}
        steps.append(
            _Step(
                number,
                window,
                merge(iv for c, _ in streams.values() for iv in c),
                merge(iv for _, n in streams.values() for iv in n),
                collectives,
                streams,
                gpu_end,
            )
        )
    return steps


# --8<-- [end:definitions]


def _nccl_name(kernel: dict, spans: list[dict]) -> str:
    """The collective an NCCL kernel runs: its nccl:* span's name, else the kernel's
    `Collective name`, else the kernel's own name without its signature."""
    for s in spans:
        if s["name"].startswith("nccl:"):
            return s["name"]
    if "Collective name" in kernel.get("args", {}):
        return "nccl:" + str(kernel["args"]["Collective name"])
    return kernel["name"].split("(")[0]


def _first_known_bytes(sources: list[dict]) -> int | None:
    for source in sources:
        if (nbytes := collective_bytes(source)) is not None:
            return nbytes
    return None


def analyse_trace(trace: dict) -> list[StepBreakdown]:
    """Every traced step of one rank's trace, in order."""
    parsed = _parse(trace)
    out = []
    for s in parsed.steps:
        lo, hi = s.window
        by_name: dict[str, int] = {}
        bytes_by_name: dict[str, int | None] = {}
        for name, nbytes in s.collectives:
            by_name[name] = by_name.get(name, 0) + 1
            before = bytes_by_name.get(name, 0)
            bytes_by_name[name] = None if before is None or nbytes is None else before + nbytes
        total: int | None = None
        source: str | None = None
        if s.collectives and all(v is not None for v in bytes_by_name.values()):
            total, source = sum(bytes_by_name.values()), "collective args"
        else:
            labelled = [
                int(m.group(1))
                for e in parsed.main_spans
                if lo <= e["ts"] < hi and (m := ALLREDUCE_BYTES.match(e.get("name", "")))
            ]
            if labelled:
                total, source = sum(labelled), "span labels"
            elif not s.collectives:
                total, source = 0, "collective args"  # nothing sent
        out.append(
            StepBreakdown(
                step=s.number,
                start_us=lo,
                step_ms=(hi - lo) / 1e3,
                compute_ms=length(s.compute) / 1e3,
                communication_ms=length(s.communication) / 1e3,
                hidden_ms=length(intersect(s.compute, s.communication)) / 1e3,
                collectives=len(s.collectives),
                bytes=total,
                bytes_source=source,
                collectives_by_name=by_name,
                bytes_by_name=bytes_by_name,
                gpu_end_ms=None if s.gpu_end is None else (s.gpu_end - lo) / 1e3,
            )
        )
    return out


def is_gpu_trace(trace: dict) -> bool:
    """Whether the trace recorded GPU work (kernels, copies, memsets)."""
    return any(e.get("cat") in GPU_CATEGORIES for e in complete_events(trace))


def median_step(steps: list[StepBreakdown]) -> StepBreakdown:
    """The traced step with the median step time (the lower one for an even count)."""
    if not steps:
        raise ValueError("no traced step: was --profile-steps at least 1 and --steps as many?")
    ordered = sorted(steps, key=lambda s: s.step_ms)
    return ordered[(len(ordered) - 1) // 2]


def step_timeline(trace: dict, step: int) -> dict:
    """What one step's timeline chart draws, in ms from the step's start on the CPU.
    CPU traces: the main thread's compute intervals by span (forward, backward,
    optimizer), its communication spans (waits, blocking all-reduces, launches), and the
    collectives in flight, all within the step. GPU traces: per stream, the compute and
    NCCL work the step launched, wherever it ran (past the step's end when the GPU lags)."""
    parsed = _parse(trace)
    chosen = [s for s in parsed.steps if s.number == step]
    if not chosen:
        raise ValueError(
            f"step {step} is not traced here; traced: {[s.number for s in parsed.steps]}"
        )
    s = chosen[0]
    lo, hi = s.window

    def rel(intervals: list[Interval]) -> list[Interval]:
        return [((a - lo) / 1e3, (b - lo) / 1e3) for a, b in intervals]

    if parsed.is_gpu:  # GPU kernels do not sit inside the CPU's spans
        return {
            "step": step,
            "step_ms": (hi - lo) / 1e3,
            "gpu": True,
            "compute": {"compute": rel(s.compute)},
            "waiting": [],
            "communication": rel(s.communication),
            "streams": {k: (rel(c), rel(n)) for k, (c, n) in s.streams.items()},
        }
    compute = {
        name: rel(
            intersect(s.compute, merge(span(e) for e in parsed.main_spans if e.get("name") == name))
        )
        for name in COMPUTE_SPANS
    }
    waiting = merge(
        span(e)
        for e in parsed.main_spans
        if e.get("name", "").startswith(COMMUNICATION_SPAN_PREFIXES)
    )
    return {
        "step": step,
        "step_ms": (hi - lo) / 1e3,
        "gpu": False,
        "compute": compute,
        "waiting": rel(clip(waiting, lo, hi)),
        "communication": rel(s.communication),
        "streams": {},
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


# ---------------------------------------------------------------------------------------
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
