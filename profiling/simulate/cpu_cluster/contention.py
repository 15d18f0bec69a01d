"""Contention: how much compute and communication slow each other on the machine's
shared cores, fitted from the calibration's timings (`measure`, `worker`).

Two kinds, as a large all-reduce mostly waits for the link and a small one for the
cores (each message round wakes a thread):

- a large all-reduce in flight through a model's backward: how much longer the
  backward took (a plain ratio, timed by the worker) and how much longer the
  all-reduce (`comm_slowdown`, from when it ended);
- small all-reduces launched one at a time through a compute, as an overlapped stage
  launches its buckets: the trickle's two slowdowns (`latency_slowdowns`), fitted so
  that the model's own trickle (`model_trickle`) ends where the measured ones did.
"""

from __future__ import annotations

import statistics

from profiling.simulate.cpu_cluster.sharing import SharedCores
from profiling.simulate.schedule import CostModel, Grad, StageSchedule, Workload, simulate

SEQUENCE_BYTES = 4 * 2**10  # latency-bound: what a call costs beyond its bytes (`measure`)

LATENCY_SLOWDOWN_MAX = 20.0  # the fit's upper end: compute 21 times slower while calls fly
LATENCY_KEYS = ("latency_slowdown", "comm_latency_slowdown")

MIN_COMM_RATE = 0.05  # communication never measured slower than this under backward


def comm_slowdown(with_backward: list[list[float]], alone_s: float) -> float:
    """How much longer communication takes while backward runs, from repeats of
    [seconds from an all-reduce's launch to its end, backward's seconds], both started
    together, and the same all-reduce's seconds alone. Per repeat: the part of the
    all-reduce left when backward ended ran at full speed, so the rest, alone_s - (end -
    backward), was done during backward, at that fraction of full speed; 1 / rate - 1,
    the median over repeats."""
    rates = []
    for end_s, backward_s in with_backward:
        if end_s <= backward_s:  # all of it under backward
            rate = alone_s / end_s
        else:
            rate = (alone_s - (end_s - backward_s)) / backward_s
        rates.append(min(1.0, max(MIN_COMM_RATE, rate)))
    return 1 / statistics.median(rates) - 1


def flight_under(calls: list[list[float]], until_s: float) -> tuple[float, int]:
    """From [launch, end] per call, in launch order on one lane: the seconds before
    `until_s` in which some call was in flight (queued calls wait inside another's
    flight), and how many calls were launched while the one before still flew."""
    flown, covered, queued = 0.0, 0.0, 0
    for k, (launch_s, end_s) in enumerate(calls):
        queued += k > 0 and launch_s < calls[k - 1][1]
        start_s = max(launch_s, covered)
        flown += max(0.0, min(end_s, until_s) - start_s)
        covered = max(covered, end_s)
    return flown, queued


# --8<-- [start:trickle]
def trickle_slowdowns(repeat: list, one_call_s: float, busy_launch_s: float) -> tuple[float, float]:
    """(latency_slowdown, comm_latency_slowdown) from one repeat of the trickle: [the
    compute's end, the last call's end, the compute alone, [launch, end] per call], all
    from the compute's start, and what a call costs alone (`one_call_s`, plus
    `busy_launch_s` if launched while another flew: the model's own figures).

    - In flight: the seconds `flown` before the compute's end with a call in flight.
    - Compute: it took `extra` = end - alone longer, all of it in flight, so in `flown`
      it did flown - extra of work: slowdown extra / (flown - extra) (the whole
      compute's with / alone - 1 where it lost more than it flew, which the uniform
      rate cannot place).
    - Communication: the last call is launched at the compute's end, so from there to
      the last end the lane ran at full speed; the rest of the calls' work was done in
      `flown`: `comm_slowdown`'s reading of an all-reduce under a backward, with the
      calls' work as the all-reduce and `flown` as the backward."""
    compute_s, last_end_s, alone_s, calls = repeat
    flown, queued = flight_under(calls, compute_s)
    extra = compute_s - alone_s
    if 0 < extra < flown:
        latency = extra / (flown - extra)
    else:
        latency = compute_s / alone_s - 1
    work_s = len(calls) * one_call_s + queued * busy_launch_s
    tail_s = last_end_s - compute_s  # at full speed, after the compute
    comm = comm_slowdown([[flown + tail_s, flown]], work_s) if flown > 0 else 0.0
    return latency, comm


# --8<-- [end:trickle]


def model_trickle(
    compute_s: float,
    calls: int,
    cost: CostModel,
    busy_launch_s: float,
    latency_slowdown: float,
    comm_latency_slowdown: float,
    nbytes: int = SEQUENCE_BYTES,
) -> list:
    """The trickle as the model schedules it, in the worker's repeat format: `calls`
    all-reduces of `nbytes` ready at even steps of a `compute_s` compute, the last at its
    end, each in a bucket of its own on one lane, at these slowdowns (all four: the
    calls are latency-bound); [compute's end, last call's end, compute_s, [[start,
    end] per call]], a call's start being when the lane serves it."""
    grads = tuple(Grad(f"call {k}", nbytes, compute_s * (k + 1) / calls) for k in range(calls))
    step = simulate(
        Workload(grads, forward_s=0.0, backward_s=compute_s, optimizer_s=0.0),
        [[k] for k in range(calls)],
        cost,
        StageSchedule(overlap=True),
        SharedCores(
            slowdown=latency_slowdown,
            comm_slowdown=comm_latency_slowdown,
            latency_slowdown=latency_slowdown,
            comm_latency_slowdown=comm_latency_slowdown,
            busy_launch_s=busy_launch_s,
        ),
    )
    backward = next(s for s in step.lane("compute") if s.label == "backward")
    spans = [[s.start_s, s.end_s] for s in step.lane("comm")]
    return [backward.end_s, spans[-1][1], compute_s, spans]


# --8<-- [start:latency]
def latency_slowdowns(sequence: dict, cost: CostModel, busy_launch_s: float) -> dict[str, float]:
    """The two slowdowns of small all-reduces under compute, from the trickle's repeats.

    - `comm_latency_slowdown`: `trickle_slowdowns`' per repeat (each against that
      repeat's own compute alone, a call at the model's cost of its size), the median,
      never below 0.
    - `latency_slowdown`: the one at which the model's own trickle (`model_trickle`,
      the repeats' median compute alone, that communication slowdown) ends its compute
      where the repeats' median did. Each repeat's pair gives that repeat back, but the
      two medians, taken apart, need not give back the median repeat (they can end the
      model's compute and its last call well short of it: docs/appendix/simulator-runs.md).
      With the communication's fixed, the compute's end rises with the slowdown, so one
      figure fits it (both fitted to the two ends fit a whole curve of pairs)."""
    one_call_s = cost(sequence["size_bytes"]).seconds
    repeats = sequence["trickle"]["repeats"]
    pairs = [trickle_slowdowns(r, one_call_s, busy_launch_s) for r in repeats]
    comm = max(0.0, statistics.median(p[1] for p in pairs))
    alone_s = statistics.median(r[2] for r in repeats)
    end_s = statistics.median(r[0] for r in repeats)
    calls, nbytes = sequence["trickle"]["calls"], sequence["size_bytes"]

    def compute_end_s(latency: float) -> float:
        return model_trickle(alone_s, calls, cost, busy_launch_s, latency, comm, nbytes)[0]

    if compute_end_s(0.0) >= end_s:  # no later than the model's with no slowdown
        latency = 0.0
    elif compute_end_s(LATENCY_SLOWDOWN_MAX) <= end_s:
        latency = LATENCY_SLOWDOWN_MAX
    else:  # bisection, to 20 / 2**50
        low, high = 0.0, LATENCY_SLOWDOWN_MAX
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (middle, high) if compute_end_s(middle) < end_s else (low, middle)
        latency = (low + high) / 2
    return {"latency_slowdown": latency, "comm_latency_slowdown": comm}


# --8<-- [end:latency]
