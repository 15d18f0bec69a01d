"""The experiment's options: one field of `Settings` per command-line flag."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import profiling.large_batch

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
    parser = argparse.ArgumentParser(
        prog="python -m profiling.large_batch",
        description=profiling.large_batch.__doc__.split("\n\n")[0],
    )
    for f in dataclasses.fields(Settings):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default
        )
    return Settings(**vars(parser.parse_args(argv)))
