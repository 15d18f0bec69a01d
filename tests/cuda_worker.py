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

import stages.auto_bucket
from ddp.config import Config
from ddp.data import rank_batch
from ddp.dist import replicas_identical, setup_process_group, teardown_process_group
from ddp.models import rank_model
from stages.auto_bucket import TRIAL_ROUNDS
from stages.drop_in import DistributedDataParallel

# Past the choice (second backward) and its trial: TRIAL_ROUNDS rounds of two steps for
# each of at most five layouts (no seconds of trial wanted: this checks the collectives).
STEPS = 2 + 2 * TRIAL_ROUNDS * 5 + 1


def main() -> None:
    stages.auto_bucket.TRIAL_SECONDS = 0.0  # the fewest rounds, however short the steps
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
    timed = [t["measured_step_s"] for t in choice["trials"]]
    assert choice["trial_rounds"] == 0 or all(s > 0 for s in timed), choice["trials"]
    identical = replicas_identical(model.module)
    if rank == 0:
        print(f"layout {choice['layout']} cap {choice['bucket_cap_mb']:g}; identical {identical}")
    teardown_process_group()


if __name__ == "__main__":
    main()
