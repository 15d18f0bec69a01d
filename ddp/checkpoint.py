"""Checkpoints a run resumes from bit for bit, written so that a rank killed at any moment
never leaves one that loads half.

Layout, one folder per checkpoint, under `--checkpoint-dir DIR` and the run's name:

    DIR/<run>/step-00000014/rank-00000.pt    each rank's own state (torch.save)
    DIR/<run>/step-00000014/rank-00001.pt
    DIR/<run>/step-00000014/COMMITTED        JSON: step, world size, run settings,
                                             each file's size and sha256

Every rank saves its own file: parameters and optimizer state agree across ranks, but
BatchNorm's running statistics and each rank's random number generator do not. A
checkpoint exists once COMMITTED does, and COMMITTED comes last: every rank writes and
fsyncs its file, rank 0 gathers their sizes and digests, writes the marker to a temporary
name, fsyncs it and renames it into place (a rename is atomic on POSIX file systems), then
fsyncs the folder so the rename itself survives a crash. A rank killed before that leaves
a folder without COMMITTED, which loading skips; the previous checkpoint is deleted only
after the new one is committed.

What a rank's file holds is everything its next step depends on: the model's state
(parameters and buffers), the optimizer's (momentum), the learning-rate scheduler's where
the loop has one, the step, the torch generator's state (CUDA's too, where there is one),
the data position, and whatever else the loop carries from step to step (`loop`: the
large-batch experiment's results so far). The stages' data path has no generator of its
own to save: `ddp.data.synthetic_batch` seeds a fresh one from (--seed, micro-batch
index), so the position is the next step and nothing more.

Without a process group (one process training alone, as the large-batch experiment does
by default) the same files are written, one rank's worth, with no collective."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ddp.config import Config

COMMITTED = "COMMITTED"
STEP_PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: corrupt, partial, or another run's."""


@dataclass(frozen=True)
class RunSettings:
    """What a checkpoint must agree with to be resumed from: a different model, batch,
    learning rate or world size would train on from a state it did not make. --steps and
    --warmup-steps may change (train longer from the same checkpoint). Under --elastic
    the world size may change too, and the policy may not (`ddp.elastic.settings`)."""

    model: str
    width: int
    depth: int
    global_batch: int
    accumulation_steps: int
    lr: float
    seed: int
    world_size: int


# What else a loop may pass: the large-batch experiment's run, as a dict of plain values.
Settings = RunSettings | Mapping[str, object]


def run_settings(cfg: Config, global_batch: int, world_size: int) -> RunSettings:
    return RunSettings(
        model=cfg.model,
        width=cfg.width,
        depth=cfg.depth,
        global_batch=global_batch,
        accumulation_steps=cfg.accumulation_steps,
        lr=cfg.lr,
        seed=cfg.seed,
        world_size=world_size,
    )


# --8<-- [start:save]
def save(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: Settings,
    midway: Callable[[], None] = lambda: None,
    *,
    scheduler: LRScheduler | None = None,
    position: Mapping[str, object] | None = None,
    loop: Mapping[str, object] | None = None,
    group: dist.ProcessGroup | None = None,
    keep: int = 1,
) -> Path:
    """Checkpoint the state after `step` optimizer steps; collective over `group` (the
    default one) when a process group is initialised: every rank calls it. `position` is the
    data position beyond the step (an epoch and the iteration in it), `loop` what else the
    loop must go on with; both hold tensors, numbers, strings, lists and dicts only, which
    load with weights_only=True. Returns the committed folder. `midway` runs once this
    rank's file is half written (the fault injection's hook). `keep`: how many committed
    checkpoints stay, the newest; older ones, and folders of writes that did not finish,
    are deleted once this one is committed."""
    rank, world = rank_and_world(group)
    step_dir = run_dir / f"{STEP_PREFIX}{step:08d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_states(),
        "data": {"next_step": step, **(position or {})},
        "loop": dict(loop or {}),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    name = f"rank-{rank:05d}.pt"
    write_durably(step_dir / name, data, midway)
    entry = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    files = all_gather(entry, group)
    if rank == 0:
        fsync_dir(step_dir)  # the rank files' names, before the marker that vouches for them
        manifest = {"step": step, "settings": settings_dict(settings), "files": files}
        write_durably(step_dir / (COMMITTED + ".tmp"), json.dumps(manifest, indent=1).encode())
        os.replace(step_dir / (COMMITTED + ".tmp"), step_dir / COMMITTED)
        fsync_dir(step_dir)
        folders = sorted(run_dir.glob(STEP_PREFIX + "*"), reverse=True)
        kept = [d for d in folders if (d / COMMITTED).is_file()][:keep]
        for old in folders:
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)
    # No rank trains on (and can be killed believing it saved) before the marker exists.
    if world > 1:
        dist.barrier(group=group)
    return step_dir


# --8<-- [end:save]


def settings_dict(settings: Settings) -> dict:
    """`settings` as the manifest holds it: a JSON object (tuples read back as lists)."""
    plain = asdict(settings) if is_dataclass(settings) else dict(settings)
    return json.loads(json.dumps(plain))


def rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in `group` and the group's size; (0, 1) with no process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather(obj: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's `obj`, in rank order; [obj] with no process group."""
    if not dist.is_initialized():
        return [obj]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def write_durably(path: Path, data: bytes, midway: Callable[[], None] = lambda: None) -> None:
    """Write `data` to `path` and fsync it: on disk, not only in the page cache."""
    with open(path, "wb") as f:
        half = len(data) // 2
        f.write(data[:half])
        f.flush()
        midway()
        f.write(data[half:])
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the names in folder `path` (a rename, a new file) survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_states() -> dict[str, torch.Tensor | list[torch.Tensor]]:
    states: dict[str, torch.Tensor | list[torch.Tensor]] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


# --8<-- [start:load]
def restore(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: Settings,
    *,
    scheduler: LRScheduler | None = None,
    group: dist.ProcessGroup | None = None,
    any_world: bool = False,
) -> dict | None:
    """Load the newest committed checkpoint under `run_dir` into `model`, `optimizer`,
    `scheduler` and the generators, and return its state (`step`, `data`: the position,
    with `next_step`; `loop`), or None when there is none. Collective over `group` when a
    process group is initialised: rank 0 picks the checkpoint, every rank checks and loads
    its own file, and if any rank's check fails every rank raises the same CheckpointError.
    `any_world` (--elastic): a checkpoint written by W ranks loads on any number W', rank
    r taking rank r mod W's file (see `read_rank_file`)."""
    rank, world = rank_and_world(group)
    chosen = [newest_committed(run_dir) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(chosen, group=group, group_src=0)
    step_dir = chosen[0]
    if step_dir is None:
        return None
    try:
        state = read_rank_file(step_dir, rank, settings, scheduler is not None, any_world)
        error = None
    except CheckpointError as e:
        state, error = None, str(e)
    errors = all_gather(error, group)
    if any(errors):
        raise CheckpointError(next(e for e in errors if e))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if rank == 0:
        print(f"resuming from {step_dir} (step {state['step']})", file=sys.stderr, flush=True)
    return state


# --8<-- [end:load]


def resume(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: Settings,
) -> int:
    """`restore` for a loop whose position is its step: the step to go on from (0 when
    there is no checkpoint). Collective over the default group."""
    state = restore(run_dir, model, optimizer, settings)
    return state["data"]["next_step"] if state is not None else 0


def newest_committed(run_dir: Path) -> Path | None:
    """The committed checkpoint of the highest step; folders without COMMITTED are writes
    that did not finish, and are skipped (saying so)."""
    for step_dir in sorted(run_dir.glob(STEP_PREFIX + "*"), reverse=True):
        if (step_dir / COMMITTED).is_file():
            return step_dir
        print(f"skipping {step_dir}: no {COMMITTED} marker, its write did not finish",
              file=sys.stderr, flush=True)  # fmt: skip
    return None


def read_rank_file(
    step_dir: Path,
    rank: int,
    settings: Settings,
    with_scheduler: bool = False,
    any_world: bool = False,
) -> dict:
    """This rank's state from a committed checkpoint, refused unless its manifest matches
    this run and the file is whole (size and sha256 as committed). `with_scheduler`: the
    loop has a learning-rate scheduler, whose state the checkpoint must hold. `any_world`:
    the checkpoint may come from another number of ranks W, and rank r reads rank r mod W's
    file. Parameters and optimizer state are the same in every file; what is a rank's own
    (its generator, BatchNorm's running statistics) is then that rank's, and a rank past
    W takes a copy of another's."""
    marker = step_dir / COMMITTED
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
        ours = files[rank % len(files) if any_world else rank]
        written = dict(manifest["settings"])
    except (OSError, ValueError, KeyError, IndexError, TypeError, ZeroDivisionError) as e:
        raise CheckpointError(f"{marker} is unreadable ({e}); delete {step_dir} to go on") from e
    here = settings_dict(settings)
    if written != here:
        absent = "(absent)"
        differ = {k: (written.get(k, absent), here.get(k, absent)) for k in {**written, **here}}
        differ = {k: v for k, v in differ.items() if v[0] != v[1]}
        raise CheckpointError(
            f"{marker} was written by another run: "
            + ", ".join(f"{k} {a} there, {b} here" for k, (a, b) in differ.items())
            + "; pick another --checkpoint-dir"
        )
    path = step_dir / ours["file"]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path} is missing from a committed checkpoint ({e})") from e
    if len(data) != ours["bytes"] or hashlib.sha256(data).hexdigest() != ours["sha256"]:
        raise CheckpointError(
            f"{path} is corrupt: {len(data)} bytes whose sha256 differs from the "
            f"{ours['bytes']} committed in {marker}; delete {step_dir} to resume from scratch"
        )
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # unpickling refused (weights_only) or malformed
        raise CheckpointError(f"{path} does not load with weights_only=True: {e}") from e
    if with_scheduler and state.get("scheduler") is None:
        raise CheckpointError(
            f"{path} holds no learning-rate scheduler state, which this run needs; "
            f"pick another --checkpoint-dir or delete {step_dir}"
        )
    return state


def params_sha256(model: nn.Module) -> str:
    """sha256 over the parameters in `named_parameters()` order: for each, a line
    `name dtype shape\\n`, then its bytes as stored (contiguous, CPU, native byte order).
    Two runs print the same digest only if every parameter is bit-identical."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        tensor = p.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name} {tensor.dtype} {list(p.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
