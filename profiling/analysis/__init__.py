"""Where a step's time goes, read from torch.profiler traces: compute, communication,
overlap.

from profiling.analysis import analyse_runs, read_logdir, rank_average
    rows = rank_average(analyse_runs(read_logdir("runs/compare")))

`python -m profiling.compare` runs the main job and prints these figures; this module only
reads. Everything below `read_logdir` is a pure function of the trace JSON (the dict in a
`*.pt.trace.json.gz` file), so the tests can feed it hand-built traces.

The parts, in the order a reader meets them:

- `steps`: the definitions (step, compute, communication, hidden, exposed, overlap)
  and a CPU trace's step in their terms;
- `gpu`: a GPU trace's step (kernels by the step that launched them, NCCL's payloads);
- `intervals`: the interval algebra every figure is a length of;
- `formats`: the trace's events and the formats read (kineto's older names too);
- `trace`: one rank's trace, its steps and one step's timeline;
- `runs`: ranks and runs aggregated, and reading a log directory.
"""

from profiling.analysis.formats import (
    COMMUNICATION_SPAN_PREFIXES,
    COMPUTE_ONLY,
    COMPUTE_ONLY_AGAIN,
    COMPUTE_SPANS,
    GLOO_LANE,
    TraceFormatError,
)
from profiling.analysis.intervals import Interval, clip, intersect, length, merge, subtract
from profiling.analysis.runs import (
    RankResult,
    RunSummary,
    analyse_runs,
    load_trace,
    rank_average,
    read_logdir,
)
from profiling.analysis.steps import StepBreakdown
from profiling.analysis.trace import analyse_trace, is_gpu_trace, median_step, step_timeline

__all__ = [
    "COMMUNICATION_SPAN_PREFIXES",
    "COMPUTE_ONLY",
    "COMPUTE_ONLY_AGAIN",
    "COMPUTE_SPANS",
    "GLOO_LANE",
    "Interval",
    "RankResult",
    "RunSummary",
    "StepBreakdown",
    "TraceFormatError",
    "analyse_runs",
    "analyse_trace",
    "clip",
    "intersect",
    "is_gpu_trace",
    "length",
    "load_trace",
    "median_step",
    "merge",
    "rank_average",
    "read_logdir",
    "step_timeline",
    "subtract",
]
