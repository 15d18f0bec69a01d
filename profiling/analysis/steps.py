"""What a traced step's figures mean: the definitions a learner reads, and the CPU
trace's step in their terms (`cpu_steps`; a GPU trace's is `gpu.gpu_steps`).

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
- exposed communication: step time minus the `compute_only` run's step time, same rank
  (the mean of `compute_only` before every other run and `compute_only_again` after them,
  where both were traced). It includes what the trace does not call communication
  (bucket copies, launch overhead, waiting for the slower rank, a shared CPU) and is
  noisy: two medians.
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

from dataclasses import dataclass, field

from profiling.analysis.formats import (
    COMMUNICATION_SPAN_PREFIXES,
    COMPUTE_SPANS,
    collective_bytes,
    event_start,
    is_collective,
    span,
)
from profiling.analysis.intervals import Interval, clip, intersect, merge, subtract


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
class Step:
    number: int
    window: Interval  # its ProfilerStep span, on the CPU's clock
    compute: list[Interval]  # merged
    communication: list[Interval]  # merged
    collectives: list[tuple[str, int | None]]  # (name, payload bytes) of each one it started
    # GPU traces: per CUDA stream (and GLOO_LANE), its (compute, communication), merged
    streams: dict[str, tuple[list[Interval], list[Interval]]] = field(default_factory=dict)
    gpu_end: float | None = None  # GPU traces: when the last GPU work it launched ended


# --8<-- [start:definitions]
def cpu_steps(events: list[dict], on_main: list[dict], windows) -> list[Step]:
    """Communication: every Gloo collective in flight, on any thread. Compute: the main
    thread's operators in forward/backward/optimizer, less its waits. Each cut at the
    step's boundaries: on the CPU, work runs where it is issued."""
    collectives = sorted((e for e in events if is_collective(e)), key=event_start)
    communication = merge(span(e) for e in collectives)
    inside = merge(span(e) for e in on_main if e.get("name") in COMPUTE_SPANS)
    operators = merge(span(e) for e in on_main if e.get("cat") == "cpu_op")
    waiting = merge(
        span(e) for e in on_main if e.get("name", "").startswith(COMMUNICATION_SPAN_PREFIXES)
    )
    compute = subtract(intersect(operators, inside), waiting)
    return [
        Step(
            number,
            (lo, hi),
            clip(compute, lo, hi),
            clip(communication, lo, hi),
            [(e["name"], collective_bytes(e)) for e in collectives if lo <= e["ts"] < hi],
        )
        for number, (lo, hi) in windows
    ]


# --8<-- [end:definitions]
