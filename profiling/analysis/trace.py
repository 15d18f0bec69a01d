"""One rank's trace, read: every traced step's `StepBreakdown`, the median step, and
what one step's timeline chart draws."""

from __future__ import annotations

from dataclasses import dataclass

from ddp.spans import ALLREDUCE_BYTES
from profiling.analysis.formats import (
    COMMUNICATION_SPAN_PREFIXES,
    COMPUTE_SPANS,
    GPU_CATEGORIES,
    PROFILER_STEP,
    check_format,
    complete_events,
    is_collective,
    main_thread,
    span,
)
from profiling.analysis.gpu import gpu_steps
from profiling.analysis.intervals import Interval, clip, intersect, length, merge
from profiling.analysis.steps import Step, StepBreakdown, cpu_steps


@dataclass
class Parsed:
    steps: list[Step]
    main_spans: list[dict]  # the main thread's events
    is_gpu: bool


# --8<-- [start:parse]
def parse(trace: dict) -> Parsed:
    events = complete_events(trace)
    check_format(events)
    pid_tid = main_thread(events)
    on_main = [e for e in events if (e.get("pid"), e.get("tid")) == pid_tid]
    windows = sorted(
        (int(m.group(1)), span(e)) for e in on_main if (m := PROFILER_STEP.match(e.get("name", "")))
    )
    if any(e.get("cat") in GPU_CATEGORIES for e in events):
        return Parsed(gpu_steps(events, windows), on_main, True)
    return Parsed(cpu_steps(events, on_main, windows), on_main, False)


# --8<-- [end:parse]


def analyse_trace(trace: dict) -> list[StepBreakdown]:
    """Every traced step of one rank's trace, in order."""
    parsed = parse(trace)
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
    parsed = parse(trace)
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
        # Each collective its own bar, and when the main thread issued each all-reduce:
        # a figure shows the launches one by one, not one bar of "something in flight".
        "collective_rows": [rel(row) for row in collective_rows(trace, (lo, hi))],
        "launches": [
            (e["ts"] - lo) / 1e3
            for e in parsed.main_spans
            if e.get("name", "").startswith(LAUNCH_SPAN) and lo <= e["ts"] < hi
        ],
    }


LAUNCH_SPAN = "allreduce "  # the stages' span around each all-reduce they issue (ddp/spans)


def collective_rows(trace: dict, window: Interval) -> list[list[Interval]]:
    """Every collective in flight within `window`, each cut to it but not merged with the
    others, stacked into as few rows as keep each row's bars apart (Gloo runs two
    collectives of one group at once: two rows)."""
    lo, hi = window
    rows: list[list[Interval]] = []
    for start, end in sorted(span(e) for e in complete_events(trace) if is_collective(e)):
        bar = (max(start, lo), min(end, hi))
        if bar[0] >= bar[1]:
            continue
        row = next((r for r in rows if r[-1][1] <= bar[0]), None)
        if row is None:
            rows.append(row := [])
        row.append(bar)
    return rows
