"""The calibration's timed measurements, each made on every rank of the cluster at once
(the worker, `worker`, calls them in its order): what small and large all-reduces cost
alone, in a sequence and trickled through a compute; the stages' passes over the
gradients; the buffers' broadcast; and each stage's step with nothing communicated.
Every figure is the slowest rank's, as the benchmark times a step.
"""

from __future__ import annotations

import operator
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Importing it registers torch's "fake" backend (a test utility torch ships): `own_steps`.
import torch.testing._internal.distributed.fake_pg  # noqa: F401

import stages
from ddp.config import Config
from ddp.data import rank_batch
from ddp.dist import broadcast_buffers, slowest_seconds
from ddp.models import rank_model
from ddp.train import ComputeOnly
from profiling.bench import variants as bench
from profiling.bench.options import FLOOR
from profiling.simulate.cpu_cluster.contention import SEQUENCE_BYTES, flight_under

CONCURRENCY_BYTES = (4 * 2**10, 4 * 2**20)  # latency-bound, and wire-bound
CONCURRENCY_REPEATS = 30  # a few ms each: the medians of many, as one pair is noisy
WARMUP = 3
COPY_BYTES = 4 * 2**20  # the pass timed: the MLP's largest gradient
COPY_REPEATS = 20
BROADCAST_REPEATS = 30  # the buffers' broadcast: a fraction of a millisecond each
OWN_REPEATS = 15  # rounds of every stage's step with no communication, each once a round
SEQUENCE_LENGTHS = (1, 16)  # the slope between them: per call, the first's wait left out
SEQUENCE_REPEATS = 15
SEQUENCE_WORK = (256, 40)  # before each sequence, 40 matmuls of 256 x 256 (a few ms)
# The compute small all-reduces are trickled through: one launched after every
# TRICKLE_MATMULS matmuls of SEQUENCE_WORK's side, the last at the compute's end, as a
# backward's last gradient is ready at its end. With five matmuls between launches, a call
# leaves every millisecond or two and the whole trickle lasts about as long as the
# validated models' backward (the timings: docs/appendix/simulator-runs.md).
TRICKLE_MATMULS = 5


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(f"calibration: {text}", file=sys.stderr, flush=True)


def concurrency(nbytes: int) -> dict:
    """Seconds (median of the slowest rank) for one all-reduce of `nbytes`, and for two
    launched asynchronously at once and both waited for."""
    a, b = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)

    def two() -> None:
        works = [dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)]
        for work in works:
            work.wait()

    two()  # connections and buffers for both
    one_s = statistics.median(slowest_seconds(lambda: dist.all_reduce(a), CONCURRENCY_REPEATS))
    two_s = statistics.median(slowest_seconds(two, CONCURRENCY_REPEATS))
    say(f"{nbytes} B: one all-reduce {one_s * 1e3:.2f} ms, two at once {two_s * 1e3:.2f} ms")
    return {"size_bytes": nbytes, "one_s": one_s, "two_s": two_s}


def copy_s_per_byte() -> float:
    """Seconds per byte of the pass a stage makes over a gradient as it goes into its
    bucket (divided by the world size, into a view of the flat buffer); the median of
    the slowest rank's, every rank at once, as in a step."""
    grad, bucket = torch.randn(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    world = dist.get_world_size()
    pass_s = statistics.median(
        slowest_seconds(lambda: torch.div(grad, world, out=bucket), COPY_REPEATS)
    )
    say(f"a pass over {COPY_BYTES >> 20} MiB of gradient: {pass_s * 1e3:.2f} ms")
    return pass_s / COPY_BYTES


def sequence() -> dict:
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
    say(
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


def _time_after_backward(
    cfg: Config, model: torch.nn.Module, steps: int, work: Callable[[int], None]
) -> list[float]:
    """Seconds of `work(step)` where a step does its work after backward: `steps` times,
    `model`'s forward and backward on this rank's batch, a barrier (so every rank
    starts the work at once, as in a step), then `work` timed; per step the slowest
    rank's, the warm-up included (the caller drops it)."""
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


def copy_after_backward(cfg: Config) -> float:
    """Seconds per byte of a stage's two passes over `cfg`'s gradients where a step makes
    them: right after backward (`_time_after_backward`), every gradient divided by the
    world size into its view of one flat buffer (in reverse parameter order, as the
    buckets go), then the average copied back; per byte of one pass, the median over
    repeats. A pass made just after backward costs more per byte than
    `copy_s_per_byte`'s, one 4 MiB gradient divided over and over (by how much:
    docs/appendix/simulator-runs.md, "Calibration"); and for the CNN's 17 small tensors
    each call's own overhead counts. As the stage with one bucket does it; with several,
    each bucket's copy in, all-reduce and copy out follow one another, and an
    overlapped stage copies each gradient in as backward writes it, which this does
    not time apart."""
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


def calls_after_backward(cfg: Config) -> dict:
    """`sequence`'s calls one by one, where a step issues its calls: right after `cfg`'s
    backward (`_time_after_backward`), 1 and then 16 small all-reduces one after the other,
    alternating repeat by repeat (so both lengths see the same spells of the machine).
    Its slope is what a call costs in the step of this model: the slope taken after
    matmuls (`sequence`) moves from one calibration to the next, where what the stages'
    own calls cost after backward hardly does (the runs: docs/appendix/simulator-runs.md).
    `sequence`'s layout: `slope_s` reads it."""
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
    say(f"{cfg.model}: small all-reduces one by one right after backward: {medians_ms}")
    return {"size_bytes": SEQUENCE_BYTES, "lengths": list(SEQUENCE_LENGTHS), "seconds": rows}


def broadcast_buffers_s(cfg: Config) -> float:
    """Seconds of `ddp.dist.broadcast_buffers` over `cfg`'s model, as a stage with
    broadcast_buffers makes it before each forward: from a barrier (a step starts at
    one in the benchmark), the slowest rank's, the median over repeats; 0 for a model
    without buffers. Gloo's broadcast is not an all-reduce of as many bytes: it takes
    fewer message rounds, and on 4 ranks a small one costs several times less (the
    timings: docs/appendix/simulator-runs.md, "Calibration")."""
    model = rank_model(cfg, dist.get_rank())
    if not list(model.buffers()):
        return 0.0
    group = dist.group.WORLD
    # --8<-- [start:broadcast]
    seconds = slowest_seconds(lambda: broadcast_buffers(model, group), WARMUP + BROADCAST_REPEATS)
    # --8<-- [end:broadcast]
    return statistics.median(seconds[WARMUP:])


def own_steps(cfg: Config, layouts: list[list]) -> dict:
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
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([r], backend="fake") for r in range(world)]  # all make all
    alone = groups[rank]
    device = torch.device("cpu")

    def wrap(stage: str, cap: float | None) -> Callable:
        if stage == FLOOR:
            return lambda model, _: ComputeOnly(model, process_group=alone)
        options = {} if cap is None else {"bucket_cap_mb": cap}
        # `stages.STAGES` read now, not at import: built on first use (a test stands in its own)
        return lambda model, _: stages.STAGES[stage](model, process_group=alone, **options)

    # --8<-- [start:own_steps]
    timed = [[FLOOR, None], *layouts]
    variants = [bench.build_variant(stage, wrap(stage, cap), cfg, device) for stage, cap in timed]
    for k in range(WARMUP + OWN_REPEATS):
        batches = bench.make_batches(variants[0].model, cfg, 2 * k, 2, device)
        shift = k % len(variants)  # the order rotated by one a round, as the benchmark's
        for variant in variants[shift:] + variants[:shift]:
            # One step untimed first: the first after a switch pays for the one before
            # having pushed this one's memory out of cache (the benchmark drops it too).
            bench.step(variant, batches[0], device)
            variant.step_times_s.append(bench.step(variant, batches[1], device)[0])
    # --8<-- [end:own_steps]
    slowest = torch.tensor([v.step_times_s for v in variants], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = [row[WARMUP:] for row in slowest.tolist()]
    compute = rows[0]
    own = [
        [stage, cap, statistics.median(row), statistics.median(map(operator.sub, row, compute))]
        for (stage, cap), row in zip(layouts, rows[1:], strict=True)
    ]
    say(
        f"{cfg.model}: each stage's step with no communication, beyond the compute alone "
        f"({statistics.median(compute) * 1e3:.1f} ms): "
        + ", ".join(
            f"{stage}{'' if cap is None else f' {cap:g}'} {extra * 1e3:+.2f} ms"
            for stage, cap, _, extra in own
        )
    )
    return {"compute_s": statistics.median(compute), "layouts": own}
