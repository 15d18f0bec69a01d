"""A plain torch DDP script, unchanged by the swap: a small MLP, a few steps with `no_sync`
gradient accumulation, on CPU Gloo.

    torchrun --standalone --nproc-per-node 2 tests/clients/plain_flow.py
    torchrun --standalone --nproc-per-node 2 -m stages.swap tests/clients/plain_flow.py
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

# Imported before the group exists: the optimizer's first step would import torch._dynamo
# lazily, which then holds the Gloo group past destroy_process_group, and its threads can
# abort the exit ("terminate called without an active exception"; see ddp/dist.py).
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.clients.common import check_ddp, report_params

STEPS = 4
ACCUMULATION = 2  # micro-batches per step; all but the last under no_sync


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    check_ddp(model)
    if rank == 0:
        print(f"DDP class module: {type(model).__module__}", flush=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        for micro in range(ACCUMULATION):
            x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
            last = micro == ACCUMULATION - 1
            with nullcontext() if last else model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    report_params(model.module.parameters())
    # The wrapper goes before the group: torch's Reducer, freed with the last reference to
    # the Gloo group, joins Gloo's thread while holding the GIL that the thread waits for (a
    # hang at exit, about one run in 20 on 2 cores).
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
