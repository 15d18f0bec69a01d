"""The rebuilt_buckets stage (`stages/rebuilt_buckets.py`): after the first step, buckets
are rebuilt in the order gradients became ready, which rank 0 broadcasts once. The
suite's four properties (`tests.suite`) on a worked case of three steps."""

from __future__ import annotations

from tests.cases import run_case
from tests.suite import check_case, trainable, worked


def test_the_ready_order_is_broadcast_once_before_the_second_step(pool):
    case = worked("rebuilt_buckets", steps=3)
    check_case(pool, case)
    calls = pool.run(case.world_size, run_case, case)[0].calls
    broadcasts = [[c for c in step[0] if c[0] == "broadcast"] for step in calls]
    assert broadcasts == [[], [("broadcast", (len(trainable(case)),))], []]
