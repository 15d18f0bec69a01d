"""The one suite: every stage and torch's own DDP, checked on real Gloo groups against
single-process training, with hypothesis drawing cases. Four properties, numbered in
`check_case`:

1. replicas start identical, although every rank initialised its own weights;
2. after every optimizer step, parameters are bit-identical on all ranks;
3. gradients and parameters equal one process's on the whole batch, every step (with k
   micro-batches under no_sync: on the k-times larger batch);
4. the collectives of each synchronised backward are the ones the stage declares
   (`collectives`), and there are none inside no_sync."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ddp.train import keyword_options
from stages import STAGES
from tests.adapters import WRAPPERS
from tests.cases import (
    PER_BUCKET,
    PER_PARAMETER,
    READY_ORDER,
    STATIC_USED,
    STATUS,
    TORCH_OPTIONS,
    Case,
    expected_bucket_sizes,
    ready_order,
    reference_run,
    run_case,
    status_rides,
    status_width,
)
from tests.models import NetSpec, build_net
from tests.pool import MAX_WORLD, check_no_errors

EXAMPLES = int(os.environ.get("DDP_STAGES_EXAMPLES", "200"))  # per stage per run


@st.composite
def nets(draw) -> NetSpec:
    hidden = draw(st.integers(0, 3))
    return NetSpec(
        d_in=draw(st.integers(1, 6)),
        width=draw(st.integers(1, 8)),
        d_out=draw(st.integers(1, 4)),
        order=tuple(draw(st.permutations(range(hidden)))),
        dtypes=tuple(
            draw(
                st.lists(st.sampled_from(["float32", "float64"]), min_size=hidden, max_size=hidden)
            )
        ),
        frozen=tuple(draw(st.lists(st.booleans(), min_size=hidden, max_size=hidden))),
        tied=hidden > 0 and draw(st.booleans()),
        transposed=draw(st.booleans()),
    )


CAPS = st.one_of(st.just(1e-9), st.floats(1e-6, 1e-3), st.just(25.0))
DRAWN = {  # the keyword options a stage may take, each drawn where the stage takes it
    "find_unused_parameters": st.booleans(),
    "broadcast_buffers": st.booleans(),
    "gradient_as_bucket_view": st.booleans(),
    "first_bucket_cap_mb": st.one_of(st.none(), CAPS),
    "round_robin_groups": st.integers(1, 3),
    "static_graph": st.booleans(),
}


@st.composite
def options(draw, wrapper: str) -> tuple[tuple[str, object], ...]:
    """The keyword options the stage (or torch's DDP) takes, drawn."""
    takes = TORCH_OPTIONS if wrapper == "torch_ddp" else keyword_options(STAGES[wrapper])
    drawn = {name: draw(strategy) for name, strategy in DRAWN.items() if name in takes}
    if wrapper != "torch_ddp" and hasattr(STAGES[wrapper], "register_comm_hook"):
        drawn["comm_hook"] = draw(st.sampled_from([None, "allreduce", "torch_allreduce"]))
    return tuple(drawn.items())


def cases(wrapper: str) -> st.SearchStrategy[Case]:
    return st.builds(
        Case,
        wrapper=st.just(wrapper),
        net=nets(),
        world_size=st.integers(1, MAX_WORLD),
        per_rank_batch=st.integers(1, 4),
        steps=st.integers(1, 3),
        accumulation=st.integers(1, 3),
        optimizer=st.sampled_from(["sgd", "adam"]),
        # MiB; these parameters hold 4 B to 256 B, so 1e-9 puts one parameter in each
        # bucket and 25 puts all in one.
        bucket_cap_mb=CAPS,
        seed=st.integers(0, 2**16),
        options=options(wrapper),
        set_to_none=st.booleans(),
    )


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
    buckets = expected_bucket_sizes(model, case.bucket_cap_mb)
    torch_ddp = case.wrapper == "torch_ddp"
    cls = nn.parallel.DistributedDataParallel if torch_ddp else STAGES[case.wrapper]
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


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_equivalent_to_single_process(pool, wrapper: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(case=cases(wrapper))
    def check(case: Case) -> None:
        check_case(pool, case)

    check()
