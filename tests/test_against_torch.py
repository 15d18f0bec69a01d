"""Each stage against torch's own DistributedDataParallel, given the same arguments.

The suite compares stages with single-process training; the options that only make
sense with several replicas (unused parameters that differ per rank, buffers that
follow rank 0, gradients living in bucket buffers) have no single-process answer, so
here the reference is torch's DDP itself. Every worker trains the same function twice
on the same Gloo group, once wrapped by the stage and once by torch's DDP, from the
same per-rank seeds (ranks initialise differently on purpose: both wrappers must
broadcast rank 0's state), and the test compares the two rank by rank, step by step."""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.adapters import build_wrapper, stages_from
from tests.models import BRANCHES, Branchy, NetSpec, Normed, build_net
from tests.pool import RankError, check_no_errors

EXAMPLES = int(os.environ.get("DDP_STAGES_TORCH_EXAMPLES", "12"))  # per stage per test
SECONDS = 20  # a hang fails the test after this long instead of blocking CI
TIGHT = {"rtol": 1.3e-6, "atol": 1e-5}  # torch.testing's float32 default; W-fold errors are far out


def ours_and_torchs(rank: int, group: dist.ProcessGroup, train, stage: str, *args):
    """Runs on every rank: `train` under the stage, then under torch's DDP."""
    return train(rank, group, stage, *args), train(rank, group, "torch_ddp", *args)


def run_both(pool, world_size: int, train, stage: str, *args) -> list[tuple]:
    return check_no_errors(pool.run(world_size, ours_and_torchs, train, stage, *args, timeout_s=60))


def assert_same(ours: dict, theirs: dict, where: str, tol: dict = TIGHT) -> None:
    """Named tensors (or None) of the stage's run equal the reference's (torch DDP's)
    within `tol`; integer tensors exactly."""
    assert ours.keys() == theirs.keys(), f"{where}: {sorted(ours)} vs {sorted(theirs)}"
    for name, mine in ours.items():
        other = theirs[name]
        assert (mine is None) == (other is None), (
            f"{where}, {name}: the stage gives {'None' if mine is None else 'a tensor'}, "
            f"the reference {'None' if other is None else 'a tensor'}"
        )
        if mine is None:
            continue
        if not mine.is_floating_point():
            assert torch.equal(mine, other), f"{where}, {name}: {mine} vs {other}"
        else:
            torch.testing.assert_close(
                mine, other, **tol, msg=lambda m, name=name: f"{where}, {name}: {m}"
            )


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def grads_of(model: nn.Module) -> dict:
    return {name: _clone(p.grad) for name, p in model.named_parameters()}


def params_of(model: nn.Module) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------
# 1. Unused parameters: which branches forward runs changes per step, micro-batch, rank.


@dataclass(frozen=True)
class Routing:
    world_size: int
    # Per step, per micro-batch (all but the last under no_sync), per rank: the
    # branches forward runs.
    steps: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    bucket_cap_mb: float
    set_to_none: bool
    gradient_as_bucket_view: bool
    seed: int


@st.composite
def routings(draw, stage: str) -> Routing:
    world_size = draw(st.integers(2, 3))
    use = st.lists(st.integers(0, BRANCHES - 1), unique=True, max_size=BRANCHES).map(tuple)
    micro_batch = st.lists(use, min_size=world_size, max_size=world_size).map(tuple)
    step = st.lists(micro_batch, min_size=1, max_size=2).map(tuple)
    return Routing(
        world_size=world_size,
        steps=draw(st.lists(step, min_size=1, max_size=3).map(tuple)),
        # MiB; 1e-9 gives every parameter a bucket of its own, 25 puts all in one.
        bucket_cap_mb=draw(st.sampled_from([1e-9, 2e-4, 25.0])),
        set_to_none=draw(st.booleans()),
        gradient_as_bucket_view=stage in stages_from("grad_views") and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def train_routed(rank: int, group: dist.ProcessGroup, wrapper: str, routing: Routing) -> list:
    """[(gradients before the optimizer step, parameters after it)] per step."""
    torch.manual_seed(routing.seed * 31 + 1000 * rank + 1)  # ranks differ until broadcast
    model = Branchy()
    options = {"find_unused_parameters": True}
    if routing.gradient_as_bucket_view:
        options["gradient_as_bucket_view"] = True
    wrapped = build_wrapper(wrapper, model, group, bucket_cap_mb=routing.bucket_cap_mb, **options)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(routing.seed * 7919 + rank)
    record = []
    for micro_batches in routing.steps:
        for j, uses in enumerate(micro_batches):
            last = j == len(micro_batches) - 1
            x, y = torch.randn(2, 3, generator=data), torch.randn(2, 2, generator=data)
            with nullcontext() if last else wrapped.no_sync():
                loss = F.mse_loss(wrapped(x, uses[rank]), y) / len(micro_batches)
                loss.backward()
        grads = grads_of(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=routing.set_to_none)
        record.append((grads, params_of(model)))
    return record


@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_unused_parameters_as_torch(pool, stage: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(routing=routings(stage))
    # Branch 2 unused everywhere, branch 1 on rank 0 only, and a no_sync micro-batch
    # that uses branch 0 on rank 1 where the synced one does not.
    @example(
        routing=Routing(
            world_size=2,
            steps=((((0, 1), (1,)),), (((), (0,)), ((1, 0), ()))),
            bucket_cap_mb=1e-9,
            set_to_none=True,
            gradient_as_bucket_view=False,
            seed=0,
        )
    )
    def check(routing: Routing) -> None:
        runs = run_both(pool, routing.world_size, train_routed, stage, routing)
        for rank, (ours, torchs) in enumerate(runs):
            for step, ((grads, params), (torch_grads, torch_params)) in enumerate(
                zip(ours, torchs, strict=True)
            ):
                where = f"rank {rank}, step {step} of {routing.steps}"
                assert_same(grads, torch_grads, f"gradient, {where}")
                assert_same(params, torch_params, f"parameter after the step, {where}")

    check()


def healthy_step(rank: int, group: dist.ProcessGroup, stage: str) -> tuple[float, dict, dict]:
    """After an error: is the group still usable? A plain all-reduce, and one step of a
    fresh stage and of torch's DDP whose gradients must agree."""
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, group=group)
    grads = []
    for wrapper in (stage, "torch_ddp"):
        torch.manual_seed(1000 * rank)
        model = Branchy()
        wrapped = build_wrapper(wrapper, model, group)
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
        wrapped(x, tuple(range(BRANCHES))).square().mean().backward()
        grads.append(grads_of(model))
    return total.item(), *grads


def check_healthy(world_size: int, after: tuple[float, dict, dict]) -> None:
    total, ours, torchs = after
    assert total == world_size * (world_size + 1) / 2, (
        f"an all-reduce after the error summed to {total}: a collective was left half-done"
    )
    assert_same(ours, torchs, "gradient of a step after the error")


def used_on_rank_0_only(
    rank: int, group: dist.ProcessGroup, stage: str, bucket_cap_mb: float
) -> tuple[str | None, tuple]:
    torch.manual_seed(1000 * rank)
    wrapped = build_wrapper(stage, Branchy(), group, bucket_cap_mb=bucket_cap_mb)
    use = (0, 1, 2) if rank == 0 else (0, 2)  # branch 1 gets no gradient on ranks 1, 2, ...
    try:
        wrapped(torch.randn(2, 3), use).sum().backward()
        wrapped.finish_gradient_synchronization()
        error = None
    except RuntimeError as e:
        error = str(e)
    return error, healthy_step(rank, group, stage)


@pytest.mark.parametrize("bucket_cap_mb", [1e-9, 25.0])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_parameter_unused_on_some_ranks_without_the_flag(
    pool, stage: str, world_size: int, bucket_cap_mb: float
) -> None:
    """torch's DDP hangs here (the ranks that used branch 1 wait for a bucket the others
    never send); the stage raises on every rank, naming the parameter and the ranks."""
    runs = pool.run(world_size, used_on_rank_0_only, stage, bucket_cap_mb, timeout_s=SECONDS)
    for rank, run in enumerate(runs):
        assert not isinstance(run, RankError), run.traceback
        error, after = run
        assert error is not None, f"rank {rank} did not raise"
        for lacking in range(1, world_size):
            assert re.search(rf"rank {lacking}: \[[^\]]*'branches\.1\.weight'", error), error
            assert re.search(rf"rank {lacking}: \[[^\]]*'branches\.1\.bias'", error), error
        assert "rank 0:" not in error, f"rank 0 had every gradient: {error}"
        assert "branches.0" not in error and "branches.2" not in error, (
            f"branches 0 and 2 were used everywhere: {error}"
        )
        check_healthy(world_size, after)


def loss_beside_the_output(
    rank: int, group: dist.ProcessGroup, stage: str, term_first: bool, bucket_cap_mb: float
) -> tuple[str | None, tuple]:
    torch.manual_seed(1000 * rank)
    model = Branchy(extra=True)
    wrapped = build_wrapper(
        stage, model, group, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True
    )
    try:
        # Autograd runs the later-built term first: `term_first` makes extra's gradient
        # arrive last, else first, before any gradient forward's outputs lead to.
        beside = model.extra.weight.sum() if term_first else None
        out = wrapped(torch.randn(2, 3), tuple(range(BRANCHES)))
        beside = model.extra.weight.sum() if beside is None else beside
        (out.sum() + beside).backward()
        wrapped.finish_gradient_synchronization()
        error = None
    except RuntimeError as e:
        error = str(e)
    return error, healthy_step(rank, group, stage)


@pytest.mark.parametrize("bucket_cap_mb", [1e-9, 25.0])
@pytest.mark.parametrize("term_first", [True, False], ids=["extra-last", "extra-first"])
@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_loss_reaches_a_parameter_the_output_does_not(
    pool, stage: str, term_first: bool, bucket_cap_mb: float
) -> None:
    """With find_unused_parameters=True, forward's outputs decide what is unused; a loss
    that reaches a parameter some other way breaks that (torch's DDP raises "Expected
    to mark a variable ready only once"). The stage must raise on every rank."""
    runs = pool.run(2, loss_beside_the_output, stage, term_first, bucket_cap_mb, timeout_s=SECONDS)
    for rank, run in enumerate(runs):
        assert not isinstance(run, RankError), run.traceback
        error, after = run
        assert error is not None, (
            f"rank {rank} finished backward without an error, where torch's DDP raises "
            "'Expected to mark a variable ready only once'"
        )
        assert "'extra.weight'" in error, error
        check_healthy(2, after)


# ---------------------------------------------------------------------------------------
# 2. Buffers: BatchNorm's running statistics follow rank 0, at the forwards torch picks.


# step: one synced step; accumulate: two micro-batches, the first under no_sync;
# eval: forward in eval mode under no_grad; no_grad: forward in train mode under no_grad
# (updates the running statistics but synchronises nothing).
OPS = ("step", "accumulate", "eval", "no_grad")


def train_with_buffers(
    rank: int,
    group: dist.ProcessGroup,
    wrapper: str,
    ops: tuple[str, ...],
    broadcast_buffers: bool,
    own_statistics: bool,
    seed: int,
) -> list[tuple[dict, dict, torch.Tensor | None]]:
    """[(parameters, buffers, output of an eval/no_grad forward)] after construction and
    after each op."""
    torch.manual_seed(seed * 31 + 1000 * rank + 1)
    model = Normed()
    if own_statistics:  # every rank starts with running statistics of its own
        with torch.no_grad():
            model.norm.running_mean.normal_()
            model.norm.running_var.uniform_(0.5, 2.0)
            model.norm.num_batches_tracked.fill_(3 * rank + 1)
    wrapped = build_wrapper(
        wrapper, model, group, bucket_cap_mb=25.0, broadcast_buffers=broadcast_buffers
    )
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(seed * 7919 + rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:  # each rank its own distribution
        x = torch.randn(4, 3, generator=data) * (rank + 1) + rank
        return x, torch.randn(4, 2, generator=data)

    def state(output: torch.Tensor | None = None) -> tuple[dict, dict, torch.Tensor | None]:
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        return params_of(model), buffers, _clone(output)

    record = [state()]
    for op in ops:
        output = None
        if op == "eval":
            wrapped.eval()
            with torch.no_grad():
                output = wrapped(batch()[0])
            wrapped.train()
        elif op == "no_grad":
            with torch.no_grad():
                output = wrapped(batch()[0])
        else:
            k = 2 if op == "accumulate" else 1
            for j in range(k):
                x, y = batch()
                with wrapped.no_sync() if j < k - 1 else nullcontext():
                    (F.mse_loss(wrapped(x), y) / k).backward()
            optimizer.step()
            optimizer.zero_grad()
        record.append(state(output))
    return record


def compare_buffer_runs(runs: list[tuple], ops: tuple[str, ...]) -> None:
    for rank, (ours, torchs) in enumerate(runs):
        for i, ((params, buffers, out), (t_params, t_buffers, t_out)) in enumerate(
            zip(ours, torchs, strict=True)
        ):
            where = f"rank {rank}, after {('construction', *ops)[i]!r} (op {i} of {ops})"
            assert_same(params, t_params, f"parameter, {where}")
            assert_same(buffers, t_buffers, f"buffer, {where}")
            assert_same({"output": out}, {"output": t_out}, f"forward output, {where}")


@pytest.mark.parametrize("broadcast_buffers", [True, False])
@pytest.mark.parametrize("stage", stages_from("buffers"))
def test_buffers_at_construction_as_torch(pool, stage: str, broadcast_buffers: bool) -> None:
    """Ranks start with different running statistics. torch's `broadcast_buffers=False`
    leaves them out of the broadcast at construction too (its documentation for
    `init_sync`); True broadcasts rank 0's."""
    runs = run_both(pool, 2, train_with_buffers, stage, (), broadcast_buffers, True, 0)
    compare_buffer_runs(runs, ())


@pytest.mark.parametrize("broadcast_buffers", [True, False])
@pytest.mark.parametrize("stage", stages_from("buffers"))
def test_buffers_as_torch(pool, stage: str, broadcast_buffers: bool) -> None:
    """Then through steps, accumulation and no-grad forwards. With broadcast_buffers=False
    ranks start from the same statistics here, so that this test checks forwards only
    (the construction is the test above's); per-rank data makes them drift apart."""

    @settings(
        max_examples=max(EXAMPLES // 3, 1),  # and the two explicit examples
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(
        world_size=st.integers(2, 3),
        ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=6).map(tuple),
        seed=st.integers(0, 2**16),
    )
    # Each rule once: a synced forward makes the next forward broadcast (the eval one
    # too); one after no_sync, eval or no_grad does not.
    @example(world_size=2, ops=("step", "accumulate", "eval", "step", "eval", "step"), seed=0)
    @example(world_size=3, ops=("accumulate", "no_grad", "accumulate", "eval", "eval"), seed=1)
    def check(world_size: int, ops: tuple[str, ...], seed: int) -> None:
        own = broadcast_buffers  # see the docstring
        runs = run_both(
            pool, world_size, train_with_buffers, stage, ops, broadcast_buffers, own, seed
        )
        compare_buffer_runs(runs, ops)

    check()


# ---------------------------------------------------------------------------------------
# 3. gradient_as_bucket_view: .grad is the bucket's memory, and stays so.

VIEW_NET = NetSpec(  # two dtypes, a tied and a transposed weight, a frozen layer
    d_in=3,
    width=4,
    d_out=2,
    order=(1, 0, 2),
    dtypes=("float32", "float64", "float32"),
    frozen=(False, False, True),
    tied=True,
    transposed=True,
)


def in_a_bucket(grad: torch.Tensor, buckets) -> bool:
    start, size = grad.data_ptr(), grad.numel() * grad.element_size()
    return any(
        b.buffer.data_ptr() <= start
        and start + size <= b.buffer.data_ptr() + b.buffer.numel() * b.buffer.element_size()
        for b in buckets
    )


def train_on_views(
    rank: int,
    group: dist.ProcessGroup,
    wrapper: str,
    bucket_cap_mb: float,
    accumulation: int,
    set_to_none: bool,
) -> list[tuple[dict, dict]]:
    """[(gradients, parameters after the step)] per step. Checks as it goes that the
    stage's gradients live in its buckets and, with set_to_none=False, that backward
    never allocates a new one; the identity checks run under torch's DDP too, so they
    expect only what torch does."""
    model = build_net(VIEW_NET, seed=1000 * rank + 1)
    wrapped = build_wrapper(
        wrapper, model, group, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True
    )
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ours = wrapper != "torch_ddp"
    record, kept = [], {}
    for step in range(3):
        for j in range(accumulation):
            x, y = torch.randn(2, 3, generator=data), torch.randn(2, 2, generator=data)
            with wrapped.no_sync() if j < accumulation - 1 else nullcontext():
                loss = F.mse_loss(wrapped(x), y) / accumulation
                before = {n: (p.grad, _ptr(p.grad)) for n, p in trainable}
                loss.backward()
            for n, p in trainable:
                if step >= 1 and not set_to_none:  # .grad is already the bucket's view
                    assert p.grad is before[n][0] and p.grad.data_ptr() == before[n][1], (
                        f"{wrapper}: step {step}, micro-batch {j}: backward replaced the "
                        f"gradient of {n} instead of summing into it"
                    )
        for n, p in trainable:
            assert p.grad is not None, f"{wrapper}: {n} has no gradient after step {step}"
            if ours:
                assert in_a_bucket(p.grad, wrapped.buckets), (
                    f"{wrapper}: step {step}: the gradient of {n} is not a view into a bucket"
                )
            if step == 2 and not set_to_none:  # from step 1 on, buckets stay put
                assert p.grad is kept[n], f"{wrapper}: the gradient of {n} moved at step 2"
        kept = {n: p.grad for n, p in trainable}
        grads = grads_of(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        record.append((grads, params_of(model)))
    return record


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("bucket_cap_mb", [1e-9, 25.0])
@pytest.mark.parametrize("stage", stages_from("grad_views"))
def test_gradient_as_bucket_view_as_torch(
    pool, stage: str, bucket_cap_mb: float, accumulation: int, set_to_none: bool
) -> None:
    runs = run_both(pool, 2, train_on_views, stage, bucket_cap_mb, accumulation, set_to_none)
    for rank, (ours, torchs) in enumerate(runs):
        for step, ((grads, params), (t_grads, t_params)) in enumerate(
            zip(ours, torchs, strict=True)
        ):
            assert_same(grads, t_grads, f"gradient, rank {rank}, step {step}")
            assert_same(params, t_params, f"parameter after the step, rank {rank}, step {step}")
