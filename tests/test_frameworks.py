"""The drop-in where frameworks and real training code reach past torch DDP's public
methods: the class swapped in for torch's, the reducer methods and logging data they
call, torch.compile's graph cuts at bucket boundaries, and static_graph's cases
(reentrant backward, a gradient that comes twice, unused parameters found once). Each
is run with torch's DDP as well, on the same script, and the results compared."""

from __future__ import annotations

import copy
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch.utils.checkpoint import checkpoint

import stages.drop_in
from stages.drop_in import DistributedDataParallel as DropIn
from stages.drop_in import class_swap
from tests.against_torch import EXACT, TIGHT, assert_same, grads_of, params_of, run_checked

ROOT = Path(__file__).resolve().parents[1]


def _ddp_class(which: str) -> type:
    return DropIn if which == "ours" else class_swap.TORCH_DDP


# --- the swap -------------------------------------------------------------------------


def test_install_puts_the_drop_in_where_torch_ddp_was_imported() -> None:
    import tests.nets as already_imported  # a module that bound nothing of DDP's

    already_imported.DDPAlias = class_swap.TORCH_DDP  # as `from torch... import ... as DDPAlias`
    try:
        stages.drop_in.install()
        assert torch.nn.parallel.DistributedDataParallel is DropIn
        assert torch.nn.parallel.distributed.DistributedDataParallel is DropIn
        assert already_imported.DDPAlias is DropIn
        assert class_swap.TORCH_DDP is not DropIn  # torch's own class stays reachable
    finally:
        stages.drop_in.uninstall()
    assert torch.nn.parallel.DistributedDataParallel is class_swap.TORCH_DDP
    assert already_imported.DDPAlias is class_swap.TORCH_DDP
    # Only what install() rebound goes back: the drop-in's own name stays the drop-in.
    assert stages.drop_in.DistributedDataParallel is DropIn
    stages.drop_in.install()  # and it installs again
    try:
        assert torch.nn.parallel.DistributedDataParallel is DropIn
    finally:
        stages.drop_in.uninstall()
        del already_imported.DDPAlias


def test_swap_reaches_ranks_the_script_spawns(tmp_path) -> None:
    """`python -m stages.swap` on a script whose ranks torch.multiprocessing.spawn starts
    as fresh interpreters (as ignite's idist.Parallel does): they build the drop-in too,
    through the sitecustomize the swap puts first on their PYTHONPATH; and the
    sitecustomize that one hides still runs, in the parent and in both ranks."""
    hidden = (
        'import os\nos.write(1, f"hidden sitecustomize ran in pid {os.getpid()}\\n".encode())\n'
    )
    (tmp_path / "sitecustomize.py").write_text(hidden)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    script = ROOT / "tests" / "fixtures" / "spawned_ranks.py"
    out = subprocess.run(
        [sys.executable, "-m", "stages.swap", str(script)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    reports = re.findall(r"^(parent|rank \d) \(pid (\d+)\): (\S+)$", out.stdout, re.M)
    drop_in = "stages.drop_in.DistributedDataParallel"
    assert sorted((who, cls) for who, _, cls in reports) == [
        ("parent", drop_in), ("rank 0", drop_in), ("rank 1", drop_in)
    ], out.stdout  # fmt: skip
    hidden_ran = set(re.findall(r"^hidden sitecustomize ran in pid (\d+)$", out.stdout, re.M))
    assert {pid for _, pid, _ in reports} <= hidden_ran, out.stdout


# --- static_graph as torch documents it -----------------------------------------------


class Checkpointed(nn.Module):
    """A block used twice under reentrant checkpointing ("twice"), the layers after
    the first inside one reentrant checkpoint, so that the first gradients come from its
    inner backward and the last from the outer one ("inner"), or a layer no forward
    uses ("unused")."""

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.first, self.block, self.unused, self.head = (nn.Linear(6, 6) for _ in range(4))
        if case != "unused":
            self.unused.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if self.case == "inner":
            return checkpoint(self._rest, x, use_reentrant=True)
        if self.case == "twice":
            x = checkpoint(self.block, x, use_reentrant=True)
            x = checkpoint(self.block, x, use_reentrant=True)
        else:
            x = self.block(x)
        return self.head(torch.tanh(x))

    def _rest(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(x)))


STATIC_CASES = ("twice", "inner", "unused")


def _batches(rank: int, steps: int) -> list[torch.Tensor]:
    data = torch.Generator().manual_seed(rank)
    # requires_grad: reentrant checkpointing needs an input that does, to run backward
    return [torch.randn(4, 6, generator=data).requires_grad_() for _ in range(steps)]


def static_graph_run(rank: int, group: dist.ProcessGroup, which: str, case: str) -> dict:
    torch.manual_seed(0)
    model = Checkpointed(case)
    ddp = _ddp_class(which)(model, process_group=group, static_graph=True, bucket_cap_mb=1e-4)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for x in _batches(rank, 4):
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(model)


def static_graph_both(rank: int, group: dist.ProcessGroup, case: str) -> tuple[dict, dict]:
    return static_graph_run(rank, group, "ours", case), static_graph_run(rank, group, "torch", case)


def one_process(case: str, world_size: int) -> dict:
    """The same steps in one process, on every rank's batch at once (mean loss)."""
    torch.manual_seed(0)
    model = Checkpointed(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.1, momentum=0.9, weight_decay=0.01)
    per_rank = [_batches(rank, 4) for rank in range(world_size)]
    for step in range(4):
        x = torch.cat([batches[step] for batches in per_rank]).detach().requires_grad_()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(model)


@pytest.mark.parametrize("case", STATIC_CASES)
def test_static_graph_cases_equal_one_process_and_torch(pool, case: str) -> None:
    expected = one_process(case, world_size=2)
    for rank, (ours, torchs) in enumerate(run_checked(pool, 2, static_graph_both, case)):
        assert_same(ours, torchs, f"rank {rank}, {case}: ours against torch's DDP", TIGHT)
        assert_same(ours, expected, f"rank {rank}, {case}: ours against one process", TIGHT)
        if case == "unused":  # no rank used it: its .grad stayed None, so no weight decay
            torch.manual_seed(0)
            initial = Checkpointed(case).unused.weight
            torch.testing.assert_close(ours["unused.weight"], initial, **EXACT)


def static_graph_changes(rank: int, group: dist.ProcessGroup) -> str:
    """A graph that is not the same every step, under static_graph=True: the error."""
    torch.manual_seed(0)
    model = Checkpointed("twice")
    ddp = DropIn(model, process_group=group, static_graph=True)
    x = torch.randn(4, 6, requires_grad=True)
    ddp(x).sum().backward()
    model.case = "once"  # now the block's gradient comes once, not twice
    try:
        ddp(x).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_static_graph_names_a_graph_that_changed(pool) -> None:
    for message in run_checked(pool, 2, static_graph_changes):
        assert "'block.weight' got 1 gradient(s) in this backward where the first got 2" in (
            message
        ), message


# --- what frameworks call: reducer, logging data --------------------------------------


def trigger_sync(rank: int, group: dist.ProcessGroup, which: str) -> dict:
    """accelerate's trigger_sync_in_backward: forwards inside no_sync(), then the last
    backward synchronised through `reducer.prepare_for_backward([])`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    ddp = _ddp_class(which)(model, process_group=group, bucket_cap_mb=1e-4)
    data = torch.Generator().manual_seed(rank)
    with ddp.no_sync():
        losses = [ddp(torch.randn(4, 5, generator=data)).pow(2).mean() for _ in range(3)]
    for loss in losses[:-1]:
        loss.backward()
    ddp.require_backward_grad_sync = True
    ddp.reducer.prepare_for_backward([])
    losses[-1].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def trigger_sync_both(rank: int, group: dist.ProcessGroup) -> tuple[dict, dict]:
    return trigger_sync(rank, group, "ours"), trigger_sync(rank, group, "torch")


def test_reducer_prepare_for_backward_synchronises_after_no_sync(pool) -> None:
    runs = run_checked(pool, 2, trigger_sync_both)
    for rank, (ours, torchs) in enumerate(runs):
        assert_same(ours, torchs, f"rank {rank}: gradients against torch's DDP", TIGHT)
    assert_same(runs[0][0], runs[1][0], "gradients, rank 0 against rank 1", EXACT)


def logging_data(rank: int, group: dist.ProcessGroup, which: str) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    ddp = _ddp_class(which)(model, process_group=group)
    ddp._set_ddp_runtime_logging_sample_rate(2)
    seen = [ddp._get_ddp_logging_data()]
    for _ in range(4):
        ddp(torch.randn(4, 5)).sum().backward()
        seen.append(ddp._get_ddp_logging_data())
    return seen


def logging_data_both(rank: int, group: dist.ProcessGroup) -> tuple:
    return logging_data(rank, group, "ours"), logging_data(rank, group, "torch")


# Keys torch's C++ logger fills that the drop-in reports as well (torch's keys that
# depend on its reducer's internals alone are left out: none a framework reads).
SAME_VALUES = (
    "backend_name", "bucket_sizes", "module_name", "device_ids", "dtypes", "world_size",
    "rank", "broadcast_buffers", "bucket_cap_bytes", "find_unused_parameters",
    "gradient_as_bucket_view", "num_parameter_tensors", "total_parameter_size_bytes",
    "output_device", "is_multi_device_module", "has_sync_bn", "gloo_num_threads",
    "master_port", "master_addr", "iteration", "prev_iteration_grad_ready_order_indices",
    "has_rebuilt_buckets",
)  # fmt: skip


def test_logging_data_has_torchs_keys_and_values(pool) -> None:
    for rank, (ours, torchs) in enumerate(run_checked(pool, 2, logging_data_both)):
        for step, (mine, theirs) in enumerate(zip(ours, torchs, strict=True)):
            where = f"rank {rank}, after {step} steps"
            missing = set(theirs) - set(mine)
            assert not missing, f"{where}: keys torch reports and we do not: {sorted(missing)}"
            for key in SAME_VALUES:
                assert mine.get(key) == theirs.get(key), f"{where}, {key}: {mine} vs {theirs}"
            if step >= 2:  # sampled: the phases' times, ordered as torch's test checks them
                assert mine["backward_comm_time"] >= mine["backward_compute_comm_overlap_time"]
                assert mine["backward_comm_time_start"] >= mine["backward_compute_time_start"]
        assert ours[-1]["can_set_static_graph"] == 1


def rebuilt_layout(rank: int, group: dist.ProcessGroup, which: str) -> dict:
    """The buckets torch's logger reports once they are rebuilt in ready order, for six
    Linear(64, 64) layers under buckets of one weight's bytes (16 KiB): where the cut
    rule matters, as a bias and a weight together pass the cap."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)))
    ddp = _ddp_class(which)(model, process_group=group, bucket_cap_mb=64 * 64 * 4 / 2**20)
    ddp._set_ddp_runtime_logging_sample_rate(1)
    for _ in range(3):
        ddp(torch.randn(4, 64)).sum().backward()
    data = ddp._get_ddp_logging_data()
    return {k: data.get(k) for k in ("rebuilt_per_bucket_param_indices", "rebuilt_bucket_sizes")}


def rebuilt_layout_both(rank: int, group: dist.ProcessGroup) -> tuple[dict, dict]:
    return rebuilt_layout(rank, group, "ours"), rebuilt_layout(rank, group, "torch")


def test_buckets_are_rebuilt_where_torchs_are(pool) -> None:
    """The drop-in cuts its buckets by torch's rule (`overfill_buckets`): a layer's bias
    and weight share a bucket, as in torch's DDP, where a bucket stopping short of its
    cap would hold one each (and torch.compile cuts the graph where torch's end)."""
    for rank, (ours, torchs) in enumerate(run_checked(pool, 2, rebuilt_layout_both)):
        assert torchs["rebuilt_bucket_sizes"], "torch's logger reported no rebuilt buckets"
        assert ours == torchs, f"rank {rank}: ours {ours}, torch's {torchs}"


# --- torch.compile: the same graph cuts as torch's DDP --------------------------------


def compiled_run(
    group: dist.ProcessGroup, which: str, layers: int = 12, width: int = 512
) -> tuple[int, list[float]]:
    """How many graphs torch.compile makes of a 12-layer MLP under DDP with 1 MiB buckets
    (each layer's weight is 1 MiB), and per step when the first bucket left, as a share
    of the time backward took (one rank, its own group)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers))
    )
    graphs = []

    def count(graph_module, example_inputs) -> Callable:
        graphs.append(graph_module)  # forward and backward in one node per graph:
        return aot_eager(graph_module, example_inputs)  # gradients come at its end

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=count)
    ddp = _ddp_class(which)(compiled, process_group=group, bucket_cap_mb=1)
    shares = []
    for _ in range(4):
        launches = []
        if which == "ours":
            ddp._stats.marks.clear()
        x = torch.randn(256, width)
        loss = ddp(x).pow(2).mean()
        start = time.perf_counter()
        if which == "ours":
            ddp._send = _timed(ddp._send, launches)
        loss.backward()
        end = time.perf_counter()
        if which == "ours":
            del ddp._send
            shares.append((launches[0] - start) / (end - start))
    torch._dynamo.reset()
    return len(graphs), shares[1:]


def _timed(send: Callable, launches: list[float]) -> Callable:
    def timed_send(bucket):
        launches.append(time.perf_counter())
        return send(bucket)

    return timed_send


def compiled_both(rank: int, group: dist.ProcessGroup) -> tuple:
    return (*compiled_run(group, "ours"), compiled_run(group, "torch")[0])


def test_compiled_graphs_are_cut_at_buckets_as_torchs(pool) -> None:
    [(ours, shares, torchs)] = run_checked(pool, 1, compiled_both)
    assert ours == torchs == 12, f"compiled graphs: ours {ours}, torch's DDP {torchs}"
    # Cut at buckets, the first bucket leaves after the last layer's backward, about a
    # twelfth of the way through; uncut, after all of it (measured: 0.87).
    assert statistics.median(shares) < 0.5, f"first bucket left at {shares} of backward"


# torch's DDP breaks the graph of its compiled wrapper 3 times (its logger call, and
# entering and leaving `_inside_ddp_forward`); the drop-in, no more: its runtime stats and
# the collectives and rebuilds before a synchronised forward run eagerly inside that same
# entry (`_before_module`), as torch's C++ logger and reducer run inside its `_pre_forward`.
def compiled_wrapper_run(group: dist.ProcessGroup, which: str) -> tuple[int, dict]:
    """torch.compile of the DDP wrapper itself (accelerate compiles the prepared model
    when asked): the graph breaks over 3 steps of an MLP, and its parameters after them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    ddp = _ddp_class(which)(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), process_group=group
    )
    compiled = torch.compile(ddp, backend="eager")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(group.rank())
    for _ in range(3):
        compiled(torch.randn(4, 8, generator=data)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return breaks, params_of(ddp.module)


def compiled_wrappers(rank: int, group: dist.ProcessGroup) -> tuple:
    return compiled_wrapper_run(group, "ours"), compiled_wrapper_run(group, "torch")


def test_a_compiled_wrapper_trains_as_torchs(pool) -> None:
    for rank, ((breaks, params), (torch_breaks, torch_params)) in enumerate(
        run_checked(pool, 2, compiled_wrappers)
    ):
        assert_same(params, torch_params, f"rank {rank}, compiled", EXACT)
        assert breaks <= torch_breaks, (
            f"rank {rank}: {breaks} graph breaks in the compiled drop-in (torch's DDP: "
            f"{torch_breaks}); see TORCH_LOGS=graph_breaks"
        )


# --- mixed precision ------------------------------------------------------------------

PRECISIONS = ("bf16-autocast", "bf16-parameters")


def low_precision_run(rank: int, group: dist.ProcessGroup, which: str, precision: str) -> dict:
    """A step loop in bf16 as a user writes one: under CPU autocast, or with the model
    itself in bf16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    if precision == "bf16-parameters":
        model = model.to(torch.bfloat16)
    ddp = _ddp_class(which)(model, process_group=group, bucket_cap_mb=1e-4)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 6, generator=data).to(next(model.parameters()).dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
            loss = ddp(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(model)


def low_precision_both(rank: int, group: dist.ProcessGroup, precision: str) -> tuple:
    return tuple(low_precision_run(rank, group, w, precision) for w in ("ours", "torch"))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_low_precision_trains_as_torchs(pool, precision: str) -> None:
    for rank, (ours, torchs) in enumerate(run_checked(pool, 2, low_precision_both, precision)):
        assert_same(ours, torchs, f"rank {rank}, {precision}", EXACT)


def mixed_precision_steps(rank: int, group: dist.ProcessGroup, reduce_dtype) -> tuple:
    """torch's `mixed_precision` argument (param_dtype bf16): the drop-in's gradients
    and parameters, and what its recipe gives done by hand: each rank's gradients of a
    bf16 copy of the model, summed over ranks in reduce_dtype, divided by the world
    size, in float32 on float32 parameters. (torch's own DDP cannot run it on CPU: its
    low-precision copies wait on CUDA events.)"""
    from torch.nn.parallel.distributed import _MixedPrecision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    by_hand = copy.deepcopy(model)
    config = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    ddp = DropIn(model, process_group=group, mixed_precision=config, bucket_cap_mb=1e-4)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    hand_optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    world = dist.get_world_size(group)
    for _ in range(3):
        x = torch.randn(8, 6, generator=data)
        out = ddp(x)
        assert out.dtype == torch.bfloat16
        out.float().pow(2).mean().backward()
        low = copy.deepcopy(by_hand).to(torch.bfloat16)
        low(x.to(torch.bfloat16)).float().pow(2).mean().backward()
        for param, low_param in zip(by_hand.parameters(), low.parameters(), strict=True):
            grad = low_param.grad.to(reduce_dtype or torch.bfloat16)
            dist.all_reduce(grad, group=group)
            param.grad = grad.div_(world).float()
        assert [p.dtype for p in model.parameters()] == [torch.float32] * 4
        assert_same(grads_of(model), grads_of(by_hand), f"rank {rank}, gradients", EXACT)
        for opt in (optimizer, hand_optimizer):
            opt.step()
            opt.zero_grad()
    return params_of(model), params_of(by_hand)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce-fp32", "reduce-bf16"])
def test_mixed_precision_is_torchs_recipe(pool, reduce_dtype) -> None:
    for rank, (ours, by_hand) in enumerate(
        run_checked(pool, 2, mixed_precision_steps, reduce_dtype)
    ):
        assert_same(ours, by_hand, f"rank {rank}, parameters", EXACT)


def mixed_precision_large(rank: int, group: dist.ProcessGroup) -> tuple[dict, dict]:
    """mixed_precision (bf16 compute, fp32 reduce) with 1 MiB gradients, which bucketed's
    copy divides as it copies when a gradient and its bucket share a dtype: one
    synchronised backward, and torch's recipe by hand (the bf16 gradients summed in
    fp32, then divided)."""
    from torch.nn.parallel.distributed import _MixedPrecision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
    low = copy.deepcopy(model).to(torch.bfloat16)
    config = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ddp = DropIn(model, process_group=group, mixed_precision=config)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(rank))
    ddp(x).float().pow(2).sum().backward()
    low(x.to(torch.bfloat16)).float().pow(2).sum().backward()
    by_hand = {}
    for (name, _), low_param in zip(model.named_parameters(), low.parameters(), strict=True):
        grad = low_param.grad.float()
        dist.all_reduce(grad, group=group)
        by_hand[name] = grad / dist.get_world_size(group)
    return grads_of(model), by_hand


def test_mixed_precision_divides_in_reduce_dtype(pool) -> None:
    """On 3 ranks (a division that rounds), large bf16 gradients are divided in the
    bucket's fp32, not in bf16 as they are copied: torch's averages, to fp32's rounding."""
    # fp32's rounding (divided then summed, against summed then divided); divided in
    # bf16, the gradients here are off by up to 6e-3.
    fp32 = {"rtol": 1e-5, "atol": 1e-6}
    for rank, (ours, by_hand) in enumerate(run_checked(pool, 3, mixed_precision_large)):
        assert_same(ours, by_hand, f"rank {rank}, gradients", fp32)


def ignore_some(rank: int, group: dist.ProcessGroup) -> str:
    model = nn.Linear(2, 2)
    DropIn._set_params_and_buffers_to_ignore_for_model(model, ["bias"])
    try:
        DropIn(model, process_group=group)
    except NotImplementedError as error:
        return str(error)
    return "built"


def test_parameters_to_ignore_are_refused_by_name(pool) -> None:
    """torch's DDP leaves the parameters a framework marks (Lightning's double precision
    plugin can) unsynchronised; the drop-in does not implement it, and says so rather
    than synchronise them anyway."""
    [message] = run_checked(pool, 1, ignore_some)
    assert "_ddp_params_and_buffers_to_ignore: ['bias']" in message, message


class Branchy(nn.Module):
    """Three layers and an extra one that only some ranks' forward uses."""

    def __init__(self, use_extra: bool):
        super().__init__()
        self.use_extra = use_extra
        self.first, self.second, self.extra, self.head = (nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.second(self.first(x)))
        if self.use_extra:
            x = x + self.extra(x)
        return self.head(x)


def mixed_precision_uneven(rank: int, group: dist.ProcessGroup) -> dict:
    """mixed_precision where it meets the other stages: reduce in bf16, a layer rank 0
    never uses (find_unused_parameters, static_graph), buckets rebuilt after the first
    step, no_sync() micro-batches, and a rank that runs out of data (join)."""
    from torch.nn.parallel.distributed import _MixedPrecision

    torch.manual_seed(0)
    model = Branchy(use_extra=rank == 1)
    config = _MixedPrecision(param_dtype=torch.bfloat16)
    ddp = DropIn(
        model, process_group=group, mixed_precision=config, bucket_cap_mb=200 / 2**20,
        find_unused_parameters=True, static_graph=True,  # static: the buckets are rebuilt
    )  # fmt: skip
    layouts = [[b.buffer.numel() for b in ddp.buckets]]
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(4, 6)).float().pow(2).mean().backward()  # static_graph's first step
    optimizer.zero_grad()  # on every rank, before any can run out of data
    with ddp.join():
        for _ in range(4 if rank == 0 else 3):
            with ddp.no_sync():
                ddp(torch.randn(4, 6)).float().pow(2).mean().backward()
            ddp(torch.randn(4, 6)).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            layouts.append([b.buffer.numel() for b in ddp.buckets])
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return {"params": params_of(model), "layouts": layouts}


def test_mixed_precision_with_rebuilds_unused_and_join(pool) -> None:
    runs = run_checked(pool, 2, mixed_precision_uneven)
    assert_same(runs[0]["params"], runs[1]["params"], "parameters, rank 0 against 1", EXACT)
    # Rebuilt buckets are planned on full-precision parameters, as at construction:
    # elements per bucket stay within the cap (50 fp32 numbers), passed by at most its
    # last gradient (torch's cut; a 6 x 6 weight, 36) and a status tail. Planned on bf16
    # they would hold up to 100 before their last gradient.
    for rank, run in enumerate(runs):
        assert all(n <= 50 + 36 + 4 for layout in run["layouts"] for n in layout), (rank, run)


def sink_outputs(rank: int, group: dist.ProcessGroup, which: str) -> tuple:
    """static_graph's outputs as a script sees them: one modified in place, and one
    made without autograd (a metric), as torch's DDP returns them."""

    class TwoOutputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x):
            y = self.layer(x)
            return y, y.detach().argmax(dim=1)

    torch.manual_seed(0)
    ddp = _ddp_class(which)(TwoOutputs(), process_group=group, static_graph=True)
    seen = []
    for _ in range(2):
        y, index = ddp(torch.randn(3, 4))
        seen.append((index.requires_grad, index.grad_fn is None))
        y.mul_(2)  # in place on forward's output
        y.sum().backward()
    return seen, grads_of(ddp.module)


def sink_both(rank: int, group: dist.ProcessGroup) -> tuple:
    return sink_outputs(rank, group, "ours"), sink_outputs(rank, group, "torch")


def test_static_graph_outputs_are_torchs(pool) -> None:
    for rank, (ours, torchs) in enumerate(run_checked(pool, 2, sink_both)):
        assert ours[0] == torchs[0], f"rank {rank}: outputs {ours[0]} vs torch's {torchs[0]}"
        assert_same(ours[1], torchs[1], f"rank {rank}: gradients", TIGHT)
