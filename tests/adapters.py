"""The one place tests build a data-parallel wrapper: one of the stages, by name, or
torch's own DistributedDataParallel ("torch_ddp"), with the options given and, if asked,
a communication hook registered."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from ddp import comm_hook_functions
from ddp.train import keyword_options
from stages import STAGES

TORCH_DDP = "torch_ddp"
WRAPPERS = [*STAGES, TORCH_DDP]  # torch's own DDP is the reference row


def stages_from(first: str) -> list[str]:
    """Every stage that has `first`'s idea: it and all the stages after it."""
    order = list(STAGES)
    return order[order.index(first) :]


# name -> (ours, torch's). Workers look hooks up by name: torch's wrappers are closures,
# which pickle cannot send.
COMM_HOOKS = {
    "allreduce": (comm_hook_functions.allreduce_hook, default_hooks.allreduce_hook),
    "fp16": (comm_hook_functions.fp16_compress_hook, default_hooks.fp16_compress_hook),
    "bf16": (comm_hook_functions.bf16_compress_hook, default_hooks.bf16_compress_hook),
    "powerSGD": (comm_hook_functions.powerSGD_hook, torch_powersgd.powerSGD_hook),
}


def comm_hook_by_name(name: str) -> Callable:
    """Our hook "allreduce", ...; torch's own with the prefix "torch_": "torch_allreduce"."""
    if name.startswith("torch_"):
        return COMM_HOOKS[name.removeprefix("torch_")][1]
    return COMM_HOOKS[name][0]


_GROUP = object()  # hook_state's default: the wrapper's process group


def build_wrapper(
    name: str,
    model: nn.Module,
    group: dist.ProcessGroup | None,
    *,
    bucket_cap_mb: float | str | None = None,
    first_bucket_as_torch: bool = False,
    comm_hook: str | Callable | None = None,
    hook_state: object = _GROUP,
    **options,
) -> nn.Module:
    """`model` wrapped by stage `name` or by torch's DDP, over `group`.

    bucket_cap_mb: None leaves each wrapper its own default (25 MiB, and a 1 MiB first
    bucket for the stages from rebuilt_buckets on and for torch's DDP).
    first_bucket_as_torch: an explicit bucket_cap_mb caps the first bucket too, which is
    what torch's DDP makes of it (drop_in does this itself; the stages before it keep
    their 1 MiB first bucket unless told first_bucket_cap_mb=None).
    comm_hook: a hook, or its name for comm_hook_by_name, registered with `hook_state`
    (by default the process group, as the allreduce and 16-bit hooks expect).
    options: the wrapper's other keyword arguments, passed as they are."""
    if name == TORCH_DDP:
        wrapped = nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=bucket_cap_mb, **options
        )
    else:
        # The first stage has no buckets: a cap is for the stages that do.
        if bucket_cap_mb is not None and "bucket_cap_mb" in keyword_options(STAGES[name]):
            options["bucket_cap_mb"] = bucket_cap_mb
            if first_bucket_as_torch and name != "drop_in":
                options["first_bucket_cap_mb"] = None
        wrapped = STAGES[name](model, process_group=group, **options)
    if comm_hook is not None:
        hook = comm_hook_by_name(comm_hook) if isinstance(comm_hook, str) else comm_hook
        wrapped.register_comm_hook(group if hook_state is _GROUP else hook_state, hook)
    return wrapped
