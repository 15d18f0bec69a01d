"""round_robin_groups against torch's DDP (runs compared as tests.against_torch describes):
bucket i goes over process group i mod k, and training is torch's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests import pool as pool_module
from tests.adapters import build_wrapper, stages_from
from tests.against_torch import assert_same_steps, run_checked, sgd_steps, tolerance
from tests.nets import DEPTH, ONE_BUCKET_MB, WIDTH, Layers


def train_round_robin(
    rank: int, group: dist.ProcessGroup, wrapper: str, cap_mb: float, steps: int
) -> tuple[list, list[list[tuple[int, int]]]]:
    """([(gradients, parameters)] per step, [(bucket index, group index)] per step for
    every bucket all-reduce, with group index into [process_group, *round_robin_groups])."""
    torch.manual_seed(1000 * rank + 1)
    model = Layers()
    groups = [group, *pool_module.ROUND_ROBIN[group.size()]]
    options = {} if wrapper == "torch_ddp" else {"round_robin_groups": groups[1:]}
    wrapped = build_wrapper(
        wrapper, model, group, bucket_cap_mb=cap_mb, first_bucket_as_torch=True, **options
    )
    calls = []
    original = dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        buckets = getattr(wrapped, "buckets", [])
        for bucket in buckets:
            if tensor.data_ptr() == bucket.buffer.data_ptr():
                which = [k for k, g in enumerate(groups) if g is group]
                calls[-1].append((bucket.index, which[0] if which else -1))
        return original(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recording  # torch.distributed's: the stages look it up at call time
    try:
        record = sgd_steps(wrapped, model, rank, steps, (4, WIDTH), lambda: calls.append([]))
    finally:
        dist.all_reduce = original
    return record, calls


def round_robin_both(rank: int, group: dist.ProcessGroup, stage: str, cap_mb: float):
    """(the stage's run, torch's run, k: how many groups take turns)."""
    return (
        train_round_robin(rank, group, stage, cap_mb, 3),
        train_round_robin(rank, group, "torch_ddp", cap_mb, 3),
        1 + len(pool_module.ROUND_ROBIN[group.size()]),
    )


@pytest.mark.parametrize(
    "cap_mb, world_size",
    [(1e-9, 2), (1e-9, 3), (ONE_BUCKET_MB, 2)],
    ids=["per-parameter-W2", "per-parameter-W3", "one-W2"],
)
@pytest.mark.parametrize("stage", stages_from("round_robin"))
def test_round_robin_groups_as_torch(pool, stage: str, cap_mb: float, world_size: int) -> None:
    runs = run_checked(pool, world_size, round_robin_both, stage, cap_mb)
    n_buckets = 1 if cap_mb == ONE_BUCKET_MB else 2 * DEPTH  # 1e-9: a bucket per parameter
    for rank, ((ours, calls), (torchs, torch_calls), k) in enumerate(runs):
        assert k > 2, "the pool should give two round-robin groups besides the group"
        assert torch_calls == [[] for _ in torchs], "torch's DDP all-reduces in C++ only"
        for step, step_calls in enumerate(calls):
            expected = [(i, i % k) for i in range(n_buckets)]
            assert step_calls == expected, (
                f"rank {rank}, step {step}: (bucket, group) of each bucket all-reduce "
                f"{step_calls}, expected bucket i over group i mod {k}: {expected}"
            )
        assert_same_steps(ours, torchs, f"rank {rank}", tolerance(world_size))


def foreign_round_robin_group(rank: int, group: dist.ProcessGroup, stage: str) -> str:
    other = pool_module.ROUND_ROBIN[group.size() + 1][0]  # ranks 0..W, not 0..W-1
    try:
        build_wrapper(stage, Layers(), group, round_robin_groups=[other])
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("stage", stages_from("round_robin"))
def test_round_robin_group_over_other_ranks_raises(pool, stage: str) -> None:
    for rank, error in enumerate(run_checked(pool, 2, foreign_round_robin_group, stage)):
        assert "same ranks" in error, f"rank {rank}: {error!r}"
