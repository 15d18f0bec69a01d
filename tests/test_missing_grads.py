"""The missing_grads stage (`stages/missing_grads.py`): a parameter with no gradient on
some rank (frozen, or unused this step) gets one from the others or a clear error, never a
hang; one all-reduce of every rank's status says which. The suite's four properties
(`tests.suite`) on a worked case with a frozen layer; tests/test_bad_input.py holds the
errors."""

from __future__ import annotations

from tests.cases import run_case
from tests.suite import check_case, worked


def test_a_frozen_layer_and_the_status_all_reduce(pool):
    case = worked("missing_grads", frozen=(True, False))
    check_case(pool, case)
    calls = pool.run(case.world_size, run_case, case)[0].calls[0][0]
    assert calls[-1][0] == "all_reduce"  # the status, after the buckets (or in the last)
