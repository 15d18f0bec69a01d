"""The test pool tells a worker that died from one that hangs, and carries on after either.

A rank that crashes (glibc aborting on a corrupted heap, a segfault) never answers, as a
hung one does; the pool names the crash and its signal, and the worker's stderr holds
its stack."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from tests.pool import GlooPool


def abort_on_rank_1(rank: int, group: dist.ProcessGroup) -> int:
    if rank == 1:
        os.abort()  # SIGABRT, as glibc's "malloc(): unaligned tcache chunk detected"
    return rank


def sleep_on_rank_1(rank: int, group: dist.ProcessGroup) -> int:
    if rank == 1:
        time.sleep(3600)  # until the pool, restarting, kills it
    return rank


def rank_and_sum(rank: int, group: dist.ProcessGroup) -> tuple[int, int]:
    import torch

    t = torch.tensor([rank + 1])
    dist.all_reduce(t, group=group)
    return rank, int(t.item())


@pytest.fixture(scope="module")
def small_pool():
    pool = GlooPool(2)  # its own: these examples kill workers
    yield pool
    pool.close(kill=True)


def test_a_worker_that_dies_is_named_with_its_signal(small_pool) -> None:
    # Named as soon as the pool sees the worker gone, long before the hang's limit.
    with pytest.raises(TimeoutError, match=r"rank 1's worker died \(exit code -6, SIGABRT"):
        small_pool.run(2, abort_on_rank_1, timeout_s=600)
    assert small_pool.run(2, rank_and_sum) == [(0, 3), (1, 3)]  # restarted, and working


def test_a_worker_that_hangs_is_a_hang(small_pool) -> None:
    small_pool.run(2, rank_and_sum)  # both workers up, and this module imported in each
    # Rank 0 answers at once; rank 1 still sleeps when the limit ends, alive: a hang.
    with pytest.raises(TimeoutError, match=r"ranks \[1\] gave no answer in 10 s: a hang$"):
        small_pool.run(2, sleep_on_rank_1, timeout_s=10)
    assert small_pool.run(2, rank_and_sum) == [(0, 3), (1, 3)]
