"""Bucket layouts for the model, cut by the stages' own rule (`ddp.buckets.plan_buckets`)
or torch's, on stand-in parameters: meta tensors of each gradient's size, which hold no
memory."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import plan_buckets
from profiling.simulate.schedule import Workload


def stand_ins(workload: Workload) -> list[tuple[str, nn.Parameter]]:
    """One meta parameter of the gradient's bytes per gradient, in parameter order:
    float32 (the stages' models train in it), or 16-bit where a gradient's bytes are
    not a whole number of float32 elements (bf16 or fp16 gradients). One dtype for all,
    as a bucket holds one."""
    dtype = next(
        (d for d in (torch.float32, torch.float16)
         if all(g.nbytes % d.itemsize == 0 for g in workload.grads)),
        None,
    )  # fmt: skip
    if dtype is None:
        odd = [g.name for g in workload.grads if g.nbytes % 2][:3]
        raise ValueError(f"gradients {odd} are not a whole number of 16-bit elements")
    return [
        (g.name, nn.Parameter(torch.empty(g.nbytes // dtype.itemsize, dtype=dtype, device="meta")))
        for g in workload.grads
    ]


def uniform_buckets(
    workload: Workload,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float | None = None,
    ready_order: bool = False,
) -> list[list[int]]:
    """The layout a stage makes at this cap, as lists of gradient indices in bucket
    order: reverse parameter order at construction, ready order once rebuilt
    (`rebuilt_buckets` and later)."""
    named = stand_ins(workload)
    index = {id(p): i for i, (_, p) in enumerate(named)}
    if ready_order:
        named.sort(key=lambda item: workload.grads[index[id(item[1])]].ready_s)
    plan = plan_buckets(
        named, bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb, ready_order=ready_order
    )
    return [[index[id(p)] for _, p in members] for members in plan]


# --8<-- [start:torch]
def torch_buckets(
    workload: Workload, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
) -> list[list[int]]:
    """The layout torch's DDP rebuilds after its first step (defaults: its
    `bucket_cap_mb=None`), as lists of gradient indices in bucket order: the gradients in
    ready order, cut by torch's own `_compute_bucket_assignment_by_size`. torch adds a
    gradient and then closes the bucket once it reaches its cap, so a bucket can pass
    the cap by one gradient; `plan_buckets` closes it before a gradient would."""
    named = stand_ins(workload)
    order = sorted(range(len(named)), key=lambda i: workload.grads[i].ready_s)
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [named[i][1] for i in order],
        [int(first_bucket_cap_mb * 2**20), int(bucket_cap_mb * 2**20)],
        [False] * len(order),
        order,  # each tensor's label: its gradient's index
    )
    return [list(b) for b in buckets]


# --8<-- [end:torch]


def per_parameter(workload: Workload) -> list[list[int]]:
    """Naive: one all-reduce per gradient, in parameter order."""
    return [[i] for i in range(len(workload.grads))]
