"""The bandwidth probe: Gloo all-reduce across the shaped links, run under torchrun on
every node, and what it should measure."""

from __future__ import annotations

import json
import statistics

import torch
import torch.distributed as dist

from ddp.dist import slowest_seconds

PROBE_PREFIX = "PROBE_RESULT "


def probe_worker(megabytes: float, iterations: int) -> None:
    """All-reduce a float32 tensor of `megabytes` MB (10**6 bytes) `iterations` times
    after one untimed warm-up; each time is the slowest rank's, from a barrier. Rank 0
    prints one line: PROBE_RESULT {json}, with MB/s = tensor bytes / median time (Gloo
    all-reduce bandwidth; nccl-tests call it "algbw")."""
    dist.init_process_group("gloo")
    try:
        numel = int(megabytes * 1e6) // 4  # float32
        tensor = torch.ones(numel)
        dist.all_reduce(tensor)  # connections, buffers
        slowest = slowest_seconds(lambda: dist.all_reduce(tensor), iterations)
        world = dist.get_world_size()
        per_rank = [numel * 4 / t / 1e6 for t in slowest]
        if dist.get_rank() == 0:
            result = {
                "bytes": numel * 4,
                "ranks": world,
                "seconds": slowest,
                "MBps": statistics.median(per_rank),  # tensor bytes / time
                "MBps_min": min(per_rank),
                "MBps_max": max(per_rank),
                # What each rank sent per second (nccl-tests' "busbw"): 2(N-1)/N of it.
                "bus_MBps": statistics.median(per_rank) * 2 * (world - 1) / world,
            }
            print(PROBE_PREFIX + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


def expected_allreduce_MBps(rate_bits: int, ranks: int) -> float:
    """What the probe should measure, in tensor bytes per second (MB = 10**6 bytes).

    A ring all-reduce of S bytes over N ranks makes every rank send, and receive,
    2(N-1)/N * S bytes (reduce-scatter, then all-gather). Links are full duplex and
    every rank's link runs at the shaped rate R, so one all-reduce takes
    2(N-1)/N * S / R, and S / time = R * N / (2(N-1)): for 2 ranks, the link rate
    itself (125 MB/s at 1gbit). TCP/IP and Ethernet headers take about 4% of it.

    With several ranks per node the figure holds for N ranks in all: Gloo's ring visits
    the ranks in order, so one hop leaves each node through its link, carrying what
    every hop carries, while the hops inside a node run on its loopback, faster."""
    if ranks < 2:
        return float("inf")
    return rate_bits / 8 / 1e6 * ranks / (2 * (ranks - 1))
