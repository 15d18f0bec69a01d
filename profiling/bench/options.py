"""The benchmark's command line: its own options, every `Config` flag, the variant names
and --sweep."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import profiling.bench
from ddp.config import (
    Config,
    HelpFormatter,
    RankZeroParser,
    add_options,
    check_not_applicable,
    option,
)
from profiling.cluster.network import parse_rate

REFERENCE = "torch_ddp"
FLOOR = "compute_only"
COMM = "communication_alone"  # the bound's middle term: the buckets' all-reduces, no compute
# Config fields a sweep may vary: each value gets its own variants and batches.
SWEEPABLE = ("bucket_cap_mb", "accumulation_steps", "batch_size", "global_batch_size")
# What the two parts of the bound, and the variants that ignore the cap, depend on: swept
# over anything else, they run once and serve every value (compute_only does not care
# about buckets, nor the all-reduces about the batch), which saves a sweep minutes and
# memory.
BATCH = {"accumulation_steps", "batch_size", "global_batch_size"}
DEPENDS_ON = {
    FLOOR: BATCH,
    COMM: {"bucket_cap_mb"},
    # Variants that choose their buckets themselves, whatever --bucket-cap-mb says.
    "torch_ddp_default": BATCH,
    "drop_in_default": BATCH,
    "drop_in_auto": BATCH,
}


@dataclass
class BenchOptions:
    nproc: int = option(2, "ranks to launch with torchrun (under torchrun, WORLD_SIZE decides)")
    rounds: int = option(10, "interleaved rounds; each runs every variant, order rotated by one")
    round_warmup: int = option(1, "untimed steps per variant at the start of each round")
    variants: str = option(
        "all",
        "comma-separated subset of compute_only, communication_alone, the stages and "
        "torch_ddp, or all (the bound needs compute_only and communication_alone)",
        metavar="NAMES",
    )
    json: str = option("", "write the results as JSON to this path", metavar="PATH")
    markdown: str = option(
        "", "write the results as a markdown fragment to this path", metavar="PATH"
    )
    merge: bool = option(
        False, "keep the other workloads already in --json; render all to --markdown and --plot"
    )
    network: str = option(
        "loopback",
        "loopback, or a rate (1gbit, 500mbit): each rank in a network namespace of its own, "
        "linked at that rate each way (profiling.cluster; needs root)",
        metavar="RATE",
    )
    sweep: str = option(
        "",
        "FIELD=v1,v2,...: run every variant once per value, interleaved in the same rounds; "
        f"FIELD is one of {', '.join(SWEEPABLE)}",
        metavar="FIELD=VALUES",
    )
    plot: str = option(
        "",
        "write a PNG of the results (with --merge, of every workload in --json)",
        metavar="PATH",
    )
    render: str = option(
        "",
        "run nothing: read this JSON (as --json wrote it) and write --markdown and --plot "
        "from it, e.g. after changing how they look",
        metavar="PATH",
    )


# Config's fields mean something a little different here.
CONFIG_HELP = {
    "steps": "timed steps per variant per round",
    "warmup_steps": "untimed steps per variant once, before the first round",
}
# A round is a few steps per variant, not a whole run: Config's default of 20 would make
# each round long enough for the noise to differ between variants again.
CONFIG_DEFAULTS = {"steps": 5}
# Tracing costs time inside the steps being timed; traces come from a stage run.
NOT_APPLICABLE = {
    "profile_dir": "tracing would time itself; profile with -m stages.<name>",
    "profile_steps": "nothing is traced here",
    "deterministic": "the benchmark times the kernels a run picks by default",
    "runs": "the benchmark's runs are its --variants",
}


def parse_options(argv: list[str]) -> tuple[BenchOptions, Config]:
    """The benchmark's own options plus every `Config` flag, in one parser (one --help)."""
    parser = RankZeroParser(
        prog="python -m profiling.bench",
        description=profiling.bench.__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # --b could mean --batch-size or --bucket-cap-mb
    )
    add_options(parser, BenchOptions)
    add_options(parser, Config, CONFIG_HELP, CONFIG_DEFAULTS, NOT_APPLICABLE)
    args = parser.parse_args(argv)
    check_not_applicable(parser, args, NOT_APPLICABLE)
    args = vars(args)
    bench_names = {f.name for f in dataclasses.fields(BenchOptions)}
    opts = BenchOptions(**{k: v for k, v in args.items() if k in bench_names})
    try:
        cfg = Config(**{k: v for k, v in args.items() if k not in bench_names})
    except ValueError as error:
        parser.error(str(error))
    if cfg.bucket_cap_mb == "auto":
        parser.error("--bucket-cap-mb auto: every variant here takes MiB; the automatic "
                     "bucket size is the drop_in_auto variant")  # fmt: skip
    if opts.network != "loopback":
        try:
            parse_rate(opts.network)
        except ValueError as error:
            parser.error(f"--network: {error}, or loopback")
    if opts.sweep:
        try:
            sweep_configs(cfg, opts.sweep)
        except ValueError as error:
            parser.error(f"--sweep: {error}")
    if opts.nproc < 1 or opts.rounds < 1 or opts.round_warmup < 0:
        parser.error("--nproc and --rounds must be >= 1, --round-warmup >= 0")
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
