"""The skip_sync stage (`stages/skip_sync.py`): `no_sync()` skips the all-reduce of all
micro-batches but the last, whose backward all-reduces the accumulated gradients. The
suite's four properties (`tests.suite`) on a worked case: none inside no_sync, and the
same parameters as one process on the k-times larger batch."""

from __future__ import annotations

from tests.cases import run_case
from tests.suite import check_case, worked


def test_no_collective_inside_no_sync(pool):
    case = worked("skip_sync", accumulation=3)
    check_case(pool, case)
    for step in pool.run(case.world_size, run_case, case)[0].calls:
        assert step[0] == step[1] == [] and step[2] != []
