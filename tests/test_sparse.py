"""Sparse gradients (nn.Embedding(sparse=True)) are all-reduced as sparse tensors, each
in a bucket of its own, as torch's DDP does, with every stage's options; compared with
torch's DDP (runs compared as tests.against_torch describes)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp.train import keyword_options
from stages import STAGES
from tests.adapters import TORCH_DDP, build_wrapper, stages_from
from tests.against_torch import assert_same, params_of, run_both
from tests.nets import Bag

STEPS, ACCUMULATION = 3, 2


def grads_of_dense(model: torch.nn.Module) -> dict:
    return {
        n: None if p.grad is None else p.grad.to_dense().clone()
        for n, p in model.named_parameters()
    }


# No annotations on `bucket` and the result: torch's DDP compares them with dist.GradBucket
# and Future[Tensor], which this module's postponed annotations (strings) never equal.
def blocking_allreduce(group: dist.ProcessGroup, bucket):
    """torch's default all-reduce (each rank's gradient divided by the number of ranks,
    then summed, as its reducer and its allreduce_hook do), but done before it returns.

    The reference's hook. torch's DDP launches its all-reduces asynchronously, and on
    Gloo a collective launched while a sparse all-reduce still runs on the same group
    corrupts the heap now and then (torch 2.13.0+cpu, 2 ranks, a sparse and then a dense
    all_reduce(async_op=True): a crash within 60,000 pairs in each of five tries). torch's
    DDP on this model lost a rank after 2,640 and 3,416 runs of this test's
    training ("malloc(): unaligned tcache chunk detected"), which the pool reported as a
    hang. With this hook no collective starts while another runs; the reducer, its
    buckets, its unused parameters and bucket views stay torch's."""
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(tensor, group=group)
    done = torch.futures.Future()
    done.set_result(tensor)
    return done


def train_sparse(rank: int, group: dist.ProcessGroup, wrapper: str, options: dict) -> list:
    """[(gradients, parameters)] per step; tokens differ per rank and step."""
    torch.manual_seed(1000 * rank + 1)
    model = Bag()
    if wrapper == TORCH_DDP:  # torch's own hook, with torch's DDP; else the blocking one
        hook = options.get("comm_hook")
        options = {**options, "comm_hook": "torch_" + hook if hook else blocking_allreduce}
    ddp = build_wrapper(wrapper, model, group, bucket_cap_mb=1e-9, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    record = []
    for _ in range(STEPS):
        for j in range(ACCUMULATION):
            local = j < ACCUMULATION - 1 and hasattr(ddp, "no_sync")
            tokens = torch.randint(0, 10, (3, 5), generator=data)
            with ddp.no_sync() if local else nullcontext():
                F.mse_loss(ddp(tokens), torch.ones(3, 2)).backward()
            if not local and hasattr(ddp, "finish_gradient_synchronization"):
                ddp.finish_gradient_synchronization()
        record.append((grads_of_dense(model), params_of(model)))
        optimizer.step()
        optimizer.zero_grad()
    return record


OPTIONS = {  # each drawn where the stage takes it
    "find_unused_parameters": {"find_unused_parameters": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
}
CASES = (
    [(stage, "defaults", {}) for stage in STAGES]
    + [
        (stage, name, options)
        for stage in STAGES
        for name, options in OPTIONS.items()
        if name in keyword_options(STAGES[stage])
    ]
    + [(stage, "comm hook", {"comm_hook": "allreduce"}) for stage in stages_from("comm_hooks")]
)


@pytest.mark.parametrize(
    ("stage", "options"), [(s, o) for s, _, o in CASES], ids=[f"{s}-{n}" for s, n, _ in CASES]
)
def test_sparse_gradients_as_torch(pool, stage: str, options: dict) -> None:
    for rank, (ours, torchs) in enumerate(run_both(pool, 2, train_sparse, stage, options)):
        for step, ((grads, params), (grads_t, params_t)) in enumerate(
            zip(ours, torchs, strict=True)
        ):
            assert_same(grads, grads_t, f"rank {rank} step {step} gradients")
            assert_same(params, params_t, f"rank {rank} step {step} parameters")
