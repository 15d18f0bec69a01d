"""Put another class where code looks up torch's `DistributedDataParallel`.

A framework (HF accelerate, PyTorch Lightning) or a script builds torch's DDP itself,
from a name it imported: `from torch.nn.parallel import DistributedDataParallel`, or
`torch.nn.parallel.DistributedDataParallel` at call time. `swap_ddp_class(cls)` rebinds
both kinds: torch's own module attributes, and every module-level name already bound to
torch's class in a module imported before the call. Code imported after the call finds
`cls` in torch's modules. `isinstance(model, DistributedDataParallel)` in that code then
tests against `cls`, as the framework means it to. `restore_ddp_class()` rebinds those
names, and only those, to torch's class again.

A name bound inside a function, or kept in a container, is not found. torch's class
itself, built after the swap through `TORCH_DDP`, reads the rebound name in two places:
its `join()` then refuses it (torch checks the class by that name), and it notes its
active module for torch.compile on `cls` (which `cls` should read too).
"""

from __future__ import annotations

import sys

import torch.nn.parallel
import torch.nn.parallel.distributed

# torch's own class, kept before any swap (this module's names are never rebound).
TORCH_DDP: type = torch.nn.parallel.distributed.DistributedDataParallel
_rebound: list[tuple[dict, str, type]] = []  # (a module's names, the name, what it got)


def swap_ddp_class(replacement: type) -> int:
    """Rebind every module-level name bound to torch's class to `replacement`; returns
    how many names it rebound. A second swap first restores the first."""
    restore_ddp_class()
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict) or module is sys.modules[__name__]:
            continue
        for name, value in list(names.items()):
            if value is TORCH_DDP:
                names[name] = replacement
                _rebound.append((names, name, replacement))
    # torch's two public spellings, even if nothing had imported them yet
    for module in (torch.nn.parallel, torch.nn.parallel.distributed):
        if module.DistributedDataParallel is not replacement:
            module.DistributedDataParallel = replacement
            _rebound.append((module.__dict__, "DistributedDataParallel", replacement))
    return len(_rebound)


def restore_ddp_class() -> None:
    """torch's class back in the names a swap rebound (unless rebound since)."""
    while _rebound:
        names, name, replacement = _rebound.pop()
        if names.get(name) is replacement:
            names[name] = TORCH_DDP
