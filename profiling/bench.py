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

Reported per variant: median, min and max over all timed steps; the ratio of medians to
torch_ddp and to compute_only; the ratio to torch_ddp within each round (paired, so both
sides share that round's noise) as median and range; exposed communication (median
step minus compute-only median, as in DESIGN.md); all-reduces per step.

Outputs: the table on stdout; --json and --markdown write the same results. With
--merge, the workloads already in the --json file are kept (this run replaces its own
workload) and --markdown renders all of them, its first line naming the commands that
produced them. The markdown is a fragment the docs include under a heading.

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

from ddp.config import Config
from ddp.data import split_batch
from ddp.dist import replicas_identical, setup_process_group, teardown_process_group
from ddp.models import build_model
from ddp.train import (
    ComputeOnly,
    MicroBatches,
    Wrap,
    _synchronize,
    make_micro_batches,
    stage_wrap,
    torch_ddp_wrap,
    train_step,
)

REFERENCE = "torch_ddp"
FLOOR = "compute_only"


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


_HELP = {
    "nproc": "ranks to launch with torchrun (ignored under torchrun: WORLD_SIZE decides)",
    "rounds": "interleaved rounds; each runs every variant, order rotated by one",
    "round_warmup": "untimed steps per variant at the start of each round",
    "variants": "comma-separated subset of compute_only, the stages and torch_ddp, or all",
    "json": "write the results as JSON to this path",
    "markdown": "write the results as a markdown fragment to this path",
    "merge": "keep the other workloads already in --json and render them all to --markdown",
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

    name: str
    model: nn.Module  # the bare model; replicas_identical checks its parameters
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    step_times_s: list[float] = field(default_factory=list)  # this rank's timed steps
    step_rounds: list[int] = field(default_factory=list)  # the round of each timed step

    def finish(self) -> None:
        finish = getattr(self.wrapped, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()


def variant_wraps() -> dict[str, Wrap]:
    """Name -> wrap(model, cfg), in table order: the floor, the stages, the reference."""
    from stages import STAGES

    return {
        FLOOR: lambda model, cfg: ComputeOnly(model),
        **{name: stage_wrap(cls) for name, cls in STAGES.items()},
        REFERENCE: torch_ddp_wrap,
    }


def build_variant(name: str, wrap: Wrap, cfg: Config, device: torch.device) -> Variant:
    # As in ddp.train.train: seeded per rank on purpose, the wrapper makes replicas equal.
    torch.manual_seed(cfg.seed * 1000 + dist.get_rank())
    model = build_model(cfg.model, width=cfg.width, depth=cfg.depth).to(device)
    wrapped = wrap(model, cfg)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=cfg.lr, momentum=0.9)
    return Variant(name, model, wrapped, optimizer)


def step(variant: Variant, micro_batches: MicroBatches, device: torch.device) -> float:
    """One optimizer step (ddp.train.train_step, spans included), timed on this rank."""
    # Start together: otherwise a rank's time absorbs its partner's lag from the step
    # before (or from the previous variant), and "slowest rank" loses its meaning.
    dist.barrier()
    _synchronize(device)
    start = time.perf_counter()
    train_step(variant.wrapped, micro_batches, variant.optimizer, variant.finish)
    _synchronize(device)
    return time.perf_counter() - start


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


def allreduce_layout(variant: Variant) -> list[float] | None:
    """MiB of each all-reduce one synchronisation sends, in launch order (None: unknown)."""
    wrapped = variant.wrapped
    if isinstance(wrapped, ComputeOnly):
        return []
    if hasattr(wrapped, "buckets"):
        return [b.nbytes / 2**20 for b in wrapped.buckets]
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
    split_batch(global_batch(cfg), dist.get_rank(), dist.get_world_size())  # fail early
    wraps = variant_wraps()
    names = list(wraps) if opts.variants == "all" else opts.variants.split(",")
    unknown = [n for n in names if n not in wraps]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; pick from {list(wraps)}")
    load_before = _load_average()  # before our own ranks get busy
    variants = [build_variant(n, wraps[n], cfg, device) for n in names]

    # Warm-up once: allocations, lazy init, and torch DDP's bucket rebuild after step 1.
    warm = make_batches(variants[0].model, cfg, 0, cfg.warmup_steps, device)
    for variant in variants:
        for micro_batches in warm:
            step(variant, micro_batches, device)

    started = time.perf_counter()
    for r in range(opts.rounds):
        shift = r % len(variants)
        order = variants[shift:] + variants[:shift]
        per_round = opts.round_warmup + cfg.steps
        first = cfg.warmup_steps + r * per_round  # a fresh, seeded batch for every step
        round_batches = make_batches(variants[0].model, cfg, first, per_round, device)
        for variant in order:
            # The first step after a switch can pay for the previous variant having
            # pushed this one's memory out of cache: an artifact of interleaving.
            for i, micro_batches in enumerate(round_batches):
                seconds = step(variant, micro_batches, device)
                if i >= opts.round_warmup:
                    variant.step_times_s.append(seconds)
                    variant.step_rounds.append(r)
    elapsed = time.perf_counter() - started

    results = []
    for variant in variants:
        slowest = torch.tensor(variant.step_times_s, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # per step, the slowest rank
        identical = None if variant.name == FLOOR else replicas_identical(variant.model)
        results.append(
            {
                "name": variant.name,
                "step_times_s": slowest.tolist(),
                "step_rounds": variant.step_rounds,
                "allreduce_mib": allreduce_layout(variant),
                # Wrappers without no_sync() synchronise every micro-batch (as in train).
                "syncs_per_step": 1
                if hasattr(variant.wrapped, "no_sync")
                else cfg.accumulation_steps,
                "replicas_identical": identical,
            }
        )
    parameters = sum(p.numel() for p in variants[0].model.parameters())
    record = make_record(opts, cfg, results, parameters, elapsed)
    record["machine"]["load_average_before"] = load_before
    return record


# --- statistics and the record --------------------------------------------------------


def make_record(
    opts: BenchOptions, cfg: Config, results: list[dict], parameters: int, elapsed_s: float
) -> dict:
    """The JSON-able description of one run: command, machine, settings, per variant."""
    medians = {r["name"]: statistics.median(r["step_times_s"]) for r in results}
    reference = {r["name"]: r for r in results}.get(REFERENCE)
    variants = []
    for r in results:
        times = r["step_times_s"]
        median = medians[r["name"]]
        quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [median] * 3
        entry = {
            "name": r["name"],
            "median_ms": median * 1e3,
            "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3,
            "p25_ms": quartiles[0] * 1e3,
            "p75_ms": quartiles[2] * 1e3,
            "vs_torch_ddp": _ratio(median, medians.get(REFERENCE)),
            "vs_compute_only": _ratio(median, medians.get(FLOOR)),
            "round_vs_torch_ddp": _paired_ratios(r, reference),
            "exposed_comm_ms": (median - medians[FLOOR]) * 1e3 if FLOOR in medians else None,
            "allreduces_per_step": None
            if r["allreduce_mib"] is None
            else len(r["allreduce_mib"]) * r["syncs_per_step"],
            "allreduce_mib": r["allreduce_mib"],
            "rounds": len(set(r["step_rounds"])),
            "steps": len(times),
            "replicas_identical": r["replicas_identical"],
            "step_times_ms": [t * 1e3 for t in times],
        }
        variants.append(entry)
    return {
        "workload": workload_key(cfg),
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
        "variants": variants,
    }


def _ratio(value: float, base: float | None) -> float | None:
    return value / base if base else None


def _paired_ratios(result: dict, reference: dict | None) -> dict | None:
    """Median over rounds of (this variant's median / torch_ddp's median in that round).

    Both medians come from the same round, minutes apart at most, so a slow spell of the
    shared machine cancels out of the ratio; its spread says how far a ratio can be
    trusted."""
    if reference is None:
        return None
    ratios = []
    for r in sorted(set(result["step_rounds"])):
        mine = [
            t for t, k in zip(result["step_times_s"], result["step_rounds"], strict=True) if k == r
        ]
        ref = [
            t
            for t, k in zip(reference["step_times_s"], reference["step_rounds"], strict=True)
            if k == r
        ]
        ratios.append(statistics.median(mine) / statistics.median(ref))
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def workload_key(cfg: Config) -> str:
    """What --merge matches on: the same model, global batch, micro-batches per step,
    bucket cap, backend, world size and network (loopback keys name none, as before)."""
    shape = f"-w{cfg.width}-d{cfg.depth}" if cfg.model in ("mlp", "frozen") else ""
    rate = network()["rate"]
    return (
        f"{cfg.model}{shape}-b{global_batch(cfg)}-k{cfg.accumulation_steps}"
        f"-cap{cfg.bucket_cap_mb:g}-{dist.get_backend()}-x{dist.get_world_size()}"
        + ("" if rate == "loopback" else f"-{rate.split()[0]}")
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
    return (
        f"{s['model']}{shape}, {s['parameters']:,} parameters; per-rank batch "
        f"{s['per_rank_batch']} (global {s['global_batch']}, {s['accumulation_steps']} "
        f"micro-batch(es) per step); bucket_cap_mb {s['bucket_cap_mb']:g}; {s['world_size']} ranks "
        f"on {s['backend']} over {describe_network(s.get('network'))}; "
        f"{m['usable_cores']} of {m['cores']} cores ({m['cpu']}), "
        f"{m['threads_per_rank']} thread(s) per rank; torch {m['torch']}; "
        f"{s['rounds']} rounds x {s['steps_per_round']} timed steps per variant "
        f"(+{s['round_warmup']} untimed per round, {s['warmup_steps']} warm-up); "
        f"1/5/15-min load average {m['load_average_before']} before, "
        f"{m['load_average_end']} at the end (this run's ranks add about "
        f"{s['world_size']}); {m['date_utc']} UTC"
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


COLUMNS = [
    "variant",
    "median ms",
    "min-max ms",
    "vs torch_ddp",
    "per round vs torch_ddp",
    "vs compute_only",
    "exposed comm ms",
    "all-reduces/step",
    "steps (rounds)",
    "replicas identical",
]


def rows(record: dict) -> list[list[str]]:
    def fmt(value: float | None, spec: str, suffix: str = "") -> str:
        return "n/a" if value is None else f"{value:{spec}}{suffix}"

    out = []
    for v in record["variants"]:
        paired = v["round_vs_torch_ddp"]
        paired_text = (
            "n/a"
            if paired is None
            else f"{paired['median']:.2f}x ({paired['min']:.2f}-{paired['max']:.2f})"
        )
        identical = v["replicas_identical"]
        out.append(
            [
                v["name"],
                f"{v['median_ms']:.1f}",
                f"{v['min_ms']:.1f}-{v['max_ms']:.1f}",
                fmt(v["vs_torch_ddp"], ".2f", "x"),
                paired_text,
                fmt(v["vs_compute_only"], ".2f", "x"),
                fmt(v["exposed_comm_ms"], ".1f"),
                fmt(v["allreduces_per_step"], "d"),
                f"{v['steps']} ({v['rounds']})",
                "n/a (no sync)" if identical is None else str(identical),
            ]
        )
    return out


def print_table(record: dict) -> None:
    table = [COLUMNS, *rows(record)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    print(f"\n{describe(record)}\nmedian of the slowest rank per step")
    for row in table:
        print(
            "  ".join(
                cell.rjust(w) if i else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def markdown_table(record: dict) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" + "|---:" * (len(COLUMNS) - 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(record)]
    return "\n".join(lines)


def markdown(records: list[dict]) -> str:
    """A fragment for the docs: first line the commands, then one table per workload."""
    commands = " then ".join(f"`{r['command']}`" for r in records)
    parts = [
        f"Produced by {commands}, from the repository root.",
        "",
        "Step time is the median over all timed steps of the slowest rank's time. "
        "*per round vs torch_ddp* is the median (and range) over rounds of the ratio "
        "within one round, where both sides share the machine's noise. *exposed comm* "
        "is step time minus compute-only time.",
    ]
    for r in records:
        s = r["settings"]
        parts += ["", f"### {s['model']}, {s['parameters'] / 1e6:.1f}M parameters", ""]
        parts += [describe(r) + ".", "", markdown_table(r)]
    return "\n".join(parts) + "\n"


def write_outputs(record: dict, opts: BenchOptions) -> None:
    records = [record]
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


if __name__ == "__main__":
    main()
