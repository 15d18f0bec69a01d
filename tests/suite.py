"""What the suite checks on one case, for every stage and torch's own DDP: four
properties, numbered in `check_case`:

1. replicas start identical, although every rank initialised its own weights;
2. after every optimizer step, parameters are bit-identical on all ranks;
3. gradients and parameters equal one process's on the whole batch, every step (with k
   micro-batches under no_sync: on the k-times larger batch);
4. the collectives of each synchronised backward are the ones the stage declares
   (`collectives`), and there are none inside no_sync.

tests/test_suite.py draws the cases; each stage's own test file checks a worked case."""

from __future__ import annotations

import torch
from torch import nn

from stages import STAGES
from tests.cases import (
    PER_BUCKET,
    PER_PARAMETER,
    READY_ORDER,
    STATIC_USED,
    STATUS,
    Case,
    expected_bucket_sizes,
    ready_order,
    reference_run,
    run_case,
    status_rides,
    status_width,
)
from tests.nets import NetSpec, build_net
from tests.pool import check_no_errors


def tolerance(t: torch.Tensor) -> dict:
    # Every net has float32 layers at both ends, so float64 layers' gradients carry
    # float32 rounding too: one float32-level tolerance for all. A missing division by
    # W (a factor of 2 to 4) or an unsynchronised gradient is far outside it.
    return {"rtol": 1e-5, "atol": 1e-5}  # atol as torch.testing uses for float32


def check_case(pool, case: Case) -> None:
    runs = pool.run(case.world_size, run_case, case)
    check_no_errors(runs)
    rank0 = runs[0]
    # 1. Replicas start identical, although every rank initialised its own weights.
    for rank, run in enumerate(runs):
        for a, b in zip(run.init, rank0.init, strict=True):
            assert torch.equal(a, b), f"rank {rank} starts from other weights than rank 0"
    # 2. After every optimizer step, parameters are bit-identical on all ranks.
    for rank, run in enumerate(runs):
        for step, (mine, theirs) in enumerate(zip(run.params, rank0.params, strict=True)):
            for a, b in zip(mine, theirs, strict=True):
                assert torch.equal(a, b), f"rank {rank} differs from rank 0 after step {step}"
    # 3. Equal to one process on the whole batch (k micro-batches: the k-times larger
    # batch), gradients and parameters, every step.
    reference = reference_run(case, rank0.init)
    for step in range(case.steps):
        for i, (g, g_ref) in enumerate(zip(rank0.grads[step], reference.grads[step], strict=True)):
            assert (g is None) == (g_ref is None), f"param {i} step {step}: grad presence"
            if g is not None:
                torch.testing.assert_close(
                    g,
                    g_ref,
                    **tolerance(g),
                    msg=lambda m, i=i, step=step: f"grad {i} step {step}: {m}",
                )
        for i, (p, p_ref) in enumerate(
            zip(rank0.params[step], reference.params[step], strict=True)
        ):
            torch.testing.assert_close(
                p,
                p_ref,
                **tolerance(p),
                msg=lambda m, i=i, step=step: f"param {i} step {step}: {m}",
            )
    # 4. Collectives per synchronised backward are what the stage declares (its
    # `collectives`); none inside no_sync.
    model = build_net(case.net, seed=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    torch_ddp = case.wrapper == "torch_ddp"
    cls = nn.parallel.DistributedDataParallel if torch_ddp else STAGES[case.wrapper]
    overfill = getattr(cls, "overfill_buckets", False)  # where the stage cuts a bucket
    buckets = expected_bucket_sizes(model, case.bucket_cap_mb, overfill=overfill)
    declared = getattr(cls, "collectives", ())
    opts = dict(case.options)
    rebuilds = READY_ORDER in declared and (
        not opts.get("find_unused_parameters") or opts.get("static_graph")
    )
    if rebuilds:  # from the second step on, in the order gradients became ready
        ready_model, order = ready_order(case)
        rebuilt = expected_bucket_sizes(
            ready_model,
            case.bucket_cap_mb,
            order,
            min(opts.get("first_bucket_cap_mb") or case.bucket_cap_mb, case.bucket_cap_mb),
            overfill=overfill,
        )
    for step, step_calls in enumerate(rank0.calls):
        if rebuilds and step > 0:
            buckets = rebuilt
        for j, calls in enumerate(step_calls):
            if hasattr(cls, "no_sync") and j < case.accumulation - 1:
                assert calls == [], f"collectives inside no_sync: {calls}"
            elif torch_ddp:  # its own run in C++: we see its comm hook's
                assert len(calls) >= 1 and {c[0] for c in calls} == {"all_reduce"}
            else:
                if PER_BUCKET in declared:  # launched in bucket order, not as they filled
                    assert step > 0 or rank0.bucket_sizes == buckets, "bucket layout"
                expected = [
                    call
                    for what in declared
                    for call in expected_calls(what, cls, case, trainable, buckets, rebuilds, step)
                ]
                assert calls == expected, f"{case.wrapper} declares {declared}: got {calls}"


def expected_calls(what, cls, case, trainable, buckets, rebuilds, step) -> list[tuple]:
    """The collectives (name, shape) that one declaration of a stage stands for."""
    n = len(trainable)
    if what == PER_PARAMETER:
        return [("all_reduce", tuple(p.shape)) for p in trainable]
    if what == PER_BUCKET:
        sizes = list(buckets)
        # The last bucket's room for the status, after its gradients (zeros where the
        # status travels on its own); a comm hook gets the gradients alone.
        if STATUS in cls.collectives and sizes and not dict(case.options).get("comm_hook"):
            sizes[-1] += len(cls.status_columns)
        return [("all_reduce", (size,)) for size in sizes]
    if what == READY_ORDER:  # once, before the second synchronised step's forward
        return [("broadcast", (n,))] if rebuilds and step == 1 else []
    if what == STATIC_USED:  # once, in the first synchronised backward, before its buckets
        return (
            [("all_reduce", (n,))] if dict(case.options).get("static_graph") and step == 0 else []
        )
    if what == STATUS:
        if status_rides(dict(case.options)) and buckets:
            return []  # it travels in the last bucket's all-reduce
        return [("all_reduce", (status_width(cls, n, dict(case.options)),))]
    raise AssertionError(f"{cls.__name__} declares {what!r}, which the suite does not know")


def worked(stage: str, *, frozen=(False, False), bucket_cap_mb: float = 1e-4, steps: int = 2,
           accumulation: int = 1) -> Case:  # fmt: skip
    """A worked case for one stage: 2 ranks, two hidden layers in swapped order (so
    forward order differs from parameter order), one float64, a tied layer."""
    net = NetSpec(d_in=3, width=4, d_out=2, order=(1, 0), dtypes=("float32", "float64"),
                  frozen=frozen, tied=True)  # fmt: skip
    return Case(stage, net, world_size=2, per_rank_batch=2, steps=steps,
                accumulation=accumulation, optimizer="sgd", bucket_cap_mb=bucket_cap_mb,
                seed=1)  # fmt: skip


def trainable(case: Case) -> list[nn.Parameter]:
    return [p for p in build_net(case.net, seed=0).parameters() if p.requires_grad]
