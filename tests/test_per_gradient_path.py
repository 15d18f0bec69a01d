"""The final class's path per gradient is short: few Python calls of the project's own
code per gradient in a warm synchronised backward, with default options.

Each gradient's hook (stage overlapped) notes the gradient, counts its bucket down and,
when the bucket is complete, hands it on; everything else the later stages do runs once
per bucket or once per step. `sys.setprofile` counts every Python call made while
backward runs, and the ones whose code lives in `stages/` or `ddp/` are divided by the
number of gradients."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.pool import check_no_errors

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tuple(str(ROOT / part) + "/" for part in ("stages", "ddp"))
MAX_CALLS_PER_GRADIENT = 4


def small_parameters_model(blocks: int = 48, width: int = 32) -> nn.Module:
    """Many small parameters (4 per block, and a head's 2): where the cost per gradient
    shows, since each one's compute is tiny."""
    layers = [m for _ in range(blocks) for m in (nn.Linear(width, width), nn.LayerNorm(width))]
    return nn.Sequential(*layers, nn.Linear(width, width))


def calls_in_backward(rank: int, group, stage: str, options: dict) -> tuple[float, dict]:
    """(project calls per gradient, the most frequent of them) in one warm backward."""
    from stages import STAGES

    torch.manual_seed(0)
    model = small_parameters_model()
    ddp = STAGES[stage](model, process_group=group, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    for _ in range(4):  # warm: the buckets rebuilt in ready order, as in training
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    loss = nn.functional.mse_loss(ddp(x), y)
    calls: Counter = Counter()
    spans: Counter = Counter()  # profiler spans opened, by any code (none while none records)

    def count(frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(PROJECT):
            where = code.co_filename.removeprefix(str(ROOT) + "/")
            calls[f"{where}:{code.co_name}"] += 1
        elif code.co_name == "__enter__" and "self" in frame.f_locals:
            spans[type(frame.f_locals["self"]).__name__] += 1

    sys.setprofile(count)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    gradients = sum(p.requires_grad for p in model.parameters())
    assert spans["record_function"] == 0, f"profiler spans with no profiler: {dict(spans)}"
    return sum(calls.values()) / gradients, dict(calls.most_common(8))


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_last_stage_costs_few_calls_per_gradient(pool, world_size: int) -> None:
    for per_gradient, calls in check_no_errors(
        pool.run(world_size, calls_in_backward, "drop_in", {})
    ):
        assert per_gradient <= MAX_CALLS_PER_GRADIENT, (
            f"{per_gradient:.1f} Python calls of project code per gradient (at most "
            f"{MAX_CALLS_PER_GRADIENT}); the most frequent: {calls}"
        )


def test_only_stage_overlapped_works_per_gradient() -> None:
    """Later stages extend per bucket or per step (docs/final_class.md's table), so the
    path per gradient stays the one a learner reads on that page."""
    from stages import STAGES

    per_gradient = [name for name, cls in STAGES.items() if "_on_grad_ready" in vars(cls)]
    assert per_gradient == ["overlapped"]


def collective_order(rank: int, group, stage: str, options: dict) -> list[str]:
    """What one warm synchronised backward issues and waits for, in order: 'bucket' and
    'status' for each all-reduce launched, 'wait' for each wait on one."""
    import torch.distributed as dist

    from stages import STAGES

    torch.manual_seed(0)
    model = small_parameters_model(blocks=8)
    ddp = STAGES[stage](model, process_group=group, bucket_cap_mb=0.004, **options)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    for _ in range(3):
        nn.functional.mse_loss(ddp(x), y).backward()
    events: list[str] = []
    all_reduce = dist.all_reduce

    class Waited:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def recorded(tensor, *args, **kwargs):
        events.append("status" if tensor.dtype == torch.int32 else "bucket")
        work = all_reduce(tensor, *args, **kwargs)
        return Waited(work) if work is not None else None

    loss = nn.functional.mse_loss(ddp(x), y)
    dist.all_reduce = recorded
    try:
        loss.backward()
    finally:
        dist.all_reduce = all_reduce
    return events


def test_the_status_travels_in_the_last_buckets_all_reduce(pool) -> None:
    """missing_grads' status costs no collective of its own: it rides after the last
    bucket's gradients. Where it cannot (find_unused_parameters' n-wide used map), its
    own all-reduce leaves right after the last bucket, before any bucket is waited for."""
    for events in check_no_errors(pool.run(2, collective_order, "drop_in", {})):
        buckets = events.count("bucket")
        assert buckets > 1 and events == ["bucket"] * buckets + ["wait"] * buckets, events
    unused = {"find_unused_parameters": True}
    for events in check_no_errors(pool.run(2, collective_order, "drop_in", unused)):
        buckets = events.count("bucket")
        assert events[: buckets + 1] == ["bucket"] * buckets + ["status"], events
        assert events.count("status") == 1, events  # nothing went wrong: nothing more


def grads_with_a_hook_registered_after_forward(
    rank: int, group, prepared_by_reducer: bool = False
) -> list[torch.Tensor]:
    """One backward of a drop-in whose comm hook was registered between its forward and
    its backward; and the same backward's average worked out by hand. With
    `prepared_by_reducer`, the forward ran inside no_sync() and a framework's
    `reducer.prepare_for_backward` made its backward synchronise (accelerate does)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from stages import STAGES

    torch.manual_seed(0)
    ddp = STAGES["drop_in"](nn.Linear(3, 2), process_group=group)
    x = torch.full((4, 3), float(rank + 1))
    if prepared_by_reducer:
        with ddp.no_sync():
            loss = ddp(x).square().sum()
        ddp.reducer.prepare_for_backward(loss)
    else:
        loss = ddp(x).square().sum()
    ddp.register_comm_hook(group, default_hooks.allreduce_hook)  # the step's facts change
    loss.backward()
    local = torch.autograd.grad(ddp.module(x).square().sum(), ddp.module.weight)[0]
    dist.all_reduce(local, group=group)
    return [ddp.module.weight.grad, local / dist.get_world_size(group)]


def test_a_comm_hook_registered_after_forward_counts_in_that_backward(pool) -> None:
    """The per-step facts (the divisor, whether the status rides in the last bucket) are
    set at forward; registering a hook after it sets them again."""
    for prepared_by_reducer in (False, True):
        for got, average in check_no_errors(
            pool.run(2, grads_with_a_hook_registered_after_forward, prepared_by_reducer)
        ):
            torch.testing.assert_close(got, average)


def gradients_come_at_each_launch(rank: int, group) -> list[int]:
    """Per bucket launched in one synchronised backward of the unused_params stage with
    the flag, how many gradients had come: a model whose last-registered layer (the first
    buckets, in reverse order) forward never calls."""
    from stages import STAGES
    from tests.nets import Branchy

    torch.manual_seed(0)
    ddp = STAGES["unused_params"](
        Branchy(extra=True), process_group=group, bucket_cap_mb=1e-9,  # a bucket each
        find_unused_parameters=True,
    )  # fmt: skip
    came: list[int] = []
    send = ddp._send
    ddp._send = lambda bucket: came.append(len(ddp._backward.arrived)) or send(bucket)
    ddp(torch.randn(4, 3), (0, 1)).sum().backward()
    return came


def test_what_forward_does_not_reach_leaves_at_the_first_gradient(pool) -> None:
    """As torch's reducer marks them ready: the buckets of parameters forward's outputs do
    not lead to (`extra`, the first two buckets) leave once the first gradient has come,
    not at the end of backward."""
    for came in check_no_errors(pool.run(1, gradients_come_at_each_launch)):
        assert came[:2] == [1, 1], came
