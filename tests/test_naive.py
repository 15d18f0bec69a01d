"""The naive stage (`stages/naive.py`): after backward, one blocking all-reduce per
trainable parameter, in parameter order. The suite's four properties (`tests.suite`) on a
worked case; tests/test_suite.py draws many more."""

from __future__ import annotations

from tests.cases import run_case
from tests.nets import build_net
from tests.suite import check_case, worked


def test_one_all_reduce_per_trainable_parameter_in_order(pool):
    # One hidden layer frozen, a weight tied: every trainable tensor (the tied one once)
    # all-reduced on its own, in parameter order, the frozen ones not at all.
    case = worked("naive", frozen=(False, True))
    check_case(pool, case)
    (first_step, *_), *_ = pool.run(case.world_size, run_case, case)[0].calls
    trainable = [p for p in build_net(case.net, seed=0).parameters() if p.requires_grad]
    assert first_step == [("all_reduce", tuple(p.shape)) for p in trainable]
