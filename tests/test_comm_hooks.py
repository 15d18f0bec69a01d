"""Training with communication hooks against torch's DDP (runs compared as tests.against_torch
describes): the stage with our hook, and with torch's, against torch's DDP with torch's
hook, buckets included; and a second registration raises."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from ddp import comm_hook_functions
from tests.adapters import build_wrapper, comm_hook_by_name, stages_from
from tests.against_torch import assert_same_steps, run_checked, sgd_steps, tolerance
from tests.nets import DEPTH, ONE_BUCKET_MB, WIDTH, Layers

LAYER_CAP_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20  # one layer's float32 gradient bytes

# Two plain iterations (the second after the buckets are rebuilt), then compression from
# the third step on; error feedback and warm start (torch's defaults) act from the fourth.
POWERSGD = {"start_powerSGD_iter": 2, "use_error_feedback": True, "warm_start": True}
HOOK_STEPS = 5


def one_bucket_at_a_time(hook):
    """torch's reducer calls the hook for each bucket as soon as it is full, without
    waiting for the one before. PowerSGD's callbacks start all-reduces and block on them
    from Gloo's worker threads; with two buckets in flight those threads all block and
    torch's DDP hangs (seen here with 2 ranks and 2 buckets, torch 2.13). This wrapper
    waits for the previous bucket's future before starting the next, as the stage
    itself does, so that torch's DDP can run several buckets as the reference."""
    previous: list[torch.futures.Future] = []

    def serialised(state, bucket):  # torch checks that the parameter is named "bucket"
        if previous:
            previous.pop().wait()
        future = hook(state, bucket)
        previous.append(future)
        return future

    return serialised


def train_with_hook(
    rank: int, group: dist.ProcessGroup, wrapper: str, impl: str, hook: str, cap_mb: float
) -> tuple[list, list, tuple | None]:
    """([(gradients, parameters after the step)] per step, [[(bucket index, parameter
    names)] per hook call] per step, PowerSGD's (iterations, compression stats) or None).
    `impl`: whose hook, ours or torch's."""
    torch.manual_seed(1000 * rank + 1)
    model = Layers()
    fn = comm_hook_by_name(hook if impl == "ours" else f"torch_{hook}")
    if hook == "powerSGD":
        ours = comm_hook_functions.PowerSGDState
        state_type = ours if impl == "ours" else torch_powersgd.PowerSGDState
        state = state_type(group, **POWERSGD)
        if wrapper == "torch_ddp":
            fn = one_bucket_at_a_time(fn)
    else:
        state = group
    names = {id(p): n for n, p in model.named_parameters()}
    layouts = []

    def recorded(state, bucket):
        layouts[-1].append((bucket.index(), [names[id(p)] for p in bucket.parameters()]))
        return fn(state, bucket)

    wrapped = build_wrapper(
        wrapper,
        model,
        group,
        bucket_cap_mb=cap_mb,
        first_bucket_as_torch=True,
        comm_hook=recorded,
        hook_state=state,
    )
    record = sgd_steps(wrapped, model, rank, HOOK_STEPS, (4, WIDTH), lambda: layouts.append([]))
    stats = (state.iter, state.compression_stats()) if hook == "powerSGD" else None
    return record, layouts, stats


def three_runs(rank: int, group: dist.ProcessGroup, stage: str, hook: str, cap_mb: float):
    """The stage with our hook, the stage with torch's hook, torch's DDP with torch's."""
    return (
        train_with_hook(rank, group, stage, "ours", hook, cap_mb),
        train_with_hook(rank, group, stage, "torch", hook, cap_mb),
        train_with_hook(rank, group, "torch_ddp", "torch", hook, cap_mb),
    )


HOOK_CASES = [  # (hook, bucket cap, world size)
    ("allreduce", ONE_BUCKET_MB, 2),
    ("fp16", ONE_BUCKET_MB, 2),
    ("fp16", LAYER_CAP_MB, 2),
    ("bf16", LAYER_CAP_MB, 2),
    ("powerSGD", ONE_BUCKET_MB, 2),
    ("powerSGD", LAYER_CAP_MB, 2),
    ("powerSGD", ONE_BUCKET_MB, 3),
]


@pytest.mark.parametrize(
    "hook, cap_mb, world_size",
    HOOK_CASES,
    ids=[f"{h}-{'one' if c == ONE_BUCKET_MB else 'per-layer'}-W{w}" for h, c, w in HOOK_CASES],
)
@pytest.mark.parametrize("stage", stages_from("comm_hooks"))
def test_comm_hook_training_as_torch(
    pool, stage: str, hook: str, cap_mb: float, world_size: int
) -> None:
    runs = run_checked(pool, world_size, three_runs, stage, hook, cap_mb)
    tol = tolerance(world_size)
    for rank, (ours, ours_torch_hook, torchs) in enumerate(runs):
        where = f"rank {rank}, {hook}"
        assert_same_steps(ours[0], torchs[0], f"{where}, our hook vs torch DDP", tol)
        assert_same_steps(ours_torch_hook[0], torchs[0], f"{where}, torch's hook vs DDP", tol)
        # From the rebuild on (step 1), the same buckets as torch's: PowerSGD's random
        # projections and error feedback are per bucket (see tests.nets.Layers). Step 0 differs:
        # torch starts with one bucket whatever the cap.
        assert ours[1][1:] == torchs[1][1:], (
            f"{where}: buckets differ from torch's after the rebuild:\n{ours[1]}\n{torchs[1]}"
        )
        buckets = 1 if cap_mb == ONE_BUCKET_MB else DEPTH
        assert all(len(calls) == buckets for calls in ours[1]), f"{where}: {ours[1]}"
        if hook == "powerSGD":  # compression did run: fewer numbers sent than gradients
            iters, (rate, _, _) = ours[2]
            assert iters == HOOK_STEPS and rate > 1, f"{where}: PowerSGD stats {ours[2]}"
            assert ours[2] == torchs[2] == ours_torch_hook[2], where
        if hook in ("fp16", "bf16"):  # the hook ran: every gradient went through 16 bits
            half = torch.float16 if hook == "fp16" else torch.bfloat16
            for grads, _ in ours[0]:
                for name, g in grads.items():
                    assert torch.equal(g.to(half).float(), g), f"{where}: {name} is not {half}"


def register_twice(rank: int, group: dist.ProcessGroup, wrapper: str) -> list[str]:
    """What each of two register_comm_hook calls raised ("" for none)."""
    torch.manual_seed(rank)
    wrapped = build_wrapper(wrapper, Layers(), group)
    raised = []
    for _ in range(2):
        try:
            wrapped.register_comm_hook(group, default_hooks.allreduce_hook)
            raised.append("")
        except RuntimeError as e:
            raised.append(str(e))
    return raised


@pytest.mark.parametrize("wrapper", [*stages_from("comm_hooks"), "torch_ddp"])
def test_registering_a_second_hook_raises(pool, wrapper: str) -> None:
    for rank, (first, second) in enumerate(run_checked(pool, 2, register_twice, wrapper)):
        assert first == "", f"rank {rank}: the first registration raised {first}"
        assert second, f"rank {rank}: a second hook replaced the first without an error"
