"""The experiment's options, one field of `Settings` per command-line flag, and what one
run is and produces (`Run`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import profiling.studies.large_batch
from ddp.config import HelpFormatter, RankZeroParser, add_options, option

VARIANTS = ("unscaled", "no_warmup", "gradual", "constant")
DECAYS = ("step", "cosine")


@dataclass
class Settings:
    per_worker_batch: int = option(32, "n, samples per worker per step (the paper's 32)")
    workers: str = option(
        "1,4,16,32,64,256", "k values, comma-separated: global batch k*n", metavar="K,K,..."
    )
    variants: str = option(
        ",".join(VARIANTS), "learning-rate rules, comma-separated", metavar="RULE,..."
    )
    seeds: int = option(3, "seeds 0..N-1: initialisation and shuffling (the data stay)")
    epochs: int = option(16, "training epochs, the same at every batch size")
    warmup_epochs: float = option(2.0, "warmup length (gradual, constant), in epochs")
    decay: str = option("step", "the decay after the warmup", choices=DECAYS)
    decay_epochs: str = option(
        "8,12", "step decay milestones (epochs from the start); x gamma", metavar="E,E,..."
    )
    gamma: float = option(0.1, "step decay factor")
    base_lr: float = option(0.05, "SGD learning rate at the reference batch (tuned at k=1)")
    # lr = base_lr * k*n / reference_batch. The paper's reference is 256 = 8 workers of
    # 32; ours is one worker of 32, the smallest batch trained, so k=1 is the baseline.
    reference_batch: int = option(32, "the batch base_lr is for: lr = base_lr * k*n / this")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(1e-4, "weights only: not BatchNorm, not biases")
    width: int = option(256, "hidden units of the two BatchNorm layers")
    # 3 x 8192: the largest default batch takes 3 steps per epoch
    train_samples: int = option(24_576, "training samples (generated once, offline)")
    val_samples: int = option(4_096, "validation samples")
    data_seed: int = option(0, "the data set itself")
    jobs: int = option(2, "trainings run side by side on one machine (not under torchrun)")
    checkpoint_dir: str = option(
        "",
        "checkpoint each run under DIR/k<k>-<rule>-seed<s>; a run started again resumes from "
        "its newest committed checkpoint there, and a finished run is not trained again",
        metavar="DIR",
    )
    checkpoint_every: int = option(
        50, "optimizer steps between a run's checkpoints; one at its end too"
    )
    json: str = option("", "write all results (settings, runs, curves) here", metavar="PATH")
    markdown: str = option("", "write the results table here (a docs fragment)", metavar="PATH")
    plot_prefix: str = option(
        "", "write <prefix>-error.png and <prefix>-curves.png", metavar="PREFIX"
    )
    render: str = option(
        "",
        "redraw --plot-prefix's figures from this --json file of an earlier run; train nothing",
        metavar="PATH",
    )

    def __post_init__(self) -> None:
        for name in (
            "per_worker_batch", "seeds", "epochs", "jobs", "width", "reference_batch",
            "checkpoint_every",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        try:
            self.decay_epoch_list  # noqa: B018  parses, or raises
            workers = self.worker_list
        except ValueError:
            raise ValueError(
                f"--workers and --decay-epochs take comma-separated numbers, got "
                f"{self.workers!r} and {self.decay_epochs!r}"
            ) from None
        if not workers or min(workers) < 1:
            raise ValueError(f"--workers must list worker counts >= 1, got {self.workers!r}")
        unknown = set(self.variant_list) - set(VARIANTS)
        if unknown:
            raise ValueError(f"--variants: unknown {sorted(unknown)}; pick from {VARIANTS}")
        if self.decay not in DECAYS:
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
    parser = RankZeroParser(
        prog="python -m profiling.studies.large_batch",
        description=profiling.studies.large_batch.__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    add_options(parser, Settings)
    try:
        return Settings(**vars(parser.parse_args(argv)))
    except ValueError as error:  # what the fields' types cannot say: see __post_init__
        parser.error(str(error))


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
    params_sha256: str = ""  # of the final parameters (ddp.checkpoint.params_sha256)

    @property
    def final_val_error(self) -> float:
        return self.val_error[-1]
