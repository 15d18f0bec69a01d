"""Learning-rate rules for large minibatches (Goyal et al., arXiv 1706.02677), built
from torch's own schedulers so any loop that calls `scheduler.step()` once per
iteration can use them.

The linear scaling rule: when the minibatch is multiplied by s, multiply the learning
rate by s. For k workers of n samples each, against a reference batch of 256:

    lr_hat = base_lr * k * n / reference_batch                       (linear_scaled_lr)

Warmup, over the first T iterations (t counts optimizer steps from 0):

    gradual:  lr(t) = base_lr + (lr_hat - base_lr) * t / T            (t < T)
    constant: lr(t) = base_lr                                         (t < T)
    none:     T = 0

then the usual schedule, in absolute iterations (as in the paper, where the step decay
milestones count from the first epoch, warmup included):

    step:   lr(t) = lr_hat * gamma ** (number of milestones m with m <= t)
    cosine: lr(t) = lr_hat * (1 + cos(pi * (t - T) / (total - T))) / 2   (T <= t <= total)

Gradual warmup is `LinearLR` (a constant increment per step), constant warmup is
`ConstantLR`, the decay is `MultiStepLR` or `CosineAnnealingLR`, and `SequentialLR`
hands over from one to the other at iteration T. The formulas above are what
tests/test_large_batch.py checks the composed schedulers against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    MultiStepLR,
    SequentialLR,
)

WARMUPS = ("none", "gradual", "constant")
DECAYS = ("step", "cosine")


def linear_scaled_lr(
    base_lr: float, workers: int, per_worker_batch: int, reference_batch: int = 256
) -> float:
    """The linear scaling rule: base_lr * k * n / reference_batch (the paper's
    eta = 0.1 * kn / 256 for ResNet-50 has base_lr=0.1, reference_batch=256)."""
    if workers < 1 or per_worker_batch < 1 or reference_batch < 1:
        raise ValueError(
            f"workers ({workers}), per_worker_batch ({per_worker_batch}) and "
            f"reference_batch ({reference_batch}) must all be >= 1"
        )
    return base_lr * workers * per_worker_batch / reference_batch


def large_batch_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    base_lr: float,
    total_iters: int,
    warmup: str = "gradual",
    warmup_iters: int = 0,
    decay: str = "step",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
) -> LRScheduler:
    """A scheduler stepped once per iteration, for an optimizer whose groups hold the
    scaled rate lr_hat as their `lr` (set it before calling). `base_lr` is where warmup
    starts; `milestones` are absolute iterations (step decay only)."""
    if warmup not in WARMUPS:
        raise ValueError(f"unknown warmup {warmup!r}; pick one of {WARMUPS}")
    if decay not in DECAYS:
        raise ValueError(f"unknown decay {decay!r}; pick one of {DECAYS}")
    if not 0 <= warmup_iters <= total_iters:
        raise ValueError(
            f"warmup_iters ({warmup_iters}) must lie in [0, total_iters={total_iters}]"
        )
    if warmup == "none":
        warmup_iters = 0
    if warmup_iters and any(m < warmup_iters for m in milestones):
        raise ValueError(
            f"milestones {list(milestones)} fall inside the warmup (first {warmup_iters} "
            "iterations); decay after it"
        )
    scaled = [group["lr"] for group in optimizer.param_groups]
    if len(set(scaled)) != 1:
        raise ValueError(f"every parameter group must hold the same scaled lr, got {scaled}")
    factor = base_lr / scaled[0]  # LinearLR and ConstantLR scale the group's lr
    if warmup_iters and not 0 < factor <= 1:
        raise ValueError(
            f"warmup starts at base_lr={base_lr} and rises to the scaled lr {scaled[0]}; "
            "base_lr must be positive and no larger"
        )

    if decay == "step":
        # Absolute milestones: after the hand-over the decay scheduler counts from 0.
        after = MultiStepLR(optimizer, [m - warmup_iters for m in milestones], gamma=gamma)
    else:
        after = CosineAnnealingLR(optimizer, T_max=max(total_iters - warmup_iters, 1))
    if warmup_iters == 0:
        return after
    if warmup == "gradual":  # a constant increment (lr_hat - base_lr) / T per iteration
        before = LinearLR(optimizer, start_factor=factor, end_factor=1.0, total_iters=warmup_iters)
    else:
        before = ConstantLR(optimizer, factor=factor, total_iters=warmup_iters)
    return SequentialLR(optimizer, [before, after], milestones=[warmup_iters])
