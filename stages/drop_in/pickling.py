"""What pickle, copy.deepcopy and torch.save keep of the drop-in, by torch's DDP's rules:
everything but the process group and what lives in it, over the default group only."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from stages.overlapped import Backward

# Made again on unpickling: groups (not picklable), hooks (a tensor's are not pickled),
# and the backward's state with its work in flight (kept as a new wrapper's).
TRANSIENT = ("process_group", "round_robin_groups", "_bucket_groups", "_hook_handles")


def pickled_state(ddp: nn.Module) -> dict:
    """`ddp.__dict__` less what lives in the process group; a comm hook is dropped, as
    torch's DDP drops it. Refused, in torch's words, over any group but the default one."""
    if ddp.process_group is not default_group():
        raise RuntimeError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default "
            "process group. That is, when you have called init_process_group and have "
            "not passed process_group argument to DDP constructor"
        )
    if len(ddp.round_robin_groups) > 1:
        raise NotImplementedError(
            "pickling with round_robin_groups > 1: unpickling would have to make "
            "process groups, which every rank must do together"
        )
    state = {k: v for k, v in vars(ddp).items() if k not in TRANSIENT}
    state["_backward"] = Backward.none_yet()
    for hook in ("_comm_hook", "_comm_state"):
        state.pop(hook, None)
    return state


def default_group() -> dist.ProcessGroup:
    """The group unpickling takes: the default one, as torch's DDP does."""
    return dist.group.WORLD
