"""The command line every stage shares: one dataclass, parsed with argparse.

Each field carries its own description (and, where only some values work, its choices),
so `--help` and the checks that refuse a bad value come from the same place as the
default. Under torchrun every rank parses the same arguments; only rank 0 speaks, so a
refusal or `--help` appears once, not once per rank."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, NoReturn

from ddp.models import MODELS

BACKENDS = ("gloo", "nccl", "auto")
ELASTIC = ("off", "keep-global-batch", "scale-lr")  # ddp/elastic.py


def option(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A field with its `--help` text, and if only some values work, its choices; `metavar`
    names its value in --help (default: N for integers, X for other numbers); `parse`
    reads the flag's text (default: the type of `default`)."""
    metadata = {"help": help, "choices": choices, "metavar": metavar, "parse": parse}
    return field(default=default, metadata=metadata)


def bucket_cap(text: str) -> float | str:
    """--bucket-cap-mb: MiB, or `auto` for the stages that measure their own."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give MiB (a number) or auto (auto_bucket and later stages)"
        ) from None


@dataclass
class Config:
    model: str = option(
        "mlp",
        "the model every rank trains: mlp (--width x --depth), cnn (BatchNorm, many small "
        "parameters), transformer (one block, tied embedding), frozen (an MLP whose first "
        "layer does not train)",
        choices=tuple(MODELS),
    )
    width: int = option(256, "MLP units per layer; 2048 with --depth 7 is ~25M parameters")
    depth: int = option(3, "MLP layers")
    steps: int = option(20, "timed optimizer steps")
    warmup_steps: int = option(3, "untimed steps first (allocations, lazy init)")
    batch_size: int = option(
        32, "samples per rank per micro-batch (per optimizer step with --accumulation-steps 1)"
    )
    global_batch_size: int = option(
        0,
        "if > 0, replaces --batch-size: samples per micro-batch over all W ranks (a multiple of W)",
    )
    accumulation_steps: int = option(
        1, "micro-batches per optimizer step; no_sync() on all but the last"
    )
    bucket_cap_mb: float | str = option(
        25.0,
        "MiB of gradient bytes per bucket, as in torch's DDP, or auto: measured (the stages "
        "that take it, auto_bucket and later)",
        metavar="MIB|auto",
        parse=bucket_cap,
    )
    backend: str = option(
        "auto", "gloo (CPU), nccl (one GPU per rank), or auto: nccl where CUDA is", BACKENDS
    )
    lr: float = option(0.01, "SGD learning rate (momentum 0.9)")
    seed: int = option(0, "data seed; model init is seeded per rank on purpose")
    profile_dir: str = option(
        "", "write torch.profiler traces and TensorBoard scalars under DIR/<run>", metavar="DIR"
    )
    profile_steps: int = option(3, "steps traced with --profile-dir, after the warm-up steps")
    runs: str = option(
        "",
        "the main job's runs to train (python -m stages), comma-separated, e.g. "
        "compute_only,overlapped,torch_ddp (default: all)",
        metavar="NAMES",
    )
    checkpoint_dir: str = option(
        "",
        "checkpoint under DIR/<run>, and resume from the newest committed checkpoint there "
        "(torchrun --max-restarts N then resumes instead of starting over)",
        metavar="DIR",
    )
    checkpoint_every: int = option(
        50, "optimizer steps (warm-up steps included) between checkpoints; one at the end too"
    )
    checkpoint_keep: int = option(
        1, "committed checkpoints kept, the newest; an older one goes once a newer is committed"
    )
    deterministic: bool = option(
        False,
        "torch's deterministic algorithms (torch.use_deterministic_algorithms): on a GPU, "
        "needed for two runs, or a run and its resume, to end with bit-identical "
        "parameters; some of cuDNN's convolution kernels add in an order that varies",
    )
    elastic: str = option(
        "off",
        "go on with the ranks left when torchrun (--nnodes MIN:MAX --max-restarts K) re-forms "
        "the group after losing a node, resuming a checkpoint of another world size: "
        "keep-global-batch trains --global-batch-size per micro-batch on any world (a larger "
        "batch per rank; the learning rate unchanged); scale-lr trains --batch-size per rank "
        "and scales the learning rate with the global batch, --lr x (W x --batch-size) / "
        "--global-batch-size (the linear scaling rule); both need --global-batch-size, the "
        "global batch the run is planned for (docs/when-a-server-is-lost.md)",
        ELASTIC,
    )
    dataset_size: int = option(
        1024,
        "with --elastic: synthetic samples in the data set the run trains over, epoch after "
        "epoch, shuffled per epoch",
    )
    elastic_warmup_steps: int = option(
        5, "with --elastic scale-lr, steps over which a learning rate that rises is ramped up"
    )
    timeout: float = option(
        300.0,
        "seconds a rank waits for one that stopped answering before the run fails, naming it "
        "(Gloo's own default is 30 minutes)",
        metavar="S",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{flag(f.name)} must be one of {', '.join(choices)}, "
                    f"got {getattr(self, f.name)!r}"
                )
        for name in (
            "width", "depth", "steps", "batch_size", "accumulation_steps", "checkpoint_every",
            "checkpoint_keep", "dataset_size",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size < 0:
            raise ValueError(f"--global-batch-size must be >= 0, got {self.global_batch_size}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.elastic_warmup_steps < 0:
            raise ValueError(
                f"--elastic-warmup-steps must be >= 0, got {self.elastic_warmup_steps}"
            )
        if self.elastic != "off" and not self.global_batch_size:
            raise ValueError(
                f"--elastic {self.elastic} needs --global-batch-size: the global batch the run "
                "is planned for, which keep-global-batch keeps and scale-lr scales --lr from "
                "(e.g. 64 for 4 ranks of 16)"
            )
        if self.bucket_cap_mb != "auto" and not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb must be > 0 MiB or auto, got {self.bucket_cap_mb}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a finite number >= 0, got {self.lr}")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(
                f"--timeout must be a finite number of seconds > 0, got {self.timeout}"
            )
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be in [0, 2**32), got {self.seed}")
        if self.profile_steps < 1:
            raise ValueError(f"--profile-steps must be >= 1, got {self.profile_steps}")
        # The profiler warms itself up on the last warm-up step (or on the first timed
        # step when there is none); asked for more, it would trace fewer steps, silently.
        traceable = self.steps if self.warmup_steps else self.steps - 1
        if self.profile_dir and self.profile_steps > traceable:
            raise ValueError(
                f"--profile-steps {self.profile_steps} is more than the {traceable} steps that "
                f"can be traced with --steps {self.steps} --warmup-steps {self.warmup_steps}; "
                "raise --steps or lower --profile-steps"
            )

    def global_batch(self, world_size: int) -> int:
        """Samples per micro-batch over all ranks: --global-batch-size, else W x --batch-size
        (and always with --elastic scale-lr, which keeps the batch per rank)."""
        if self.elastic == "scale-lr":
            return self.batch_size * world_size
        return self.global_batch_size or self.batch_size * world_size


def flag(name: str) -> str:
    """The command-line flag of field `name`: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


class RankZeroParser(argparse.ArgumentParser):
    """argparse that speaks on rank 0 only. Under torchrun every rank parses the same
    arguments: the others exit with the same status, silently, instead of printing the
    same usage block (or --help) once per rank."""

    # Long enough for rank 0 to import torch and parse on a busy machine (5 s was not);
    # torchrun stops this rank as soon as rank 0 fails, so it is never waited out then.
    QUIET_RANK_WAIT_S = 60.0

    def print_usage(self, file: IO[str] | None = None) -> None:
        if rank_zero():
            super().print_usage(file)

    def print_help(self, file: IO[str] | None = None) -> None:
        if rank_zero():
            super().print_help(file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if status and not rank_zero():
            # torchrun stops every rank as soon as one fails, and names the first to fail
            # as the root cause: leave that to rank 0, the one that says why, instead of
            # stopping it before it has printed. Bounded, in case rank 0 parsed fine.
            time.sleep(self.QUIET_RANK_WAIT_S)
        super().exit(status, message if rank_zero() else None)


def rank_zero() -> bool:
    """Whether this process is rank 0, or not under torchrun at all: the one that prints."""
    return os.environ.get("RANK", "0") == "0"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (they hold command lines), options in a wide column."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


METAVARS = {int: "N", float: "X"}


def add_options(
    parser: argparse.ArgumentParser,
    dataclass_type: type,
    help: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
    not_applicable: dict[str, str] | None = None,
) -> None:
    """One --flag per field of `dataclass_type`, its help from the field's metadata
    (`help` overrides it by name, `defaults` the default), with the default and any
    choices shown. A field in `not_applicable` is listed as not applying, for the
    reason given, and refused if given (see `check_not_applicable`)."""
    help, defaults, not_applicable = help or {}, defaults or {}, not_applicable or {}
    for f in dataclasses.fields(dataclass_type):
        default = defaults.get(f.name, f.default)
        text = help.get(f.name, f.metadata.get("help", ""))
        choices = f.metadata.get("choices")
        metavar = f.metadata.get("metavar") or METAVARS.get(type(f.default), "TEXT")
        parse = f.metadata.get("parse") or type(f.default)
        kwargs = {"type": parse, "metavar": None if choices else metavar}
        if isinstance(f.default, bool):  # a switch: given or not
            kwargs = {"action": "store_true", "default": default}
        if f.name in not_applicable:
            text = f"does not apply: {not_applicable[f.name]}"
            kwargs["default"] = argparse.SUPPRESS
        elif isinstance(f.default, bool):
            text += f" (default: {'on' if default else 'off'})"
        else:
            text += f" (default: {'off' if default == '' else default})"
            kwargs.update(default=default, choices=choices)
        # argparse %-formats help strings: a literal % must be doubled.
        parser.add_argument(flag(f.name), help=text.replace("%", "%%"), **kwargs)


def check_not_applicable(
    parser: argparse.ArgumentParser, args: argparse.Namespace, not_applicable: dict[str, str]
) -> None:
    """Refuse, with the usage line, any option given that does not apply."""
    for name, why in not_applicable.items():
        if name in vars(args):
            parser.error(f"{flag(name)} does not apply: {why}")


def config_parser(
    module: str, description: str | None = None, not_applicable: dict[str, str] | None = None
) -> RankZeroParser:
    """The parser of `torchrun ... -m MODULE`: every Config field, described."""
    parser = RankZeroParser(
        prog=f"torchrun ... -m {module}",
        description=description,
        formatter_class=HelpFormatter,
        epilog="torchrun's own options (--nproc-per-node, --nnodes, ...) go before -m.",
        allow_abbrev=False,  # --b could mean --batch-size or --bucket-cap-mb
    )
    add_options(parser, Config, not_applicable=not_applicable)
    return parser


def parse_config(
    argv: list[str] | None = None,
    *,
    module: str,
    description: str | None = None,
    not_applicable: dict[str, str] | None = None,
    auto_bucket_cap: bool = False,
) -> Config:
    """Config from the command line of `torchrun ... -m MODULE`. Refuses with the usage
    line, before any process group or model exists: a value no run could use, an option in
    `not_applicable`, `--bucket-cap-mb auto` unless the stage measures its own
    (`auto_bucket_cap`), and what this launch cannot do (no torchrun, nccl without CUDA, a
    global batch that does not split over WORLD_SIZE ranks)."""
    not_applicable = not_applicable or {}
    parser = config_parser(module, description, not_applicable)
    args = parser.parse_args(argv)
    check_not_applicable(parser, args, not_applicable)
    try:
        cfg = Config(**vars(args))
    except ValueError as error:
        parser.error(str(error))
    if cfg.bucket_cap_mb == "auto" and not auto_bucket_cap:
        parser.error(f"--bucket-cap-mb auto: {module} takes a number of MiB; auto is for "
                     "the stages that measure their own (auto_bucket and later)")  # fmt: skip
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error(
            "RANK and WORLD_SIZE are not set: launch with torchrun, e.g. "
            f"`torchrun --standalone --nproc-per-node 2 -m {module}`"
        )
    world = int(os.environ["WORLD_SIZE"])
    if cfg.global_batch(world) % world:
        parser.error(
            f"global batch {cfg.global_batch(world)} does not split over {world} ranks; "
            f"pick a multiple of {world} for --global-batch-size"
        )
    if cfg.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            parser.error("--backend nccl needs CUDA, and torch sees no GPU; use gloo or auto")
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local_ranks > torch.cuda.device_count():
            parser.error(
                f"--backend nccl needs a GPU per rank: {local_ranks} ranks on this node, "
                f"{torch.cuda.device_count()} GPUs; run fewer ranks, or use gloo or auto"
            )
    return cfg
