"""The variants: each contender built once (model, wrapper, optimizer) and timed one
step at a time, on batches made before each round."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import Bucket, assign_buckets
from ddp.config import Config
from ddp.models import rank_model
from ddp.train import (
    ComputeOnly,
    MicroBatches,
    Wrap,
    make_micro_batches,
    synchronize,
    train_step,
)
from profiling.bench.options import COMM, FLOOR
from stages import STAGES, standard_runs


@dataclass
class Variant:
    """One contender, built once and reused by every round."""

    name: str  # compute_only, communication_alone, a stage or torch_ddp
    cfg: Config  # its own: in a sweep, each value's variants have theirs
    model: nn.Module  # the bare model; replicas_identical checks its parameters
    wrapped: nn.Module | None  # None for communication_alone, which has no step to take
    optimizer: torch.optim.Optimizer | None
    sweep_value: float | int | None = None  # None: no sweep, or one run for every value
    buckets: list[Bucket] = field(default_factory=list)  # communication_alone's buffers
    step_times_s: list[float] = field(default_factory=list)  # this rank's timed steps
    step_rounds: list[int] = field(default_factory=list)  # the round of each timed step
    settle_steps: int = 0  # bucket_cap_mb="auto": warm-up steps added while it tried layouts
    # compute_only only: the bound's F and O in each timed step, and when each gradient
    # became ready (seconds after the step's start, in `grad_names` order), from `marks`
    # and `ready_marks`, which its hooks fill in during a step.
    forward_s: list[float] = field(default_factory=list)
    optimizer_s: list[float] = field(default_factory=list)
    ready_s: list[list[float]] = field(default_factory=list)
    grad_names: list[str] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)
    ready_marks: dict[str, float] = field(default_factory=dict)
    # communication_alone only: when each bucket's all-reduce had ended, in bucket
    # order, seconds after the step's start, per timed step.
    bucket_end_s: list[list[float]] = field(default_factory=list)

    def finish(self) -> None:
        finish = getattr(self.wrapped, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()


def variant_wraps() -> dict[str, Wrap | None]:
    """Name -> wrap(model, cfg), in table order: the floor, communication alone (no
    wrapper), the stages, the reference, then the EXTRA variants (by name only)."""
    runs = standard_runs()
    return {FLOOR: runs.pop(FLOOR), COMM: None, **runs, **extra_wraps()}


def extra_wraps() -> dict[str, Wrap]:
    """Variants that `--variants all` leaves out: stage options and torch's defaults."""
    last = STAGES["drop_in"]
    return {
        # torch's DDP as most scripts use it: bucket_cap_mb=None, 25 MiB and a 1 MiB first
        "torch_ddp_default": lambda model, cfg: nn.parallel.DistributedDataParallel(model),
        "drop_in_default": lambda model, cfg: last(model),
        "drop_in_auto": lambda model, cfg: last(model, bucket_cap_mb="auto"),
        "grad_views_on": lambda model, cfg: STAGES["grad_views"](
            model, bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True
        ),
        "round_robin_2": lambda model, cfg: STAGES["round_robin"](
            model, bucket_cap_mb=cfg.bucket_cap_mb, round_robin_groups=2
        ),
    }


def build_variant(
    name: str, wrap: Wrap | None, cfg: Config, device: torch.device, sweep_value=None
) -> Variant:
    model = rank_model(cfg, dist.get_rank()).to(device)  # as ddp.train.train builds it
    if name == COMM:
        # The stages' layout: reverse parameter order, at most bucket_cap_mb MiB each.
        # The buffers stay zero (0 + 0 never overflows); Gloo's time does not depend on
        # the values.
        buckets = assign_buckets(list(model.named_parameters()), cfg.bucket_cap_mb)
        return Variant(name, cfg, model, None, None, sweep_value, buckets=buckets)
    wrapped = wrap(model, cfg)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=cfg.lr, momentum=0.9)
    variant = Variant(name, cfg, model, wrapped, optimizer, sweep_value)
    if name == FLOOR:
        marks = variant.marks
        # Each forward overwrites the mark, so with k micro-batches F ends at the last
        # forward: the first k - 1 forwards and backwards precede the synchronised
        # backward too. Two time stamps per step, a few microseconds.
        wrapped.register_forward_hook(
            lambda *_: marks.__setitem__("forward_end", time.perf_counter())
        )
        optimizer.register_step_pre_hook(
            lambda *_: marks.__setitem__("optimizer_start", time.perf_counter())
        )
        # When each gradient is ready (accumulated into .grad), for the achievable bound;
        # with k micro-batches the last one's times stay. One time stamp per parameter.
        ready = variant.ready_marks
        for name, param in model.named_parameters():
            if param.requires_grad:
                variant.grad_names.append(name)
                param.register_post_accumulate_grad_hook(
                    lambda _, name=name: ready.__setitem__(name, time.perf_counter())
                )
    return variant


def communicate(buckets: list[Bucket]) -> list[float]:
    """All-reduce every bucket back to back with no compute: launched asynchronously in
    bucket order, as the overlapped stage and torch's DDP launch them, then waited for.
    Returns perf_counter() as each one's wait returned: one process group serves them
    in order, so these are when each ended (to a thread's wake-up)."""
    works = [dist.all_reduce(b.buffer, async_op=True) for b in buckets]
    ends = []
    for work in works:
        work.wait()
        ends.append(time.perf_counter())
    return ends


def step(
    variant: Variant, micro_batches: MicroBatches, device: torch.device
) -> tuple[float, dict[str, float | list[float]]]:
    """One optimizer step (ddp.train.train_step, spans included), timed on this rank:
    (seconds, the parts of the bounds it measured), the parts named as the variant's
    lists that keep them: for compute_only forward_s (F), optimizer_s (O) and ready_s,
    for communication_alone bucket_end_s; for the others none."""
    # Start together: otherwise a rank's time absorbs its partner's lag from the step
    # before (or from the previous variant), and "slowest rank" loses its meaning.
    dist.barrier()
    synchronize(device)
    variant.ready_marks.clear()
    start = time.perf_counter()
    if variant.name == COMM:
        ends = communicate(variant.buckets)
    else:
        train_step(variant.wrapped, micro_batches, variant.optimizer, variant.finish)
    synchronize(device)
    end = time.perf_counter()
    if variant.name == COMM:
        return end - start, {"bucket_end_s": [t - start for t in ends]}
    if not variant.marks:
        return end - start, {}
    return end - start, {
        "forward_s": variant.marks["forward_end"] - start,
        # zero_grad counts with the optimizer, as in train_step's "optimizer" span.
        "optimizer_s": end - variant.marks["optimizer_start"],
        # A parameter that got no gradient this step delays no bucket: ready at once.
        "ready_s": [variant.ready_marks.get(n, start) - start for n in variant.grad_names],
    }


def global_batch(cfg: Config) -> int:
    return cfg.global_batch(dist.get_world_size())


def make_batches(
    model: nn.Module, cfg: Config, first_step: int, count: int, device: torch.device
) -> list[MicroBatches]:
    """This rank's micro-batches for steps first_step .. first_step + count - 1, as
    ddp.train.train makes them. Made before a round and shared by every variant in it:
    the same data for all, and its generation stays out of the timed steps."""
    return [
        make_micro_batches(model, cfg, i, device) for i in range(first_step, first_step + count)
    ]


def batch_key(cfg: Config) -> tuple[int, int]:
    """What make_batches depends on that a sweep may change: variants that share it share
    their batches."""
    return cfg.accumulation_steps, global_batch(cfg)


def allreduce_layout(variant: Variant) -> list[float] | None:
    """MiB of each all-reduce one synchronisation sends, in launch order (None: unknown)."""
    wrapped = variant.wrapped
    if variant.name == COMM or hasattr(wrapped, "buckets"):
        return [b.nbytes / 2**20 for b in (variant.buckets or wrapped.buckets)]
    if isinstance(wrapped, ComputeOnly):
        return []
    if hasattr(wrapped, "named_trainable"):  # naive: one all-reduce per parameter
        return [p.numel() * p.element_size() / 2**20 for _, p in wrapped.named_trainable]
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        # torch rebuilds its buckets after the first backward (in gradient-ready order);
        # a private API, so tolerate its absence rather than fail the benchmark.
        try:
            sizes = wrapped._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
            return [int(s) / 2**20 for s in str(sizes).split(",") if s.strip()]
        except Exception:
            return None
    return None
