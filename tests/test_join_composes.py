"""Join composes with every other option of the drop-in: ranks leave at any step (before
the first synchronised backward, during the automatic bucket size's measurement, inside
gradient accumulation), and the collectives a rank issues after it has left are exactly
those the ranks still training issue, no more, no fewer, so nothing hangs or mismatches.

The property is checked on a log of every collective each rank issued, start to end:
all ranks' logs must be the same sequence. At the end the replicas agree."""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests import pool
from tests.adapters import build_wrapper
from tests.cases import CollectiveLog
from tests.nets import Gated
from tests.pool import check_no_errors

EXAMPLES = int(os.environ.get("DDP_STAGES_JOIN_EXAMPLES", "200"))
SECONDS = 120  # a mismatched shadow hangs: fail after this long instead


@dataclass(frozen=True)
class UnevenCase:
    batches: tuple[int, ...]  # optimizer steps per rank (0: leaves at once)
    accumulation: int  # micro-batches per step, all but the last inside no_sync()
    bucket_cap_mb: float | str
    find_unused_parameters: bool
    static_graph: bool
    gradient_as_bucket_view: bool
    broadcast_buffers: bool
    comm_hook: bool
    round_robin_groups: int
    divide_by_initial_world_size: bool
    skip_b: tuple[tuple[bool, ...], ...]  # per rank, per step: forward skips branch b
    seed: int


@st.composite
def uneven_cases(draw) -> UnevenCase:
    world_size = draw(st.integers(2, 3))
    batches = tuple(draw(st.lists(st.integers(0, 5), min_size=world_size, max_size=world_size)))
    unused = draw(st.booleans())
    auto = not unused and draw(st.booleans())  # "auto" refuses find_unused_parameters
    static_graph = draw(st.booleans())
    # static_graph promises the same graph every step (a rank's branch may differ from
    # another's, not from its own last step: torch's DDP raises, and so does the drop-in)
    skip_b = [[unused and draw(st.booleans()) for _ in range(n)] for n in batches]
    if static_graph:
        skip_b = [[s[0]] * len(s) if s else [] for s in skip_b]
    return UnevenCase(
        batches=batches,
        accumulation=draw(st.integers(1, 2)),
        bucket_cap_mb="auto" if auto else draw(st.sampled_from([1e-9, 2e-4, 25.0])),
        find_unused_parameters=unused,
        static_graph=static_graph,
        gradient_as_bucket_view=draw(st.booleans()),
        broadcast_buffers=draw(st.booleans()),
        comm_hook=draw(st.booleans()),
        round_robin_groups=draw(st.integers(1, 3)),
        divide_by_initial_world_size=draw(st.booleans()),
        skip_b=tuple(tuple(s) for s in skip_b),
        seed=draw(st.integers(0, 2**16)),
    )


def train_uneven(rank: int, group: dist.ProcessGroup, case: UnevenCase) -> tuple:
    """(every collective this rank issued, its parameters at the end)."""
    torch.manual_seed(case.seed + 1000 * rank)
    model = Gated()
    world_size = len(case.batches)
    extra_groups = pool.ROUND_ROBIN[world_size][: case.round_robin_groups - 1]
    log = CollectiveLog()
    with log.recording() as calls:
        ddp = build_wrapper(
            "drop_in",
            model,
            group,
            bucket_cap_mb=case.bucket_cap_mb,
            find_unused_parameters=case.find_unused_parameters,
            static_graph=case.static_graph,
            gradient_as_bucket_view=case.gradient_as_bucket_view,
            broadcast_buffers=case.broadcast_buffers,
            round_robin_groups=extra_groups,
            comm_hook=default_hooks.allreduce_hook if case.comm_hook else None,
        )
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(case.seed * 7919 + rank)
        with ddp.join(divide_by_initial_world_size=case.divide_by_initial_world_size):
            for step in range(case.batches[rank]):
                for j in range(case.accumulation):
                    local = j < case.accumulation - 1
                    x, y = torch.randn(4, 3, generator=data), torch.randn(4, 2, generator=data)
                    with ddp.no_sync() if local else nullcontext():
                        out = ddp(x, use_b=not case.skip_b[rank][step])
                        F.mse_loss(out, y).backward()
                optimizer.step()
                optimizer.zero_grad()
    return calls, [p.detach().clone() for p in model.parameters()]


def check_uneven(runs: list, case: UnevenCase) -> None:
    calls0, params0 = runs[0]
    for rank, (calls, params) in enumerate(runs[1:], start=1):
        first = next(
            (i for i, pair in enumerate(zip(calls, calls0, strict=False)) if pair[0] != pair[1]),
            min(len(calls), len(calls0)),
        )
        assert calls == calls0, (
            f"rank {rank} ({case.batches[rank]} steps) issued other collectives than rank 0 "
            f"({case.batches[0]} steps), from collective {first} on: "
            f"{calls[first : first + 3]} vs {calls0[first : first + 3]}"
        )
        for i, (p, p0) in enumerate(zip(params, params0, strict=True)):
            assert torch.equal(p, p0), f"parameter {i} differs between rank {rank} and rank 0"


def test_join_composes_with_every_option(pool) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(case=uneven_cases())
    # The automatic bucket size measures after the second synchronised backward: rank 0
    # leaves before it, while rank 1 measures, rebuilds and trains on.
    @example(
        case=UnevenCase(
            batches=(2, 5),
            accumulation=1,
            bucket_cap_mb="auto",
            find_unused_parameters=False,
            static_graph=False,
            gradient_as_bucket_view=False,
            broadcast_buffers=True,
            comm_hook=False,
            round_robin_groups=1,
            divide_by_initial_world_size=True,
            skip_b=((False,) * 2, (False,) * 5),
            seed=0,
        )
    )
    def check(case: UnevenCase) -> None:
        runs = check_no_errors(pool.run(len(case.batches), train_uneven, case, timeout_s=SECONDS))
        check_uneven(runs, case)

    check()
