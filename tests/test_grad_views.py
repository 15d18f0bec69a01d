"""gradient_as_bucket_view against torch's DDP (runs compared as tests.against_torch describes):
.grad is the bucket's memory, and stays so."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.adapters import build_wrapper, stages_from
from tests.against_torch import assert_same, grads_of, params_of, run_both
from tests.nets import NetSpec, build_net
from tests.pool import check_no_errors

VIEW_NET = NetSpec(  # two dtypes, a tied and a transposed weight, a frozen layer
    d_in=3,
    width=4,
    d_out=2,
    order=(1, 0, 2),
    dtypes=("float32", "float64", "float32"),
    frozen=(False, False, True),
    tied=True,
    transposed=True,
)


def in_a_bucket(grad: torch.Tensor, buckets) -> bool:
    start, size = grad.data_ptr(), grad.numel() * grad.element_size()
    return any(
        b.buffer.data_ptr() <= start
        and start + size <= b.buffer.data_ptr() + b.buffer.numel() * b.buffer.element_size()
        for b in buckets
    )


def train_on_views(
    rank: int,
    group: dist.ProcessGroup,
    wrapper: str,
    bucket_cap_mb: float,
    accumulation: int,
    set_to_none: bool,
) -> list[tuple[dict, dict]]:
    """[(gradients, parameters after the step)] per step. Checks as it goes that the
    stage's gradients live in its buckets and, with set_to_none=False, that backward
    never allocates a new one; the identity checks run under torch's DDP too, so they
    expect only what torch does."""
    model = build_net(VIEW_NET, seed=1000 * rank + 1)
    wrapped = build_wrapper(
        wrapper, model, group, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True
    )
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ours = wrapper != "torch_ddp"
    record, kept = [], {}
    for step in range(3):
        for j in range(accumulation):
            x, y = torch.randn(2, 3, generator=data), torch.randn(2, 2, generator=data)
            with wrapped.no_sync() if j < accumulation - 1 else nullcontext():
                loss = F.mse_loss(wrapped(x), y) / accumulation
                before = {n: (p.grad, _ptr(p.grad)) for n, p in trainable}
                loss.backward()
            for n, p in trainable:
                if step >= 1 and not set_to_none:  # .grad is already the bucket's view
                    assert p.grad is before[n][0] and p.grad.data_ptr() == before[n][1], (
                        f"{wrapper}: step {step}, micro-batch {j}: backward replaced the "
                        f"gradient of {n} instead of summing into it"
                    )
        for n, p in trainable:
            assert p.grad is not None, f"{wrapper}: {n} has no gradient after step {step}"
            if ours:
                assert in_a_bucket(p.grad, wrapped.buckets), (
                    f"{wrapper}: step {step}: the gradient of {n} is not a view into a bucket"
                )
            if step == 2 and not set_to_none:  # from step 1 on, buckets stay put
                assert p.grad is kept[n], f"{wrapper}: the gradient of {n} moved at step 2"
        kept = {n: p.grad for n, p in trainable}
        grads = grads_of(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        record.append((grads, params_of(model)))
    return record


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("bucket_cap_mb", [1e-9, 25.0])
@pytest.mark.parametrize("stage", stages_from("grad_views"))
def test_gradient_as_bucket_view_as_torch(
    pool, stage: str, bucket_cap_mb: float, accumulation: int, set_to_none: bool
) -> None:
    runs = run_both(pool, 2, train_on_views, stage, bucket_cap_mb, accumulation, set_to_none)
    for rank, (ours, torchs) in enumerate(runs):
        for step, ((grads, params), (t_grads, t_params)) in enumerate(
            zip(ours, torchs, strict=True)
        ):
            assert_same(grads, t_grads, f"gradient, rank {rank}, step {step}")
            assert_same(params, t_params, f"parameter after the step, rank {rank}, step {step}")


def where_grads_live(
    rank: int, group: dist.ProcessGroup, stage: str, gradient_as_bucket_view: bool
) -> list[dict[str, tuple[bool, bool]]]:
    """Per synchronised step (two: the buckets of the stages that rebuild them change
    at the second), per trainable parameter: (its .grad is its own view in its bucket,
    its .grad lies in some bucket's buffer)."""
    model = build_net(VIEW_NET, seed=1000 * rank + 1)
    wrapped = build_wrapper(
        stage, model, group, bucket_cap_mb=1e-4, gradient_as_bucket_view=gradient_as_bucket_view
    )
    data = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(2):
        x, y = torch.randn(2, 3, generator=data), torch.randn(2, 2, generator=data)
        F.mse_loss(wrapped(x), y).backward()
        views = {
            id(p): view for b in wrapped.buckets for p, view in zip(b.params, b.views, strict=True)
        }
        steps.append(
            {
                n: (
                    p.grad.data_ptr() == views[id(p)].data_ptr()
                    and p.grad.shape == views[id(p)].shape,
                    in_a_bucket(p.grad, wrapped.buckets),
                )
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        )
    return steps


@pytest.mark.parametrize("stage", stages_from("grad_views"))
def test_grads_are_bucket_views_only_with_gradient_as_bucket_view(pool, stage: str) -> None:
    """After each synchronised backward, with gradient_as_bucket_view=True every .grad is
    its own slice of its bucket's buffer; without it (the default) no .grad lies in a
    bucket, so what the optimizer or the user does to a .grad leaves the buckets alone,
    as in torch's DDP."""
    for option in (True, False):
        runs = check_no_errors(pool.run(2, where_grads_live, stage, option))
        for rank, steps in enumerate(runs):
            for step, grads in enumerate(steps):
                for name, (own_view, in_a_buffer) in grads.items():
                    where = f"rank {rank}, step {step}, {name}"
                    if option:
                        assert own_view, f"{where}: .grad is not its view in its bucket"
                    else:
                        assert not in_a_buffer, (
                            f"{where}: .grad lies in a bucket without the option"
                        )
