"""One training run per (k, learning-rate rule, seed): k workers of n samples, each a
micro-batch of gradient accumulation, on one process or split over torchrun's ranks."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp.checkpoint import params_sha256
from ddp.fault_injection import Fault
from ddp.progress import Progress
from profiling.studies.large_batch.checkpoints import Position, RunCheckpoints, new_totals
from profiling.studies.large_batch.classification_data import (
    Split,
    classification_data,
    epoch_batches,
    worker_samplers,
)
from profiling.studies.large_batch.lr import large_batch_schedule, linear_scaled_lr
from profiling.studies.large_batch.param_groups import no_decay_param_groups
from profiling.studies.large_batch.settings import Run, Settings
from stages import STAGES


class BatchNormMLP(nn.Module):
    """Two hidden layers, each Linear (no bias: BatchNorm's shift replaces it),
    BatchNorm1d, ReLU; then a linear classifier."""

    def __init__(self, features: int = 32, width: int = 256, classes: int = 10):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(features, width, bias=False),
            nn.BatchNorm1d(width),
            nn.ReLU(),
            nn.Linear(width, width, bias=False),
            nn.BatchNorm1d(width),
            nn.ReLU(),
            nn.Linear(width, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, features)
        return self.layers(x)


# --8<-- [start:setup]
def build(s: Settings, data: Split, workers: int, variant: str, seed: int):
    """Model, optimizer and per-iteration scheduler for one run of k = `workers`."""
    features = data.train.tensors[0].shape[1]
    classes = int(data.train.tensors[1].max()) + 1
    torch.manual_seed(seed)
    model = BatchNormMLP(features, s.width, classes)
    n = s.per_worker_batch
    iters = (len(data.train) // workers) // n  # each worker's share, in steps of n
    scaled = linear_scaled_lr(s.base_lr, workers, n, s.reference_batch)
    lr = s.base_lr if variant == "unscaled" else scaled
    optimizer = torch.optim.SGD(
        no_decay_param_groups(model, s.weight_decay), lr=lr, momentum=s.momentum
    )
    warmup = {"unscaled": "none", "no_warmup": "none"}.get(variant, variant)
    scheduler = large_batch_schedule(
        optimizer,
        base_lr=min(s.base_lr, lr),
        total_iters=s.epochs * iters,
        warmup=warmup,
        warmup_iters=round(s.warmup_epochs * iters),
        decay=s.decay,
        milestones=[round(e * iters) for e in s.decay_epoch_list],
        gamma=s.gamma,
    )
    return model, optimizer, scheduler, lr, iters


# --8<-- [end:setup]


def train_run(
    s: Settings,
    data: Split,
    workers: int,
    variant: str,
    seed: int,
    process_group: dist.ProcessGroup | None = None,
    keep_params: bool = False,
    progress: Progress | None = None,
) -> Run:
    """Train one run. Under a process group (the default one, or `process_group`), this
    rank simulates k/W of the k workers. `keep_params` puts the final parameters in
    the result (for the tests); `progress` hears of every epoch. With --checkpoint-dir,
    checkpoints every --checkpoint-every steps and at the end, and goes on from the
    newest checkpoint there (profiling/studies/large_batch/checkpoints.py)."""
    distributed = process_group is not None or (dist.is_available() and dist.is_initialized())
    rank, world = (
        (dist.get_rank(process_group), dist.get_world_size(process_group))
        if distributed
        else (0, 1)
    )
    if workers % world:
        raise ValueError(f"{workers} workers do not split over {world} ranks; pick multiples")
    local = workers // world  # workers this process simulates, one micro-batch each
    model, optimizer, scheduler, lr, iters = build(s, data, workers, variant, seed)
    wrapped = model
    if distributed:
        wrapped = STAGES["skip_sync"](
            model, process_group=process_group
        )  # also broadcasts rank 0's initial weights
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    samplers = worker_samplers(len(data.train), workers, rank * local, local, seed)
    x, y = data.train.tensors
    n = s.per_worker_batch
    run = Run(workers, variant, seed, workers * n, lr, iters)
    # DDP_STAGES_FAULT (ddp/fault_injection.py) under torchrun: a rank kills itself at a step.
    fault = Fault.from_env() if distributed else None
    if fault is not None:
        fault.install(model, optimizer)
    saved = None
    if s.checkpoint_dir:
        saved = RunCheckpoints(s, run, model, optimizer, scheduler, process_group, fault)
    start = saved.restore() if saved else Position()
    step = start.epoch * iters + start.iteration  # optimizer steps done
    # A run restored after it diverged has nothing left to train.
    epochs = range(start.epoch, s.epochs) if not run.diverged else range(0)
    for epoch in epochs:
        epoch_started = time.perf_counter()
        model.train()
        totals = start.totals if epoch == start.epoch else new_totals()  # loss, wrong, samples
        batches = epoch_batches(samplers, epoch, n)  # one index tensor per worker, per step
        first = start.iteration if epoch == start.epoch else 0
        for iteration in range(first, len(batches)):
            if fault is not None:
                fault.current_step = step
            # --8<-- [start:step]
            for j, idx in enumerate(batches[iteration]):  # worker j's n sample indices
                skip = j < local - 1 and hasattr(wrapped, "no_sync")
                with wrapped.no_sync() if skip else nullcontext():
                    logits = wrapped(x[idx])  # BatchNorm statistics over this worker's n
                    loss = F.cross_entropy(logits, y[idx], reduction="sum")
                    (loss / (local * n)).backward()  # averaged over W ranks: sum / (k*n)
                totals += torch.tensor(
                    [loss.item(), (logits.argmax(1) != y[idx]).sum().item(), n],
                    dtype=torch.float64,
                )
            finish()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()  # once per iteration: warmup rises by a constant each step
            # --8<-- [end:step]
            step += 1
            if saved and saved.due(step) and iteration + 1 < len(batches):  # mid-epoch
                saved.save(step, Position(epoch, iteration + 1, totals))
        if distributed:
            dist.all_reduce(totals, group=process_group)
        run.train_loss.append(totals[0].item() / totals[2].item())
        run.train_error.append(totals[1].item() / totals[2].item())
        run.val_error.append(evaluate(model, data))
        if progress is not None:
            progress.step(time.perf_counter() - epoch_started)
        run.diverged = not math.isfinite(run.train_loss[-1])
        # At an epoch's end, after its results: a resumed run need not redo them.
        if saved and (saved.due(step) or epoch + 1 == s.epochs or run.diverged):
            saved.save(step, Position(epoch + 1))
        if run.diverged:
            break
    if keep_params:
        run.params = [p.detach().clone() for p in model.parameters()]
    run.params_sha256 = params_sha256(model)
    return run


@torch.no_grad()
def evaluate(model: nn.Module, data: Split) -> float:
    """Top-1 validation error, BatchNorm in eval mode (this rank's running statistics)."""
    model.eval()
    x, y = data.val.tensors
    logits = model(x)
    if not torch.isfinite(logits).all():
        return 1.0  # a diverged model: count every sample wrong
    return (logits.argmax(1) != y).float().mean().item()


def plan(s: Settings) -> list[tuple[int, str, int]]:
    """(k, variant, seed) for every run. Where k*n is the reference batch the four rules
    are one and the same (no scaling, so nothing to warm up): train it once."""
    jobs = []
    for seed in range(s.seeds):
        for k in s.worker_list:
            same = k * s.per_worker_batch == s.reference_batch
            for variant in s.variant_list[:1] if same else s.variant_list:
                jobs.append((k, variant, seed))
    return jobs


def _name(k: int, variant: str, seed: int) -> str:
    return f"k={k} {variant} seed={seed}"


def _one(args: tuple[Settings, int, str, int]) -> Run:
    s, k, variant, seed = args
    return train_run(s, _data(s), k, variant, seed)


_cached: dict[tuple, Split] = {}


def _data(s: Settings) -> Split:
    key = (s.train_samples, s.val_samples, s.data_seed)
    if key not in _cached:
        _cached[key] = classification_data(s.train_samples, s.val_samples, seed=s.data_seed)
    return _cached[key]


def run_all(s: Settings) -> list[Run]:
    jobs = plan(s)
    distributed = dist.is_available() and dist.is_initialized()
    # Every epoch of every run sees all the training samples once, whatever k: about
    # the same work, so epochs measure what is left.
    progress = Progress(len(jobs), len(jobs) * s.epochs)
    if s.jobs > 1 and not distributed:
        # One thread per job: each micro-batch is too small to gain from intra-op threads.
        with mp.get_context("spawn").Pool(
            s.jobs, initializer=torch.set_num_threads, initargs=(1,)
        ) as p:
            runs = []
            # In order, as each finishes: the jobs run side by side, so only finished
            # runs can be reported, not their epochs.
            for job, run in zip(jobs, p.imap(_one, [(s, *job) for job in jobs]), strict=True):
                runs.append(run)
                progress.start(_name(*job), s.epochs)
                progress.finish(f"val error {run.final_val_error:.4f}")
    else:
        runs = []
        for job in jobs:
            data = _data(s)  # made once, before the first run's clock starts
            progress.start(_name(*job), s.epochs, unit="epoch")
            runs.append(train_run(s, data, *job, progress=progress))
            progress.finish(f"val error {runs[-1].final_val_error:.4f}")
    # Where the four rules coincide, every variant's row shows the one run.
    out = []
    for r in runs:
        same = r.global_batch == s.reference_batch
        for v in s.variant_list if same else [r.variant]:
            out.append(dataclasses.replace(r, variant=v))
    return out
