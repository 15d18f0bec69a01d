"""What the suite runs: the distributed run of one case (a net of tests.nets) on the
workers, and the single-process reference it is compared with."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests import pool
from tests.adapters import TORCH_DDP, build_wrapper
from tests.against_torch import clone
from tests.nets import NetSpec, build_net

# What a stage may declare in `collectives`, each standing for some collectives of one
# synchronised backward (tests/test_suite.py, property 4, says which).
PER_PARAMETER, PER_BUCKET = "all_reduce per parameter", "all_reduce per bucket"
READY_ORDER, STATUS = "broadcast of the ready order, once", "all_reduce of the status"
STATIC_USED = "all_reduce of the used parameters, static_graph's first step"


def status_width(stage_cls: type, n: int, options: dict) -> int:
    """Numbers in the status a stage sums over the ranks, for a model of n trainable
    parameters: one per column, and with find_unused_parameters its n-wide used map."""
    used = n if options.get("find_unused_parameters") else 0
    return len(stage_cls.status_columns) + used


def status_rides(options: dict) -> bool:
    """Whether the status travels in the last bucket's all-reduce (the suite's models
    have dense gradients), not in one of its own."""
    return not options.get("find_unused_parameters") and not options.get("comm_hook")


# Options that torch's DDP has too; the torch_ddp row draws them like the stages do.
TORCH_OPTIONS = ("find_unused_parameters", "broadcast_buffers", "gradient_as_bucket_view")


@dataclass(frozen=True)
class Case:
    wrapper: str  # a stage name or "torch_ddp"
    net: NetSpec
    world_size: int
    per_rank_batch: int
    steps: int
    accumulation: int  # micro-batches per optimizer step
    optimizer: str  # sgd | adam
    bucket_cap_mb: float
    seed: int
    options: tuple[tuple[str, object], ...] = ()  # keyword options of the later stages
    set_to_none: bool = True  # optimizer.zero_grad(set_to_none=...)


@dataclass
class RankRun:
    init: list[torch.Tensor]  # parameters right after wrapping
    grads: list[list[torch.Tensor | None]] = field(default_factory=list)  # per step
    params: list[list[torch.Tensor]] = field(default_factory=list)  # per step, after it
    calls: list[list[list[tuple]]] = field(default_factory=list)  # per step, per micro-batch
    bucket_sizes: list[int] | None = None  # numel of each bucket, in bucket order


def global_batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, W*b, d_in) inputs and (k, W*b, d_out) targets, the same on every rank."""
    gen = torch.Generator().manual_seed(case.seed * 7919 + step)
    shape = (case.accumulation, case.world_size * case.per_rank_batch)
    return (
        torch.randn(*shape, case.net.d_in, generator=gen),
        torch.randn(*shape, case.net.d_out, generator=gen),
    )


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=0.01)


class CollectiveLog:
    """Records each collective the code under it issues through torch.distributed."""

    NAMES = (
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather_object",
        "reduce_scatter",
        "all_to_all",
        "reduce",
        "gather",
        "scatter",
        "barrier",
    )

    def __init__(self):
        self.calls: list[tuple] = []

    @contextmanager
    def recording(self):
        start = len(self.calls)
        originals = {name: getattr(dist, name) for name in self.NAMES}

        def counted(name, fn):
            def call(*args, **kwargs):
                first = args[0] if args else None
                shape = tuple(first.shape) if isinstance(first, torch.Tensor) else None
                self.calls.append((name, shape))
                return fn(*args, **kwargs)

            return call

        for name, fn in originals.items():
            setattr(dist, name, counted(name, fn))
        recorded: list[tuple] = []
        try:
            yield recorded
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
            recorded.extend(self.calls[start:])


def wrap(case: Case, model: nn.Module, group: dist.ProcessGroup, log: CollectiveLog):
    """The case's wrapper with the case's options; torch's DDP counts its all-reduces
    into `log` through a comm hook."""
    options = dict(case.options)
    if case.wrapper == TORCH_DDP:
        options = {k: v for k, v in options.items() if k in TORCH_OPTIONS}

        def counting_hook(state, bucket):  # torch's collectives bypass torch.distributed
            log.calls.append(("all_reduce", tuple(bucket.buffer().shape)))
            return default_hooks.allreduce_hook(group, bucket)

        options.update(comm_hook=counting_hook, hook_state=None)
    elif "round_robin_groups" in options:  # k - 1 groups the pool made over the same ranks
        options["round_robin_groups"] = pool.ROUND_ROBIN[case.world_size][
            : options["round_robin_groups"] - 1
        ]
    return build_wrapper(case.wrapper, model, group, bucket_cap_mb=case.bucket_cap_mb, **options)


def synchronize(wrapped: nn.Module) -> None:
    finish = getattr(wrapped, "finish_gradient_synchronization", None)
    if finish is not None:
        finish()


def run_case(rank: int, group: dist.ProcessGroup, case: Case) -> RankRun:
    """Train `case` on this rank; ranks start from different weights on purpose."""
    model = build_net(case.net, seed=case.seed * 31 + 1000 * rank + 1)
    log = CollectiveLog()
    wrapped = wrap(case, model, group, log)
    run = RankRun(init=[p.detach().clone() for p in model.parameters()])
    if hasattr(wrapped, "buckets"):
        run.bucket_sizes = [b.buffer.numel() - b.tail for b in wrapped.buckets]  # gradients
    optimizer = make_optimizer(case.optimizer, wrapped.parameters())
    part = slice(rank * case.per_rank_batch, (rank + 1) * case.per_rank_batch)
    for step in range(case.steps):
        inputs, targets = global_batch(case, step)
        step_calls = []
        for j in range(case.accumulation):
            last = j == case.accumulation - 1
            skip = hasattr(wrapped, "no_sync") and not last
            with wrapped.no_sync() if skip else nullcontext(), log.recording() as calls:
                loss = F.mse_loss(wrapped(inputs[j, part]), targets[j, part])
                (loss / case.accumulation).backward()
                if not skip:
                    synchronize(wrapped)
            step_calls.append(calls)
        run.calls.append(step_calls)
        run.grads.append([clone(p.grad) for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=case.set_to_none)
        run.params.append([p.detach().clone() for p in model.parameters()])
    return run


def reference_run(case: Case, init: list[torch.Tensor]) -> RankRun:
    """One process on the whole W*b batch (mean loss), from the same initial weights."""
    model = build_net(case.net, seed=0)
    with torch.no_grad():
        for p, p0 in zip(model.parameters(), init, strict=True):
            p.copy_(p0)
    optimizer = make_optimizer(case.optimizer, model.parameters())
    run = RankRun(init=init)
    for step in range(case.steps):
        inputs, targets = global_batch(case, step)
        for j in range(case.accumulation):
            loss = F.mse_loss(model(inputs[j]), targets[j])
            (loss / case.accumulation).backward()
        run.grads.append([clone(p.grad) for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=case.set_to_none)
        run.params.append([p.detach().clone() for p in model.parameters()])
    return run


def ready_order(case: Case) -> tuple[nn.Module, list[nn.Parameter]]:
    """The order one backward makes the trainable parameters' gradients ready in, seen by
    hooks on a fresh single-process copy of the net; those that got none (a layer
    forward never calls) first, in parameter order, as torch's reducer records them
    (ready at the first gradient)."""
    model = build_net(case.net, seed=0)
    order: list[nn.Parameter] = []
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.register_post_accumulate_grad_hook(order.append)
    inputs, targets = global_batch(case, 0)
    F.mse_loss(model(inputs[0]), targets[0]).backward()
    came = set(map(id, order))
    return model, [*(p for p in trainable if id(p) not in came), *order]


def expected_bucket_sizes(
    model: nn.Module,
    bucket_cap_mb: float,
    order: list[nn.Parameter] | None = None,
    first_cap_mb: float | None = None,
    overfill: bool = False,
) -> list[int]:
    """The bucket layout the stages promise, computed independently of ddp.buckets:
    reverse parameter order (or `order`), one dtype per bucket, a bucket closed before
    it would pass the cap (`first_cap_mb` for a dtype's first bucket), or with
    `overfill` closed once it reaches it (torch's rule, the drop-in's)."""
    caps = [int((first_cap_mb or bucket_cap_mb) * 2**20), int(bucket_cap_mb * 2**20)]
    trainable = order or [p for p in model.parameters() if p.requires_grad][::-1]
    buckets: list[list[nn.Parameter]] = []
    open_bucket: dict[torch.dtype, list[nn.Parameter]] = {}
    closed: dict[torch.dtype, int] = {}
    for p in trainable:
        members = open_bucket.setdefault(p.dtype, [])
        size = sum(q.numel() * q.element_size() for q in members) + p.numel() * p.element_size()
        cap = caps[min(closed.get(p.dtype, 0), 1)]
        if members and size > cap and not overfill:
            buckets.append(members)
            closed[p.dtype] = closed.get(p.dtype, 0) + 1
            members = open_bucket[p.dtype] = []
        members.append(p)
        if overfill and size >= cap:
            buckets.append(members)
            closed[p.dtype] = closed.get(p.dtype, 0) + 1
            open_bucket[p.dtype] = []
    buckets += [m for m in open_bucket.values() if m]
    first = {id(p): i for i, p in enumerate(trainable)}
    buckets.sort(key=lambda m: first[id(m[0])])
    return [sum(p.numel() for p in m) for m in buckets]
