"""Large minibatches: the linear scaling rule and warmup, reproduced small.

Goyal et al. (arXiv 1706.02677) train ResNet-50 on ImageNet with k workers of n = 32
images and keep the small-batch error up to k*n = 8k by (1) scaling the learning rate
linearly with k*n and (2) warming it up gradually over the first epochs; beyond 8k the
error rises. This module trains one small BatchNorm MLP on an offline-generated
classification set (ddp.datasets) for a fixed number of epochs at several global
batches k*n, each with four learning-rate rules:

    unscaled   base_lr at every batch size (no scaling rule), then the decay
    no_warmup  the scaled rate base_lr * k*n / reference_batch from the first step
    gradual    the scaled rate, reached from base_lr by a constant increment per step
    constant   base_lr during the warmup epochs, then the scaled rate

and reports the final validation error, mean and std over seeds, with training curves.

    .venv/bin/python -m profiling.large_batch --json out.json --markdown out.md \
        --plot-prefix out/large-batch

On one process (the default) each of the k workers is simulated by one micro-batch of
gradient accumulation: its own BatchNorm statistics over its n samples, its own slice of
the epoch's permutation, its loss summed and divided by k*n. `--jobs` runs independent
trainings side by side (one per core). Under torchrun, W ranks each simulate k/W
workers, accumulating under `no_sync()` and synchronising once per step with the
skip_sync stage; BatchNorm buffers stay per rank, and rank 0 evaluates and writes:

    torchrun --standalone --nproc-per-node 2 -m profiling.large_batch --workers 2,8 --seeds 1

Same loss normalisation (sum / (k*n): the stage averages over W ranks of sum / (k/W * n)),
same data split, same model: only where the micro-batches run differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp.datasets import Split, classification_data, epoch_batches, worker_samplers
from ddp.lr import large_batch_schedule, linear_scaled_lr
from ddp.param_groups import no_decay_param_groups

VARIANTS = ("unscaled", "no_warmup", "gradual", "constant")


@dataclass
class Settings:
    per_worker_batch: int = 32  # n, samples per worker per step (the paper's 32)
    workers: str = "1,4,16,32,64,256"  # k values, comma-separated: global batch k*n
    variants: str = ",".join(VARIANTS)  # learning-rate rules, comma-separated
    seeds: int = 3  # seeds 0..seeds-1: initialisation and shuffling (the data stay)
    epochs: int = 16  # training epochs, the same at every batch size
    warmup_epochs: float = 2.0  # warmup length (gradual, constant), in epochs
    decay: str = "step"  # step | cosine, after the warmup
    decay_epochs: str = "8,12"  # step decay milestones (epochs from the start); x gamma
    gamma: float = 0.1  # step decay factor
    base_lr: float = 0.05  # SGD learning rate at the reference batch (tuned at k=1)
    # lr = base_lr * k*n / reference_batch. The paper's reference is 256 = 8 workers of
    # 32; ours is one worker of 32, the smallest batch trained, so k=1 is the baseline.
    reference_batch: int = 32
    momentum: float = 0.9
    weight_decay: float = 1e-4  # weights only: not BatchNorm, not biases
    width: int = 256  # hidden units of the two BatchNorm layers
    train_samples: int = 24_576  # 3 x 8192: the largest default batch takes 3 steps/epoch
    val_samples: int = 4_096
    data_seed: int = 0  # the data set itself
    jobs: int = 2  # trainings run side by side on one process's machine (not torchrun)
    json: str = ""  # write all results (settings, runs, curves) here
    markdown: str = ""  # write the results table here (a docs fragment)
    plot_prefix: str = ""  # write <prefix>-error.png and <prefix>-curves.png

    def __post_init__(self) -> None:
        for name in ("per_worker_batch", "seeds", "epochs", "jobs", "width", "reference_batch"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if not self.worker_list or min(self.worker_list) < 1:
            raise ValueError(f"--workers must list worker counts >= 1, got {self.workers!r}")
        unknown = set(self.variant_list) - set(VARIANTS)
        if unknown:
            raise ValueError(f"--variants: unknown {sorted(unknown)}; pick from {VARIANTS}")
        if self.decay not in ("step", "cosine"):
            raise ValueError(f"--decay must be step or cosine, got {self.decay!r}")
        if not 0 <= self.warmup_epochs <= self.epochs:
            raise ValueError(f"--warmup-epochs must lie in [0, --epochs], got {self.warmup_epochs}")

    @property
    def worker_list(self) -> list[int]:
        return [int(k) for k in self.workers.split(",")]

    @property
    def variant_list(self) -> list[str]:
        return [v for v in self.variants.split(",") if v]

    @property
    def decay_epoch_list(self) -> list[float]:
        return [float(e) for e in self.decay_epochs.split(",") if e]


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Settings):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default
        )
    return Settings(**vars(parser.parse_args(argv)))


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


@dataclass
class Run:
    workers: int  # k
    variant: str
    seed: int
    global_batch: int  # k*n
    lr: float  # the rate after warmup (scaled, except for `unscaled`)
    iters_per_epoch: int
    train_error: list[float] = field(default_factory=list)  # per epoch, over its minibatches
    train_loss: list[float] = field(default_factory=list)  # per epoch
    val_error: list[float] = field(default_factory=list)  # per epoch, after it
    diverged: bool = False  # the loss went to inf/nan; the run stopped there
    params: list[torch.Tensor] | None = None  # final parameters, with keep_params only

    @property
    def final_val_error(self) -> float:
        return self.val_error[-1]


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
) -> Run:
    """Train one run. Under a process group (the default one, or `process_group`), this
    rank simulates k/W of the k workers. `keep_params` puts the final parameters in
    the result (for the tests)."""
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
        from stages import STAGES

        wrapped = STAGES["skip_sync"](
            model, process_group=process_group
        )  # also broadcasts rank 0's initial weights
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    samplers = worker_samplers(len(data.train), workers, rank * local, local, seed)
    x, y = data.train.tensors
    n = s.per_worker_batch
    run = Run(workers, variant, seed, workers * n, lr, iters)
    for epoch in range(s.epochs):
        model.train()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, wrong, samples
        # --8<-- [start:step]
        for minibatches in epoch_batches(samplers, epoch, n):  # one index tensor per worker
            for j, idx in enumerate(minibatches):
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
        if distributed:
            dist.all_reduce(totals, group=process_group)
        run.train_loss.append(totals[0].item() / totals[2].item())
        run.train_error.append(totals[1].item() / totals[2].item())
        run.val_error.append(evaluate(model, data))
        if not math.isfinite(run.train_loss[-1]):
            run.diverged = True
            break
    if keep_params:
        run.params = [p.detach().clone() for p in model.parameters()]
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
    if s.jobs > 1 and not distributed:
        import multiprocessing as mp

        # One thread per job: each micro-batch is too small to gain from intra-op threads.
        with mp.get_context("spawn").Pool(
            s.jobs, initializer=torch.set_num_threads, initargs=(1,)
        ) as p:
            runs = p.map(_one, [(s, *job) for job in jobs], chunksize=1)
    else:
        runs = []
        for i, job in enumerate(jobs):
            runs.append(_one((s, *job)))
            if not distributed or dist.get_rank() == 0:
                r = runs[-1]
                print(
                    f"[{i + 1}/{len(jobs)}] k={r.workers} {r.variant} seed={r.seed}: "
                    f"val error {r.final_val_error:.4f}",
                    flush=True,
                )
    # Where the four rules coincide, every variant's row shows the one run.
    out = []
    for r in runs:
        same = r.global_batch == s.reference_batch
        for v in s.variant_list if same else [r.variant]:
            out.append(dataclasses.replace(r, variant=v))
    return out


def summarise(s: Settings, runs: list[Run]) -> dict:
    """Per (k, variant): final validation error, mean and std over seeds."""
    table = {}
    for k in s.worker_list:
        for v in s.variant_list:
            errors = [r.final_val_error for r in runs if r.workers == k and r.variant == v]
            table[f"{k},{v}"] = {
                "workers": k,
                "global_batch": k * s.per_worker_batch,
                "variant": v,
                "mean": statistics.mean(errors),
                "std": statistics.stdev(errors) if len(errors) > 1 else 0.0,
                "diverged": sum(r.diverged for r in runs if r.workers == k and r.variant == v),
            }
    return table


def markdown(s: Settings, table: dict, runs: list[Run], wall_s: float, command: str) -> str:
    lines = [
        f"Produced by `{command}` in {wall_s / 60:.1f} min ({platform.node() or 'this machine'}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}).",
        "",
        f"Final top-1 validation error (%), mean ± std over {s.seeds} "
        f"seed{'s' if s.seeds > 1 else ''}; "
        f"{s.epochs} epochs, per-worker batch n = {s.per_worker_batch}, "
        f"base lr {s.base_lr} at batch {s.reference_batch}, {s.warmup_epochs:g} warmup "
        f"epochs, {s.decay} decay.",
        "",
        "| k | global batch k·n | steps/epoch | scaled lr | " + " | ".join(s.variant_list) + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(s.variant_list),
    ]
    for k in s.worker_list:
        first = next(r for r in runs if r.workers == k)
        scaled = linear_scaled_lr(s.base_lr, k, s.per_worker_batch, s.reference_batch)
        cells = []
        for v in s.variant_list:
            row = table[f"{k},{v}"]
            cell = f"{100 * row['mean']:.2f} ± {100 * row['std']:.2f}"
            if row["diverged"]:
                cell += f" ({row['diverged']} diverged)"
            cells.append(cell)
        lines.append(
            f"| {k} | {k * s.per_worker_batch} | {first.iters_per_epoch} | {scaled:g} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot(s: Settings, table: dict, runs: list[Run], prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    paths = [Path(f"{prefix}-error.png"), Path(f"{prefix}-curves.png")]

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    batches = [k * s.per_worker_batch for k in s.worker_list]
    for v in s.variant_list:
        rows = [table[f"{k},{v}"] for k in s.worker_list]
        ax.errorbar(
            batches,
            [100 * r["mean"] for r in rows],
            yerr=[100 * r["std"] for r in rows],
            marker="o",
            capsize=3,
            label=v,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("global batch k·n")
    ax.set_ylabel("final validation error (%)")
    ax.set_title(f"Validation error after {s.epochs} epochs (mean ± std, {s.seeds} seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=80)
    plt.close(fig)

    variants = s.variant_list
    cols = 2 if len(variants) > 1 else 1
    rows_n = math.ceil(len(variants) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(9, 3.2 * rows_n), sharex=True, sharey=True)
    axes = [axes] if len(variants) == 1 else list(getattr(axes, "flat", axes))
    colors = plt.cm.viridis([i / max(len(s.worker_list) - 1, 1) for i in range(len(s.worker_list))])
    for ax, v in zip(axes, variants, strict=False):
        for k, color in zip(s.worker_list, colors, strict=True):
            curves = [r.train_error for r in runs if r.workers == k and r.variant == v]
            length = min(len(c) for c in curves)
            mean = [100 * statistics.mean(c[e] for c in curves) for e in range(length)]
            ax.plot(
                range(1, length + 1), mean, color=color, label=f"k·n = {k * s.per_worker_batch}"
            )
        ax.set_title(v)
        ax.grid(alpha=0.3)
    for ax in axes[len(variants) :]:
        ax.axis("off")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.set_ylim(0, 40)  # the interesting range; diverged runs (~90%) leave the top
    fig.supxlabel("epoch")
    fig.supylabel("training error (%), mean over seeds, clipped at 40")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=80)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> None:
    s = parse_settings(argv)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        from ddp.dist import setup_process_group

        setup_process_group("gloo")
        s = dataclasses.replace(s, jobs=1)  # the ranks are the parallelism
    rank = dist.get_rank() if distributed else 0
    # One thread per process: a micro-batch of 32 gains nothing from intra-op threads,
    # and two processes (jobs or ranks) already fill the two cores.
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        runs = run_all(s)
        wall_s = time.perf_counter() - start
        if rank != 0:
            return
        table = summarise(s, runs)
        world = dist.get_world_size() if distributed else 1
        command = "python -m profiling.large_batch" + (
            f" (torchrun, {world} ranks)" if distributed else ""
        )
        report = markdown(s, table, runs, wall_s, command + _flags(argv))
        print(report)
        print(f"wall time {wall_s:.1f} s")
        if s.json:
            Path(s.json).parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "settings": dataclasses.asdict(s),
                "world_size": world,
                "wall_s": wall_s,
                "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
                "table": list(table.values()),
                "runs": [
                    {k: v for k, v in dataclasses.asdict(r).items() if k != "params"} for r in runs
                ],
            }
            Path(s.json).write_text(json.dumps(payload, indent=1) + "\n")
        if s.markdown:
            Path(s.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(s.markdown).write_text(report)
        if s.plot_prefix:
            for path in plot(s, table, runs, s.plot_prefix):
                print(f"wrote {path}")
    finally:
        if distributed:
            dist.destroy_process_group()


def _flags(argv: list[str] | None) -> str:
    import shlex
    import sys

    args = sys.argv[1:] if argv is None else argv
    return (" " + shlex.join(args)) if args else ""


if __name__ == "__main__":
    main()
