"""The benchmark's command line: its own options, every `Config` flag, the variant names
and --sweep."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import profiling.bench
from ddp.config import Config

REFERENCE = "torch_ddp"
FLOOR = "compute_only"
COMM = "communication_alone"  # the bound's middle term: the buckets' all-reduces, no compute
# Config fields a sweep may vary: each value gets its own variants and batches.
SWEEPABLE = ("bucket_cap_mb", "accumulation_steps", "batch_size", "global_batch_size")
# What the two parts of the bound depend on: swept over anything else, they run once and
# serve every value (compute_only does not care about buckets, nor the all-reduces about
# the batch), which saves a sweep minutes and memory.
DEPENDS_ON = {
    FLOOR: {"accumulation_steps", "batch_size", "global_batch_size"},
    COMM: {"bucket_cap_mb"},
}


@dataclass
class BenchOptions:
    nproc: int = 2  # ranks to launch; under torchrun, WORLD_SIZE decides instead
    rounds: int = 10  # interleaved rounds; every variant runs in every round
    round_warmup: int = 1  # untimed steps per variant at the start of each round
    variants: str = "all"  # comma-separated subset of compute_only, the stages, torch_ddp
    json: str = ""  # write the results here as JSON ("" = don't)
    markdown: str = ""  # write the table here as a markdown fragment ("" = don't)
    merge: bool = False  # keep other workloads already in --json; render all of them
    network: str = "loopback"  # or a rate, e.g. 1gbit: one shaped namespace per rank
    sweep: str = ""  # FIELD=v1,v2,...: every variant once per value, all interleaved
    plot: str = ""  # write a PNG of the results here ("" = don't)
    render: str = ""  # run nothing: render this results JSON to --markdown and --plot


_HELP = {
    "nproc": "ranks to launch with torchrun (ignored under torchrun: WORLD_SIZE decides)",
    "rounds": "interleaved rounds; each runs every variant, order rotated by one",
    "round_warmup": "untimed steps per variant at the start of each round",
    "variants": "comma-separated subset of compute_only, communication_alone, the stages\n"
    "and torch_ddp, or all (the bound needs compute_only and communication_alone)",
    "json": "write the results as JSON to this path",
    "markdown": "write the results as a markdown fragment to this path",
    "merge": "keep the other workloads already in --json and render them all to --markdown\n"
    "and --plot",
    "sweep": "FIELD=v1,v2,...: run every variant once per value, interleaved in the same\n"
    f"rounds; FIELD is one of {', '.join(SWEEPABLE)}",
    "plot": "write a PNG of the results (with --merge, of every workload in --json)",
    "render": "run nothing: read this JSON (as --json wrote it) and write --markdown and\n"
    "--plot from it, e.g. after changing how they look",
    "network": "loopback, or a rate (1gbit, 500mbit): each rank in a network namespace of\n"
    "its own, linked at that rate each way (profiling.cluster; needs root)",
    "steps": "timed steps per variant per round",
    "warmup_steps": "untimed steps per variant once, before the first round",
}


def parse_options(argv: list[str]) -> tuple[BenchOptions, Config]:
    """The benchmark's own options plus every `Config` flag, in one parser (one --help)."""
    parser = argparse.ArgumentParser(
        prog="python -m profiling.bench",
        description=profiling.bench.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    for dc in (BenchOptions, Config):
        for f in dataclasses.fields(dc):
            flag = "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                parser.add_argument(flag, action="store_true", help=_HELP.get(f.name))
            else:
                parser.add_argument(
                    flag, type=type(f.default), default=f.default, help=_HELP.get(f.name)
                )
    # A round is a few steps per variant, not a whole run: Config's default of 20 would
    # make each round long enough for the noise to differ between variants again.
    parser.set_defaults(steps=5)
    args = vars(parser.parse_args(argv))
    bench_names = {f.name for f in dataclasses.fields(BenchOptions)}
    opts = BenchOptions(**{k: v for k, v in args.items() if k in bench_names})
    cfg = Config(**{k: v for k, v in args.items() if k not in bench_names})
    if opts.network != "loopback":
        from profiling.cluster.network import parse_rate

        try:
            parse_rate(opts.network)
        except ValueError as error:
            raise SystemExit(f"--network: {error}, or loopback") from None
    if opts.sweep:
        try:
            sweep_configs(cfg, opts.sweep)
        except ValueError as error:
            raise SystemExit(f"--sweep: {error}") from None
    if opts.nproc < 1 or opts.rounds < 1 or opts.round_warmup < 0:
        raise SystemExit("--nproc and --rounds must be >= 1, --round-warmup >= 0")
    if cfg.profile_dir:
        # Tracing costs time inside the steps being timed; traces come from a stage run.
        raise SystemExit("--profile-dir does not apply here: profile with -m stages.<name>")
    return opts, cfg


def sweep_configs(cfg: Config, sweep: str) -> tuple[str, list[tuple[float | int, Config]]]:
    """`FIELD=v1,v2,...` -> (FIELD, [(value, cfg with FIELD=value), ...]); no sweep: one
    config, value None. Raises ValueError with what is wrong."""
    if not sweep:
        return "", [(None, cfg)]
    name, sep, values = sweep.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not sep or name not in SWEEPABLE or not values.strip():
        raise ValueError(f"{sweep!r}: give FIELD=v1,v2,... with FIELD one of {SWEEPABLE}")
    kind = type(getattr(cfg, name))
    out = []
    for text in values.split(","):
        try:
            value = kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not a {kind.__name__}") from None
        if any(value == v for v, _ in out):
            raise ValueError(f"{name}={text} appears twice")
        out.append((value, dataclasses.replace(cfg, **{name: value})))  # validates it too
    return name, out
