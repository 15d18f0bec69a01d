"""The drop-in (stages.drop_in.DistributedDataParallel): a training script written for
torch's DDP runs unchanged with either class, to the bit (runs compared as tests.against_torch
describes), and what the drop-in does not implement raises as torch's does."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from stages.drop_in import DistributedDataParallel as DropIn
from stages.drop_in.logging_data import RuntimeStats
from tests.against_torch import (
    EXACT,
    TIGHT,
    assert_same,
    assert_same_steps,
    buffers_of,
    grads_of,
    params_of,
    run_checked,
)
from tests.nets import UserNet
from tests.pool import MAX_WORLD
from tests.suite import check_case, worked


@dataclass(frozen=True)
class Script:
    broadcast_buffers: bool = True
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    fp16_hook: bool = False
    accumulation: int = 2
    unused_layer: bool = False  # a layer forward never calls (always, with the flag)


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
    # static_graph finds the unused layer in its first step, without the flag: from the
    # second on, its gradients are not missing.
    "static-graph-unused-layer": Script(static_graph=True, unused_layer=True, accumulation=1),
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
    model = UserNet(unused=script.find_unused_parameters or script.unused_layer)
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
    fresh = UserNet(unused=script.find_unused_parameters or script.unused_layer)
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


def test_static_graph_counts_a_layer_forward_never_calls_as_come(pool) -> None:
    """Without find_unused_parameters, static_graph learns in its first step what
    forward never reaches; from then on those gradients count as come, not missing: the
    suite's four properties hold, and no step adds an exchange of error rows (a status
    that counted them as missing would: one all-reduce more per step)."""
    case = worked("drop_in", steps=3, bucket_cap_mb=25.0)  # one bucket, rebuilt or not
    net = dataclasses.replace(case.net, unused=True)
    check_case(pool, dataclasses.replace(case, net=net, options=(("static_graph", True),)))


def unsupported_arguments(rank: int, group: dist.ProcessGroup) -> dict[str, str]:
    from stages.drop_in import DistributedDataParallel as Ours

    raised = {}
    for name, cls, options in (
        ("device_mesh", Ours, {"device_mesh": object()}),
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
    assert raised["device_mesh"].startswith("NotImplementedError"), raised
    assert "device_mesh" in raised["device_mesh"], raised
    # Implemented, but only with torch's _MixedPrecision (or what has its fields).
    assert raised["mixed_precision"].startswith("TypeError"), raised
    assert "mixed_precision" in raised["mixed_precision"], raised
    # A CPU module with a device id: torch's DDP refuses it with a ValueError, and so
    # must the drop-in.
    assert raised["torch_device_ids"].startswith("ValueError"), raised
    assert raised["device_ids"].startswith("ValueError"), raised


# --- torch's behaviours a script may rely on: each scenario runs with both classes, and
# what it returns (values, or the exception's type and message) must be the same.


def _outcome(fn) -> tuple:
    try:
        return ("returned", fn())
    except Exception as e:  # the type and message are the behaviour under test
        return ("raised", type(e).__name__, str(e))


def _hook_bucket_int(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return default_hooks.allreduce_hook(state, bucket)


def _hook_returns_int(state, bucket) -> int:
    return default_hooks.allreduce_hook(state, bucket)


class Square(nn.Module):
    """One scalar parameter; forward is p**2, whose second derivative is a constant."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self) -> torch.Tensor:
        return self.p.pow(2)


def _steps(ddp: nn.Module, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Two SGD steps on the wrapped model; the gradients of each, before the step."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for _ in range(2):
        F.mse_loss(ddp(x), torch.ones(len(x), 2)).backward()
        grads.append(model.weight.grad.clone())
        optimizer.step()
        optimizer.zero_grad()
    return grads


PICKLED = ("pickle", "deepcopy", "torch.save")  # both need the default group: all ranks


def torch_behaviour(rank: int, group: dist.ProcessGroup, which: str, scenario: str) -> tuple:
    torch.manual_seed(0)  # the same model on every rank: these are not about the broadcast
    cls = DropIn if which == "drop_in" else nn.parallel.DistributedDataParallel
    pg = None if scenario in PICKLED else group  # None: the default group

    def DDP(module: nn.Module, **options) -> nn.Module:  # noqa: N802 - a class, to the script
        return cls(module, process_group=pg, **options)

    x = torch.full((2, 3), float(rank + 1))  # each rank its own input
    if scenario == "no trainable parameter":
        return _outcome(lambda: DDP(nn.Linear(3, 2).requires_grad_(False)))
    if scenario.startswith("hook "):
        ddp = DDP(nn.Linear(3, 2))
        hook = {
            "hook not callable": 3,
            "hook bucket annotation": _hook_bucket_int,
            "hook return annotation": _hook_returns_int,
            "hook twice": default_hooks.allreduce_hook,
        }[scenario]
        if scenario == "hook twice":
            ddp.register_comm_hook(None, hook)
        return _outcome(lambda: ddp.register_comm_hook(None, hook))
    if scenario == "double backward":
        ddp = DDP(Square())
        seen = []
        for _ in range(3):
            ddp().backward(create_graph=True)
            grad = ddp.module.p.grad
            seen.append((grad.item(), grad.requires_grad))
        return _outcome(lambda: seen)
    if scenario.startswith("output never reaches backward"):
        unused = scenario.endswith("find_unused_parameters")
        model = nn.Linear(3, 2)
        ddp = DDP(model, find_unused_parameters=unused)

        def run() -> list:
            ddp(x)  # an evaluation pass under grad mode: its output is dropped
            return [g.tolist() for g in _steps(ddp, model, x)]

        return _outcome(run)
    if scenario == "static graph set after training":
        model = nn.Linear(3, 2)
        ddp = DDP(model)
        _steps(ddp, model, x)
        return _outcome(ddp._set_static_graph)
    if scenario in PICKLED:
        model = nn.Linear(3, 2)
        ddp = DDP(model)
        _steps(ddp, model, x)  # a trained model, buckets rebuilt

        def copied() -> list:
            if scenario == "pickle":
                again = pickle.loads(pickle.dumps(ddp))
            elif scenario == "deepcopy":
                again = copy.deepcopy(ddp)
            else:
                buffer = io.BytesIO()
                torch.save(ddp, buffer)
                buffer.seek(0)
                again = torch.load(buffer, weights_only=False)  # a whole module, not weights
            # The copy trains on as the original would: averaged gradients, in sync.
            return [g.tolist() for g in _steps(again, again.module, x)]

        return _outcome(copied)
    raise ValueError(f"unknown scenario {scenario!r}")


TORCH_BEHAVIOURS = [
    "no trainable parameter",
    "hook not callable",
    "hook bucket annotation",
    "hook return annotation",
    "hook twice",
    "double backward",
    "output never reaches backward",
    "output never reaches backward, find_unused_parameters",
    "static graph set after training",
    "pickle",
    "deepcopy",
    "torch.save",
]


def both_behaviours(rank: int, group: dist.ProcessGroup, scenario: str) -> tuple:
    return tuple(torch_behaviour(rank, group, which, scenario) for which in ("drop_in", "torch"))


@pytest.mark.parametrize("scenario", TORCH_BEHAVIOURS)
def test_behaves_as_torch(pool, scenario: str) -> None:
    """What a script written for torch's DDP sees, the drop-in shows too: the same values,
    or the same exception type and message."""
    world_size = MAX_WORLD if scenario in PICKLED else 2  # the default group is all workers
    for rank, (ours, torchs) in enumerate(run_checked(pool, world_size, both_behaviours, scenario)):
        where = f"rank {rank}, {scenario}: ours {ours}, torch's {torchs}"
        assert ours[0] == torchs[0], where
        if ours[0] == "raised":
            assert ours == torchs, where  # the type and the message
        else:  # values, within float tolerance: the buckets sum in another order
            torch.testing.assert_close(
                torch.tensor(ours[1]), torch.tensor(torchs[1]), **TIGHT, msg=where
            )


def test_runtime_stats_read_the_clock_only_in_the_steps_they_record() -> None:
    """As torch's reducer: the first 10 steps and one every `sample_rate` are timed and
    recorded (at the next forward); the others read no clock."""
    stats = RuntimeStats()
    stats.set_sample_rate(5)
    timed, recorded = [], []
    for _ in range(16):
        if stats.forward_started():
            recorded.append(stats.record["iteration"])
        timed.append(stats.timing)
        if stats.timing:
            for event in ("forward_compute", "backward_compute", "backward_comm"):
                stats.mark(f"{event}_start")
                stats.mark(f"{event}_end")
        else:
            assert stats.marks == {}
    assert [i for i, t in enumerate(timed) if t] == [*range(10), 14]
    assert recorded == [*range(1, 11), 15]  # each forward that records the step before
