"""broadcast_buffers against torch's DDP (runs compared as tests.against_torch describes):
BatchNorm's running statistics follow rank 0, at construction and at the forwards torch
picks."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.adapters import build_wrapper, stages_from
from tests.against_torch import EXAMPLES, assert_same, buffers_of, clone, params_of, run_both
from tests.nets import Normed

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
        return params_of(model), buffers_of(model), clone(output)

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
