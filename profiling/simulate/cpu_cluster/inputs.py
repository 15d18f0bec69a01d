"""The simulator's compute input, measured: a `Workload` for one model choice, timed on
one process with no communication, with the benchmark's model, batches and step.

    workload = measure_workload(Config(model="mlp", width=1024, depth=5, batch_size=128),
                                world_size=2)

What is timed, per repeat (each after `warmup` untimed repeats), as `ddp.train.train_step`
runs a step with one micro-batch:

- forward: the wrapped model's forward and the cross-entropy loss;
- backward: `loss.backward()`, and inside it each trainable parameter's ready time,
  seconds after backward started, stamped by a `register_post_accumulate_grad_hook`
  (the hook the overlapped stages launch buckets from, so "ready" means what it means
  there);
- optimizer: SGD(momentum 0.9) step and `zero_grad(set_to_none=True)`, as the bench.

Each figure is the median over repeats. One thread (`torch.set_num_threads(1)`), as the
benchmark's ranks run (torchrun sets OMP_NUM_THREADS=1 on this machine's 2 cores). The
heap as the benchmark's ranks hold it is the caller's to set, once per process
(`ddp.heap.steady_heap`): the calibration's worker and the command-line tools do.

Run on its own it sees a whole core. The benchmark's ranks share the machine's cores, so
the calibration (`worker`) runs it on every rank of the cluster at once, each repeat
started from a barrier (`before_repeat`), and keeps each repeat of the slowest rank, as
the benchmark keeps the slowest rank's step (`slowest_workload`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddp.config import Config
from ddp.data import rank_batch
from ddp.models import rank_model
from profiling.simulate.schedule import Grad, Workload


@dataclass(frozen=True)
class Repeat:
    """One timed step: its phases and each gradient's ready time, in seconds."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    ready_s: tuple[float, ...]  # in parameter order, after backward starts

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


def time_repeats(
    cfg: Config,
    world_size: int = 1,
    *,
    repeats: int = 10,
    warmup: int = 3,
    threads: int = 1,
    rank: int = 0,
    before_repeat: Callable[[], None] = lambda: None,
    around_backward: Callable[[], Callable[[], None]] = lambda: lambda: None,
) -> tuple[list[tuple[str, int]], list[Repeat]]:
    """(name, gradient bytes) of each trainable parameter in parameter order, and the
    timed repeats. `world_size` and `rank` pick the slice of the global batch this rank
    trains on (its shape is the bench's per-rank batch); `before_repeat` runs before
    every repeat, warm-up included (a barrier, when every rank measures at once);
    `around_backward` just before backward's clock starts, and what it returns just
    after backward's clock stops (the calibration starts an all-reduce there, and waits
    for it after, to time backward with communication in flight)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    threads_before = torch.get_num_threads()  # the caller's, given back at the end
    torch.set_num_threads(threads)
    model = rank_model(cfg, rank)  # as the bench builds a rank's model
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = [(n, p.numel() * p.element_size()) for n, p in trainable]

    stamps: list[float | None] = [None] * len(trainable)
    clock = {"backward_start": 0.0}

    def stamp(i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            stamps[i] = time.perf_counter() - clock["backward_start"]

        return hook

    handles = [p.register_post_accumulate_grad_hook(stamp(i)) for i, (_, p) in enumerate(trainable)]
    global_batch = cfg.global_batch(world_size)
    out = []
    try:
        # --8<-- [start:timing]
        for step in range(warmup + repeats):
            inputs, labels = rank_batch(model, global_batch, step, rank, world_size, cfg.seed)
            stamps[:] = [None] * len(trainable)
            before_repeat()
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(inputs), labels)
            forward_s = time.perf_counter() - t0
            after_backward = around_backward()
            t1 = clock["backward_start"] = time.perf_counter()
            loss.backward()
            backward_s = time.perf_counter() - t1
            after_backward()
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            missing = [trainable[i][0] for i, s in enumerate(stamps) if s is None]
            if missing:
                raise RuntimeError(f"parameters {missing} of model {cfg.model!r} got no gradient")
            if step >= warmup:
                out.append(Repeat(forward_s, backward_s, t3 - t2, tuple(stamps)))
        # --8<-- [end:timing]
    finally:
        for handle in handles:
            handle.remove()
        torch.set_num_threads(threads_before)
    return grads, out


def to_workload(grads: list[tuple[str, int]], repeats: list[Repeat]) -> Workload:
    """Each figure's median over the repeats."""
    return Workload(
        grads=tuple(
            Grad(name, nbytes, statistics.median(r.ready_s[i] for r in repeats))
            for i, (name, nbytes) in enumerate(grads)
        ),
        forward_s=statistics.median(r.forward_s for r in repeats),
        backward_s=statistics.median(r.backward_s for r in repeats),
        optimizer_s=statistics.median(r.optimizer_s for r in repeats),
    )


def slowest_rank(together: Sequence[Repeat]) -> int:
    """Of one repeat timed on every rank at once (together[rank]), the rank whose step
    was longest: the one the benchmark's step time is."""
    return max(range(len(together)), key=lambda rank: together[rank].step_s)


def slowest_repeats(per_rank: list[list[Repeat]]) -> list[Repeat]:
    """Repeats taken on every rank at once (per_rank[rank][k]: repeat k, started together):
    of each repeat, the slowest rank's, as the benchmark times a step."""
    lengths = {len(r) for r in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"every rank must time as many repeats, got {sorted(lengths)}")
    return [together[slowest_rank(together)] for together in zip(*per_rank, strict=True)]


def slowest_workload(grads: list[tuple[str, int]], per_rank: list[list[Repeat]]) -> Workload:
    """Of each repeat the slowest rank's (`slowest_repeats`), then the medians."""
    return to_workload(grads, slowest_repeats(per_rank))


def pooled_repeats(
    in_a_row: list[list[Repeat]], spells: Sequence[list[list[Repeat]]]
) -> list[list[Repeat]]:
    """Per rank, the repeats timed in a row (in_a_row[rank][k]) and then each spell's
    (spells[s][rank][k]), each repeat started on every rank together: `slowest_workload`
    of them takes its medians over the whole span they were timed in, not one stretch."""
    return [
        [*repeats, *(r for spell in spells for r in spell[rank])]
        for rank, repeats in enumerate(in_a_row)
    ]


def measure_workload(cfg: Config, world_size: int = 1, **options) -> Workload:
    """The workload of `cfg`'s model on one process: see the module's docstring; options
    go to `time_repeats`."""
    grads, repeats = time_repeats(cfg, world_size, **options)
    return to_workload(grads, repeats)


def workload_to_json(workload: Workload) -> dict:
    return {
        "grads": [[g.name, g.nbytes, g.ready_s] for g in workload.grads],
        "forward_s": workload.forward_s,
        "backward_s": workload.backward_s,
        "optimizer_s": workload.optimizer_s,
    }


def workload_from_json(data: dict) -> Workload:
    return Workload(
        grads=tuple(Grad(name, int(nbytes), float(ready)) for name, nbytes, ready in data["grads"]),
        forward_s=data["forward_s"],
        backward_s=data["backward_s"],
        optimizer_s=data["optimizer_s"],
    )
