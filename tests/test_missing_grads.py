"""The missing_grads stage (`stages/missing_grads.py`): a parameter with no gradient on
some rank (frozen, or unused this step) gets one from the others or a clear error, never a
hang; one all-reduce of every rank's status says which. The suite's four properties
(`tests.suite`) on a worked case with a frozen layer; tests/test_bad_input.py holds the
errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.adapters import build_wrapper, stages_from
from tests.cases import run_case
from tests.nets import Branchy
from tests.pool import check_no_errors
from tests.suite import check_case, worked


def test_a_frozen_layer_and_the_status_all_reduce(pool):
    case = worked("missing_grads", frozen=(True, False))
    check_case(pool, case)
    calls = pool.run(case.world_size, run_case, case)[0].calls[0][0]
    assert calls[-1][0] == "all_reduce"  # the status, after the buckets (or in the last)


SKIPPED = "branches.1."  # the branch no rank's forward runs (below)


def step_without_a_branch(
    rank: int, group: dist.ProcessGroup, stage: str
) -> tuple[str | None, dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """One synchronised backward of a forward that skips branch 1 on every rank: (what it
    raised, None for nothing; each parameter's .grad after it; each used parameter's
    gradient averaged over the ranks by hand). Each rank has its own input."""
    torch.manual_seed(0)
    model = Branchy()
    wrapped = build_wrapper(stage, model, group)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    use = (0, 2)
    used = [(n, p) for n, p in model.named_parameters() if not n.startswith(SKIPPED)]
    local = torch.autograd.grad(model(x, use).sum(), [p for _, p in used])  # no .grad
    averages = {}
    for (name, _), grad in zip(used, local, strict=True):
        dist.all_reduce(grad, group=group)
        averages[name] = grad / dist.get_world_size(group)
    try:
        wrapped(x, use).sum().backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return error, grads, averages


@pytest.mark.parametrize("stage", stages_from("missing_grads"))
def test_a_gradient_missing_everywhere_raises_after_the_others_are_averaged(
    pool, stage: str
) -> None:
    """A parameter no rank's forward used: the copy-out of its bucket passes over the
    gradient that is not there (one parameter at a time, not the usual copy of the whole
    bucket), so every rank raises the missing-gradient error naming it (not an error of
    the copy-out), and by then every gradient that came holds the average over the ranks
    while the missing one holds nothing made up (None, or the zeros that stood in for it)."""
    for rank, (error, grads, averages) in enumerate(
        check_no_errors(pool.run(2, step_without_a_branch, stage))
    ):
        assert error is not None and "'branches.1.weight'" in error, f"rank {rank}: {error}"
        for name, grad in grads.items():
            where = f"rank {rank}, {name}"
            if name.startswith(SKIPPED):
                assert grad is None or not grad.any(), f"{where}, used on no rank, got {grad}"
            else:
                torch.testing.assert_close(grad, averages[name], msg=lambda m, w=where: f"{w}: {m}")
