"""What every flow script in tests/clients shares: the DDP class check and the params digest.

The harness (`python -m tests.clients.run`) sets CLIENTS_EXPECT_DROP_IN=1 for the runs
under `-m stages.swap`, and CLIENTS_PARAMS_OUT to a file where rank 0 saves the final
parameters, so that torch's run and the drop-in's can be compared with a tolerance.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

DROP_IN_MODULE = "stages.drop_in"
TORCH_MODULE = "torch.nn.parallel.distributed"


def expect_drop_in() -> bool:
    """True in the harness's drop-in runs (CLIENTS_EXPECT_DROP_IN=1)."""
    return os.environ.get("CLIENTS_EXPECT_DROP_IN") == "1"


def check_ddp(model: nn.Module) -> None:
    """Fail unless `model` is the drop-in in a drop-in run, and torch's DDP otherwise."""
    wanted = DROP_IN_MODULE if expect_drop_in() else TORCH_MODULE
    got = type(model).__module__
    assert got == wanted, f"the wrapped model is a {got}.{type(model).__name__}, not {wanted}'s"


def report_params(params: Iterable[torch.Tensor]) -> None:
    """On rank 0: print `params sha256: <hex>` and the params' sum, and save them to
    CLIENTS_PARAMS_OUT when it is set."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    flat = torch.cat([p.detach().double().flatten().cpu() for p in params])
    print(f"params sha256: {hashlib.sha256(flat.numpy().tobytes()).hexdigest()}", flush=True)
    print(f"params sum: {flat.sum().item():.12g}", flush=True)
    if out := os.environ.get("CLIENTS_PARAMS_OUT"):
        torch.save(flat, out)
