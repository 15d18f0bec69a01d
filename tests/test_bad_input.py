"""Bad input raises a clear error naming the problem, on every rank, within seconds:
never a hang, never silent divergence."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp.data import split_batch
from stages import STAGES
from tests.adapters import build_wrapper, stages_from
from tests.nets import Net, NetSpec, build_net
from tests.pool import RankError

SECONDS = 120  # a hang fails the test after this long instead of blocking CI


def errors_on_every_rank(runs: list, world_size: int) -> list[RankError]:
    assert len(runs) == world_size
    not_raised = [r for r, run in enumerate(runs) if not isinstance(run, RankError)]
    assert not not_raised, f"ranks {not_raised} did not raise"
    return runs


def wrap_differing_models(rank: int, group: dist.ProcessGroup, stage: str, how: str) -> None:
    spec = NetSpec(d_in=3, width=4, d_out=2, order=(0,), dtypes=("float32",), frozen=(False,))
    if rank == 1 and how == "shape":
        spec = NetSpec(d_in=3, width=5, d_out=2, order=(0,), dtypes=("float32",), frozen=(False,))
    if rank == 1 and how == "dtype":
        spec = NetSpec(d_in=3, width=4, d_out=2, order=(0,), dtypes=("float64",), frozen=(False,))
    if rank == 1 and how == "count":
        spec = NetSpec(d_in=3, width=4, d_out=2, order=(), dtypes=(), frozen=())
    build_wrapper(stage, build_net(spec, seed=rank), group)


@pytest.mark.parametrize("how", ["shape", "dtype", "count"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_models_that_differ_across_ranks(pool, stage: str, how: str) -> None:
    runs = pool.run(2, wrap_differing_models, stage, how, timeout_s=SECONDS)
    for error in errors_on_every_rank(runs, 2):
        assert error.type_name == "ValueError"
        assert "models differ across ranks" in error.message
        first_difference = {
            "shape": "'inp.weight' [5, 3]",
            "dtype": "'hidden.0.weight' [4, 4] torch.float64",
            "count": "parameter 2 is 'hidden.0.weight' [4, 4] torch.float32 on rank 0 "
            "but 'out.weight'",
        }[how]
        assert first_difference in error.message and "rank 1" in error.message


def step_with_unused_parameter(rank: int, group: dist.ProcessGroup, stage: str) -> None:
    spec = NetSpec(d_in=3, width=4, d_out=2, order=(), unused=True)
    wrapped = build_wrapper(stage, build_net(spec, seed=rank), group)
    loss = F.mse_loss(wrapped(torch.randn(4, 3)), torch.randn(4, 2))
    loss.backward()
    wrapped.finish_gradient_synchronization()


@pytest.mark.parametrize("stage", list(STAGES))
def test_parameter_without_gradient(pool, stage: str) -> None:
    runs = pool.run(2, step_with_unused_parameter, stage, timeout_s=SECONDS)
    for error in errors_on_every_rank(runs, 2):
        assert error.type_name == "RuntimeError"
        assert "'unused.weight'" in error.message and "'unused.bias'" in error.message
        assert "got no gradient" in error.message


def calls_out_of_order(rank: int, group: dist.ProcessGroup, stage: str, mistake: str) -> None:
    spec = NetSpec(d_in=3, width=4, d_out=2, order=())
    wrapped = build_wrapper(stage, build_net(spec, seed=rank), group)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    if mistake == "finish before backward":
        wrapped(x)
        wrapped.finish_gradient_synchronization()
    elif mistake == "two forwards, one backward":
        F.mse_loss(wrapped(x), y)
        F.mse_loss(wrapped(x), y).backward()
    elif mistake == "finish twice":
        F.mse_loss(wrapped(x), y).backward()
        wrapped.finish_gradient_synchronization()
        wrapped.finish_gradient_synchronization()


WRONG_ORDER = [
    (stage, mistake)
    for stage in STAGES
    for mistake in ["finish before backward", "two forwards, one backward", "finish twice"]
    # Stages that finish inside backward make a second finish a cheap no-op, by contract.
    if not (mistake == "finish twice" and stage in stages_from("overlapped"))
    # The drop-in forgets a forward whose output never reached backward, as torch's DDP
    # does (tests/test_drop_in.py compares it with torch's).
    and not (mistake == "two forwards, one backward" and stage == "drop_in")
]


@pytest.mark.parametrize(("stage", "mistake"), WRONG_ORDER)
def test_calls_in_the_wrong_order(pool, stage: str, mistake: str) -> None:
    mistake_in_message = {
        "finish before backward": "before loss.backward()",
        "two forwards, one backward": "forward called again before",
        "finish twice": "twice",
    }[mistake]
    runs = pool.run(2, calls_out_of_order, stage, mistake, timeout_s=SECONDS)
    for error in errors_on_every_rank(runs, 2):
        assert error.type_name == "RuntimeError", error.traceback
        assert mistake_in_message in error.message


@pytest.mark.parametrize("cap", [0.0, -1.0, math.nan])
@pytest.mark.parametrize("stage", stages_from("bucketed"))
def test_bucket_cap_must_be_positive(stage: str, cap: float) -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        STAGES[stage](nn.Linear(2, 2), bucket_cap_mb=cap)


def test_naive_has_no_buckets() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_cap_mb'"):
        STAGES["naive"](nn.Linear(2, 2), bucket_cap_mb=25.0)


@pytest.mark.parametrize("stage", list(STAGES))
def test_no_process_group(stage: str) -> None:
    assert not dist.is_initialized()  # the pytest process itself never joins a group
    with pytest.raises(RuntimeError, match="no process group is initialised"):
        STAGES[stage](Net(NetSpec(d_in=2, width=2, d_out=2, order=())))


@pytest.mark.parametrize(("global_batch", "world"), [(30, 4), (5, 2), (1, 3)])
def test_global_batch_that_does_not_split(global_batch: int, world: int) -> None:
    with pytest.raises(
        ValueError, match=f"global batch {global_batch} does not split over {world} ranks"
    ):
        split_batch(global_batch, rank=0, world_size=world)
