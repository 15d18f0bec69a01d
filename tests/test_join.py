"""Uneven inputs under Join against torch's DDP (runs compared as tests.against_torch
describes): ranks with fewer batches shadow the others, as under torch's DDP."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms import Join

from tests.adapters import build_wrapper, stages_from
from tests.against_torch import (
    EXACT,
    assert_same,
    assert_same_steps,
    buffers_of,
    grads_of,
    ours_and_torchs,
    params_of,
    run_checked,
    tolerance,
)
from tests.nets import ONE_BUCKET_MB, Normed, UsedTwice
from tests.pool import RankError


@dataclass(frozen=True)
class JoinCase:
    world_size: int
    broadcast_buffers: bool
    divide_by_initial_world_size: bool
    several_buckets: bool
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    manager: str  # "method": `with model.join()`; "Join": `with Join([model])`


# Seven two-way options in eight runs: Taguchi's L8 orthogonal array, in which every
# pair of options meets in all four combinations.
JOIN_CASES = [
    JoinCase(2, True, True, False, False, False, "method"),
    JoinCase(2, True, True, True, True, True, "Join"),
    JoinCase(2, False, False, False, False, True, "Join"),
    JoinCase(2, False, False, True, True, False, "method"),
    JoinCase(3, True, False, False, True, False, "Join"),
    JoinCase(3, True, False, True, False, True, "method"),
    JoinCase(3, False, True, False, True, True, "method"),
    JoinCase(3, False, True, True, False, False, "Join"),
]


def train_uneven(rank: int, group: dist.ProcessGroup, wrapper: str, case: JoinCase) -> tuple:
    """([(gradients, parameters, buffers)] per own step, (parameters, buffers) at the end).
    Rank r has 2 + 2r batches: rank 0 leaves first, while its buffers are stale."""
    torch.manual_seed(1000 * rank + 1)
    model = Normed()
    options = {
        "broadcast_buffers": case.broadcast_buffers,
        "find_unused_parameters": case.find_unused_parameters,
        "gradient_as_bucket_view": case.gradient_as_bucket_view,
    }
    cap_mb = 1e-9 if case.several_buckets else ONE_BUCKET_MB
    wrapped = build_wrapper(
        wrapper, model, group, bucket_cap_mb=cap_mb, first_bucket_as_torch=True, **options
    )
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    divide = case.divide_by_initial_world_size
    if case.manager == "method":
        manager = wrapped.join(divide_by_initial_world_size=divide)
    else:
        manager = Join([wrapped], divide_by_initial_world_size=divide)
    record = []
    with manager:
        for _ in range(2 + 2 * rank):
            x = torch.randn(4, 3, generator=data) * (rank + 1) + rank  # per-rank statistics
            y = torch.randn(4, 2, generator=data)
            F.mse_loss(wrapped(x), y).backward()
            grads = grads_of(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=not case.gradient_as_bucket_view)
            record.append((grads, params_of(model), buffers_of(model)))
    return record, (params_of(model), buffers_of(model))


@pytest.mark.parametrize("case", JOIN_CASES, ids=[f"case{i}" for i in range(len(JOIN_CASES))])
@pytest.mark.parametrize("stage", stages_from("join"))
def test_uneven_inputs_with_join_as_torch(pool, stage: str, case: JoinCase) -> None:
    runs = run_checked(pool, case.world_size, ours_and_torchs, train_uneven, stage, case)
    tol = tolerance(case.world_size)
    finals = []
    for rank, ((ours, final), (torchs, torch_final)) in enumerate(runs):
        where = f"rank {rank} of {case}"
        assert_same_steps(ours, torchs, where, tol)
        assert_same(final[0], torch_final[0], f"{where}, parameters at the end", tol)
        assert_same(final[1], torch_final[1], f"{where}, buffers at the end", tol)
        finals.append(final)
    for rank, (params, _) in enumerate(finals[1:], start=1):  # Join's closing broadcast
        assert_same(params, finals[0][0], f"rank {rank}'s final parameters vs rank 0's", EXACT)


class Skips(nn.Module):
    """Two layers; `skip=True` leaves the second without a gradient."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = self.first(x)
        return h[:, :2] if skip else self.second(h)


def miss_a_gradient_after_a_rank_left(rank: int, group: dist.ProcessGroup, stage: str) -> None:
    """Rank 0 trains one step and leaves; rank 1's second step misses `second`'s
    gradients, while rank 0 shadows it."""
    torch.manual_seed(0)
    wrapped = build_wrapper(stage, Skips(), group)
    with wrapped.join():
        for step in range(1 + rank):
            wrapped(torch.randn(4, 3), skip=step == 1).sum().backward()


@pytest.mark.parametrize("stage", stages_from("join"))
def test_a_rank_that_left_raises_with_the_others(pool, stage: str) -> None:
    """The ranks still training find a gradient missing: the rank that left, shadowing
    their step, takes part in the exchange of what went wrong and raises the same error,
    rather than leave them waiting for it (or mismatch their next collective)."""
    runs = pool.run(2, miss_a_gradient_after_a_rank_left, stage, timeout_s=120)
    assert all(isinstance(run, RankError) for run in runs), runs
    for error in runs:
        assert error.type_name == "RuntimeError", error.message
        assert "got no gradient" in error.message and "rank 1" in error.message, error.message
        assert "'second.weight'" in error.message and "'second.bias'" in error.message


def static_graph_after_a_rank_left_early(rank: int, group: dist.ProcessGroup) -> dict:
    """static_graph=True: in the first epoch rank 1 has no batch at all, so it shadows the
    first synchronised step and learns the graph from it; in the second both train."""
    from stages.drop_in import DistributedDataParallel

    torch.manual_seed(0)
    wrapped = DistributedDataParallel(UsedTwice(first=True), process_group=group, static_graph=True)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for batches in ([2, 0], [2, 2]):
        with wrapped.join():
            for _ in range(batches[rank]):
                wrapped(torch.randn(4, 3, generator=data)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    return params_of(wrapped.module)


def test_static_graph_learned_by_a_rank_that_left_before_the_first_step(pool) -> None:
    """The rank that shadowed static_graph's first step expects each gradient as often
    as that step brought it (twice for `inner`, used inside a reentrant checkpoint and
    outside it), as the rank that trained it does: it
    trains on without an error, and the replicas stay equal."""
    runs = pool.run(2, static_graph_after_a_rank_left_early, timeout_s=120)
    for rank, run in enumerate(runs):
        assert not isinstance(run, RankError), f"rank {rank}: {run.traceback}"
    assert_same(runs[1], runs[0], "rank 1 against rank 0", EXACT)
