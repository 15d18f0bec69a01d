"""Training through our own all-reduce: the drop-in stage with `point_to_point_hook`
(ddp.collectives on every bucket) against torch's DistributedDataParallel with its
default Gloo all-reduce, from the same seeds and batches (runs compared as
tests.against_torch describes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp.comm_hook_functions import PointToPointState, point_to_point_hook
from tests.adapters import TORCH_DDP, build_wrapper
from tests.against_torch import TIGHT, assert_same_steps, run_checked, sgd_steps
from tests.nets import WIDTH, Layers

LAYER_CAP_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20  # one layer's float32 gradients a bucket
STEPS = 4


def train(
    rank: int, group: dist.ProcessGroup, wrapper: str, algorithm: str | None, per_node: int = 1
) -> tuple[list, list[int], int]:
    """([(gradients, parameters after the step)] per step, elements our hook averaged
    per step, bytes it sent to other nodes); with our hook when `algorithm` is given."""
    torch.manual_seed(1000 * rank + 1)  # ranks start apart: the wrapper must broadcast
    model = Layers()
    hook, averaged = {}, []

    def counted(state, bucket):
        averaged[-1] += bucket.buffer().numel()
        return point_to_point_hook(state, bucket)

    state = PointToPointState(group, algorithm or "ring", per_node)
    if algorithm is not None:
        hook = {"comm_hook": counted, "hook_state": state}
    wrapped = build_wrapper(wrapper, model, group, bucket_cap_mb=LAYER_CAP_MB, **hook)
    record = sgd_steps(wrapped, model, rank, STEPS, (4, WIDTH), lambda: averaged.append(0))
    return record, averaged, state.bytes_sent_between_nodes


def ours_and_torchs(rank: int, group: dist.ProcessGroup, algorithm: str, per_node: int) -> tuple:
    return train(rank, group, "drop_in", algorithm, per_node), train(rank, group, TORCH_DDP, None)


# (algorithm, world size, ranks per node)
CASES = [("ring", 2, 1), ("ring", 3, 1), ("ring", 4, 1)]
CASES += [(algorithm, 3, 1) for algorithm in ("naive", "halving_doubling", "tree")]
CASES += [(a, 4, 2) for a in ("hierarchical_ring", "hierarchical_halving_doubling")]


@pytest.mark.parametrize(
    "algorithm, world_size, per_node", CASES, ids=[f"{a}-W{w}-g{g}" for a, w, g in CASES]
)
def test_drop_in_trains_with_our_all_reduce_as_torch_ddp(
    pool, algorithm: str, world_size: int, per_node: int
) -> None:
    runs = run_checked(pool, world_size, ours_and_torchs, algorithm, per_node)
    gradients = sum(p.numel() for p in Layers().parameters())
    for rank, ((ours, averaged, between), (torchs, _, _)) in enumerate(runs):
        # Our hook, not torch's all-reduce, averaged every gradient of every step.
        assert averaged == [gradients] * STEPS, f"rank {rank}: our hook averaged {averaged}"
        # Three phases: only a node's first rank sends to other nodes; else every rank does.
        leader = rank % per_node == 0
        assert (between > 0) == leader, f"rank {rank} sent {between} B to other nodes"
        # Float sums in another order than Gloo's: within rounding, not bit for bit.
        assert_same_steps(ours, torchs, f"rank {rank}, our {algorithm} vs torch DDP", TIGHT)
    # Replicas stay bit-identical: every rank's parameters after every step are rank 0's.
    for rank, ((ours, _, _), _) in enumerate(runs[1:], start=1):
        first = runs[0][0][0]
        for step, ((_, params), (_, params0)) in enumerate(zip(ours, first, strict=True)):
            for name, value in params.items():
                assert torch.equal(value, params0[name]), (
                    f"our {algorithm}, step {step}: rank {rank}'s {name} differs from rank 0's"
                )


def test_hook_rejects_an_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="algorithm 'butterfly' is not one of naive, ring"):
        PointToPointState(None, "butterfly")
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1, got 0"):
        PointToPointState(None, "hierarchical_ring", ranks_per_node=0)
