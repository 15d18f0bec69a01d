"""find_unused_parameters against torch's DDP (runs compared as tests.against_torch describes):
which branches forward runs changes per step, micro-batch and rank. And the errors: a
parameter unused on some ranks without the flag, where torch's DDP hangs, and a loss that
reaches a parameter the output does not, where it raises; the stage raises on every
rank and leaves the group usable. And the line torch's DDP writes when the flag finds
nothing unused: the drop-in writes it where and as often as torch's does."""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from stages.drop_in import DistributedDataParallel as DropIn
from stages.drop_in.class_swap import TORCH_DDP
from stages.unused_params import NOTHING_UNUSED
from tests.adapters import build_wrapper, stages_from
from tests.against_torch import EXAMPLES, assert_same, grads_of, params_of, run_both
from tests.nets import BRANCHES, Branchy, TwoHeads, UsedTwice, UserNet
from tests.pool import RankError, check_no_errors, free_port

SECONDS = 120  # a hang fails the test after this long instead of blocking CI


@dataclass(frozen=True)
class Routing:
    world_size: int
    # Per step, per micro-batch (all but the last under no_sync), per rank: the
    # branches forward runs.
    steps: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    bucket_cap_mb: float
    set_to_none: bool
    gradient_as_bucket_view: bool
    seed: int


@st.composite
def routings(draw, stage: str) -> Routing:
    world_size = draw(st.integers(2, 3))
    use = st.lists(st.integers(0, BRANCHES - 1), unique=True, max_size=BRANCHES).map(tuple)
    micro_batch = st.lists(use, min_size=world_size, max_size=world_size).map(tuple)
    step = st.lists(micro_batch, min_size=1, max_size=2).map(tuple)
    return Routing(
        world_size=world_size,
        steps=draw(st.lists(step, min_size=1, max_size=3).map(tuple)),
        # MiB; 1e-9 gives every parameter a bucket of its own, 25 puts all in one.
        bucket_cap_mb=draw(st.sampled_from([1e-9, 2e-4, 25.0])),
        set_to_none=draw(st.booleans()),
        gradient_as_bucket_view=stage in stages_from("grad_views") and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def train_routed(rank: int, group: dist.ProcessGroup, wrapper: str, routing: Routing) -> list:
    """[(gradients before the optimizer step, parameters after it)] per step."""
    torch.manual_seed(routing.seed * 31 + 1000 * rank + 1)  # ranks differ until broadcast
    model = Branchy()
    options = {"find_unused_parameters": True}
    if routing.gradient_as_bucket_view:
        options["gradient_as_bucket_view"] = True
    wrapped = build_wrapper(wrapper, model, group, bucket_cap_mb=routing.bucket_cap_mb, **options)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(routing.seed * 7919 + rank)
    record = []
    for micro_batches in routing.steps:
        for j, uses in enumerate(micro_batches):
            last = j == len(micro_batches) - 1
            x, y = torch.randn(2, 3, generator=data), torch.randn(2, 2, generator=data)
            with nullcontext() if last else wrapped.no_sync():
                loss = F.mse_loss(wrapped(x, uses[rank]), y) / len(micro_batches)
                loss.backward()
        grads = grads_of(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=routing.set_to_none)
        record.append((grads, params_of(model)))
    return record


@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_unused_parameters_as_torch(pool, stage: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(routing=routings(stage))
    # Branch 2 unused everywhere, branch 1 on rank 0 only, and a no_sync micro-batch
    # that uses branch 0 on rank 1 where the synced one does not.
    @example(
        routing=Routing(
            world_size=2,
            steps=((((0, 1), (1,)),), (((), (0,)), ((1, 0), ()))),
            bucket_cap_mb=1e-9,
            set_to_none=True,
            gradient_as_bucket_view=False,
            seed=0,
        )
    )
    def check(routing: Routing) -> None:
        runs = run_both(pool, routing.world_size, train_routed, stage, routing)
        for rank, (ours, torchs) in enumerate(runs):
            for step, ((grads, params), (torch_grads, torch_params)) in enumerate(
                zip(ours, torchs, strict=True)
            ):
                where = f"rank {rank}, step {step} of {routing.steps}"
                assert_same(grads, torch_grads, f"gradient, {where}")
                assert_same(params, torch_params, f"parameter after the step, {where}")

    check()


def healthy_step(rank: int, group: dist.ProcessGroup, stage: str) -> tuple[float, dict, dict]:
    """After an error: is the group still usable? A plain all-reduce, and one step of a
    fresh stage and of torch's DDP whose gradients must agree."""
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, group=group)
    grads = []
    for wrapper in (stage, "torch_ddp"):
        torch.manual_seed(1000 * rank)
        model = Branchy()
        wrapped = build_wrapper(wrapper, model, group)
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
        wrapped(x, tuple(range(BRANCHES))).square().mean().backward()
        grads.append(grads_of(model))
    return total.item(), *grads


def check_healthy(world_size: int, after: tuple[float, dict, dict]) -> None:
    total, ours, torchs = after
    assert total == world_size * (world_size + 1) / 2, (
        f"an all-reduce after the error summed to {total}: a collective was left half-done"
    )
    assert_same(ours, torchs, "gradient of a step after the error")


def raised_then_healthy(
    rank: int, group: dist.ProcessGroup, stage: str, wrapped: nn.Module, backward
) -> tuple[str | None, tuple]:
    """(What `backward()` and finishing the synchronisation raised, None for nothing;
    healthy_step after it)."""
    try:
        backward()
        wrapped.finish_gradient_synchronization()
        error = None
    except RuntimeError as e:
        error = str(e)
    return error, healthy_step(rank, group, stage)


def used_on_rank_0_only(
    rank: int, group: dist.ProcessGroup, stage: str, bucket_cap_mb: float
) -> tuple[str | None, tuple]:
    torch.manual_seed(1000 * rank)
    wrapped = build_wrapper(stage, Branchy(), group, bucket_cap_mb=bucket_cap_mb)
    use = (0, 1, 2) if rank == 0 else (0, 2)  # branch 1 gets no gradient on ranks 1, 2, ...

    def backward() -> None:
        wrapped(torch.randn(2, 3), use).sum().backward()

    return raised_then_healthy(rank, group, stage, wrapped, backward)


@pytest.mark.parametrize("bucket_cap_mb", [1e-9, 25.0])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", stages_from("missing_grads"))
def test_parameter_unused_on_some_ranks_without_the_flag(
    pool, stage: str, world_size: int, bucket_cap_mb: float
) -> None:
    """torch's DDP hangs here (the ranks that used branch 1 wait for a bucket the others
    never send); the stage raises on every rank, naming the parameter and the ranks."""
    runs = pool.run(world_size, used_on_rank_0_only, stage, bucket_cap_mb, timeout_s=SECONDS)
    for rank, run in enumerate(runs):
        assert not isinstance(run, RankError), run.traceback
        error, after = run
        assert error is not None, f"rank {rank} did not raise"
        for lacking in range(1, world_size):
            assert re.search(rf"rank {lacking}: \[[^\]]*'branches\.1\.weight'", error), error
            assert re.search(rf"rank {lacking}: \[[^\]]*'branches\.1\.bias'", error), error
        assert "rank 0:" not in error, f"rank 0 had every gradient: {error}"
        assert "branches.0" not in error and "branches.2" not in error, (
            f"branches 0 and 2 were used everywhere: {error}"
        )
        check_healthy(world_size, after)


def loss_beside_the_output(
    rank: int, group: dist.ProcessGroup, stage: str, term_first: bool, bucket_cap_mb: float
) -> tuple[str | None, tuple]:
    torch.manual_seed(1000 * rank)
    model = Branchy(extra=True)
    wrapped = build_wrapper(
        stage, model, group, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True
    )

    def backward() -> None:
        # Autograd runs the later-built term first: `term_first` makes extra's gradient
        # arrive last, else first, before any gradient forward's outputs lead to.
        beside = model.extra.weight.sum() if term_first else None
        out = wrapped(torch.randn(2, 3), tuple(range(BRANCHES)))
        beside = model.extra.weight.sum() if beside is None else beside
        (out.sum() + beside).backward()

    return raised_then_healthy(rank, group, stage, wrapped, backward)


@pytest.mark.parametrize("bucket_cap_mb", [1e-9, 25.0])
@pytest.mark.parametrize("term_first", [True, False], ids=["extra-last", "extra-first"])
@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_loss_reaches_a_parameter_the_output_does_not(
    pool, stage: str, term_first: bool, bucket_cap_mb: float
) -> None:
    """With find_unused_parameters=True, forward's outputs decide what is unused; a loss
    that reaches a parameter some other way breaks that (torch's DDP raises "Expected
    to mark a variable ready only once"). The stage must raise on every rank."""
    runs = pool.run(2, loss_beside_the_output, stage, term_first, bucket_cap_mb, timeout_s=SECONDS)
    for rank, run in enumerate(runs):
        assert not isinstance(run, RankError), run.traceback
        error, after = run
        assert error is not None, (
            f"rank {rank} finished backward without an error, where torch's DDP raises "
            "'Expected to mark a variable ready only once'"
        )
        assert "'extra.weight'" in error, error
        check_healthy(2, after)


def flag_turned_off(rank: int, group: dist.ProcessGroup, stage: str) -> tuple[str | None, tuple]:
    torch.manual_seed(1000 * rank)
    model = Branchy()
    wrapped = build_wrapper(stage, model, group, find_unused_parameters=True)
    wrapped.find_unused_parameters = False  # read at every step, as the rest of the stage

    def backward() -> None:
        wrapped(torch.randn(2, 3), (0, 2)).sum().backward()  # branch 1 unused everywhere

    return raised_then_healthy(rank, group, stage, wrapped, backward)


@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_the_flag_turned_off_after_construction_counts_missing_gradients(pool, stage: str):
    """find_unused_parameters is read at every step: turned off after construction, a
    parameter no rank used is a missing gradient, an error on every rank, not a zero
    average written into its .grad."""
    runs = pool.run(2, flag_turned_off, stage, timeout_s=SECONDS)
    for rank, run in enumerate(runs):
        assert not isinstance(run, RankError), run.traceback
        error, after = run
        assert error is not None and "'branches.1.weight'" in error, f"rank {rank}: {error}"
        check_healthy(2, after)


def gradient_twice(
    rank: int, group: dist.ProcessGroup, stage: str, first: bool
) -> tuple[str | None, tuple]:
    torch.manual_seed(1000 * rank)
    # With a first layer, a bucket per parameter: none leaves before its gradient came
    # (the second comes after its bucket left), nothing is missing, and the status
    # carries the problem. Without one, one bucket: it leaves at the first 4 gradients,
    # before the second ones come, and only the end of backward sees them.
    cap = 1e-9 if first else 25.0
    wrapped = build_wrapper(stage, UsedTwice(first), group, bucket_cap_mb=cap)

    def backward() -> None:
        wrapped(torch.randn(2, 3)).sum().backward()

    return raised_then_healthy(rank, group, stage, wrapped, backward)


@pytest.mark.parametrize("first", [True, False], ids=["in-the-status", "after-the-status"])
@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_a_gradient_that_comes_twice_raises_on_every_rank(pool, stage: str, first: bool) -> None:
    """Without find_unused_parameters too: a problem a rank notes in its backward (here
    a gradient that came twice; torch's DDP raises "Expected to mark a variable ready
    only once" on that rank) is an error, never a silent sum of half the gradient, and
    the group stays usable. Noted before the status left, every rank raises; after, the
    rank that saw it (here every rank)."""
    runs = pool.run(2, gradient_twice, stage, first, timeout_s=SECONDS)
    for rank, run in enumerate(runs):
        assert not isinstance(run, RankError), run.traceback
        error, after = run
        assert error is not None, f"rank {rank} finished a backward that got a gradient twice"
        assert "'inner.weight' got its gradient twice" in error, error
        check_healthy(2, after)


def accumulated_then_not_reached_by_the_loss(
    rank: int, group: dist.ProcessGroup, stage: str
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1000 * rank)
    model = TwoHeads()
    wrapped = build_wrapper(stage, model, group, find_unused_parameters=True)
    x = torch.full((1, 3), float(rank + 1))  # each rank its own gradient
    with wrapped.no_sync():
        wrapped(x)[1].sum().backward()  # accumulates aux's gradient, locally
    accumulated = model.aux.weight.grad.clone()
    wrapped(x)[0].sum().backward()  # synchronised; reaches aux (an output) but uses main only
    return accumulated, model.aux.weight.grad.clone()


@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_gradient_accumulated_in_no_sync_is_averaged(pool, stage: str) -> None:
    """A parameter that forward's outputs reach gets no gradient in the synchronised
    backward (its loss does not use it): what it accumulated inside no_sync() is what
    this rank contributes, so it ends as the average of the ranks' accumulations."""
    runs = pool.run(2, accumulated_then_not_reached_by_the_loss, stage, timeout_s=SECONDS)
    for run in runs:
        assert not isinstance(run, RankError), run.traceback
    expected = (runs[0][0] + runs[1][0]) / 2  # computed here, from each rank's own
    for rank, (_, averaged) in enumerate(runs):
        torch.testing.assert_close(averaged, expected, msg=lambda m, r=rank: f"rank {r}: {m}")


# --- torch's warning when the flag finds nothing unused --------------------------------

# What each rank runs, in this order, with torch's class and then the drop-in's: (name,
# DDP options, whether the model has a layer forward never calls, whether every backward
# is inside no_sync()). torch warns once per process: the order is part of the test.
NOTHING_UNUSED_SCENARIOS = (
    ("a layer unused", {"find_unused_parameters": True}, True, False),
    ("flag off", {}, False, False),
    ("static_graph", {"find_unused_parameters": True, "static_graph": True}, False, False),
    ("inside no_sync", {"find_unused_parameters": True}, False, True),
    ("all used", {"find_unused_parameters": True}, False, False),
    ("all used, a second model", {"find_unused_parameters": True}, False, False),
)


def nothing_unused_run(rank: int, port: int, log_dir: str) -> None:
    """One rank in a fresh process (torch's warning comes once per process): its stderr
    (fd 2, where torch's C++ log and Python's sys.stderr both write) into a file of its
    own, a marker line before every step, and any Python warning caught, with its text."""
    log = open(os.path.join(log_dir, f"rank{rank}.txt"), "w")  # open while the process lives
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for cls in (TORCH_DDP, DropIn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, options, unused_layer, no_sync in NOTHING_UNUSED_SCENARIOS:
                torch.manual_seed(rank)
                ddp = cls(UserNet(unused=unused_layer), **options)
                for step in range(3):
                    marker = f"-- {cls.__module__} | {name} | step {step}"
                    print(marker, file=sys.stderr, flush=True)
                    with ddp.no_sync() if no_sync else nullcontext():
                        ddp(torch.randn(4, 3)).square().mean().backward()
        for w in caught:
            print(f"== {cls.__module__} | {w.message}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


def said_nothing_unused(text: str) -> dict[tuple[str, str], list]:
    """What a rank's stderr `text` holds, per (class's module, channel): on "stderr",
    [(scenario and step, the words)] of each line that says no parameter was unused; on
    "warnings", the Python warnings its scenarios raised."""
    said: dict[tuple[str, str], list] = {}
    where = who = ""
    for line in text.splitlines():
        if line.startswith("-- "):
            who, scenario, step = line[3:].split(" | ")
            where = f"{scenario}, {step}"
        elif line.startswith("== "):
            module, message = line[3:].split(" | ", 1)
            said.setdefault((module, "warnings"), []).append(message)
        elif "did not find any unused parameters" in line:
            words = line.split("] Warning: ", 1)[-1].removesuffix(" (function operator())")
            said.setdefault((who, "stderr"), []).append((where, words))
    return said


def test_nothing_unused_is_said_as_torch_says_it(tmp_path) -> None:
    """find_unused_parameters=True with every parameter used: torch's DDP writes one line
    on stderr (C++'s log, not a Python warning) on every rank, at the first synchronised
    forward, and never again in that process; nothing with a layer unused, without the
    flag, with static_graph, or inside no_sync(). The drop-in says the same, in the same
    words, at the same step, and raises the same Python warnings (static_graph's, that
    the flag is not needed with it)."""
    context = mp.start_processes(
        nothing_unused_run,
        args=(free_port(), str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + SECONDS * 2
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, f"no end in {SECONDS * 2} s: a hang"
    finally:
        for process in context.processes:
            process.kill()
    torch_ddp = "torch.nn.parallel.distributed"
    for rank in range(2):
        said = said_nothing_unused((tmp_path / f"rank{rank}.txt").read_text())
        for channel in ("stderr", "warnings"):
            torchs = said.get((torch_ddp, channel), [])
            ours = said.get(("stages.drop_in", channel), [])
            assert ours == torchs, f"rank {rank}, {channel}: the drop-in's {ours}, torch's {torchs}"
        assert said[(torch_ddp, "stderr")] == [("all used, step 0", NOTHING_UNUSED)], said


# --- with the flag, the averages go into .grad only once the status has settled --------


def grads_as_the_status_settles(
    rank: int, group: dist.ProcessGroup, stage: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One synchronised backward with find_unused_parameters=True in which every rank
    uses every parameter: (each .grad as the status settles, each .grad after backward,
    this rank's own gradients). Each rank has its own input."""
    torch.manual_seed(0)
    model = Branchy()
    wrapped = build_wrapper(stage, model, group, find_unused_parameters=True)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    use = tuple(range(BRANCHES))
    names = [n for n, _ in model.named_parameters()]
    own = torch.autograd.grad(model(x, use).sum(), list(model.parameters()))  # no .grad
    loss = wrapped(x, use).sum()
    status = wrapped._status  # this backward's, made by the forward
    settle, seen = status.settle, {}

    def settle_seen(ddp: nn.Module) -> None:
        seen.update({n: p.grad.clone() for n, p in model.named_parameters()})
        settle(ddp)

    status.settle = settle_seen
    loss.backward()
    after = {n: p.grad.clone() for n, p in model.named_parameters()}
    return seen, after, dict(zip(names, own, strict=True))


@pytest.mark.parametrize("stage", stages_from("unused_params"))
def test_with_the_flag_averages_are_copied_out_after_the_status(pool, stage: str) -> None:
    """With find_unused_parameters, what goes into a .grad depends on who used what,
    which the status says: the averages are copied out once it has settled, never as
    the buckets land, even in a step where every parameter was used everywhere."""
    runs = check_no_errors(pool.run(2, grads_as_the_status_settles, stage, timeout_s=SECONDS))
    for rank, (seen, after, own) in enumerate(runs):
        assert seen.keys() == after.keys(), f"rank {rank}: the status did not settle: {seen}"
        for name, grad in after.items():
            where = f"rank {rank}, {name}"
            torch.testing.assert_close(
                seen[name], own[name], msg=lambda m, w=where: f"{w}, as the status settled: {m}"
            )
            average = (runs[0][2][name] + runs[1][2][name]) / 2
            torch.testing.assert_close(
                grad, average, msg=lambda m, w=where: f"{w}, after backward: {m}"
            )
