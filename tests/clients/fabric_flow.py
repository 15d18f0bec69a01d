"""Lightning Fabric's DDP strategy on CPU: a small MLP and SGD, a few steps with gradient
accumulation under `fabric.no_backward_sync`.

    torchrun --standalone --nproc-per-node 2 tests/clients/fabric_flow.py
    torchrun --standalone --nproc-per-node 2 -m stages.swap tests/clients/fabric_flow.py
"""

from __future__ import annotations

import gc

import lightning
import torch

# Imported before the group exists (torch's optimizer step imports it lazily otherwise, and
# it then holds the Gloo group past destroy_process_group: see plain_flow.py).
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn

from tests.clients.common import check_ddp, report_params

STEPS = 4
ACCUMULATION = 2  # micro-batches per step; all but the last skip the gradient sync


def main() -> None:
    lightning.seed_everything(0)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    check_ddp(model._forward_module)
    data = torch.Generator().manual_seed(1 + fabric.global_rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        for micro in range(ACCUMULATION):
            x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATION - 1):
                fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    report_params(model.parameters())
    # Fabric leaves the group to the interpreter's exit, where Gloo's threads, still
    # running, abort about one run in four ("terminate called without an active
    # exception"), with torch's DDP as with the drop-in: end it here, wrapper first.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
