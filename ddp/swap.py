"""Put another class where code looks up torch's `DistributedDataParallel`.

A framework (HF accelerate, PyTorch Lightning) or a script builds torch's DDP itself,
from a name it imported: `from torch.nn.parallel import DistributedDataParallel`, or
`torch.nn.parallel.DistributedDataParallel` at call time. `swap_ddp_class(cls)` rebinds
both kinds: torch's own module attributes, and every module-level name already bound to
torch's class in a module imported before the call. Code imported after the call finds
`cls` in torch's modules. `isinstance(model, DistributedDataParallel)` in that code then
tests against `cls`, as the framework means it to.

A name bound inside a function, or kept in a container, is not found; nor is a
subclass of torch's class, which stays one.
"""

from __future__ import annotations

import sys

import torch.nn.parallel
import torch.nn.parallel.distributed

# torch's own class, kept before any swap (swapping again, or back, rebinds from here).
TORCH_DDP: type = torch.nn.parallel.distributed.DistributedDataParallel
_current: type = TORCH_DDP


def swap_ddp_class(replacement: type) -> int:
    """Rebind every module-level name bound to torch's class (or to an earlier
    replacement) to `replacement`; `swap_ddp_class(TORCH_DDP)` undoes it. Returns how
    many names it rebound."""
    global _current
    old, _current = _current, replacement
    rebound = 0
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict) or module is sys.modules[__name__]:  # TORCH_DDP stays
            continue
        for name, value in list(names.items()):
            if value is old and old is not replacement:
                names[name] = replacement
                rebound += 1
    # torch's two public spellings, even if nothing had imported them yet
    for module in (torch.nn.parallel, torch.nn.parallel.distributed):
        module.DistributedDataParallel = replacement
    return rebound


def swapped_class() -> type:
    """The class torch's names point to now: torch's own unless swapped."""
    return _current
