"""What every rank runs: the sweep over message sizes, each size's algorithms
interleaved round by round, each call timed on every rank and kept as the slowest
rank's time; and the local reduction's own speed, for the model's gamma.

Launched by `profiling.collectives.cli` under torchrun (one node per namespace on the
shaped cluster, or `--standalone` on loopback), with its settings as JSON in the
environment (COLLECTIVES_SETTINGS); rank 0 writes the result to the file named there."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ddp.collectives import all_reduce
from ddp.dist import slowest_seconds

GLOO = "gloo"  # torch's own all-reduce (Gloo's ring), the reference row
ELEMENT_BYTES = 4  # float32
WARMUP_BYTES = (4 * 2**10, 256 * 2**10)


def run_worker(settings: dict) -> None:
    """settings: sizes_bytes, algorithms, delay_ms, min_repeats, max_repeats,
    seconds_per_size, ranks_per_node (1 if absent), out (rank 0's result file)."""
    dist.init_process_group("gloo")
    try:
        result = sweep(settings)
        if dist.get_rank() == 0:
            with open(settings["out"], "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _call(algorithm: str, tensor: torch.Tensor, delay_s: float, ranks_per_node: int) -> None:
    if algorithm == GLOO:
        dist.all_reduce(tensor)
    else:
        all_reduce(tensor, algorithm, ranks_per_node=ranks_per_node, delay_s=delay_s)


def sweep(settings: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    delay_s = settings["delay_ms"] / 1e3
    per_node = settings.get("ranks_per_node", 1)
    algorithms = list(settings["algorithms"])
    if delay_s > 0 and GLOO in algorithms:
        algorithms.remove(GLOO)  # Gloo's own cannot be given the emulated delay
    # Connections, the allocator, code paths, and the page cache: before anything is
    # timed (the first size measured was several times slower without this).
    for size_bytes in WARMUP_BYTES:
        tensor = torch.zeros(size_bytes // ELEMENT_BYTES)
        for _ in range(5):
            for algorithm in algorithms:
                _call(algorithm, tensor, delay_s, per_node)

    cells, add_cells = [], []
    start = time.perf_counter()
    for size_bytes in settings["sizes_bytes"]:
        # Zeros stay zeros however often they are summed: every call adds the same
        # numbers, at the same speed, with no refill between calls.
        tensor = torch.zeros(size_bytes // ELEMENT_BYTES)
        seconds: dict[str, list[float]] = {a: [] for a in algorithms}
        rounds, done = None, 0
        while rounds is None or done < rounds:
            # Rotate the order each round: a slow spell of the shared machine, or the
            # page cache warming up, falls on every algorithm alike.
            k = done % len(algorithms)
            for algorithm in algorithms[k:] + algorithms[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                _call(algorithm, tensor, delay_s, per_node)
                seconds[algorithm].append(time.perf_counter() - t0)
            if rounds is None:  # the first round sets how many fit in the time per size
                first = torch.tensor([sum(s[0] for s in seconds.values())], dtype=torch.float64)
                dist.all_reduce(first, op=dist.ReduceOp.MAX)  # every rank decides alike
                wanted = int(settings["seconds_per_size"] / max(first.item(), 1e-9))
                rounds = min(max(wanted, settings["min_repeats"]), settings["max_repeats"])
            done += 1
        slowest = torch.tensor([seconds[a] for a in algorithms], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # each call: the slowest rank's time
        for algorithm, times in zip(algorithms, slowest.tolist(), strict=True):
            cells.append({"algorithm": algorithm, "size_bytes": size_bytes, "seconds": times})
        add_cells.append({"size_bytes": size_bytes, "seconds": _time_add(tensor, rounds)})
        if rank == 0:
            medians = ", ".join(
                f"{a} {sorted(t)[len(t) // 2] * 1e3:.2f}"
                for a, t in zip(algorithms, slowest.tolist(), strict=True)
            )
            print(f"collectives: {world} ranks, {size_bytes} B, {rounds} rounds, ms: {medians}",
                  file=sys.stderr, flush=True)  # fmt: skip
        del tensor
    return {
        "world_size": world,
        "delay_ms": settings["delay_ms"],
        "ranks_per_node": per_node,
        "threads_per_rank": torch.get_num_threads(),
        "seconds_of_rounds": time.perf_counter() - start,
        "cells": cells,
        "add": add_cells,
    }


def _time_add(tensor: torch.Tensor, repeats: int) -> list[float]:
    """The reduction alone: `tensor += other` on every rank at once, as the algorithms
    add what they receive, timed like a call (slowest rank). Its seconds per byte of
    `tensor` is the model's gamma."""
    other = torch.zeros_like(tensor)
    return slowest_seconds(lambda: tensor.add_(other), repeats)


if __name__ == "__main__":
    run_worker(json.loads(os.environ["COLLECTIVES_SETTINGS"]))
