"""The bucketed stage (`stages/bucketed.py`): after backward, one all-reduce per bucket of
about bucket_cap_mb, buckets cut in reverse parameter order. The suite's four properties
(`tests.suite`) on worked cases, and the buckets the cap cuts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stages.bucketed import DIVIDE_WHILE_COPYING_BYTES
from tests.adapters import TORCH_DDP, build_wrapper
from tests.against_torch import TIGHT, assert_same, grads_of, run_both
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


def large_gradients(rank: int, group: dist.ProcessGroup, stage: str) -> dict:
    """One synchronised backward of two Linear(512, 512) layers (1 MiB weights) on this
    rank's own batch: each .grad after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
    wrapped = build_wrapper(stage, model, group, bucket_cap_mb=25.0)
    if stage != TORCH_DDP:  # the premise: these buckets take the one-pass copy
        for bucket in wrapped.buckets:
            assert bucket.nbytes >= DIVIDE_WHILE_COPYING_BYTES * len(bucket.params)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(rank))
    wrapped(x).pow(2).mean().backward()
    if stage != TORCH_DDP:  # bucketed synchronises here; the later stages in backward
        wrapped.finish_gradient_synchronization()
        for bucket in wrapped.buckets:  # the copy in divides, in one pass: the buffer's
            assert wrapped._copies[bucket.index].copy_in(bucket, 3), "not divided as copied"
            for view, param in zip(bucket.views, bucket.params, strict=True):
                assert torch.equal(view, param.grad / 3), "the buffer is not the .grad / 3"
    return grads_of(model)


@pytest.mark.parametrize("stage", ["bucketed", "overlapped", "missing_grads", "drop_in"])
def test_large_gradients_are_divided_as_they_are_copied(pool, stage: str) -> None:
    """Large gradients are divided by the world size as they are copied into their
    bucket (one pass, as torch's reducer does), not again in the buffer: on 3 ranks, the
    averages of torch's DDP."""
    for rank, (ours, torchs) in enumerate(run_both(pool, 3, large_gradients, stage)):
        assert_same(ours, torchs, f"rank {rank}: gradients against torch's DDP", TIGHT)
