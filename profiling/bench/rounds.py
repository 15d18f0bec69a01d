"""The run on every rank: build every variant, warm up, run the interleaved rounds, and
gather the slowest rank's times into the record."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddp.config import Config
from ddp.data import split_batch
from ddp.dist import replicas_identical, setup_process_group, teardown_process_group
from ddp.heap import steady_heap
from ddp.progress import Progress
from profiling.bench.options import (
    COMM,
    DEPENDS_ON,
    FLOOR,
    SWEEPABLE,
    BenchOptions,
    sweep_configs,
)
from profiling.bench.output import print_table, write_outputs
from profiling.bench.records import make_record
from profiling.bench.variants import (
    allreduce_layout,
    batch_key,
    build_variant,
    extra_wraps,
    global_batch,
    make_batches,
    step,
    variant_wraps,
)
from profiling.common.report import load_average


def run_worker(opts: BenchOptions, cfg: Config) -> None:
    steady_heap()  # a variant's step must not cost more for what another freed before it
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
    load_before = load_average()  # before our own ranks get busy
    variants = []
    for i, (value, c) in enumerate(configs):
        for n in names:
            if swept and swept not in DEPENDS_ON.get(n, SWEEPABLE):
                if i == 0:  # one for every value: its sweep_value is None
                    variants.append(build_variant(n, wraps[n], c, device))
            else:
                variants.append(build_variant(n, wraps[n], c, device, value))
    model = variants[0].model  # every variant's model has the same type: same batches

    # Rank 0 shows the warm-up, then each round, as runs of steps.
    warmup_steps = len(variants) * cfg.warmup_steps
    round_steps = len(variants) * (opts.round_warmup + cfg.steps)
    progress = Progress(bool(warmup_steps) + opts.rounds, warmup_steps + opts.rounds * round_steps)

    # Warm-up once: allocations, lazy init, and torch DDP's bucket rebuild after step 1.
    warm = {batch_key(c): make_batches(model, c, 0, cfg.warmup_steps, device) for _, c in configs}
    if warmup_steps:
        progress.start("warm-up", warmup_steps)
    for variant in variants:
        batches = warm[batch_key(variant.cfg)]
        for micro_batches in batches:
            seconds, _ = step(variant, micro_batches, device)
            progress.step(seconds, detail=variant.name)
        # bucket_cap_mb="auto" tries layouts for a few dozen steps: warm-up too, so that no
        # timed step runs a layout on trial. Every rank runs as many (the trials count
        # synchronised steps alike everywhere).
        extra = 0
        while getattr(variant.wrapped, "auto_bucket_pending", False):
            if not batches:
                raise SystemExit(
                    f"{variant.name}: bucket_cap_mb='auto' tries layouts in its first steps; "
                    "--warmup-steps 0 would time them (use at least 1)"
                )
            step(variant, batches[extra % len(batches)], device)
            extra += 1
        variant.settle_steps = extra
    if warmup_steps:
        progress.finish()
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
        progress.start(f"round {r + 1}", round_steps)
        for variant in order:
            # The first step after a switch can pay for the previous variant having
            # pushed this one's memory out of cache: an artifact of interleaving.
            for i, micro_batches in enumerate(round_batches[batch_key(variant.cfg)]):
                seconds, parts = step(variant, micro_batches, device)
                progress.step(seconds, detail=variant.name)
                if i >= opts.round_warmup:
                    variant.step_times_s.append(seconds)
                    variant.step_rounds.append(r)
                    for name, value in parts.items():  # the bounds' parts
                        getattr(variant, name).append(value)
        progress.finish()
    elapsed = time.perf_counter() - started

    def slowest(times: list) -> list:
        """Per step (and per gradient or bucket, for lists of lists), the slowest rank's."""
        out = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
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
                "settle_steps": variant.settle_steps,
                **(
                    {
                        "forward_s": slowest(variant.forward_s),
                        "optimizer_s": slowest(variant.optimizer_s),
                        "ready_s": slowest(variant.ready_s),
                        "grad_names": variant.grad_names,
                    }
                    if variant.name == FLOOR
                    else {}
                ),
                **(
                    {
                        "bucket_end_s": slowest(variant.bucket_end_s),
                        "bucket_names": [b.names for b in variant.buckets],
                    }
                    if variant.name == COMM
                    else {}
                ),
            }
        )
    parameters = sum(p.numel() for p in model.parameters())
    record = make_record(opts, cfg, results, parameters, elapsed, swept, configs)
    record["machine"]["load_average_before"] = load_before
    return record


def _json_safe(choice: dict | None) -> dict | None:
    if choice is None:
        return None
    return {
        k: ({str(c): t for c, t in v.items()} if isinstance(v, dict) else v)
        for k, v in choice.items()
    }
