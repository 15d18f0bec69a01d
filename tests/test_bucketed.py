"""The bucketed stage (`stages/bucketed.py`): after backward, one all-reduce per bucket of
about bucket_cap_mb, buckets cut in reverse parameter order. The suite's four properties
(`tests.suite`) on worked cases, and the buckets the cap cuts."""

from __future__ import annotations

from tests.cases import expected_bucket_sizes, run_case
from tests.nets import build_net
from tests.suite import check_case, trainable, worked


def test_the_cap_cuts_the_buckets(pool):
    for cap in (1e-9, 25.0):  # one parameter a bucket; all in one, one per dtype
        case = worked("bucketed", bucket_cap_mb=cap)
        check_case(pool, case)
        run = pool.run(case.world_size, run_case, case)[0]
        expected = expected_bucket_sizes(build_net(case.net, seed=0), cap)
        assert run.bucket_sizes == expected
        assert len(expected) == (2 if cap == 25.0 else len(trainable(case)))
