"""Going on with the ranks that are left: what `--elastic` changes in the training loop.

Under `torchrun --nnodes MIN:MAX --max-restarts K`, a lost node makes torchrun re-form
the group with the nodes that are left; the workers start again with a smaller
WORLD_SIZE and resume from the last committed checkpoint, written by more ranks. What a
step then trains is the policy's:

    keep-global-batch  every world trains --global-batch-size samples per micro-batch,
                       split over the ranks there are (a larger batch per rank); the
                       samples, the learning rate and its schedule are those of the step
    scale-lr           every rank trains --batch-size samples per micro-batch, so the
                       global batch follows the world, and the learning rate follows it
                       by the linear scaling rule (Goyal et al., 2017):
                       lr = --lr x (W x --batch-size) / --global-batch-size; lowered at
                       once, raised over --elastic-warmup-steps (their gradual warmup)

The run trains on a data set of --dataset-size synthetic samples, epoch after epoch, each
epoch in an order of its own (shuffled by --seed and the epoch): sample id i is the
(i mod N)-th of epoch i // N's order. Which ids a step trains is a function of the run,
not of the world. With the global batch kept, micro-batch m holds the ids m*G .. m*G+G-1
however many ranks split it. With the batch per rank kept, the ids are a stream of blocks
of --batch-size, and each step takes the next k x W blocks; how many blocks were taken is
in the checkpoint, so after a change of world the stream goes on where it was. Either way
the steps that count (those a checkpoint kept) train every id once, whatever the worlds
were: no sample is skipped or trained twice within an epoch. `DDP_STAGES_SAMPLE_LOG=DIR`
makes each rank write the ids it trains on, step by step, for a harness to check that
(`profiling/studies/elastic_trials.py`)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp import checkpoint
from ddp.config import Config
from ddp.data import split_batch, synthetic_batch

KEEP_GLOBAL_BATCH, SCALE_LR = "keep-global-batch", "scale-lr"
SAMPLE_LOG = "DDP_STAGES_SAMPLE_LOG"


@dataclass(frozen=True)
class Plan:
    """What one world trains per optimizer step under a policy."""

    policy: str
    world: int
    per_rank: int  # samples per rank per micro-batch
    micro_batches: int  # per optimizer step (--accumulation-steps)
    lr: float  # the learning rate this world trains at, once any ramp is over

    @property
    def global_batch(self) -> int:  # samples per micro-batch over all ranks
        return self.per_rank * self.world


def plan(cfg: Config, world: int) -> Plan:
    """The policy's plan for `world` ranks (refused if the global batch does not split)."""
    if cfg.elastic == KEEP_GLOBAL_BATCH:
        if cfg.global_batch_size % world:
            raise ValueError(
                f"--elastic keep-global-batch: global batch {cfg.global_batch_size} does not "
                f"split over the {world} ranks left; pick a --global-batch-size that every "
                "world the run may re-form with divides"
            )
        return Plan(cfg.elastic, world, cfg.global_batch_size // world,
                    cfg.accumulation_steps, cfg.lr)  # fmt: skip
    if cfg.elastic == SCALE_LR:
        lr = linear_scaled_lr(cfg.lr, cfg.batch_size * world, cfg.global_batch_size)
        return Plan(cfg.elastic, world, cfg.batch_size, cfg.accumulation_steps, lr)
    raise ValueError(f"no plan for --elastic {cfg.elastic}")


def linear_scaled_lr(base_lr: float, global_batch: int, reference_batch: int) -> float:
    """Goyal et al.'s linear scaling rule: a global batch s times the reference trains at
    s times the reference's learning rate."""
    return base_lr * global_batch / reference_batch


@dataclass(frozen=True)
class Ramp:
    """The learning rate as a function of the step: `from_lr` at step `start`, then a
    straight line to `to_lr` over `steps` steps, and `to_lr` after. A function of the step
    only, so a run restarted at the same world resumes the same rates, bit for bit."""

    start: int
    from_lr: float
    to_lr: float
    steps: int

    def lr(self, step: int) -> float:
        done = min(max(step - self.start, 0), self.steps)
        if done == self.steps:  # exactly to_lr, not a rounding of the line's end
            return self.to_lr
        return self.from_lr + (self.to_lr - self.from_lr) * done / self.steps


def next_ramp(previous: Ramp | None, to_lr: float, step: int, warmup_steps: int) -> Ramp:
    """The ramp of a run (re)started at `step` whose world trains at `to_lr`. The same
    target as the checkpoint's: its ramp goes on as if nothing happened. A lower one:
    at once (a smaller rate is never the risk). A higher one: a straight line from the
    rate of the step, over `warmup_steps` steps, as Goyal et al.'s gradual warmup."""
    if previous is None:
        return Ramp(step, to_lr, to_lr, 0)
    if previous.to_lr == to_lr:
        return previous
    now = previous.lr(step)
    if to_lr < now or warmup_steps == 0:
        return Ramp(step, to_lr, to_lr, 0)
    return Ramp(step, now, to_lr, warmup_steps)


# -- which samples a rank trains on ------------------------------------------------------


def sample_ids(p: Plan, step: int, blocks: int, rank: int) -> list[range]:
    """The ids of the samples `rank` trains on in each micro-batch of optimizer step
    `step`; `blocks`: the blocks of the stream taken before this step (scale-lr)."""
    if p.policy == KEEP_GLOBAL_BATCH:  # micro-batch m, split over the world
        part = split_batch(p.global_batch, rank, p.world)
        firsts = [(step * p.micro_batches + j) * p.global_batch for j in range(p.micro_batches)]
        return [range(f + part.start, f + part.stop) for f in firsts]
    blocks_ = (blocks + j * p.world + rank for j in range(p.micro_batches))
    return [range(q * p.per_rank, (q + 1) * p.per_rank) for q in blocks_]


class DataSet:
    """--dataset-size synthetic samples for `model`, seeded by --seed, visited in epochs:
    sample id i is the (i mod N)-th of epoch i // N's order, a permutation seeded by
    (--seed, epoch), as DistributedSampler shuffles each epoch."""

    def __init__(self, model: nn.Module, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.inputs, self.labels = synthetic_batch(model, size, 0, seed)
        self.orders: dict[int, torch.Tensor] = {}

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self.orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self.orders = {epoch: torch.randperm(self.size, generator=gen)}  # one epoch at a time
        return self.orders[epoch]

    def __getitem__(self, ids: range) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor([int(self.order(i // self.size)[i % self.size]) for i in ids])
        return self.inputs[index], self.labels[index]


def settings(cfg: Config) -> dict:
    """What a checkpoint must agree with to be resumed from under `--elastic`: the run's,
    less the world size, plus the data set's size and the policy (and for scale-lr the
    batch per rank)."""
    fixed = asdict(checkpoint.run_settings(cfg, cfg.global_batch_size, world_size=0))
    del fixed["world_size"]
    if cfg.elastic == SCALE_LR:
        fixed["batch_size"] = cfg.batch_size
    return {**fixed, "dataset_size": cfg.dataset_size, "elastic": cfg.elastic}


class Elastic:
    """The loop's side of `--elastic`: the plan of this world, where the data and the
    learning rate stand, what goes into a checkpoint, and what rank 0 says."""

    def __init__(self, cfg: Config, model: nn.Module, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.data = DataSet(model, cfg.dataset_size, cfg.seed)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.plan = plan(cfg, self.world)
        self.settings = settings(cfg)
        self.blocks = 0  # blocks of the stream taken so far (scale-lr)
        self.ramp = next_ramp(None, self.plan.lr, 0, cfg.elastic_warmup_steps)
        self.end = cfg.warmup_steps + cfg.steps  # the step the run ends before (`last_step`)
        self.log = sample_log(self.rank, self.world)

    # --8<-- [start:resume]
    def resume(
        self, run_dir: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> int:
        """Load the newest committed checkpoint under `run_dir` (None: no checkpoints),
        whatever world wrote it, and go on from its step, data position and learning rate.
        Rank 0 prints the header: the policy, and what this world trains."""
        state = None
        if run_dir is not None:
            state = checkpoint.restore(run_dir, model, optimizer, self.settings, any_world=True)
        step, before = 0, self.world
        if state is not None:
            data = state["data"]
            step, before, self.blocks = data["next_step"], data["world_size"], data["blocks"]
            self.ramp = next_ramp(Ramp(**data["ramp"]), self.plan.lr, step,
                                  self.cfg.elastic_warmup_steps)  # fmt: skip
        self.end = self.last_step(step)
        if self.rank == 0:
            print(self.header(step, before), flush=True)
        return step

    # --8<-- [end:resume]

    def last_step(self, step: int) -> int:
        """The step the run ends before, going on from `step`. keep-global-batch: the
        planned --warmup-steps + --steps. scale-lr: once the stream has given the samples
        the planned run trains (that many steps of --global-batch-size per micro-batch),
        rounded up to a whole step of this world: fewer ranks take more steps."""
        planned = self.cfg.warmup_steps + self.cfg.steps
        if self.cfg.elastic != SCALE_LR:
            return planned
        p = self.plan
        blocks = -(-planned * p.micro_batches * self.cfg.global_batch_size // p.per_rank)
        return step + max(0, -(-(blocks - self.blocks) // (p.micro_batches * self.world)))

    def header(self, step: int, before: int) -> str:
        """The policy and what this world trains; after a change of world, the change."""
        p, cfg = self.plan, self.cfg
        what = (
            f"global batch {p.global_batch} per micro-batch ({p.per_rank} per rank) "
            f"x {p.micro_batches} micro-batch{'es' if p.micro_batches > 1 else ''} per step"
        )
        lr = f"lr {self.ramp.lr(step):g}"
        if cfg.elastic == SCALE_LR:
            lr += f" (--lr {cfg.lr:g} x {p.global_batch}/{cfg.global_batch_size})"
        if self.ramp.steps and self.ramp.lr(step) != self.ramp.to_lr:
            lr += f", rising to {self.ramp.to_lr:g} over {self.ramp.steps} steps"
        steps = f"step {step} to {self.end}"
        ranks = f"{self.world} rank{'s' if self.world > 1 else ''}"
        if before != self.world:
            return (f"elastic {cfg.elastic}: re-formed from {before} to {ranks}, {steps}: "
                    f"{what}, {lr}")  # fmt: skip
        return f"elastic {cfg.elastic}: {ranks}, {steps}: {what}, {lr}"

    def start_step(
        self, step: int, optimizer: torch.optim.Optimizer
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Set the step's learning rate; return this rank's micro-batches, and log the
        ids of their samples."""
        for group in optimizer.param_groups:
            group["lr"] = self.ramp.lr(step)
        ids = sample_ids(self.plan, step, self.blocks, self.rank)
        if self.log is not None:
            ranges = [[r.start, r.stop] for r in ids]
            line = {"step": step, "world": self.world, "time": time.time(), "ids": ranges}
            self.log.write(json.dumps(line) + "\n")
        return [tuple(t.to(self.device) for t in self.data[r]) for r in ids]

    def end_step(self) -> None:
        if self.cfg.elastic == SCALE_LR:
            self.blocks += self.plan.micro_batches * self.world

    def position(self) -> dict:
        """The data position and learning rate a checkpoint keeps, beside its step."""
        return {"world_size": self.world, "blocks": self.blocks, "ramp": asdict(self.ramp)}

    def final_loss(self, model: nn.Module) -> float:
        """The loss over the whole data set, in evaluation mode: how far the run got,
        comparable between runs whatever their worlds were; rank 0 prints it."""
        training = model.training
        model.eval()  # BatchNorm's running statistics, not the data set's own
        with torch.no_grad():
            inputs, labels = self.data.inputs.to(self.device), self.data.labels.to(self.device)
            loss = F.cross_entropy(model(inputs), labels).item()
        model.train(training)
        if self.rank == 0:
            print(f"elastic: final loss {loss:.6f} over the {self.data.size} samples",
                  flush=True)  # fmt: skip
        return loss


def sample_log(rank: int, world: int) -> TextIO | None:
    """This rank's sample log if DDP_STAGES_SAMPLE_LOG names a folder: one file per group
    and rank, `group-<restart count>-<world size>-rank-<rank>.jsonl` (the restart count
    and the world size tell apart the groups a run re-forms: a group that grows when a
    node joins late keeps the count), a line
    per step: its number, the world, the time, and the [start, stop) ranges of sample
    ids per micro-batch."""
    folder = os.environ.get(SAMPLE_LOG)
    if not folder:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    Path(folder).mkdir(parents=True, exist_ok=True)
    # Line-buffered appends: a killed rank leaves every step it started.
    return open(Path(folder) / f"group-{attempt}-{world}-rank-{rank}.jsonl", "a", buffering=1)
