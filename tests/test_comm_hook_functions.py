"""Our communication hooks against torch's, on real Gloo groups and identical inputs.

torch's Python hooks only call methods of the bucket they are given, so they run on our
GradBucket as they are: each case hands ours and torch's the same layout with separate
copies of the same gradients, and compares what comes back, what is left in the
bucket and, for PowerSGD, the state carried between iterations."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from ddp import comm_hook_functions
from ddp.buckets import assign_buckets
from ddp.comm_hook_functions import GradBucket, PowerSGDState
from tests.adapters import COMM_HOOKS
from tests.pool import MAX_WORLD, check_no_errors

SMALL_CAP_MB = 512 / 2**20  # 512 B: the float32 layers split over three buckets
ONE_BUCKET_MB = 25.0  # every float32 gradient in one bucket

# name -> (ours, torch's): the pairs of COMM_HOOKS and one more. Workers look hooks up by
# name: torch's wrapper is a closure, which pickle cannot send.
HOOKS = {
    **COMM_HOOKS,
    # torch's wrapper swaps a float16 copy in with set_buffer: this pair checks that our
    # set_buffer replaces the buffer as torch's does (a copy would all-reduce float32).
    "fp16_wrapper": (
        comm_hook_functions.fp16_compress_hook,
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    ),
}


def build_model() -> nn.Module:
    """Only the parameters' shapes matter; forward never runs. The two (8, 8) weights
    with other shapes between them make torch's grouping by shape reorder PowerSGD's
    matrices; the (1, 8) weight is a matrix too thin to compress; the float64 layer
    gets a bucket of its own."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8),
        nn.Linear(8, 6),
        nn.Linear(6, 8),
        nn.Linear(8, 8),
        nn.Linear(8, 1),
        nn.Linear(4, 5, dtype=torch.float64),
    )


def compare_with_torch(
    rank: int, group: dist.ProcessGroup, hook: str, steps: int, cap_mb: float, settings: dict
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs on every rank: `steps` iterations over all buckets, our hook and torch's
    on the same gradients. Returns (local gradients, our average) per step and bucket."""
    ours_hook, torch_hook = HOOKS[hook]
    model = build_model()
    named = list(model.named_parameters())
    ours, theirs = assign_buckets(named, cap_mb), assign_buckets(named, cap_mb)
    if hook == "powerSGD":
        ours_state = PowerSGDState(group, **settings)
        torch_state = torch_powersgd.PowerSGDState(group, **settings)
    else:
        ours_state = torch_state = None if settings.get("default_group") else group
    record = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)  # differs per rank and step
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=g, dtype=param.dtype)
        for our_bucket, torch_bucket in zip(ours, theirs, strict=True):
            for bucket in (our_bucket, torch_bucket):
                for i, param in enumerate(bucket.params):
                    bucket.view_of(i).copy_(param.grad)  # local sums, not yet / W
            local = our_bucket.buffer.clone()
            is_last = our_bucket.index == len(ours) - 1
            # Wait for each before the next: PowerSGD's callbacks start collectives and
            # block on them; with many buckets in flight, ranks hang (torch's hook too).
            got = ours_hook(ours_state, GradBucket(our_bucket, is_last)).wait()
            want = torch_hook(torch_state, GradBucket(torch_bucket, is_last)).wait()
            where = f"rank {rank}, step {step}, bucket {our_bucket.index} ({hook})"
            assert got.dtype == our_bucket.buffer.dtype, where
            assert_same(got, want.to(got.dtype), where)
            if hook != "fp16_wrapper":  # torch's wrapper leaves the bucket's buffer alone
                assert_same(our_bucket.buffer, torch_bucket.buffer, where)
            record.append((local, got.clone()))
        if hook == "powerSGD":
            assert ours_state.iter == torch_state.iter == step + 1
            assert ours_state.compression_stats() == torch_state.compression_stats()
            if ours_state.use_error_feedback and step >= ours_state.start_powerSGD_iter:
                assert ours_state.error_dict.keys() == torch_state.error_dict.keys()
                for index, error in ours_state.error_dict.items():
                    where = f"rank {rank}, step {step}, error of bucket {index}"
                    assert_same(error, torch_state.error_dict[index], where)
    return record


def assert_same(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    """Bit for bit. Every hook does torch's operations in torch's order (PowerSGD even
    through torch's bmm kernel, see ddp.comm_hook_functions._matmul), so any difference is a
    deviation from torch's algorithm, not rounding."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")


def run_on_ranks(pool, world_size: int, *args) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    runs = check_no_errors(pool.run(world_size, compare_with_torch, *args))
    # Every rank must leave with the same average, or the replicas drift apart.
    for r, run in enumerate(runs[1:], start=1):
        for (_, got0), (_, got) in zip(runs[0], run, strict=True):
            assert torch.equal(got0, got), f"rank {r} averaged differently from rank 0"
    return runs


def mean_over_ranks(runs, i: int) -> torch.Tensor:
    return torch.stack([run[i][0] for run in runs]).mean(0)


@pytest.mark.parametrize(
    "hook, world_size, default_group",
    [
        ("allreduce", 2, False),
        ("allreduce", 3, False),
        # None means the default group: all MAX_WORLD ranks of the pool.
        ("allreduce", MAX_WORLD, True),
        ("fp16", 2, False),
        ("fp16", 3, False),
        ("bf16", 2, False),
        ("fp16_wrapper", 2, False),
    ],
)
def test_simple_hooks_match_torch(pool, hook: str, world_size: int, default_group: bool) -> None:
    # Bit for bit: both divide, cast and all-reduce the same numbers in the same order.
    runs = run_on_ranks(pool, world_size, hook, 1, SMALL_CAP_MB, {"default_group": default_group})
    # And they average: to float32 rounding (dividing before summing rounds
    # differently from the mean), or to the 16-bit format's.
    atol = {"allreduce": 1e-6, "fp16": 5e-3, "fp16_wrapper": 5e-3, "bf16": 3e-2}[hook]
    for i, (_, got) in enumerate(runs[0]):
        want = mean_over_ranks(runs, i)
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "world_size, cap_mb, settings",
    [
        (2, SMALL_CAP_MB, {}),
        (2, ONE_BUCKET_MB, {"use_error_feedback": False, "warm_start": False}),
        # r = 2 needs a rate below 2 to find any of these small matrices worth compressing.
        (
            3,
            ONE_BUCKET_MB,
            {"matrix_approximation_rank": 2, "min_compression_rate": 1, "warm_start": False},
        ),
        (2, ONE_BUCKET_MB, {"use_error_feedback": False, "orthogonalization_epsilon": 1e-8}),
        # r = 4 orthogonalises by QR, not Gram-Schmidt; at rate 0.5 the matrices still
        # count as worth compressing.
        (2, SMALL_CAP_MB, {"matrix_approximation_rank": 4, "min_compression_rate": 0.5}),
    ],
)
def test_powerSGD_matches_torch(pool, world_size: int, cap_mb: float, settings: dict) -> None:
    steps, start = 5, 2  # two plain iterations, then three compressed (warm start from 4)
    settings = {"start_powerSGD_iter": start, "random_seed": 7, **settings}
    runs = run_on_ranks(pool, world_size, "powerSGD", steps, cap_mb, settings)
    plain = start * len(runs[0]) // steps  # records before start_powerSGD_iter
    for i, (_, got) in enumerate(runs[0][:plain]):
        torch.testing.assert_close(got, mean_over_ranks(runs, i), rtol=0, atol=1e-6)
    # After it, low rank: some bucket no longer arrives as the exact mean.
    assert any(
        not torch.allclose(got, mean_over_ranks(runs, i), atol=1e-3)
        for i, (_, got) in enumerate(runs[0][plain:], start=plain)
    )


def test_grad_bucket_has_torchs_interface() -> None:
    public = {name for name in dir(dist.GradBucket) if not name.startswith("_")}
    assert public <= set(dir(GradBucket)), public - set(dir(GradBucket))
    a, b = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))
    (bucket,) = assign_buckets([("a", a), ("b", b)], bucket_cap_mb=1.0)
    grad_bucket = GradBucket(bucket, is_last=True)
    assert grad_bucket.index() == 0 and grad_bucket.is_last()
    assert grad_bucket.parameters() == [b, a]
    assert grad_bucket.buffer() is bucket.buffer
    grad_bucket.gradients()[1].fill_(1.0)  # views: writes land in the buffer
    assert torch.equal(bucket.buffer, torch.tensor([0.0] * 4 + [1.0] * 6))
    half = bucket.buffer.half()
    grad_bucket.set_buffer(half)  # replaces, as torch's C++ does; no copy
    assert grad_bucket.buffer() is half and grad_bucket.gradients()[1].dtype == torch.float16
    assert bucket.buffer.dtype == torch.float32


def test_hooks_reject_a_bad_state() -> None:
    (bucket,) = assign_buckets([("w", nn.Parameter(torch.zeros(3, 3)))], bucket_cap_mb=1.0)
    grad_bucket = GradBucket(bucket, is_last=True)
    with pytest.raises(NotImplementedError, match="batch_tensors_with_same_shape"):
        PowerSGDState(None, batch_tensors_with_same_shape=True)
    with pytest.raises(ValueError, match="start_powerSGD_iter must be > 1"):
        PowerSGDState(None, start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDState(None, matrix_approximation_rank=0)
    with pytest.raises(TypeError, match="allreduce_hook's state is the process group"):
        comm_hook_functions.allreduce_hook(PowerSGDState(None), grad_bucket)
    with pytest.raises(TypeError, match="must be a PowerSGDState"):
        comm_hook_functions.powerSGD_hook(None, grad_bucket)
