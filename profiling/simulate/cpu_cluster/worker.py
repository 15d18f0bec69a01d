"""The calibration's worker: this module under torchrun, one node per rank of a virtual
cluster (`calibration.calibrate` starts it, its settings in the environment, `ENV`).
On every rank at once (`measure`), it measures, in this order:

1. the collective cost: Gloo's all-reduce at a handful of sizes, with the all-reduce
   benchmark's own sweep (`profiling.collectives.worker.sweep`: rounds interleaved,
   the slowest rank's time per call, and `tensor += other` for gamma), fitted on the
   driver's side with `profiling.collectives.model.fit` on each size's fastest call
   (`calibration.SWEEP_SECONDS`), free_bytes no deeper than the link's token bucket
   and beta no faster than its rate, and turned into a `Cost` per size by `cost_model`;
2. concurrency: two all-reduces launched asynchronously at once against one. Gloo
   serves a process group with two worker threads, so two collectives can be in flight
   together; where two small ones take about as long as one, `lanes` says 2. It is
   reported, not used: the model of a stage with one process group keeps one lane, as
   the trickle of item 4 runs on such a group and holds in its figures whatever the
   second thread overlaps under compute (two lanes on top would count it twice), and
   16 launched at once were never near twice as fast as 16 one after the other (the
   runs: docs/appendix/simulator-runs.md, "Calibration", Lanes);
3. the stages' own pass over a gradient: `torch.div(grad, W, out=bucket_view)`, what
   bucketed and overlapped do to each gradient before its all-reduce (and a copy of
   the same size after it), on every rank at once: per model over all its gradients
   right after its backward (`copy_after_backward`, what the model uses), and over
   one 4 MiB gradient, repeated (`copy_s_per_byte`, all that older calibrations have);
4. small all-reduces in a sequence, interleaved in every repeat:
   - a collective's cost in a sequence (`call_s`): after some compute, 1 and then 16
     small all-reduces one after the other, as a stage issues its buckets. The sweep
     starts every call from a barrier and times that call alone, and a call in a
     sequence costs something else (on 2 ranks more, on 4 more or less); what a call
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
     2 ranks a trickle can end no sooner than the same calls made after the compute,
     where the same launched all at once end inside it (the timings:
     docs/appendix/simulator-runs.md). The calls' stamps are
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
   (`calls_after_backward`): the model's own `call_s`, what its predictions use; and
   the broadcast of its buffers (`broadcast_buffers_s`), which the stages with
   broadcast_buffers make before each forward;
6. per model, given the runs' layouts, each stage's step at each cap with nothing
   communicated, over a fake process group of the rank alone, against the compute
   alone in the same rounds (`own_steps`): what the stage's own Python costs a step.

Rank 0 writes all of it as JSON, which `calibration.fitted` fits on the driver's side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ddp.config import Config
from ddp.dist import setup_process_group, slowest_seconds, teardown_process_group
from ddp.heap import steady_heap
from profiling.collectives.worker import sweep
from profiling.simulate.cpu_cluster import measure
from profiling.simulate.cpu_cluster.inputs import (
    pooled_repeats,
    slowest_rank,
    slowest_repeats,
    slowest_workload,
    time_repeats,
    to_workload,
    workload_to_json,
)
from profiling.simulate.cpu_cluster.measure import WARMUP, say

REPEATS = 15  # timed compute repeats per model, each way (alone, with communication)
# The compute alone is also timed in spells spread over the whole calibration (before
# the sweep, between its parts, after the model's own figures), all pooled with the
# REPEATS: the machine's pace swings over seconds, and 15 repeats in a row (2-3 s) are
# one swing, where the benchmark's median spans two minutes of them.
SPELL_REPEATS = 5
COMM_COVER = 2.0  # the all-reduce in flight is sized to last this many backwards
COMM_ALONE = 5  # then timed alone this many times
MAX_COMM_BYTES = 256 * 2**20
ENV = "SIMULATE_CALIBRATION"  # the settings, as JSON, from `calibration.calibrate`


def worker(settings: dict) -> None:
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
            "concurrency": [measure.concurrency(n) for n in measure.CONCURRENCY_BYTES],
            "copy_s_per_byte": measure.copy_s_per_byte(),
        }
        spells.take()
        result["sequence"] = measure.sequence()
        spells.take()
        result["models"] = {
            key: _model(cfg, largest_s / largest, spells, key, settings.get("layouts", {}).get(key))
            for key, cfg in configs.items()
        }
        if rank == 0:
            Path(settings["out"]).write_text(json.dumps(result))
        say(f"calibration done on {dist.get_world_size()} ranks")
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


def _model(
    cfg: Config, s_per_byte: float, spells: Spells, key: str, layouts: list[list] | None = None
) -> dict:
    """The compute of `cfg` on every rank at once, then backward again with an all-reduce
    in flight for all of it; the compute kept is these repeats and every spell of it
    (`Spells`), pooled; and, given `layouts` ([stage, cap_mb] each), those stages' steps
    with no communication (`measure.own_steps`)."""
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
    copy_s_per_byte = measure.copy_after_backward(cfg)
    calls = measure.calls_after_backward(cfg)
    broadcast_s = measure.broadcast_buffers_s(cfg)
    own = measure.own_steps(cfg, layouts) if layouts else None
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
    say(
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
