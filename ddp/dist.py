"""Process groups and the two things every stage does at construction:
make all replicas start identical, and check that they are the same model."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout

from ddp.watchdog import Watchdog

_watchdog: Watchdog | None = None  # the heartbeat of the group setup_process_group made
JOIN_TIMEOUT_S = 300.0  # at least, for every rank to join the group (ddp.train's default --timeout)
# Groups made once and shared by every wrapper that asks with the same key (new_group is
# collective and costly); dropped at teardown, so that no group outlives it.
_shared_groups: dict[object, list[dist.ProcessGroup]] = {}


def setup_process_group(backend: str = "auto", timeout_s: float | None = None) -> torch.device:
    """Join the process group that torchrun describes in the environment.

    `backend="auto"` picks NCCL with one GPU per LOCAL_RANK when this node has a GPU
    for each of its ranks, Gloo on CPU otherwise. `timeout_s`: how long this rank waits
    for one that does not answer before it fails naming it (ddp.watchdog); None: no
    watchdog, and torch's default timeout (30 minutes for Gloo). Returns the device this
    rank computes on."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(
                f"{var} is not set: launch with torchrun, e.g. "
                "`torchrun --standalone --nproc-per-node 2 -m stages.naive`"
            )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if backend == "auto":  # NCCL refuses two ranks on one GPU
        backend = "nccl" if 0 < local_ranks <= gpus else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA; use --backend gloo on CPU")
        if int(os.environ["LOCAL_RANK"]) >= gpus:
            raise RuntimeError(
                f"rank {os.environ['RANK']}: backend nccl needs a GPU per rank, and LOCAL_RANK "
                f"{os.environ['LOCAL_RANK']} has none of this node's {gpus}; run at most "
                f"{gpus} per node (--nproc-per-node), or use --backend gloo"
            )
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    elif backend == "gloo":
        device = torch.device("cpu")
    else:
        raise ValueError(f"unknown backend {backend!r}; pick gloo, nccl or auto")
    if not dist.is_initialized():
        import_dynamo_first()
        store, rank, world_size = next(dist.rendezvous("env://"))
        # torchrun's agent keeps one store across restarts, and keys of the attempt before
        # (the dead workers' Gloo addresses) would be read as this attempt's: restarted
        # workers then fail to connect, or wait on each other. A prefix per attempt.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"attempt-{attempt}", store)
        # Making the group waits for every rank to start, and one may start late (a busy
        # or slow node): at least JOIN_TIMEOUT_S for that. Collectives then time out 10%
        # after the watchdog's timeout, so the watchdog, which can name a missing rank
        # where Gloo cannot, speaks first. (torch gives no public way to set the two
        # apart: `_set_pg_timeout` changes what init set.)
        join = (
            None if timeout_s is None else timedelta(seconds=max(JOIN_TIMEOUT_S, timeout_s * 1.1))
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=join
        )
        if timeout_s is not None:
            _set_pg_timeout(timedelta(seconds=timeout_s * 1.1))
            global _watchdog
            _watchdog = Watchdog(dist.PrefixStore("heartbeat", store), rank, world_size, timeout_s)
    return device


def import_dynamo_first() -> None:
    """Import torch._dynamo now, before the group exists.

    The optimizer's first step imports it lazily, and importing it while a process group
    exists leaves references to the group inside torch that destroy_process_group does
    not drop. The group then outlives teardown, and Gloo's threads (`gloo_tcp_loop`,
    `pt_gloo_runloop`) run on into interpreter shutdown, where they can abort the
    process ("terminate called without an active exception"; how often, and how it was
    found: docs/when-a-rank-dies.md). Imported first, it holds nothing, and teardown
    ends every Gloo thread."""
    import torch._dynamo  # noqa: F401


def shared_groups(
    key: object, make: Callable[[], list[dist.ProcessGroup]]
) -> list[dist.ProcessGroup]:
    """`make()`'s groups, made on the first call with `key` and returned again after,
    until `teardown_process_group`."""
    if key not in _shared_groups:
        _shared_groups[key] = make()
    return _shared_groups[key]


def require_process_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The group a stage communicates over: the one given, else the default one."""
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group is initialised: call torch.distributed.init_process_group "
            "(or ddp.dist.setup_process_group under torchrun) before wrapping the model"
        )
    return process_group if process_group is not None else dist.group.WORLD


def in_place_collective(tensor: torch.Tensor, collective: Callable[[torch.Tensor], object]) -> None:
    """Run `collective` on `tensor` in place, through a contiguous copy when needed.

    Collectives take dense contiguous buffers; a transposed parameter is neither."""
    if tensor.is_contiguous():
        collective(tensor)
    else:
        buffer = tensor.contiguous()
        collective(buffer)
        tensor.copy_(buffer)


def check_same_parameters(module: nn.Module, process_group: dist.ProcessGroup) -> None:
    """Raise on every rank if any rank's parameters differ in name, shape, dtype or order.

    Every rank gathers every rank's description, so every rank raises the same error
    instead of some ranks raising while others wait in a collective forever."""
    mine = [
        (name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ]
    everyone: list[list | None] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, mine, group=process_group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for i, (ref, other) in enumerate(zip(reference, theirs, strict=False)):
            if ref != other:
                raise ValueError(
                    f"models differ across ranks: parameter {i} is "
                    f"{_describe(ref)} on rank 0 but {_describe(other)} on rank {rank}; "
                    "every rank must build the same model"
                )
        if len(reference) != len(theirs):
            raise ValueError(
                f"models differ across ranks: rank 0 has {len(reference)} parameters, "
                f"rank {rank} has {len(theirs)}; every rank must build the same model"
            )


def _describe(entry: tuple) -> str:
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad else ", frozen"
    return f"'{name}' {list(shape)} {dtype}{frozen}"


def broadcast_module_states(
    module: nn.Module, process_group: dist.ProcessGroup, src: int = 0, buffers: bool = True
) -> None:
    """Copy group rank `src`'s parameters (and buffers) to every rank.

    Ranks seed differently (torch.initial_seed() differs per process), so without this
    replicas start from different weights and never agree."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *(module.buffers() if buffers else [])]:
            in_place_collective(
                tensor, lambda t: dist.broadcast(t, group=process_group, group_src=src)
            )


def broadcast_buffers(
    module: nn.Module,
    process_group: dist.ProcessGroup,
    src: int = 0,
    *,
    buffers: list[torch.Tensor] | None = None,
) -> None:
    """Copy group rank `src`'s buffers to every rank: one broadcast per dtype of buffer.
    `buffers`: the module's, listed once by a caller that broadcasts every step (listing
    them walks every submodule: tens of microseconds on a deep model)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in module.buffers() if buffers is None else buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in buffers])
        dist.broadcast(flat, group=process_group, group_src=src)
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()


def slowest_seconds(op: Callable[[], object], repeats: int) -> list[float]:
    """Seconds each of `repeats` calls of `op` took, every call started from a barrier on
    every rank of the default group and timed as the slowest rank's (one collective)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=collective_device(None))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def replicas_identical(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when every parameter is bit-identical to rank 0's.

    Buffers are left out on purpose: BatchNorm's running statistics are per worker (each
    sees its own slice of the batch). torch's DDP re-broadcasts rank 0's buffers before
    each forward, but the forward then updates them per worker again."""
    group = require_process_group(process_group)
    mismatches = torch.zeros(1, device=collective_device(group))
    with torch.no_grad():
        for tensor in module.parameters():
            rank0 = tensor.detach().clone().contiguous()
            dist.broadcast(rank0, group=group, group_src=0)
            if not torch.equal(rank0, tensor.detach()):
                mismatches += 1
    dist.all_reduce(mismatches, group=group)
    return bool(mismatches.item() == 0)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective on `group` (None: the default group) must live:
    NCCL sends CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def teardown_process_group() -> None:
    """Destroy the process group, after dropping everything that still refers to it.

    A Gloo group still referenced after destroy_process_group lives on, and its threads
    (`gloo_tcp_loop`, `pt_gloo_runloop`) with it, into interpreter shutdown, where they
    can abort the process ("terminate called without an active exception"). Three
    things held it: a wrapper kept alive by its own parameter hooks (the hooks now hold
    it weakly: stage overlapped), torch._dynamo imported after the group was made
    (`import_dynamo_first`), and the round-robin groups shared between wrappers
    (`shared_groups`, dropped here). tests/test_torchrun.py checks that no Gloo thread
    is left after a stage's run."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    _shared_groups.clear()
    gc.collect()
    dist.destroy_process_group()
