"""Benchmark: every stage's step time against torch's DDP and compute-only, interleaved.

    python -m profiling.bench --nproc 2 --model mlp --width 2048 --depth 6 --batch-size 64 \
        --rounds 30 --steps 5 --json out.json --markdown out.md

Run like this, the module launches `torchrun --standalone --nproc-per-node N` on itself
(a subprocess with the same Python), so one command does everything. Under a launcher
of your own it runs directly, and the launcher's WORLD_SIZE replaces --nproc:

    torchrun --standalone --nproc-per-node 2 -m profiling.bench --model cnn --rounds 30

With --network 1gbit (any tc rate) the ranks run on a shaped network instead of
loopback: `profiling.cluster` puts each rank in a network namespace of its own, with a
link limited to that rate each way, measures Gloo's all-reduce bandwidth across it
(recorded with the results), runs the benchmark as one torchrun node per namespace, and
removes the namespaces afterwards. It needs root; where the cluster cannot be made, the
benchmark says why and runs on loopback, and the results say loopback.

Method. Every variant (compute_only, each stage in `stages.STAGES`, torch_ddp) is built
once, model, wrapper and optimizer, and trained for --warmup-steps untimed steps. Then
--rounds rounds: each round runs every variant for --round-warmup untimed and --steps
timed steps, in an order rotated by one each round, so a slow spell on a shared machine
hits every variant alike. Every step starts at a barrier and its time is the slowest
rank's. All variants see the same batches. The step is `ddp.train.train`'s: for each of
--accumulation-steps micro-batches forward, cross-entropy, backward (inside no_sync()
but for the last, where the wrapper has it), finish_gradient_synchronization; then the
SGD(momentum) step and zero_grad.

The perfect-overlap bound. Two more things are timed in the same rounds: inside every
compute_only step, the time from its start to the end of the last micro-batch's forward
(F: with one micro-batch, the forward; nothing can be communicated before it ends) and
from the optimizer step's start to the step's end (O: nothing can update before the
last all-reduce ends); and a variant `communication_alone`, which all-reduces the
gradient buckets (ddp.buckets.assign_buckets at the same bucket cap, the stages'
layout) back to back with no compute, launched asynchronously in bucket order and
waited for, timed like a step (A). No wrapper that synchronises once per step can beat

    bound = max(compute_only, F + A + O)

since compute and communication at best overlap completely. Every figure here is the
median of the slowest rank per step.

Reported per variant: median, min and max over all timed steps; the ratio of medians to
torch_ddp, to compute_only and to the bound; the ratio to torch_ddp and to the bound
within each round (paired, so both sides share that round's noise) as median and range;
exposed communication (median step minus compute-only median, as in DESIGN.md);
all-reduces per step; with several micro-batches per step, the time per micro-batch.

Sweeps. `--sweep bucket_cap_mb=1e-6,1,25,1e6` (or accumulation_steps, batch_size,
global_batch_size) builds every variant once per value and interleaves all of them in
the same rounds, so the curve is not bent by the machine's mood; each value has its own
bound. compute_only and communication_alone run once for all values where the swept
field does not change them (DEPENDS_ON). The markdown adds a summary table, one row per
value.

Outputs: the table on stdout; --json and --markdown write the same results, --plot a PNG
(one panel per workload: bars, or the sweep's curve). With --merge, the workloads already
in the --json file are kept (this run replaces its own workload) and --markdown and
--plot render all of them, the markdown's first line naming the commands that produced
them. The markdown is a fragment the docs include under a heading. `--render FILE.json`
runs nothing and redraws --markdown and --plot from results already written.

Every option of `ddp.config.Config` applies (--model, --batch-size, --bucket-cap-mb,
...), except that --steps counts timed steps per variant per round and --profile-dir is
refused (tracing would time itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import Bucket, assign_buckets
from ddp.config import Config
from ddp.data import split_batch
from ddp.dist import replicas_identical, setup_process_group, teardown_process_group
from ddp.models import build_model
from ddp.train import (
    ComputeOnly,
    MicroBatches,
    Wrap,
    make_micro_batches,
    standard_runs,
    synchronize,
    train_step,
)

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
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
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
        from profiling.cluster import parse_rate

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


# --- launching ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    opts, cfg = parse_options(argv)
    if opts.render:
        records = json.loads(Path(opts.render).read_text())["workloads"]
        write_outputs(records[-1], dataclasses.replace(opts, json="", merge=False), records)
        return
    if "RANK" not in os.environ:
        raise SystemExit(launch(opts, argv))
    run_worker(opts, cfg)


def launch(opts: BenchOptions, argv: list[str]) -> int:
    """Run this module under torchrun on `opts.nproc` ranks, on loopback or on a shaped
    cluster (--network); return its exit code."""
    python = sys.executable
    if Path(python).is_relative_to(Path.cwd()):
        python = os.path.relpath(python)  # `.venv/bin/python`, as typed, not /home/...
    # The workers record the command that was typed, so results name what produced them.
    env = {"BENCH_COMMAND": shlex.join([python, "-m", "profiling.bench", *argv])}
    worker_args = ["-m", "profiling.bench", *_without(argv, "--nproc", "--network")]
    if opts.plot:
        import matplotlib  # noqa: F401  fail now, not after minutes of benchmarking
    if opts.network != "loopback":
        from profiling.cluster import VirtualCluster, available

        ok, why = available()
        if ok:
            with VirtualCluster(ranks=opts.nproc, rate=opts.network) as cluster:
                probe = cluster.probe() if opts.nproc > 1 else None
                env["BENCH_NETWORK"] = json.dumps({"rate": opts.network, "probe": probe})
                return cluster.run(worker_args, env=env).returncode
        print(f"profiling.bench: no shaped network ({why}); running on loopback", file=sys.stderr)
    env["BENCH_NETWORK"] = json.dumps({"rate": "loopback"})
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += [f"--nproc-per-node={opts.nproc}", *worker_args]
    return subprocess.run(torchrun, env={**os.environ, **env}).returncode


def _without(argv: list[str], *flags: str) -> list[str]:
    """argv minus `flags` and their values: the workers don't need them, and torchrun's
    own parser rejects --nproc as an ambiguous abbreviation of its --nproc-per-node even
    after the module name."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out


def network() -> dict:
    """The network the ranks talk over, as `launch` passed it on; a launcher of the
    user's own says nothing, and the network is then unknown."""
    return json.loads(os.environ.get("BENCH_NETWORK", '{"rate": "unknown (own launcher)"}'))


# --- the variants ---------------------------------------------------------------------


@dataclass
class Variant:
    """One contender, built once and reused by every round."""

    name: str  # compute_only, communication_alone, a stage or torch_ddp
    cfg: Config  # its own: in a sweep, each value's variants have theirs
    model: nn.Module  # the bare model; replicas_identical checks its parameters
    wrapped: nn.Module | None  # None for communication_alone, which has no step to take
    optimizer: torch.optim.Optimizer | None
    sweep_value: float | int | None = None  # None: no sweep, or one run for every value
    buckets: list[Bucket] = field(default_factory=list)  # communication_alone's buffers
    step_times_s: list[float] = field(default_factory=list)  # this rank's timed steps
    step_rounds: list[int] = field(default_factory=list)  # the round of each timed step
    # compute_only only: the bound's F and O in each timed step, from `marks`, which its
    # hooks fill in during a step.
    forward_s: list[float] = field(default_factory=list)
    optimizer_s: list[float] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)

    def finish(self) -> None:
        finish = getattr(self.wrapped, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()


def variant_wraps() -> dict[str, Wrap | None]:
    """Name -> wrap(model, cfg), in table order: the floor, communication alone (no
    wrapper), the stages, the reference, then the EXTRA variants (by name only)."""
    runs = standard_runs()
    return {FLOOR: runs.pop(FLOOR), COMM: None, **runs, **extra_wraps()}


def extra_wraps() -> dict[str, Wrap]:
    """Variants that `--variants all` leaves out: stage options and torch's defaults."""
    from stages import STAGES

    last = STAGES["drop_in"]
    return {
        # torch's DDP as most scripts use it: bucket_cap_mb=None, 25 MiB and a 1 MiB first
        "torch_ddp_default": lambda model, cfg: nn.parallel.DistributedDataParallel(model),
        "drop_in_default": lambda model, cfg: last(model),
        "drop_in_auto": lambda model, cfg: last(model, bucket_cap_mb="auto"),
        "grad_views_on": lambda model, cfg: STAGES["grad_views"](
            model, bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True
        ),
        "round_robin_2": lambda model, cfg: STAGES["round_robin"](
            model, bucket_cap_mb=cfg.bucket_cap_mb, round_robin_groups=2
        ),
    }


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


def build_variant(
    name: str, wrap: Wrap | None, cfg: Config, device: torch.device, sweep_value=None
) -> Variant:
    # As in ddp.train.train: seeded per rank on purpose, the wrapper makes replicas equal.
    torch.manual_seed(cfg.seed * 1000 + dist.get_rank())
    model = build_model(cfg.model, width=cfg.width, depth=cfg.depth).to(device)
    if name == COMM:
        # The stages' layout: reverse parameter order, at most bucket_cap_mb MiB each.
        # The buffers stay zero (0 + 0 never overflows); Gloo's time does not depend on
        # the values.
        buckets = assign_buckets(list(model.named_parameters()), cfg.bucket_cap_mb)
        return Variant(name, cfg, model, None, None, sweep_value, buckets=buckets)
    wrapped = wrap(model, cfg)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=cfg.lr, momentum=0.9)
    variant = Variant(name, cfg, model, wrapped, optimizer, sweep_value)
    if name == FLOOR:
        marks = variant.marks
        # Each forward overwrites the mark, so with k micro-batches F ends at the last
        # forward: the first k - 1 forwards and backwards precede the synchronised
        # backward too. Two time stamps per step, a few microseconds.
        wrapped.register_forward_hook(
            lambda *_: marks.__setitem__("forward_end", time.perf_counter())
        )
        optimizer.register_step_pre_hook(
            lambda *_: marks.__setitem__("optimizer_start", time.perf_counter())
        )
    return variant


def communicate(buckets: list[Bucket]) -> None:
    """All-reduce every bucket back to back with no compute: launched asynchronously in
    bucket order, as the overlapped stage and torch's DDP launch them, then waited for."""
    works = [dist.all_reduce(b.buffer, async_op=True) for b in buckets]
    for work in works:
        work.wait()


def step(
    variant: Variant, micro_batches: MicroBatches, device: torch.device
) -> tuple[float, float | None, float | None]:
    """One optimizer step (ddp.train.train_step, spans included), timed on this rank:
    (seconds, F, O), F and O only for compute_only (else None)."""
    # Start together: otherwise a rank's time absorbs its partner's lag from the step
    # before (or from the previous variant), and "slowest rank" loses its meaning.
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    if variant.name == COMM:
        communicate(variant.buckets)
    else:
        train_step(variant.wrapped, micro_batches, variant.optimizer, variant.finish)
    synchronize(device)
    end = time.perf_counter()
    if not variant.marks:
        return end - start, None, None
    # zero_grad counts with the optimizer, as in train_step's "optimizer" span.
    return end - start, variant.marks["forward_end"] - start, end - variant.marks["optimizer_start"]


def global_batch(cfg: Config) -> int:
    return cfg.global_batch(dist.get_world_size())


def make_batches(
    model: nn.Module, cfg: Config, first_step: int, count: int, device: torch.device
) -> list[MicroBatches]:
    """This rank's micro-batches for steps first_step .. first_step + count - 1, as
    ddp.train.train makes them. Made before a round and shared by every variant in it:
    the same data for all, and its generation stays out of the timed steps."""
    return [
        make_micro_batches(model, cfg, i, device) for i in range(first_step, first_step + count)
    ]


def batch_key(cfg: Config) -> tuple[int, int]:
    """What make_batches depends on that a sweep may change: variants that share it share
    their batches."""
    return cfg.accumulation_steps, global_batch(cfg)


def allreduce_layout(variant: Variant) -> list[float] | None:
    """MiB of each all-reduce one synchronisation sends, in launch order (None: unknown)."""
    wrapped = variant.wrapped
    if variant.name == COMM or hasattr(wrapped, "buckets"):
        return [b.nbytes / 2**20 for b in (variant.buckets or wrapped.buckets)]
    if isinstance(wrapped, ComputeOnly):
        return []
    if hasattr(wrapped, "named_trainable"):  # naive: one all-reduce per parameter
        return [p.numel() * p.element_size() / 2**20 for _, p in wrapped.named_trainable]
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        # torch rebuilds its buckets after the first backward (in gradient-ready order);
        # a private API, so tolerate its absence rather than fail the benchmark.
        try:
            sizes = wrapped._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
            return [int(s) / 2**20 for s in str(sizes).split(",") if s.strip()]
        except Exception:
            return None
    return None


# --- the run --------------------------------------------------------------------------


def run_worker(opts: BenchOptions, cfg: Config) -> None:
    device = setup_process_group(cfg.backend)
    try:
        record = benchmark(opts, cfg, device)  # holds no module: the group can go
        if dist.get_rank() == 0:
            print_table(record)
            write_outputs(record, opts)
        bad = [v["name"] for v in record["variants"] if v["replicas_identical"] is False]
        if bad:
            raise SystemExit(f"replicas differ after the benchmark for {bad}")
    finally:
        teardown_process_group()


def benchmark(opts: BenchOptions, cfg: Config, device: torch.device) -> dict:
    """Build every variant, run the interleaved rounds, return the results as plain data."""
    swept, configs = sweep_configs(cfg, opts.sweep)
    for _, c in configs:
        split_batch(global_batch(c), dist.get_rank(), dist.get_world_size())  # fail early
    wraps = variant_wraps()
    extra = extra_wraps()
    names = (
        [n for n in wraps if n not in extra] if opts.variants == "all" else opts.variants.split(",")
    )
    unknown = [n for n in names if n not in wraps]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; pick from {list(wraps)}")
    names = [n for n in wraps if n in names]  # table order, whatever order was typed
    load_before = _load_average()  # before our own ranks get busy
    variants = []
    for i, (value, c) in enumerate(configs):
        for n in names:
            if swept and swept not in DEPENDS_ON.get(n, SWEEPABLE):
                if i == 0:  # one for every value: its sweep_value is None
                    variants.append(build_variant(n, wraps[n], c, device))
            else:
                variants.append(build_variant(n, wraps[n], c, device, value))
    model = variants[0].model  # every variant's model has the same type: same batches

    # Warm-up once: allocations, lazy init, and torch DDP's bucket rebuild after step 1.
    warm = {batch_key(c): make_batches(model, c, 0, cfg.warmup_steps, device) for _, c in configs}
    for variant in variants:
        for micro_batches in warm[batch_key(variant.cfg)]:
            step(variant, micro_batches, device)
    del warm

    started = time.perf_counter()
    for r in range(opts.rounds):
        shift = r % len(variants)
        order = variants[shift:] + variants[:shift]
        per_round = opts.round_warmup + cfg.steps
        first = cfg.warmup_steps + r * per_round  # a fresh, seeded batch for every step
        round_batches = {
            batch_key(c): make_batches(model, c, first, per_round, device) for _, c in configs
        }
        for variant in order:
            # The first step after a switch can pay for the previous variant having
            # pushed this one's memory out of cache: an artifact of interleaving.
            for i, micro_batches in enumerate(round_batches[batch_key(variant.cfg)]):
                seconds, forward_s, optimizer_s = step(variant, micro_batches, device)
                if i >= opts.round_warmup:
                    variant.step_times_s.append(seconds)
                    variant.step_rounds.append(r)
                    if forward_s is not None:
                        variant.forward_s.append(forward_s)
                        variant.optimizer_s.append(optimizer_s)
    elapsed = time.perf_counter() - started

    def slowest(times: list[float]) -> list[float]:
        out = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)  # per step, the slowest rank
        return out.tolist()

    results = []
    for variant in variants:
        identical = None if variant.name in (FLOOR, COMM) else replicas_identical(variant.model)
        k = variant.cfg.accumulation_steps
        results.append(
            {
                "name": variant.name,
                "sweep_value": variant.sweep_value,
                "accumulation_steps": k,
                "step_times_s": slowest(variant.step_times_s),
                "step_rounds": variant.step_rounds,
                "allreduce_mib": allreduce_layout(variant),
                # Wrappers without no_sync() synchronise every micro-batch (as in train).
                "syncs_per_step": 1
                if variant.name == COMM or hasattr(variant.wrapped, "no_sync")
                else k,
                "replicas_identical": identical,
                # bucket_cap_mb="auto": what it measured and the cap it chose
                "auto_bucket_choice": _json_safe(
                    getattr(variant.wrapped, "auto_bucket_choice", None)
                ),
                **(
                    {
                        "forward_s": slowest(variant.forward_s),
                        "optimizer_s": slowest(variant.optimizer_s),
                    }
                    if variant.name == FLOOR
                    else {}
                ),
            }
        )
    parameters = sum(p.numel() for p in model.parameters())
    record = make_record(opts, cfg, results, parameters, elapsed, swept, configs)
    record["machine"]["load_average_before"] = load_before
    return record


# --- statistics and the record --------------------------------------------------------


def make_record(
    opts: BenchOptions,
    cfg: Config,
    results: list[dict],
    parameters: int,
    elapsed_s: float,
    swept: str = "",
    configs: list | None = None,
) -> dict:
    """The JSON-able description of one run: command, machine, settings, per variant."""
    # In a sweep, a variant with no sweep value ran once for every value (DEPENDS_ON).
    shared = [r for r in results if swept and r.get("sweep_value") is None]
    groups: dict = {}  # sweep value -> its own results, in table order
    for r in results:
        if not (swept and r.get("sweep_value") is None):
            groups.setdefault(r.get("sweep_value"), []).append(r)
    # A shared variant's ratios would have to pick one value's: it has none.
    variants = [variant_entry(r, {r["name"]: r}, None) for r in shared]
    bounds = []
    for value, group in groups.items():
        by_name = {r["name"]: r for r in shared + group}
        bound = perfect_overlap_bound(by_name.get(FLOOR), by_name.get(COMM))
        if bound is not None:
            k = group[0].get("accumulation_steps", 1)
            bounds.append({"sweep_value": value, "accumulation_steps": k, **bound})
        variants += [variant_entry(r, by_name, bound) for r in group]
    return {
        "workload": workload_key(cfg, swept),
        "command": os.environ.get("BENCH_COMMAND") or _torchrun_command(),
        "machine": machine(),
        "settings": {
            "model": cfg.model,
            **({"width": cfg.width, "depth": cfg.depth} if cfg.model in ("mlp", "frozen") else {}),
            "parameters": parameters,
            "per_rank_batch": global_batch(cfg) // dist.get_world_size(),
            "global_batch": global_batch(cfg),
            "accumulation_steps": cfg.accumulation_steps,
            "bucket_cap_mb": cfg.bucket_cap_mb,
            **({"sweep": {"field": swept, "values": [v for v, _ in configs]}} if swept else {}),
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "rounds": opts.rounds,
            "steps_per_round": cfg.steps,
            "warmup_steps": cfg.warmup_steps,
            "round_warmup": opts.round_warmup,
            "optimizer": f"SGD(lr={cfg.lr}, momentum=0.9)",
            "seed": cfg.seed,
            "network": network(),
            "elapsed_s": round(elapsed_s, 1),
        },
        "bounds": bounds,
        "variants": variants,
    }


def variant_entry(r: dict, by_name: dict[str, dict], bound: dict | None) -> dict:
    """One variant's figures, against the others of its group (its sweep value)."""
    times = r["step_times_s"]
    median = statistics.median(times)
    floor, reference = by_name.get(FLOOR), by_name.get(REFERENCE)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [median] * 3
    floor_median = statistics.median(floor["step_times_s"]) if floor else None
    k = r.get("accumulation_steps", 1)
    return {
        "name": r["name"],
        "sweep_value": r.get("sweep_value"),
        "accumulation_steps": k,
        "median_ms": median * 1e3,
        "per_micro_batch_ms": median * 1e3 / k,
        "min_ms": min(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "p25_ms": quartiles[0] * 1e3,
        "p75_ms": quartiles[2] * 1e3,
        "vs_torch_ddp": _ratio(
            median, statistics.median(reference["step_times_s"]) if reference else None
        ),
        "vs_compute_only": _ratio(median, floor_median),
        "vs_bound": None if bound is None else median * 1e3 / bound["bound_ms"],
        "round_vs_torch_ddp": None
        if reference is None
        else _paired(r, _round_medians(reference["step_times_s"], reference["step_rounds"])),
        "round_vs_bound": None
        if bound is None
        else _paired(r, {int(rnd): ms / 1e3 for rnd, ms in bound["per_round_ms"].items()}),
        # Communication alone has no compute to expose anything behind.
        "exposed_comm_ms": (median - floor_median) * 1e3
        if floor_median is not None and r["name"] != COMM
        else None,
        "allreduces_per_step": None
        if r["allreduce_mib"] is None
        else len(r["allreduce_mib"]) * r["syncs_per_step"],
        "allreduce_mib": r["allreduce_mib"],
        "rounds": len(set(r["step_rounds"])),
        "steps": len(times),
        "replicas_identical": r["replicas_identical"],
        **({"auto_bucket_choice": r["auto_bucket_choice"]} if r.get("auto_bucket_choice") else {}),
        "step_times_ms": [t * 1e3 for t in times],
        **(
            {
                "forward_ms": [t * 1e3 for t in r["forward_s"]],
                "optimizer_ms": [t * 1e3 for t in r["optimizer_s"]],
            }
            if "forward_s" in r
            else {}
        ),
    }


def _json_safe(choice: dict | None) -> dict | None:
    if choice is None:
        return None
    return {
        k: ({str(c): t for c, t in v.items()} if isinstance(v, dict) else v)
        for k, v in choice.items()
    }


def perfect_overlap_bound(floor: dict | None, comm: dict | None) -> dict | None:
    """max(compute_only, F + A + O) from the medians of one run's parts (see the module's
    docstring), overall and per round; None without both compute_only and
    communication_alone. `floor` holds step_times_s, forward_s, optimizer_s and
    step_rounds; `comm` step_times_s and step_rounds."""
    if floor is None or comm is None or "forward_s" not in floor:
        return None

    def bound(c: float, f: float, a: float, o: float) -> float:
        return max(c, f + a + o)

    c = statistics.median(floor["step_times_s"])
    f = statistics.median(floor["forward_s"])
    o = statistics.median(floor["optimizer_s"])
    a = statistics.median(comm["step_times_s"])
    rounds = floor["step_rounds"]
    c_r = _round_medians(floor["step_times_s"], rounds)
    f_r = _round_medians(floor["forward_s"], rounds)
    o_r = _round_medians(floor["optimizer_s"], rounds)
    a_r = _round_medians(comm["step_times_s"], comm["step_rounds"])
    per_round = {  # str keys, as JSON has them
        str(k): bound(c_r[k], f_r[k], a_r[k], o_r[k]) * 1e3 for k in c_r if k in a_r
    }
    return {
        "compute_only_ms": c * 1e3,
        "forward_ms": f * 1e3,
        "communication_alone_ms": a * 1e3,
        "optimizer_ms": o * 1e3,
        "bound_ms": bound(c, f, a, o) * 1e3,
        "bound_by": "compute" if c >= f + a + o else "communication",
        "per_round_ms": per_round,
    }


def _ratio(value: float, base: float | None) -> float | None:
    return value / base if base else None


def _round_medians(times: list[float], rounds: list[int]) -> dict[int, float]:
    """Round -> the median of the times taken in it."""
    by_round: dict[int, list[float]] = {}
    for t, k in zip(times, rounds, strict=True):
        by_round.setdefault(k, []).append(t)
    return {k: statistics.median(ts) for k, ts in sorted(by_round.items())}


def _paired(result: dict, base_by_round: dict[int, float]) -> dict | None:
    """Median over rounds of (this variant's median / the base's in that round).

    Both come from the same round, minutes apart at most, so a slow spell of the shared
    machine cancels out of the ratio; its spread says how far a ratio can be trusted."""
    mine = _round_medians(result["step_times_s"], result["step_rounds"])
    ratios = [m / base_by_round[k] for k, m in mine.items() if base_by_round.get(k)]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def workload_key(cfg: Config, swept: str = "") -> str:
    """What --merge matches on: the same model, global batch, micro-batches per step,
    bucket cap, backend, world size and network (loopback keys name none, as before),
    and the field swept, if any."""
    shape = f"-w{cfg.width}-d{cfg.depth}" if cfg.model in ("mlp", "frozen") else ""
    rate = network()["rate"]
    return (
        f"{cfg.model}{shape}-b{global_batch(cfg)}-k{cfg.accumulation_steps}"
        f"-cap{cfg.bucket_cap_mb:g}-{dist.get_backend()}-x{dist.get_world_size()}"
        + ("" if rate == "loopback" else f"-{rate.split()[0]}")
        + (f"-sweep-{swept}" if swept else "")
    )


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "threads_per_rank": torch.get_num_threads(),  # torchrun sets OMP_NUM_THREADS=1
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        # How busy the machine was: others' work before, ours plus theirs at the end.
        "load_average_end": _load_average(),
    }


def _load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _torchrun_command() -> str:
    """The command as best known when a launcher of the user's own started us."""
    args = shlex.join(sys.argv[1:])
    world = os.environ.get("WORLD_SIZE", "?")
    return f"torchrun --standalone --nproc-per-node {world} -m profiling.bench {args}"


# --- output ---------------------------------------------------------------------------


def describe(record: dict) -> str:
    """One line: the machine and the settings the numbers only hold for."""
    m, s = record["machine"], record["settings"]
    shape = f" width {s['width']} depth {s['depth']}" if "width" in s else ""
    sweep = s.get("sweep")
    swept = "" if sweep is None else sweep["field"]
    batch = (
        "per-rank batch swept"
        if swept in ("batch_size", "global_batch_size")
        else f"per-rank batch {s['per_rank_batch']} (global {s['global_batch']})"
    )
    micro = (
        "micro-batches per step swept"
        if swept == "accumulation_steps"
        else f"{s['accumulation_steps']} micro-batch(es) per step"
    )
    cap = "" if swept == "bucket_cap_mb" else f"; bucket_cap_mb {s['bucket_cap_mb']:g}"
    swept_text = (
        ""
        if sweep is None
        else f"; {swept} swept over {', '.join(f'{v:g}' for v in sweep['values'])}, "
        "every value's variants interleaved in the same rounds"
    )
    return (
        f"{s['model']}{shape}, {s['parameters']:,} parameters; {batch}, {micro}{cap}"
        f"{swept_text}; {s['world_size']} ranks "
        f"on {s['backend']} over {describe_network(s.get('network'))}; "
        f"{m['usable_cores']} of {m['cores']} cores ({m['cpu']}), "
        f"{m['threads_per_rank']} thread(s) per rank; torch {m['torch']}; "
        f"{s['rounds']} rounds x {s['steps_per_round']} timed steps per variant "
        f"(+{s['round_warmup']} untimed per round, {s['warmup_steps']} warm-up); "
        f"1/5/15-min load average {m.get('load_average_before')} before, "
        f"{m['load_average_end']} at the end (this run's ranks add about "
        f"{s['world_size']}); {s.get('elapsed_s', '?')} s of rounds; {m['date_utc']} UTC"
    )


def describe_network(net: dict | None) -> str:
    if net is None or net["rate"] == "loopback":
        return "loopback"
    if net.get("probe") is None:
        return net["rate"]
    p = net["probe"]
    return (
        f"one network namespace per rank, links shaped to {net['rate']} each way (tbf), "
        f"Gloo all-reduce of {p['bytes'] / 1e6:g} MB measured at {p['MBps']:.0f} MB/s "
        f"(tensor bytes / time; {p['expected_MBps']:.0f} expected)"
    )


def describe_bound(bound: dict, swept: str = "") -> str:
    """`bound = max(compute_only C, forward F + communication alone A + optimizer O)`."""
    value = "" if not swept else f"{swept} {bound['sweep_value']:g}: "
    k = bound.get("accumulation_steps", 1)
    # With k micro-batches, F runs from the start to the end of the last forward.
    head = "forward" if k == 1 else f"{k - 1} micro-batch{'es' if k > 2 else ''} + the last forward"
    return (
        f"{value}perfect-overlap bound = max(compute_only {bound['compute_only_ms']:.1f}, "
        f"{head} {bound['forward_ms']:.1f} + communication alone "
        f"{bound['communication_alone_ms']:.1f} + optimizer {bound['optimizer_ms']:.1f}) "
        f"= {bound['bound_ms']:.1f} ms ({bound['bound_by']}-bound)"
    )


def columns(record: dict) -> list[str]:
    """The table's columns: a first one for the swept value, per micro-batch time where
    a step has several."""
    sweep = record["settings"].get("sweep")
    several = any(v.get("accumulation_steps", 1) > 1 for v in record["variants"])
    return [
        *([sweep["field"]] if sweep else []),
        "variant",
        "median ms",
        *(["ms per micro-batch"] if several else []),
        "min-max ms",
        "vs torch_ddp",
        "per round vs torch_ddp",
        "vs compute_only",
        *(["vs bound", "per round vs bound"] if record.get("bounds") else []),
        "exposed comm ms",
        "all-reduces/step",
        "steps (rounds)",
        "replicas identical",
    ]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _fmt_paired(paired: dict | None) -> str:
    if paired is None:
        return "n/a"
    return f"{paired['median']:.2f}x ({paired['min']:.2f}-{paired['max']:.2f})"


def rows(record: dict) -> list[list[str]]:
    names = columns(record)
    out = []
    for v in record["variants"]:
        identical = v["replicas_identical"]
        cells = {
            "variant": v["name"],
            "median ms": f"{v['median_ms']:.1f}",
            "ms per micro-batch": _fmt(v.get("per_micro_batch_ms"), ".1f"),
            "min-max ms": f"{v['min_ms']:.1f}-{v['max_ms']:.1f}",
            "vs torch_ddp": _fmt(v["vs_torch_ddp"], ".2f", "x"),
            "per round vs torch_ddp": _fmt_paired(v["round_vs_torch_ddp"]),
            "vs compute_only": _fmt(v["vs_compute_only"], ".2f", "x"),
            "vs bound": _fmt(None if v["name"] == COMM else v.get("vs_bound"), ".2f", "x"),
            "per round vs bound": _fmt_paired(
                None if v["name"] == COMM else v.get("round_vs_bound")
            ),
            "exposed comm ms": _fmt(v["exposed_comm_ms"], ".1f"),
            "all-reduces/step": _fmt(v["allreduces_per_step"], "d"),
            "steps (rounds)": f"{v['steps']} ({v['rounds']})",
            "replicas identical": "n/a (no sync)"
            if v["name"] == FLOOR
            else "n/a"
            if identical is None
            else str(identical),
        }
        if names[0] not in cells:  # the swept field; None: one run serves every value
            cells[names[0]] = "all" if v["sweep_value"] is None else f"{v['sweep_value']:g}"
        out.append([cells[name] for name in names])
    return out


def sweep_summary(record: dict) -> tuple[list[str], list[list[str]]] | None:
    """One row per swept value: the bound's parts, then each training variant's time
    and its ratio to the bound (per micro-batch when accumulation_steps is swept)."""
    sweep = record["settings"].get("sweep")
    if sweep is None:
        return None
    per_micro = sweep["field"] == "accumulation_steps"
    key = "per_micro_batch_ms" if per_micro else "median_ms"
    unit = "ms per micro-batch" if per_micro else "ms"
    trained = []
    for v in record["variants"]:
        if v["name"] not in (FLOOR, COMM) and v["name"] not in trained:
            trained.append(v["name"])
    bounds = {b["sweep_value"]: b for b in record.get("bounds", [])}
    header = [
        sweep["field"],
        f"compute_only {unit}",
        "communication alone ms",
        f"bound {unit}",
        *[f"{name} {unit} (vs bound)" for name in trained],
    ]
    out = []
    for value in sweep["values"]:
        mine = {v["name"]: v for v in record["variants"] if v["sweep_value"] in (value, None)}
        bound = bounds.get(value)
        k = value if per_micro else 1
        row = [
            f"{value:g}",
            _fmt(mine[FLOOR][key] if FLOOR in mine else None, ".1f"),
            _fmt(mine[COMM]["median_ms"] if COMM in mine else None, ".1f"),
            _fmt(None if bound is None else bound["bound_ms"] / k, ".1f"),
        ]
        for name in trained:
            v = mine.get(name)
            row.append(
                "n/a" if v is None else f"{v[key]:.1f} ({_fmt(v.get('vs_bound'), '.2f', 'x')})"
            )
        out.append(row)
    return header, out


def print_table(record: dict) -> None:
    print(f"\n{describe(record)}\nmedian of the slowest rank per step")
    swept = record["settings"].get("sweep", {}).get("field", "")
    for bound in record.get("bounds", []):
        print(describe_bound(bound, swept))
    tables = [(columns(record), rows(record))]
    summary = sweep_summary(record)
    if summary is not None:
        tables.append(summary)
    for header, body in reversed(tables):
        table = [header, *body]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        print()
        for row in table:
            print(
                "  ".join(
                    cell.rjust(w) if i else cell.ljust(w)
                    for i, (cell, w) in enumerate(zip(row, widths, strict=True))
                )
            )


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def network_label(settings: dict) -> str:
    """'loopback', '1gbit', ...; records made before --network existed ran on loopback."""
    return settings.get("network", {"rate": "loopback"})["rate"].split()[0]


def markdown(records: list[dict]) -> str:
    """A fragment for the docs: first line the commands, then one table per workload."""
    commands = " then ".join(f"`{r['command']}`" for r in records)
    parts = [
        f"Produced by {commands}, from the repository root.",
        "",
        "Step time is the median over all timed steps of the slowest rank's time. "
        "*per round vs torch_ddp* is the median (and range) over rounds of the ratio "
        "within one round, where both sides share the machine's noise. *exposed comm* "
        "is step time minus compute-only time. The *bound* is the perfect-overlap bound "
        "max(compute_only, forward + communication alone + optimizer), its parts "
        "measured in the same rounds.",
    ]
    for r in records:
        s = r["settings"]
        title = f"{s['model']}, {s['parameters'] / 1e6:.1f}M parameters"
        if "sweep" in s:
            title += f", {s['sweep']['field']} swept"
        title += f", {s['world_size']} ranks, {network_label(s)}"
        parts += ["", f"### {title}", "", describe(r) + "."]
        swept = s.get("sweep", {}).get("field", "")
        if r.get("bounds"):
            parts += ["", *[f"- {describe_bound(b, swept)}" for b in r["bounds"]]]
        summary = sweep_summary(r)
        if summary is not None:
            parts += ["", markdown_table(*summary), "", "Every variant:"]
        parts += ["", markdown_table(columns(r), rows(r))]
    return "\n".join(parts) + "\n"


def write_outputs(record: dict, opts: BenchOptions, records: list[dict] | None = None) -> None:
    """Write --json (merged into what is there with --merge), then --markdown and --plot
    of every record written (or of `records`, when given: --render)."""
    records = records or [record]
    if opts.merge and opts.json and Path(opts.json).exists():
        kept = json.loads(Path(opts.json).read_text())["workloads"]
        # Replace this workload in place (keeps the order), append it if new.
        keys = [r["workload"] for r in kept]
        if record["workload"] in keys:
            kept[keys.index(record["workload"])] = record
            records = kept
        else:
            records = [*kept, record]
    if opts.json:
        Path(opts.json).write_text(json.dumps({"workloads": records}, indent=1) + "\n")
        print(f"wrote {opts.json}")
    if opts.markdown:
        Path(opts.markdown).write_text(markdown(records))
        print(f"wrote {opts.markdown}")
    if opts.plot:
        plot(records, opts.plot)
        print(f"wrote {opts.plot}")


# --- the figure -----------------------------------------------------------------------

COLORS = {FLOOR: "0.55", COMM: "0.8", REFERENCE: "tab:orange"}


def plot(records: list[dict], path: str) -> None:
    """One panel per workload: horizontal bars (median, whiskers min to max) against
    the bound, or for a sweep, each training variant's median against the swept value
    with its p25-p75 band, the bound and compute_only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(len(records), 3)
    nrows = -(-len(records) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(records) :]:
        ax.set_visible(False)
    for ax, record in zip(axes.flat, records, strict=False):
        s = record["settings"]
        title = f"{s['model']} {s['parameters'] / 1e6:.1f}M, per-rank batch {s['per_rank_batch']}"
        cores = record["machine"].get("usable_cores")
        title += f"\n{s['world_size']} ranks on {cores} cores, {network_label(s)}"
        if "sweep" in s:
            _plot_sweep(ax, record)
        else:
            title += f", bucket cap {s['bucket_cap_mb']:g} MiB"
            _plot_bars(ax, record)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x" if "sweep" not in s else "y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _plot_bars(ax, record: dict) -> None:
    variants = record["variants"][::-1]  # first variant on top
    names = [v["name"] for v in variants]
    medians = [v["median_ms"] for v in variants]
    whiskers = [
        [v["median_ms"] - v["min_ms"] for v in variants],
        [v["max_ms"] - v["median_ms"] for v in variants],
    ]
    colors = [COLORS.get(n, "tab:blue") for n in names]
    ax.barh(names, medians, xerr=whiskers, color=colors, capsize=2, error_kw={"lw": 0.8})
    bounds = record.get("bounds")
    if bounds:
        b = bounds[0]["bound_ms"]
        ax.axvline(b, color="k", ls="--", lw=1)
        ax.text(b, len(variants) - 0.45, f" perfect-overlap bound {b:.0f} ms", fontsize=7)
        ax.set_ylim(-0.6, len(variants))
        for y, v in enumerate(variants):
            if v["name"] not in (FLOOR, COMM):
                ax.text(v["max_ms"], y, f" {v['vs_bound']:.2f}x bound", va="center", fontsize=7)
    ax.set_xlabel("step time, ms (median; whiskers min-max)", fontsize=8)
    ax.tick_params(labelsize=8)


def _plot_sweep(ax, record: dict) -> None:
    sweep = record["settings"]["sweep"]
    values = sweep["values"]
    per_micro = sweep["field"] == "accumulation_steps"
    key = "per_micro_batch_ms" if per_micro else "median_ms"
    x = range(len(values))  # evenly spaced: the values span up to 12 decades

    def series(name: str, field: str) -> list[float | None]:
        by_value = {v["sweep_value"]: v for v in record["variants"] if v["name"] == name}
        out = []
        for value in values:
            v = by_value.get(value, by_value.get(None))  # None: one run for every value
            k = value if per_micro else 1
            out.append(None if v is None else v[field] / (k if field != key else 1))
        return out

    names = []
    for v in record["variants"]:
        if v["name"] not in names:
            names.append(v["name"])
    for name in names:
        if name == COMM:
            continue
        y = series(name, key)
        style = {"color": COLORS.get(name)} if name in COLORS else {}
        if name == FLOOR:
            ax.plot(x, y, ls=":", marker=".", label=name, **style)
            continue
        ax.plot(x, y, marker="o", ms=4, label=name, **style)
        ax.fill_between(x, series(name, "p25_ms"), series(name, "p75_ms"), alpha=0.2, **style)
    bounds = {b["sweep_value"]: b["bound_ms"] for b in record.get("bounds", [])}
    if bounds:
        ax.plot(
            x,
            [bounds.get(v, float("nan")) / (v if per_micro else 1) for v in values],
            color="k",
            ls="--",
            lw=1,
            label="perfect-overlap bound",
        )
    ax.set_xticks(list(x), [f"{v:g}" for v in values], fontsize=8)
    label = {"bucket_cap_mb": "bucket_cap_mb (MiB)", "accumulation_steps": "micro-batches per sync"}
    ax.set_xlabel(label.get(sweep["field"], sweep["field"]), fontsize=8)
    ax.set_ylabel("ms per micro-batch" if per_micro else "step time, ms (median)", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=8)


if __name__ == "__main__":
    main()
