"""Calibration: everything a prediction needs, measured on the virtual cluster at one
rate and world size, before any run it predicts is measured (the validation calibrates
each model on its own, just before that model's benchmark).

    calibration = calibrate("1gbit", 2, {"mlp": Config(model="mlp", ...)})

One cluster (`profiling.cluster.VirtualCluster`), one torchrun node per rank, each
running `worker` (this module under torchrun), which measures, in this order:

1. the collective cost: Gloo's all-reduce at a handful of sizes, with the all-reduce
   benchmark's own sweep (`profiling.collectives.worker.sweep`: rounds interleaved,
   the slowest rank's time per call, and `tensor += other` for gamma), fitted on the
   driver's side with `profiling.collectives.model.fit` on each size's fastest call
   (`SWEEP_SECONDS`), free_bytes no deeper than the link's token bucket and beta no
   faster than its rate, and turned into a `Cost` per size by `cost_model`;
2. concurrency: two all-reduces launched asynchronously at once against one. Gloo
   serves a process group with two worker threads, so two collectives can be in flight
   together; where two small ones take about as long as one, `lanes` says 2. It is
   reported, not used: the model of a stage with one process group keeps one lane, as
   the trickle of item 4 runs on such a group and holds in its figures whatever the
   second thread overlaps under compute (with two lanes on top, one calibration on 4
   ranks put overlapped 25% short), and 16 launched at once were never near twice as
   fast as 16 one after the other (0.75-1.01 of the slope on 4 ranks, four runs);
3. the stages' own pass over a gradient: `torch.div(grad, W, out=bucket_view)`, what
   bucketed and overlapped do to each gradient before its all-reduce (and a copy of
   the same size after it), on every rank at once: per model over all its gradients
   right after its backward (`_copy_after_backward`, what the model uses), and over
   one 4 MiB gradient, repeated (`copy_s_per_byte`, all that older calibrations have);
4. small all-reduces in a sequence, interleaved in every repeat:
   - a collective's cost in a sequence (`call_s`): after some compute, 1 and then 16
     small all-reduces one after the other, as a stage issues its buckets. The sweep
     starts every call from a barrier and times that call alone; in a sequence each
     call measured 1.5-3 times that on two ranks (0.70 against 0.34 ms, 0.9 against
     0.3), and 0.6-1.6 times on four (4.9 against 6.8, 5.2 against 4.3); what a call
     costs beyond (or short of) the sweep's figure goes to every collective's latency;
   - the same lengths launched all at once, then waited for: `busy_launch_s`, what a
     call queued behind others costs beyond one issued after the last has ended;
   - 16 launched one at a time through a compute, one after every few matmuls, as an
     overlapped stage launches its buckets through backward, against the same compute
     alone, each call stamping its launch and its end: `latency_slowdown` and
     `comm_latency_slowdown`, how much longer compute takes while small all-reduces
     fly, and they while it runs (`latency_slowdowns`: the communication's from each
     repeat's flights, `trickle_slowdowns`, the compute's fitted to the median
     repeat). A large all-reduce mostly waits for the link, a small one for the cores
     (each message round wakes a thread), so the two share the cores differently.
     Launched one at a time, each wakes Gloo's thread on cores the compute holds: on
     2 ranks, 16 trickled through 16 ms of matmuls ended, in one calibration, about
     when the same compute and then the same 16 one after the other would have (31.6
     against 16.1 + 16.5 ms), where 16 launched all at once at its start ended inside
     the compute. The calls' stamps are
     needed: where the lane keeps up with the launches, the two ends alone (the
     compute's and the last call's) fit a whole curve of pairs, where one end and the
     flights pick one;
5. per model, the compute: `inputs.time_repeats` on every rank at once (each repeat from
   a barrier, so the ranks share the cores as the benchmark's do; the slowest rank's
   repeat kept), 15 in a row here and 5 in each of four spells spread over the whole
   calibration (`Spells`: before the sweep, before the sequence, after it, and after
   this model's own figures), the medians over all of them (`inputs.pooled_repeats`);
   and the same backward again with one all-reduce in flight that lasts
   longer than it: `slowdown` = backward with / backward without - 1, how much longer
   compute takes while communication runs on the same cores; and the other way round,
   from when that all-reduce ended against the same all-reduce alone, how much longer
   communication takes while backward runs (`comm_slowdown`); and item 4's sequence
   again where a step issues its calls, right after that model's backward
   (`_calls_after_backward`): the model's own `call_s`, what its predictions use; and
   the broadcast of its buffers (`_broadcast_buffers`), which the stages with
   broadcast_buffers make before each forward;
6. per model, given the runs' layouts, each stage's step at each cap with nothing
   communicated, over a fake process group of the rank alone, against the compute
   alone in the same rounds (`_own_steps`): what the stage's own Python costs a step.

Rank 0 writes all of it as JSON; `calibrate` fits the cost and returns plain data (what
the validation's JSON keeps), which `Calibration.from_json` turns into model inputs.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ddp.config import Config
from profiling.cluster.network import parse_rate, tbf_burst_bytes
from profiling.collectives.model import counts, fit, measure_gamma, medians
from profiling.simulate.inputs import workload_from_json
from profiling.simulate.schedule import Cost, CostModel, Workload

if TYPE_CHECKING:
    import torch

ALGORITHM = "gloo"  # the stages call torch's all-reduce: Gloo's ring, on CPU
# The sweep: 4 KiB to 16 MiB by factors of 4 (7 sizes: 4 fitted, 3 held out), as many
# rounds as fit in half a second per size, 3 to 10. About 10 s on 4 ranks at 1 Gbit/s.
SWEEP = {
    "sizes_bytes": [4 * 2**10 * 4**k for k in range(7)],
    "algorithms": [ALGORITHM],
    "delay_ms": 0.0,
    "min_repeats": 3,
    "max_repeats": 10,
    "seconds_per_size": 0.5,
}
# The sweep's figure per size: its fastest call. Gloo's small all-reduce on 2 ranks runs
# at one of two paces from one call to the next (4 KiB in 0.16-0.73 ms or in 1.8-7.6),
# and a median on the slow side, fitted, let the fit trade wire for latency: 512 KiB of
# each phase passed free at 1 Gbit/s, past the token bucket's 256 KiB. A call's latency comes
# from the sequence's slope (`call_s`), not from here, so the sweep sets only the wire
# (beta and free_bytes), which its fastest calls show best; and free_bytes is capped at
# the bucket's depth (`tbf_burst_bytes`), all a link shaped by it can pass at once, and
# beta at the link's rate: past the bucket, no byte crosses faster.
SWEEP_SECONDS = "min_s"
CONCURRENCY_BYTES = (4 * 2**10, 4 * 2**20)  # latency-bound, and wire-bound
CONCURRENCY_REPEATS = 30  # a few ms each: the medians of many, as one pair is noisy
TWO_LANES_BELOW = 1.5  # two small all-reduces at once take < 1.5x one: they overlap
REPEATS = 15  # timed compute repeats per model, each way (alone, with communication)
WARMUP = 3
# The compute alone is also timed in spells spread over the whole calibration (before
# the sweep, between its parts, after the model's own figures), all pooled with the
# REPEATS: the machine's pace swings over seconds, and 15 repeats in a row (2-3 s) are
# one swing, where the benchmark's median spans two minutes of them.
SPELL_REPEATS = 5
COMM_COVER = 2.0  # the all-reduce in flight is sized to last this many backwards
COMM_ALONE = 5  # then timed alone this many times
COPY_BYTES = 4 * 2**20  # the pass timed: the MLP's largest gradient
COPY_REPEATS = 20
MAX_COMM_BYTES = 256 * 2**20
BROADCAST_REPEATS = 30  # the buffers' broadcast: a fraction of a millisecond each
OWN_REPEATS = 15  # rounds of every stage's step with no communication, each once a round
SEQUENCE_BYTES = 4 * 2**10  # latency-bound: what a call costs beyond its bytes
SEQUENCE_LENGTHS = (1, 16)  # the slope between them: per call, the first's wait left out
SEQUENCE_REPEATS = 15
SEQUENCE_WORK = (256, 40)  # before each sequence, 40 matmuls of 256 x 256 (a few ms)
# The compute small all-reduces are trickled through: one launched after every
# TRICKLE_MATMULS matmuls of SEQUENCE_WORK's side, the last at the compute's end, as a
# backward's last gradient is ready at its end. 16 x 5 matmuls: about 16 ms on 2 ranks,
# 23-28 on 4, within the validated models' backward (15-58 ms): a launch a millisecond
# or two.
TRICKLE_MATMULS = 5
LATENCY_SLOWDOWN_MAX = 20.0  # the fit's upper end: compute 21 times slower while calls fly
ENV = "SIMULATE_CALIBRATION"


# --8<-- [start:cost]
def cost_model(
    fit: dict, world_size: int, algorithm: str = ALGORITHM, call_s: float = 0.0
) -> CostModel:
    """The fitted alpha-beta-gamma model as a `Cost` per size: latency = call_s + steps *
    alpha + bytes added * gamma (what a call costs in a sequence beyond or short of the
    sweep's figure, message rounds, the reduction: what no other collective slows), never
    below 0; wire = sum over phases of max(0, phase bytes - free_bytes) * beta (what
    holds the link)."""

    def cost(nbytes: int) -> Cost:
        c = counts(algorithm, world_size, nbytes)
        wire = sum(max(0.0, phase - fit["free_bytes"]) for phase in c.phases)
        return Cost(
            latency_s=max(0.0, call_s + c.steps * fit["alpha_s"] + c.added * fit["gamma"]),
            wire_s=wire * fit["beta_s_per_byte"],
        )

    return cost


# --8<-- [end:cost]


@dataclass(frozen=True)
class Calibration:
    """One (rate, world size)'s model inputs."""

    rate: str
    world_size: int
    cost: CostModel
    workloads: dict[str, Workload]  # model key -> its compute
    slowdowns: dict[str, float]  # model key -> backward's slowdown under communication
    # model key -> communication's slowdown under backward (0 where not calibrated)
    comm_slowdowns: dict[str, float] = field(default_factory=dict)
    # The same two while small all-reduces fly, in their latency, for the whole cluster
    # (None where not calibrated: the model's slowdowns above stand in)
    latency_slowdown: float | None = None
    comm_latency_slowdown: float | None = None
    busy_launch_s: float = 0.0  # what a collective launched while another flies adds
    copy_s_per_byte: float = 0.0  # a pass over one 4 MiB gradient (into or out of a bucket)
    buffer_bytes: dict[str, list[int]] = field(default_factory=dict)  # per buffer dtype
    # model key -> the same pass over that model's gradients, timed right after its
    # backward (absent in calibrations made before it was measured)
    model_copy_s_per_byte: dict[str, float] = field(default_factory=dict)
    # model key -> the cost with that model's own call_s, from the sequence timed right
    # after its backward (absent in calibrations made before it was measured)
    model_costs: dict[str, CostModel] = field(default_factory=dict)
    # model key -> the two slowdowns of small all-reduces under compute, the trickle's
    # fitted again with that model's cost (`model_latency_slowdowns`); where it has one
    model_latency_slowdowns: dict[str, dict[str, float]] = field(default_factory=dict)
    # model key -> seconds of its buffers' broadcast before forward, as a step makes it
    # (`_broadcast_buffers`; absent in calibrations made before it was measured)
    broadcast_buffers_s: dict[str, float] = field(default_factory=dict)
    # model key -> (stage, cap_mb) -> seconds its step took beyond the compute alone with
    # no communication (`_own_steps`; absent in calibrations made before it was measured)
    own_steps_s: dict[str, dict[tuple[str, float | None], float]] = field(default_factory=dict)

    def own_s(self, model: str, stage: str, cap_mb: float | None) -> float:
        """What `stage` at `cap_mb` took beyond `model`'s compute with no communication,
        where the calibration timed it; else 0."""
        return self.own_steps_s.get(model, {}).get((stage, cap_mb), 0.0)

    def for_model(self, model: str) -> Calibration:
        """This calibration with `model`'s own figures where they were measured: its pass
        over its gradients as the copy, as a pass just after backward costs more per
        byte than one 4 MiB gradient divided over and over (`_copy_after_backward`); its
        cost of a call in a sequence right after its backward (`_calls_after_backward`),
        for every stage; and the trickle's two slowdowns fitted with that cost, so that
        a stage launching its calls through backward counts a call's cost once: in the
        cost, not again in slowdowns fitted with the cluster's."""
        mine: dict = {}
        if model in self.model_copy_s_per_byte:
            mine["copy_s_per_byte"] = self.model_copy_s_per_byte[model]
        if model in self.model_costs:
            mine["cost"] = self.model_costs[model]
            mine.update(self.model_latency_slowdowns.get(model, {}))
        return dataclasses.replace(self, **mine) if mine else self

    def contention(self, model: str) -> dict[str, float | None]:
        """The four slowdowns of `model`'s step, as `schedule.simulate` takes them."""
        return {
            "slowdown": self.slowdowns.get(model, 0.0),
            "comm_slowdown": self.comm_slowdowns.get(model, 0.0),
            "latency_slowdown": self.latency_slowdown,
            "comm_latency_slowdown": self.comm_latency_slowdown,
        }

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        model_costs = {
            k: cost_model(data["fit"], data["world_size"], call_s=m["call_s"])
            for k, m in data["models"].items()
            if "call_s" in m
        }
        return cls(
            rate=data["rate"],
            world_size=data["world_size"],
            cost=cost_model(data["fit"], data["world_size"], call_s=data.get("call_s", 0.0)),
            workloads={k: workload_from_json(m["workload"]) for k, m in data["models"].items()},
            slowdowns={k: m["slowdown"] for k, m in data["models"].items()},
            comm_slowdowns={k: m.get("comm_slowdown", 0.0) for k, m in data["models"].items()},
            latency_slowdown=data.get("latency_slowdown"),
            comm_latency_slowdown=data.get("comm_latency_slowdown"),
            busy_launch_s=data.get("busy_launch_s", 0.0),
            copy_s_per_byte=data.get("copy_s_per_byte", 0.0),
            buffer_bytes={k: m.get("buffer_bytes", []) for k, m in data["models"].items()},
            model_copy_s_per_byte={
                k: m["copy_s_per_byte"] for k, m in data["models"].items() if "copy_s_per_byte" in m
            },
            model_costs=model_costs,
            model_latency_slowdowns=model_latency_slowdowns(data, model_costs),
            broadcast_buffers_s={
                k: m["broadcast_buffers_s"]
                for k, m in data["models"].items()
                if "broadcast_buffers_s" in m
            },
            own_steps_s={
                k: {(stage, cap): extra_s for stage, cap, _, extra_s in m["own_steps"]["layouts"]}
                for k, m in data["models"].items()
                if "own_steps" in m
            },
        )


def lanes(concurrency: list[dict]) -> int:
    """2 if two latency-bound all-reduces launched together overlap, else 1."""
    small = min(concurrency, key=lambda c: c["size_bytes"])
    return 2 if small["two_s"] < TWO_LANES_BELOW * small["one_s"] else 1


def busy_launch_s(sequence: dict) -> float:
    """What a small all-reduce launched while others fly or wait costs
    beyond one issued after the last has ended (what the model charges with `call_s`):
    the per-call slope of the sequences launched all at once (each extra call of a
    burst is queued behind the others), less that of the sequences waited for call by
    call. A slope over many calls: a single pair launched together was measured at
    0.62 to 3.71 ms on 2 ranks from one calibration to the next."""
    return max(0.0, slope_s(sequence, "async_seconds") - slope_s(sequence))


def slope_s(sequence: dict, key: str = "seconds") -> float:
    """Seconds per extra call: (the longer sequence - the shorter) / the calls between
    them, from the medians of `sequence[key]` (one list of repeats per length)."""
    (n_short, short), (n_long, long) = sorted(
        zip(sequence["lengths"], map(statistics.median, sequence[key]), strict=True)
    )
    return (long - short) / (n_long - n_short)


def call_s(sequence: dict, cost: CostModel) -> float:
    """What a collective costs in a sequence beyond the cost model's figure for it: the
    sequence's slope per call, less `cost` of its size, so that a small call costs the
    slope. Negative where the fit says more: on 4 ranks the fit's 4 KiB all-reduce
    ranged 3.9-8.3 ms over 14 calibrations, the slope 4.9-6.6 ms; held at 0, call_s
    once put naive with 17 small gradients 18% long."""
    return slope_s(sequence) - cost(sequence["size_bytes"]).seconds


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
    from profiling.simulate.schedule import Grad, StageSchedule, simulate

    grads = tuple(Grad(f"call {k}", nbytes, compute_s * (k + 1) / calls) for k in range(calls))
    step = simulate(
        Workload(grads, forward_s=0.0, backward_s=compute_s, optimizer_s=0.0),
        [[k] for k in range(calls)],
        cost,
        StageSchedule(overlap=True, busy_launch_s=busy_launch_s),
        slowdown=latency_slowdown,
        comm_slowdown=comm_latency_slowdown,
        latency_slowdown=latency_slowdown,
        comm_latency_slowdown=comm_latency_slowdown,
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
      two medians, taken apart, need not give back the median repeat: on 2 ranks at
      1 Gbit/s, in one calibration, they ended the model's compute 9% early and its
      last call 15% early (fitted, the compute's end is the median's and the last
      call's 8% early). With the communication's fixed, the compute's end rises with
      the slowdown, so one figure fits it (both fitted to the two ends fit a whole
      curve of pairs)."""
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


LATENCY_KEYS = ("latency_slowdown", "comm_latency_slowdown")


def model_latency_slowdowns(data: dict, costs: dict[str, CostModel]) -> dict[str, dict[str, float]]:
    """Per model of a calibration's `data` with its own cost (`costs`), the trickle's two
    slowdowns fitted with that cost (`latency_slowdowns`): what `calibrate` kept, or,
    in a calibration made before it kept them, fitted now from its trickle (the same
    figures). None where the calibration has no trickle."""
    if "trickle" not in data.get("sequence", {}):
        return {}
    fitted = {}
    for key, cost in costs.items():
        kept = data["models"][key]
        if all(k in kept for k in LATENCY_KEYS):
            fitted[key] = {k: kept[k] for k in LATENCY_KEYS}
        else:
            fitted[key] = latency_slowdowns(data["sequence"], cost, data.get("busy_launch_s", 0.0))
    return fitted


def buffer_bytes(cfg: Config) -> list[int]:
    """Bytes of the model's buffers, one entry per dtype: what a stage with
    broadcast_buffers (buffers and later, torch's default) broadcasts before each
    synchronised forward, one broadcast per dtype (`ddp.dist.broadcast_buffers`)."""
    from ddp.models import build_model

    model = build_model(cfg.model, width=cfg.width, depth=cfg.depth)
    by_dtype: dict = {}
    for b in model.buffers():
        by_dtype[b.dtype] = by_dtype.get(b.dtype, 0) + b.numel() * b.element_size()
    return list(by_dtype.values())


# - the driver ------------------------------------------------------------------------


def calibrate(
    rate: str,
    world_size: int,
    configs: dict[str, Config],
    timeout: float = 900,
    *,
    layouts: dict[str, list[tuple[str, float | None]]] | None = None,
) -> dict:
    """Run `worker` on a fresh cluster of `world_size` ranks linked at `rate`; return its
    measurements with the cost fit and the lanes (plain data; `Calibration.from_json`).
    `layouts`: per model key, the (stage, cap_mb) whose steps with no communication to
    time (`_own_steps`; none if not given)."""
    from profiling.cluster.network import available
    from profiling.cluster.virtual_cluster import VirtualCluster
    from profiling.report import load_average

    ok, why = available()
    if not ok:
        raise SystemExit(f"profiling.simulate: no shaped network ({why}); run as root")
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calibration.json"
        settings = {
            "out": str(out),
            "sweep": SWEEP,
            "configs": {k: dataclasses.asdict(c) for k, c in configs.items()},
            "layouts": {k: [list(v) for v in vs] for k, vs in (layouts or {}).items()},
        }
        with VirtualCluster(ranks=world_size, rate=rate) as cluster:
            code = cluster.run(
                ["-m", "profiling.simulate.calibrate"],
                env={ENV: json.dumps(settings)},
                timeout=timeout,
            ).returncode
        if code != 0:
            raise SystemExit(
                f"profiling.simulate: calibration on {world_size} ranks at {rate} failed "
                f"(exit {code}); its output is above"
            )
        result = json.loads(out.read_text())
    return fitted(
        result,
        rate,
        world_size,
        {key: buffer_bytes(cfg) for key, cfg in configs.items()},
        load_before=load_before,
        load_after=load_average(),
    )


def fitted(
    result: dict,
    rate: str,
    world_size: int,
    buffers: dict[str, list[int]],
    load_before: float | None = None,
    load_after: float | None = None,
) -> dict:
    """The driver's side of `calibrate`: the workers' measurements `result` with the cost
    fitted and everything fitted from it (plain data). `refit` runs it again on a kept
    calibration."""
    sweep = {**result["sweep"], "network": {"rate": rate}}
    # --8<-- [start:sweep]
    fits = fit(
        medians([sweep]),
        measure_gamma([sweep]),
        key=SWEEP_SECONDS,  # each size's fastest call
        max_free_bytes=tbf_burst_bytes(parse_rate(rate)),  # the token bucket's depth
        min_beta_s_per_byte=8 / parse_rate(rate),  # and its rate
    )
    # --8<-- [end:sweep]
    if ALGORITHM not in fits:
        raise SystemExit(f"profiling.simulate: too few sizes to fit {ALGORITHM}: {SWEEP}")
    sweep_cost = cost_model(fits[ALGORITHM], world_size)  # before any call_s
    extra_s = call_s(result["sequence"], sweep_cost)
    cost = cost_model(fits[ALGORITHM], world_size, call_s=extra_s)
    busy_s = busy_launch_s(result["sequence"])
    return {
        **result,  # first: what is fitted here wins over a kept figure of the same name
        "rate": rate,
        "world_size": world_size,
        "fit": fits[ALGORITHM],
        "call_s": extra_s,
        "lanes": lanes(result["concurrency"]),
        "busy_launch_s": busy_s,
        **latency_slowdowns(result["sequence"], cost, busy_s),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "models": {
            key: {
                **m,
                "buffer_bytes": buffers[key],
                **model_fits(m, fits[ALGORITHM], world_size, result["sequence"], busy_s),
            }
            for key, m in result["models"].items()
        },
    }


# What `fitted` adds to the workers' measurements: the rest of a kept calibration is them.
# Dropped before fitting again, so that a figure `fitted` no longer makes is not kept.
FITTED_KEYS = (
    "rate", "world_size", "fit", "call_s", "lanes", "busy_launch_s",
    "load_average_before", "load_average_after", *LATENCY_KEYS,
)  # fmt: skip
MODEL_FITTED_KEYS = ("buffer_bytes", "comm_slowdown", "call_s", *LATENCY_KEYS)


def refit(calibration: dict) -> dict:
    """A kept calibration (`fitted`'s output, as the validation's JSON holds it) fitted
    again by the code as it is now, from the same measurements: how a change to the fit
    would have predicted runs already measured."""
    result = {k: v for k, v in calibration.items() if k not in FITTED_KEYS}
    result["models"] = {
        key: {k: v for k, v in m.items() if k not in MODEL_FITTED_KEYS}
        for key, m in calibration["models"].items()
    }
    buffers = {key: m.get("buffer_bytes", []) for key, m in calibration["models"].items()}
    return fitted(
        result,
        calibration["rate"],
        calibration["world_size"],
        buffers,
        calibration.get("load_average_before"),
        calibration.get("load_average_after"),
    )


# --8<-- [start:own]
def model_fits(m: dict, fit: dict, world_size: int, sequence: dict, busy_s: float) -> dict:
    """One model's figures fitted on the driver's side from its measurements `m`: how
    much communication slows under its backward, its call after backward (`call_s`
    of its own sequence, against the cluster's `fit`), and the trickle's two slowdowns
    fitted again with that call's cost (`Calibration.for_model`)."""
    model_call_s = call_s(m["calls_after_backward"], cost_model(fit, world_size))
    model_cost = cost_model(fit, world_size, call_s=model_call_s)
    return {
        "comm_slowdown": comm_slowdown(m["comm_with_backward_s"], m["comm_alone_s"]),
        "call_s": model_call_s,
        **latency_slowdowns(sequence, model_cost, busy_s),
    }


# --8<-- [end:own]


# - the worker, on every rank -----------------------------------------------------------


def worker(settings: dict) -> None:
    import torch.distributed as dist

    from ddp.dist import setup_process_group, teardown_process_group
    from ddp.heap import steady_heap
    from profiling.collectives.worker import sweep

    steady_heap()  # the heap as the benchmark's ranks hold it (`ddp.heap`)
    # The stages' setup and teardown: torch._dynamo imported before the group exists (the
    # optimizer's step would import it after, and keep the group alive into interpreter
    # shutdown, where Gloo's threads can abort the process).
    setup_process_group("gloo")
    try:
        rank = dist.get_rank()
        configs = {key: Config(**cfg) for key, cfg in settings["configs"].items()}
        spells = Spells(configs)
        spells.take()
        sweep_result = sweep(settings["sweep"])
        largest = max(c["size_bytes"] for c in sweep_result["cells"])
        largest_s = statistics.median(
            next(c["seconds"] for c in sweep_result["cells"] if c["size_bytes"] == largest)
        )
        result = {
            "sweep": sweep_result,
            "concurrency": [_concurrency(n) for n in CONCURRENCY_BYTES],
            "copy_s_per_byte": _copy_s_per_byte(),
        }
        spells.take()
        result["sequence"] = _sequence()
        spells.take()
        result["models"] = {
            key: _model(cfg, largest_s / largest, spells, key, settings.get("layouts", {}).get(key))
            for key, cfg in configs.items()
        }
        if rank == 0:
            Path(settings["out"]).write_text(json.dumps(result))
        _say(f"calibration done on {dist.get_world_size()} ranks")
    finally:
        teardown_process_group()


class Spells:
    """The compute alone, timed in spells through the calibration: `take` times
    SPELL_REPEATS repeats of every model, on every rank at once, each from a barrier (as
    `_model` times its own), and notes when, from the first spell's start."""

    def __init__(self, configs: dict[str, Config]) -> None:
        self.configs = configs
        self.repeats: dict[str, list] = {key: [] for key in configs}  # per spell, this rank's
        self.at_s: dict[str, list[float]] = {key: [] for key in configs}
        self.started = time.perf_counter()

    def take(self, keys: list[str] | None = None) -> None:
        import torch.distributed as dist

        from profiling.simulate.inputs import time_repeats

        for key in keys or list(self.configs):
            self.at_s[key].append(time.perf_counter() - self.started)
            _, repeats = time_repeats(
                self.configs[key],
                dist.get_world_size(),
                repeats=SPELL_REPEATS,
                warmup=1,
                rank=dist.get_rank(),
                before_repeat=dist.barrier,
            )
            self.repeats[key].append(repeats)


def _say(text: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"calibration: {text}", file=sys.stderr, flush=True)


def _concurrency(nbytes: int) -> dict:
    """Seconds (median of the slowest rank) for one all-reduce of `nbytes`, and for two
    launched asynchronously at once and both waited for."""
    import torch
    import torch.distributed as dist

    from ddp.dist import slowest_seconds

    a, b = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)

    def two() -> None:
        works = [dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)]
        for work in works:
            work.wait()

    two()  # connections and buffers for both
    one_s = statistics.median(slowest_seconds(lambda: dist.all_reduce(a), CONCURRENCY_REPEATS))
    two_s = statistics.median(slowest_seconds(two, CONCURRENCY_REPEATS))
    _say(f"{nbytes} B: one all-reduce {one_s * 1e3:.2f} ms, two at once {two_s * 1e3:.2f} ms")
    return {"size_bytes": nbytes, "one_s": one_s, "two_s": two_s}


def _copy_s_per_byte() -> float:
    """Seconds per byte of the pass a stage makes over a gradient as it goes into its
    bucket (divided by the world size, into a view of the flat buffer); the median of
    the slowest rank's, every rank at once, as in a step."""
    import torch
    import torch.distributed as dist

    from ddp.dist import slowest_seconds

    grad, bucket = torch.randn(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    world = dist.get_world_size()
    pass_s = statistics.median(
        slowest_seconds(lambda: torch.div(grad, world, out=bucket), COPY_REPEATS)
    )
    _say(f"a pass over {COPY_BYTES >> 20} MiB of gradient: {pass_s * 1e3:.2f} ms")
    return pass_s / COPY_BYTES


def _time_after_backward(
    cfg: Config, model: torch.nn.Module, steps: int, work: Callable[[int], None]
) -> list[float]:
    """Seconds of `work(step)` where a step does its work after backward: `steps` times,
    `model`'s forward and backward on this rank's batch, a barrier (so every rank
    starts the work at once, as in a step), then `work` timed; per step the slowest
    rank's, the warm-up included (the caller drops it)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ddp.data import rank_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    seconds = []
    # --8<-- [start:after_backward]
    for step in range(steps):
        inputs, labels = rank_batch(model, cfg.global_batch(world), step, rank, world, cfg.seed)
        F.cross_entropy(model(inputs), labels).backward()
        dist.barrier()
        start = time.perf_counter()
        work(step)
        seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    # --8<-- [end:after_backward]
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _copy_after_backward(cfg: Config) -> float:
    """Seconds per byte of a stage's two passes over `cfg`'s gradients where a step makes
    them: right after backward (`_time_after_backward`), every gradient divided by the
    world size into its view of one flat buffer (in reverse parameter order, as the
    buckets go), then the average copied back; per byte of one pass, the median over
    repeats. A pass made just after backward costs more per byte than
    `copy_s_per_byte`'s, one 4 MiB gradient divided over and over: for the
    validation's MLP (16 MiB) 1.5-1.9 times on 2 ranks and 1.7-4.6 times on 4, in the
    first two calibrations that timed both; and for the CNN's 17 small tensors each
    call's own overhead counts. As the stage with one bucket does it; with several,
    each bucket's copy in, all-reduce and copy out follow one another, and an
    overlapped stage copies each gradient in as backward writes it, which this does
    not time apart."""
    import torch
    import torch.distributed as dist

    from ddp.models import rank_model

    world = dist.get_world_size()
    model = rank_model(cfg, dist.get_rank())
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    flat = torch.empty(sum(p.numel() for p in params))
    views = list(flat.split([p.numel() for p in params]))
    nbytes = flat.numel() * flat.element_size()

    # --8<-- [start:copy]
    def two_passes(step: int) -> None:
        for p, view in zip(params, views, strict=True):
            torch.div(p.grad.view(-1), world, out=view)
        for p, view in zip(params, views, strict=True):
            p.grad.view(-1).copy_(view)

    # --8<-- [end:copy]
    seconds = _time_after_backward(cfg, model, WARMUP + COPY_REPEATS, two_passes)
    return statistics.median(seconds[WARMUP:]) / (2 * nbytes)


def _calls_after_backward(cfg: Config) -> dict:
    """Item 4's sequence where a step issues its calls, right after `cfg`'s backward
    (`_time_after_backward`): 1 and then 16 small all-reduces one after the other,
    alternating repeat by repeat (so both lengths see the same spells of the machine).
    Its slope is what a call costs in the step of this model. On the second machine
    the validation's naive stage measured 1.8 to 2.1 ms a small call on 2 ranks in all
    six clusters of three runs, while the sequence after matmuls gave 1.0 to 2.0 ms
    from one calibration to the next; over four runs on both machines it gave 0.47 to
    1.08 times naive's figure on 2 ranks (a median of 0.81), 0.85 to 1.08 on 4 (0.93).
    `sequence`'s layout: `slope_s` reads it."""
    import torch
    import torch.distributed as dist

    from ddp.models import rank_model

    tensors = [torch.zeros(SEQUENCE_BYTES // 4) for _ in range(max(SEQUENCE_LENGTHS))]
    kinds = len(SEQUENCE_LENGTHS)

    # --8<-- [start:calls]
    def calls(step: int) -> None:
        for t in tensors[: SEQUENCE_LENGTHS[step % kinds]]:
            dist.all_reduce(t)

    # --8<-- [end:calls]
    steps = kinds * (WARMUP + SEQUENCE_REPEATS)  # a whole number of each length
    model = rank_model(cfg, dist.get_rank())
    seconds = _time_after_backward(cfg, model, steps, calls)
    rows = [seconds[kinds * WARMUP + k :: kinds] for k in range(kinds)]
    medians_ms = ", ".join(
        f"{n} {statistics.median(r) * 1e3:.2f} ms"
        for n, r in zip(SEQUENCE_LENGTHS, rows, strict=True)
    )
    _say(f"{cfg.model}: small all-reduces one by one right after backward: {medians_ms}")
    return {"size_bytes": SEQUENCE_BYTES, "lengths": list(SEQUENCE_LENGTHS), "seconds": rows}


def _broadcast_buffers(cfg: Config) -> float:
    """Seconds of `ddp.dist.broadcast_buffers` over `cfg`'s model, as a stage with
    broadcast_buffers makes it before each forward: from a barrier (a step starts at
    one in the benchmark), the slowest rank's, the median over repeats; 0 for a model
    without buffers. Gloo's broadcast is not an all-reduce of as many bytes: on the
    virtual cluster at 1 Gbit/s one broadcast of either of the CNN's two took
    0.56-0.65 ms on 4 ranks, where an all-reduce of the same bytes took 4.3-8.3 ms; on
    2 ranks, 0.19-0.26 ms."""
    import torch.distributed as dist

    from ddp.dist import broadcast_buffers, slowest_seconds
    from ddp.models import rank_model

    model = rank_model(cfg, dist.get_rank())
    if not list(model.buffers()):
        return 0.0
    group = dist.group.WORLD
    # --8<-- [start:broadcast]
    seconds = slowest_seconds(lambda: broadcast_buffers(model, group), WARMUP + BROADCAST_REPEATS)
    # --8<-- [end:broadcast]
    return statistics.median(seconds[WARMUP:])


def _own_steps(cfg: Config, layouts: list[list]) -> dict:
    """Each stage's step with no communication at all, against the compute alone: every
    [stage, cap_mb] of `layouts` and `ComputeOnly`, each built over a process group that
    moves nothing (torch's fake backend: every collective returns at once, done), so
    that what a stage's step takes beyond the compute's is its own: its hooks' and
    bookkeeping's Python, and its passes over the gradients. Rank r's fake group is
    [r] alone, so each stage sees a world of one (its status rows are one row, not W).
    Built and stepped by the benchmark's own `build_variant` and `step` (each step from
    a barrier on the real group, so that the ranks share the cores as in the
    benchmark), interleaved as its rounds are: every layout in turn, the order rotated
    by one a round, two steps each, the first untimed; of each round, the slowest
    rank's timed step, then per layout the median over rounds of its step less that
    round's compute alone. What a fake collective costs to call (its Python and c10d
    dispatch, about 4 us on the machine here) stays in, where the model's cost of a
    call holds it too."""
    import torch
    import torch.distributed as dist

    # Importing it registers torch's "fake" backend (a test utility torch ships).
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    from ddp.train import ComputeOnly
    from profiling.bench.options import FLOOR
    from profiling.bench.variants import build_variant, make_batches, step
    from stages import STAGES

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([r], backend="fake") for r in range(world)]  # all make all
    alone = groups[rank]
    device = torch.device("cpu")

    def wrap(stage: str, cap: float | None) -> Callable:
        if stage == FLOOR:
            return lambda model, _: ComputeOnly(model, process_group=alone)
        options = {} if cap is None else {"bucket_cap_mb": cap}
        return lambda model, _: STAGES[stage](model, process_group=alone, **options)

    # --8<-- [start:own_steps]
    timed = [[FLOOR, None], *layouts]
    variants = [build_variant(stage, wrap(stage, cap), cfg, device) for stage, cap in timed]
    for k in range(WARMUP + OWN_REPEATS):
        batches = make_batches(variants[0].model, cfg, 2 * k, 2, device)
        shift = k % len(variants)  # the order rotated by one a round, as the benchmark's
        for variant in variants[shift:] + variants[:shift]:
            # One step untimed first: the first after a switch pays for the one before
            # having pushed this one's memory out of cache (the benchmark drops it too).
            step(variant, batches[0], device)
            variant.step_times_s.append(step(variant, batches[1], device)[0])
    # --8<-- [end:own_steps]
    slowest = torch.tensor([v.step_times_s for v in variants], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = [row[WARMUP:] for row in slowest.tolist()]
    compute = rows[0]
    own = [
        [stage, cap, statistics.median(row), statistics.median(map(operator.sub, row, compute))]
        for (stage, cap), row in zip(layouts, rows[1:], strict=True)
    ]
    _say(
        f"{cfg.model}: each stage's step with no communication, beyond the compute alone "
        f"({statistics.median(compute) * 1e3:.1f} ms): "
        + ", ".join(
            f"{stage}{'' if cap is None else f' {cap:g}'} {extra * 1e3:+.2f} ms"
            for stage, cap, _, extra in own
        )
    )
    return {"compute_s": statistics.median(compute), "layouts": own}


def _sequence() -> dict:
    """Small all-reduces, per repeat the slowest rank's:

    - from the end of some compute to the end of `SEQUENCE_LENGTHS` issued one after
      the other ("seconds"), and all launched at once, then waited for
      ("async_seconds");
    - the longest trickled through a compute, one launched after every
      `TRICKLE_MATMULS` matmuls ("trickle"): when the compute ended and when the last
      all-reduce did (each stamps its own end as it completes), with the same compute
      alone, each started from a barrier: the figures of the rank whose compute took
      longest with the trickle, on its own clock.

    All of it interleaved in every repeat, so all see the same spells of the machine:
    on two shared cores a small all-reduce's cost swings 2-3x from one second to the
    next, so each repeat's compute with calls is compared with that repeat's compute
    alone (its calls with the model's cost of a call)."""
    import torch
    import torch.distributed as dist

    side, matmuls = SEQUENCE_WORK
    a = torch.randn(side, side)
    tensors = [torch.zeros(SEQUENCE_BYTES // 4) for _ in range(max(SEQUENCE_LENGTHS))]
    for t in tensors:  # connections and buffers
        dist.all_reduce(t)

    def compute(n: int) -> None:
        for _ in range(n):
            a @ a

    def one_by_one(n: int) -> None:
        for t in tensors[:n]:
            dist.all_reduce(t)

    def all_at_once(n: int) -> None:
        for work in [dist.all_reduce(t, async_op=True) for t in tensors[:n]]:
            work.wait()

    def trickled(launch: bool) -> tuple[float, float, list[list[float]]]:
        """`TRICKLE_MATMULS` matmuls, then an all-reduce launched (if `launch`; else the
        same compute alone), once per tensor: seconds from the start to the compute's
        end, to the last all-reduce's end, and to each all-reduce's launch and end."""
        dist.barrier()
        start = time.perf_counter()
        launches, ends = [], []  # each all-reduce stamps its own end (on Gloo's thread)
        for t in tensors:
            compute(TRICKLE_MATMULS)
            if launch:
                launches.append(time.perf_counter())
                work = dist.all_reduce(t, async_op=True)
                # value(): an all-reduce that failed raises here, not a stamp as if it ended
                ends.append(work.get_future().then(lambda f: (f.value(), time.perf_counter())[1]))
        compute_end = time.perf_counter()
        stamps = torch.futures.wait_all(ends)  # the callbacks' own stamps
        calls = [[at - start, end - start] for at, end in zip(launches, stamps, strict=True)]
        return compute_end - start, max(stamps, default=compute_end) - start, calls

    ways = [(way, n) for way in (one_by_one, all_at_once) for n in SEQUENCE_LENGTHS]
    seconds: list[list[float]] = [[] for _ in ways]
    trickle = []  # per repeat: [compute's end, last end, compute alone, [launch, end]s]
    for _ in range(SEQUENCE_REPEATS):
        for times, (way, n) in zip(seconds, ways, strict=True):
            dist.barrier()
            compute(matmuls)
            start = time.perf_counter()
            way(n)
            times.append(time.perf_counter() - start)
        compute_end, comm_end, calls = trickled(launch=True)
        compute_alone, _, _ = trickled(launch=False)
        trickle.append([compute_end, comm_end, compute_alone, calls])
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = slowest.tolist()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trickle)
    # Of each repeat, the rank whose compute took longest with the trickle (the last to
    # finish: the one a step waits for), all of its figures on its own clock.
    repeats = [max(ranks, key=lambda r: r[0]) for ranks in zip(*gathered, strict=True)]
    medians_ms = [
        (statistics.median(s) * 1e3, way.__name__, n)
        for s, (way, n) in zip(rows, ways, strict=True)
    ]
    with_, end, alone = (statistics.median(r[k] for r in repeats) * 1e3 for k in range(3))
    flown = statistics.median(flight_under(r[3], r[0])[0] for r in repeats) * 1e3
    _say(
        "small all-reduces, "
        + ", ".join(f"{n} {name.replace('_', ' ')}: {m:.2f} ms" for m, name, n in medians_ms)
        + f"; {len(tensors)} trickled through {len(tensors) * TRICKLE_MATMULS} matmuls "
        f"({alone:.2f} ms alone): the compute {with_:.2f} ms ({flown:.2f} of it with a call "
        f"in flight), the last all-reduce {end:.2f} ms"
    )
    n = len(SEQUENCE_LENGTHS)
    return {
        "size_bytes": SEQUENCE_BYTES,
        "lengths": list(SEQUENCE_LENGTHS),
        "seconds": rows[:n],
        "async_seconds": rows[n : 2 * n],
        "trickle": {"calls": len(tensors), "matmuls_per_call": TRICKLE_MATMULS, "repeats": repeats},
    }


def _model(
    cfg: Config, s_per_byte: float, spells: Spells, key: str, layouts: list[list] | None = None
) -> dict:
    """The compute of `cfg` on every rank at once, then backward again with an all-reduce
    in flight for all of it; the compute kept is these repeats and every spell of it
    (`Spells`), pooled; and, given `layouts` ([stage, cap_mb] each), those stages' steps
    with no communication (`_own_steps`)."""
    import torch
    import torch.distributed as dist

    from ddp.dist import slowest_seconds
    from profiling.simulate.inputs import (
        pooled_repeats,
        slowest_rank,
        slowest_repeats,
        slowest_workload,
        time_repeats,
        to_workload,
        workload_to_json,
    )

    rank, world = dist.get_rank(), dist.get_world_size()

    def everyone(repeats: list) -> list[list]:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, repeats)
        return gathered

    # --8<-- [start:slowdown]
    # Alternate: every other repeat has an all-reduce in flight through its backward,
    # so both kinds see the same spells of the shared machine. Its size is the same on
    # every rank: from the slowest rank's backward (as the benchmark times a step) in a
    # first, short measurement, and the sweep's largest size, timed the same way.
    main_at_s = time.perf_counter() - spells.started
    options = {"rank": rank, "before_repeat": dist.barrier}
    grads, first = time_repeats(cfg, world, repeats=3, warmup=WARMUP, **options)
    backward_s = slowest_workload(grads, everyone(first)).backward_s
    comm_bytes = int(min(MAX_COMM_BYTES, COMM_COVER * backward_s / s_per_byte))
    buffer = torch.zeros(comm_bytes // 4)
    count = iter(range(10**9))
    comm_s: list[float] = []  # from each launch to its end, seen from this rank

    def every_other() -> Callable[[], None]:
        if next(count) % 2 == 0:
            return lambda: None
        start = time.perf_counter()
        work = dist.all_reduce(buffer, async_op=True)

        def wait() -> None:
            work.wait()
            comm_s.append(time.perf_counter() - start)

        return wait

    _, repeats = time_repeats(
        cfg, world, repeats=2 * REPEATS, warmup=2, around_backward=every_other, **options
    )  # 2 warm-up repeats: one of each kind, so the count stays in step with the parity
    per_rank = everyone(repeats)
    workload = slowest_workload(grads, [r[0::2] for r in per_rank])
    with_comm = slowest_workload(grads, [r[1::2] for r in per_rank])
    slowdown = with_comm.backward_s / workload.backward_s - 1
    # The other way round: of each repeat, the slowest rank's (the last to launch, so
    # its clock holds no wait for the others), the all-reduce's end against its backward.
    ends = everyone(comm_s[1:])  # the first was the warm-up's
    with_backward = []
    for k, together in enumerate(zip(*[r[1::2] for r in per_rank], strict=True)):
        rank_k = slowest_rank(together)
        with_backward.append([ends[rank_k][k], together[rank_k].backward_s])
    alone_s = statistics.median(slowest_seconds(lambda: dist.all_reduce(buffer), COMM_ALONE))
    # --8<-- [end:slowdown]
    copy_s_per_byte = _copy_after_backward(cfg)
    calls = _calls_after_backward(cfg)
    broadcast_s = _broadcast_buffers(cfg)
    own = _own_steps(cfg, layouts) if layouts else None
    spells.take([key])  # the last spell, after this model's own figures
    # --8<-- [start:spells]
    # What predictions use: the alone repeats above and every spell's, pooled, so that
    # the compute is the median over the calibration's span, not over one swing of the
    # shared machine's pace. The slowdown keeps its own partners (the same swings).
    by_spell = [everyone(repeats) for repeats in spells.repeats[key]]
    pooled = slowest_repeats(pooled_repeats([r[0::2] for r in per_rank], by_spell))
    spread = to_workload(grads, pooled)
    trace = [
        [at, slowest_workload(grads, spell).compute_s]
        for at, spell in zip(spells.at_s[key], by_spell, strict=True)
    ]
    trace.append([main_at_s, workload.compute_s])
    # --8<-- [end:spells]
    _say(
        f"{cfg.model}: forward {workload.forward_s * 1e3:.1f} ms, backward "
        f"{workload.backward_s * 1e3:.1f} ms alone, {with_comm.backward_s * 1e3:.1f} ms with "
        f"{comm_bytes / 2**20:.1f} MiB in flight (slowdown {slowdown:.2f}; the all-reduce "
        f"{alone_s * 1e3:.1f} ms alone), optimizer "
        f"{workload.optimizer_s * 1e3:.1f} ms, a pass over its gradients "
        f"{copy_s_per_byte * 2**20 * 1e3:.2f} ms/MiB, its buffers' broadcast "
        f"{broadcast_s * 1e3:.2f} ms; the compute over {len(by_spell)} spells too "
        f"{spread.compute_s * 1e3:.1f} ms (these alone {workload.compute_s * 1e3:.1f})"
    )
    return {
        "config": dataclasses.asdict(cfg),
        "workload": workload_to_json(spread),
        "alone_workload": workload_to_json(workload),  # the REPEATS alone, in a row
        "compute_spells_s": sorted(trace),  # [seconds into the calibration, compute s]
        "compute_repeats_s": [  # what "workload" is the medians of, but the ready times
            [r.forward_s, r.backward_s, r.optimizer_s] for r in pooled
        ],
        "copy_s_per_byte": copy_s_per_byte,
        "backward_with_comm_s": with_comm.backward_s,
        "comm_bytes": comm_bytes,
        "slowdown": slowdown,
        "comm_with_backward_s": with_backward,
        "comm_alone_s": alone_s,
        "calls_after_backward": calls,
        "broadcast_buffers_s": broadcast_s,
        **({"own_steps": own} if own is not None else {}),
    }


if __name__ == "__main__":
    worker(json.loads(os.environ[ENV]))
