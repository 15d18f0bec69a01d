"""Comparing a stage with torch's own DistributedDataParallel, given the same arguments.

The suite compares stages with single-process training; the options that only make
sense with several replicas (unused parameters that differ per rank, buffers that
follow rank 0, gradients living in bucket buffers, hooks, Join, ...) have no
single-process answer, so there the reference is torch's DDP itself. Every worker
trains the same function twice on the same Gloo group, once wrapped by the stage and
once by torch's DDP, from the same per-rank seeds (ranks initialise differently on
purpose: both wrappers must broadcast rank 0's state), and the test compares the two
rank by rank, step by step.

Tolerances. assert_same defaults to TIGHT, torch.testing's float32 default. The tests
that take tolerance(W) compare 2-rank runs bit for bit (EXACT): an all-reduce of two
numbers is one commutative addition, every hook (ours and torch's) does the same
operations in the same order, and the stage's other steps (copies, a division by 1 or
by W) round the same way as torch's reducer. With 3 ranks, Gloo adds three numbers in
an order that depends on where an element sits in the flat buffer, and the two
wrappers lay their buckets out differently in the first iteration (torch puts
everything in one bucket in parameter order, the stages use the cap in reverse
order), so the last bit may differ: there, TIGHT."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.adapters import TORCH_DDP
from tests.pool import check_no_errors

EXAMPLES = int(os.environ.get("DDP_STAGES_TORCH_EXAMPLES", "12"))  # per stage per test
TIGHT = {"rtol": 1.3e-6, "atol": 1e-5}  # torch.testing's float32 default; W-fold errors are far out
EXACT = {"rtol": 0.0, "atol": 0.0}


def tolerance(world_size: int) -> dict:
    return EXACT if world_size == 2 else TIGHT  # see the module docstring


def ours_and_torchs(rank: int, group: dist.ProcessGroup, train, stage: str, *args):
    """Runs on every rank: `train` under the stage, then under torch's DDP."""
    return train(rank, group, stage, *args), train(rank, group, TORCH_DDP, *args)


def run_both(pool, world_size: int, train, stage: str, *args) -> list[tuple]:
    return check_no_errors(
        pool.run(world_size, ours_and_torchs, train, stage, *args, timeout_s=120)
    )


def run_checked(pool, world_size: int, fn, *args) -> list:
    """fn(rank, group, *args) on every rank; the first rank's error fails the test, and
    so does a hang after 120 s instead of blocking CI."""
    return check_no_errors(pool.run(world_size, fn, *args, timeout_s=120))


def assert_same(ours: dict, theirs: dict, where: str, tol: dict = TIGHT) -> None:
    """Named tensors (or None) of the stage's run equal the reference's (torch DDP's)
    within `tol`; integer tensors exactly."""
    assert ours.keys() == theirs.keys(), f"{where}: {sorted(ours)} vs {sorted(theirs)}"
    for name, mine in ours.items():
        other = theirs[name]
        assert (mine is None) == (other is None), (
            f"{where}, {name}: the stage gives {'None' if mine is None else 'a tensor'}, "
            f"the reference {'None' if other is None else 'a tensor'}"
        )
        if mine is None:
            continue
        if not mine.is_floating_point():
            assert torch.equal(mine, other), f"{where}, {name}: {mine} vs {other}"
        else:
            torch.testing.assert_close(
                mine, other, **tol, msg=lambda m, name=name: f"{where}, {name}: {m}"
            )


def assert_same_steps(ours: list, theirs: list, where: str, tol: dict) -> None:
    """Two records of [(named tensors, named tensors, ...)] per step."""
    assert len(ours) == len(theirs), f"{where}: {len(ours)} steps vs {len(theirs)}"
    for step, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        for k, (a, b) in enumerate(zip(mine, other, strict=True)):
            assert_same(a, b, f"{where}, step {step}, record {k}", tol)


def clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def grads_of(model: nn.Module) -> dict:
    return {name: clone(p.grad) for name, p in model.named_parameters()}


def params_of(model: nn.Module) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def buffers_of(model: nn.Module) -> dict:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def sgd_steps(
    wrapped: nn.Module,
    model: nn.Module,
    rank: int,
    steps: int,
    shape: tuple[int, int],
    before=lambda: None,
    after=lambda: None,
) -> list:
    """`steps` SGD steps on this rank's seeded random regression batches of `shape`,
    calling `before()` and `after()` around each: [(gradients, parameters after the
    step)] per step."""
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    record = []
    for _ in range(steps):
        before()
        x, y = torch.randn(*shape, generator=data), torch.randn(*shape, generator=data)
        F.mse_loss(wrapped(x), y).backward()
        grads = grads_of(model)
        optimizer.step()
        optimizer.zero_grad()
        record.append((grads, params_of(model)))
        after()
    return record
