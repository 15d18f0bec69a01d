"""A GPU trace's step: the kernels, copies and memsets each step launched, wherever on
the GPU's clock they ran, and its NCCL collectives by name and payload."""

from __future__ import annotations

import bisect

from profiling.analysis.formats import (
    GLOO_LANE,
    GPU_CATEGORIES,
    NCCL_LAUNCH_SPANS,
    collective_bytes,
    event_start,
    is_collective,
    is_launch,
    span,
)
from profiling.analysis.intervals import Interval, merge
from profiling.analysis.steps import Step


# --8<-- [start:gpu]
def gpu_steps(events: list[dict], windows) -> list[Step]:
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
    gloo = sorted((e for e in events if is_collective(e) and e["cat"] != "kernel"), key=event_start)
    steps = []
    for (number, window), work in zip(windows, own, strict=True):
        lanes: dict[str, tuple[list[Interval], list[Interval]]] = {}
        collectives = []
        for e, launch in sorted(work, key=lambda pair: event_start(pair[0])):
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
            Step(
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


# --8<-- [end:gpu]


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
