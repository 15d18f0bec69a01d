"""The drop-in (stages.drop_in.DistributedDataParallel): a training script written for
torch's DDP runs unchanged with either class, to the bit (runs compared as tests.compare
describes), and what the drop-in does not implement raises as torch's does."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.compare import (
    EXACT,
    assert_same,
    assert_same_steps,
    buffers_of,
    grads_of,
    params_of,
    run_checked,
)
from tests.models import UserNet


@dataclass(frozen=True)
class Script:
    broadcast_buffers: bool = True
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    fp16_hook: bool = False
    accumulation: int = 2


SCRIPTS = {
    "defaults": Script(),
    "unused-views-no-broadcast": Script(
        broadcast_buffers=False,
        bucket_cap_mb=1e-9,
        find_unused_parameters=True,
        gradient_as_bucket_view=True,
    ),
    # No no_sync with static_graph: torch's reducer fails an internal assert
    # (expect_autograd_hooks_, torch 2.13) when the first iteration runs under no_sync.
    "static-graph-unused-fp16": Script(
        static_graph=True, find_unused_parameters=True, fp16_hook=True, accumulation=1
    ),
    "static-graph-small-buckets": Script(static_graph=True, bucket_cap_mb=1e-4, accumulation=1),
}


def user_script(rank: int, group: dist.ProcessGroup, which: str, script: Script) -> tuple:
    """A torch DDP training loop as a user writes it; `which` picks the class. It
    constructs the class itself, not through tests.adapters: that a call written for
    torch's DDP runs unchanged is what the test proves."""
    if which == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        from stages.drop_in import DistributedDataParallel as DDP

    torch.manual_seed(1000 * rank + 1)
    model = UserNet(unused=script.find_unused_parameters)
    ddp = DDP(
        model,
        device_ids=None,
        broadcast_buffers=script.broadcast_buffers,
        process_group=group,
        bucket_cap_mb=script.bucket_cap_mb,
        find_unused_parameters=script.find_unused_parameters,
        gradient_as_bucket_view=script.gradient_as_bucket_view,
        static_graph=script.static_graph,
    )
    if script.fp16_hook:
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    record = []
    for _ in range(3):
        for j in range(script.accumulation):
            x = torch.randn(4, 3, generator=data) * (rank + 1)
            y = torch.randn(4, 2, generator=data)
            if j < script.accumulation - 1:
                with ddp.no_sync():
                    (F.mse_loss(ddp(x), y) / script.accumulation).backward()
            else:
                (F.mse_loss(ddp(x), y) / script.accumulation).backward()
        grads = grads_of(ddp.module)
        optimizer.step()
        optimizer.zero_grad()
        record.append((grads, params_of(ddp.module), buffers_of(ddp.module)))
    keys = list(ddp.state_dict().keys())
    saved = io.BytesIO()
    torch.save(ddp.module.state_dict(), saved)
    saved.seek(0)
    fresh = UserNet(unused=script.find_unused_parameters)
    fresh.load_state_dict(torch.load(saved, weights_only=True))
    return record, keys, fresh.state_dict(), ddp.module.state_dict()


def user_script_both(rank: int, group: dist.ProcessGroup, script: Script):
    return user_script(rank, group, "ours", script), user_script(rank, group, "torch", script)


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_torch_ddp_script_runs_unchanged(pool, script: Script) -> None:
    for rank, (ours, torchs) in enumerate(run_checked(pool, 2, user_script_both, script)):
        record, keys, reloaded, state = ours
        t_record, t_keys, _, _ = torchs
        assert_same_steps(record, t_record, f"rank {rank}", EXACT)
        assert keys == t_keys, f"rank {rank}: state_dict keys {keys} vs torch's {t_keys}"
        assert all(k.startswith("module.") for k in keys), keys
        assert_same(dict(reloaded), dict(state), f"rank {rank}, reloaded state_dict", EXACT)


def unsupported_arguments(rank: int, group: dist.ProcessGroup) -> dict[str, str]:
    from stages.drop_in import DistributedDataParallel as Ours

    raised = {}
    for name, cls, options in (
        ("mixed_precision", Ours, {"mixed_precision": object()}),
        ("device_ids", Ours, {"device_ids": [0]}),
        ("torch_device_ids", nn.parallel.DistributedDataParallel, {"device_ids": [0]}),
    ):
        try:
            cls(nn.Linear(2, 2), process_group=group, **options)
            raised[name] = ""
        except Exception as e:  # noqa: BLE001 - the type is what the test checks
            raised[name] = f"{type(e).__name__}: {e}"
    return raised


def test_drop_in_rejects_what_it_does_not_implement(pool) -> None:
    raised, _ = run_checked(pool, 2, unsupported_arguments)
    assert raised["mixed_precision"].startswith("NotImplementedError"), raised
    assert "mixed_precision" in raised["mixed_precision"], raised
    # A CPU module with a device id: torch's DDP refuses it with a ValueError, and so
    # must the drop-in.
    assert raised["torch_device_ids"].startswith("ValueError"), raised
    assert raised["device_ids"].startswith("ValueError"), raised
