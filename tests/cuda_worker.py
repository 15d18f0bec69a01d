"""What tests/test_cuda.py runs under torchrun on GPUs (it runs on CPU Gloo too): the
drop-in with bucket_cap_mb="auto" under `join()`, until the automatic layout is decided;
rank r trains 2r more batches than rank 0, so the ranks that finish first shadow the
others.

    torchrun --nproc-per-node <GPUs> -m tests.cuda_worker
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp.config import Config
from ddp.data import rank_batch
from ddp.dist import replicas_identical, setup_process_group, teardown_process_group
from ddp.models import rank_model
from stages.drop_in import DistributedDataParallel

STEPS = 80  # past the choice (second backward) and its 5 rounds of trial steps


def main() -> None:
    device = setup_process_group("auto")  # NCCL where each rank has a GPU, else Gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = Config(model="mlp", width=256, depth=4)
    model = DistributedDataParallel(rank_model(cfg, rank).to(device), bucket_cap_mb="auto")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with model.join():
        for step in range(STEPS + 2 * rank):
            inputs, labels = rank_batch(model.module, cfg.global_batch(world), step, rank, world)
            F.cross_entropy(model(inputs.to(device)), labels.to(device)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    choice = model.auto_bucket_choice
    assert not model.auto_bucket_pending, "the automatic layout was not decided"
    assert all(t["measured_step_s"] > 0 for t in choice["trials"]), choice["trials"]
    identical = replicas_identical(model.module)
    if rank == 0:
        print(f"layout {choice['layout']} cap {choice['bucket_cap_mb']:g}; identical {identical}")
    teardown_process_group()


if __name__ == "__main__":
    main()
