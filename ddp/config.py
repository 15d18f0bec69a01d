"""The command line every stage shares: one dataclass, parsed with argparse."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass
class Config:
    model: str = "mlp"  # mlp | cnn | transformer | frozen
    width: int = 256  # MLP units per layer; 2048 with depth 7 is ~25M parameters
    depth: int = 3  # MLP layers
    steps: int = 20  # timed optimizer steps
    warmup_steps: int = 3  # untimed steps first (allocations, lazy init)
    batch_size: int = 32  # samples per rank per step; the global batch is W times this
    global_batch_size: int = 0  # if > 0, overrides batch_size: split over the W ranks
    accumulation_steps: int = 1  # micro-batches per step; no_sync() on all but the last
    bucket_cap_mb: float = 25.0  # MiB of gradient bytes per bucket, as in torch's DDP
    backend: str = "auto"  # gloo | nccl | auto (nccl when CUDA is there)
    lr: float = 0.01  # SGD learning rate (momentum 0.9)
    seed: int = 0  # data seed; model init is deliberately seeded per rank
    profile_dir: str = ""  # if set, write torch.profiler traces and scalars under it
    profile_steps: int = 3  # steps traced, after the warm-up steps

    def __post_init__(self) -> None:
        for name in (
            "width",
            "depth",
            "steps",
            "batch_size",
            "accumulation_steps",
            "profile_steps",
        ):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size < 0:
            raise ValueError(f"--global-batch-size must be >= 0, got {self.global_batch_size}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb must be > 0 MiB, got {self.bucket_cap_mb}")

    def global_batch(self, world_size: int) -> int:
        """Samples per micro-batch over all ranks: --global-batch-size, else W x --batch-size."""
        return self.global_batch_size or self.batch_size * world_size


def parse_config(argv: list[str] | None = None, description: str | None = None) -> Config:
    """Config from the command line: one --flag per field, defaults from the dataclass."""
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(Config):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default
        )
    return Config(**vars(parser.parse_args(argv)))
