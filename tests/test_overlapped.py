"""The overlapped stage (`stages/overlapped.py`): each bucket's all-reduce launched from
backward's hooks once its gradients are in, waited for at the end of backward. The
suite's four properties (`tests.suite`) on worked cases; tests/test_analysis.py checks
in real traces that communication overlaps backward."""

from __future__ import annotations

from tests.suite import check_case, worked


def test_buckets_launched_from_backward_give_the_single_process_result(pool):
    for cap in (1e-9, 1e-4, 25.0):  # one a parameter, a few, all in one
        check_case(pool, worked("overlapped", bucket_cap_mb=cap))
