"""Checkpoints of the experiment's runs, written and read by ddp/checkpoint.py (atomic,
one file per rank, a COMMITTED marker last): one folder per run under --checkpoint-dir,

    DIR/k4-gradual-seed0/step-00000012/rank-00000.pt ... COMMITTED

written every --checkpoint-every optimizer steps and at the run's end, so that an
interrupted experiment started again (by hand, or by torchrun --max-restarts) resumes each
run where it stopped, bit for bit, and skips the runs it had finished.

Beyond what ddp/checkpoint.py saves of every loop (model with its BatchNorm statistics,
optimizer, step, torch's generator), a run's checkpoint holds:

- the learning-rate scheduler's state: where the warmup and the decay are;
- the data position, (epoch, iteration). The data path's only generator is
  DistributedSampler's, which it seeds afresh with seed + epoch for each epoch's
  permutation: the epoch is all of its state there is. The data set is made from
  --data-seed, the model from the run's seed; after that the loop draws nothing from
  torch's generator (there is no dropout), which is saved all the same;
- the results so far: each finished epoch's loss and errors, whether the run diverged,
  and the current epoch's running sums (this rank's, all-reduced at the epoch's end)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ddp import checkpoint
from ddp.fault_injection import Fault
from profiling.studies.large_batch.settings import Run, Settings

# Settings that choose which runs there are, or where results go, not how one trains.
NOT_TRAINING = (
    "workers", "variants", "seeds", "jobs", "json", "markdown", "plot_prefix", "render",
    "checkpoint_dir", "checkpoint_every",
)  # fmt: skip
RESULTS = ("train_loss", "train_error", "val_error", "diverged")  # the Run fields saved


def run_folder(workers: int, variant: str, seed: int) -> str:
    return f"k{workers}-{variant}-seed{seed}"


def new_totals() -> torch.Tensor:
    """An epoch's running sums: loss, wrong answers, samples."""
    return torch.zeros(3, dtype=torch.float64)


@dataclass
class Position:
    """Where a run goes on: at `iteration` of `epoch`, with the epoch's sums so far."""

    epoch: int = 0
    iteration: int = 0
    totals: torch.Tensor = field(default_factory=new_totals)


class RunCheckpoints:
    """The checkpoints of one run (k, rule, seed) over `group`'s ranks (or one process):
    of its model, optimizer, scheduler and results (`run`)."""

    def __init__(
        self,
        s: Settings,
        run: Run,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler,
        group: dist.ProcessGroup | None,
        fault: Fault | None = None,
    ) -> None:
        self.dir = Path(s.checkpoint_dir) / run_folder(run.workers, run.variant, run.seed)
        self.every, self.epochs = s.checkpoint_every, s.epochs
        self.run, self.model, self.optimizer, self.scheduler = run, model, optimizer, scheduler
        self.group, self.fault = group, fault
        self.rank, world = checkpoint.rank_and_world(group)
        # A checkpoint resumes only the run that wrote it: every setting that changes
        # the training, the run's own k, rule and seed, and the ranks it was split over.
        trains = {k: v for k, v in dataclasses.asdict(s).items() if k not in NOT_TRAINING}
        self.settings = {
            **trains, "workers": run.workers, "variant": run.variant, "seed": run.seed,
            "world_size": world,
        }  # fmt: skip

    def restore(self) -> Position:
        """Load the newest committed checkpoint into the model, optimizer and scheduler,
        and its results so far into the run; the position to go on from (the start when
        there is none)."""
        state = checkpoint.restore(
            self.dir, self.model, self.optimizer, self.settings,
            scheduler=self.scheduler, group=self.group,
        )  # fmt: skip
        if state is None:
            return Position()
        for name in RESULTS:
            setattr(self.run, name, state["loop"][name])
        position = Position(
            state["data"]["epoch"], state["data"]["iteration"], state["loop"]["totals"]
        )
        if self.rank == 0 and self.finished(position):
            print(f"{self.dir.name}: finished before; its results are read from {self.dir}, "
                  "not trained again", file=sys.stderr, flush=True)  # fmt: skip
        return position

    def finished(self, position: Position) -> bool:
        """Whether the run has nothing left to train: every epoch done, or diverged."""
        return self.run.diverged or position.epoch >= self.epochs

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, position: Position) -> None:
        """Checkpoint the run after `step` optimizer steps, to go on from `position`."""
        fault = self.fault
        checkpoint.save(
            self.dir, step, self.model, self.optimizer, self.settings,
            partial(fault.at, "checkpoint", step) if fault else lambda: None,
            scheduler=self.scheduler,
            position={"epoch": position.epoch, "iteration": position.iteration},
            loop={"totals": position.totals, **{k: getattr(self.run, k) for k in RESULTS}},
            group=self.group,
        )  # fmt: skip
