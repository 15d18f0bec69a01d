"""What `gradient_as_bucket_view=True` saves: gradient memory and step time, measured.

    python -m profiling.studies.grad_view_memory --nproc 2 --width 2048 --depth 7 --batch-size 64

Runs the grad_views stage twice under torchrun, each time in fresh processes, once
copying gradients into the buckets and out again (the default) and once with `.grad`
as views into them, and prints per mode: the bytes of gradient storage alive after a
step (`.grad` tensors plus bucket buffers, each storage counted once), the peak
resident memory of the slowest rank, and the median step time. The loop keeps the
views: `optimizer.zero_grad(set_to_none=False)`, as torch's documentation advises for
this option. Modes run one after the other, not interleaved: quote the ratio, and rerun
to see the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp.data import rank_batch
from ddp.dist import setup_process_group, teardown_process_group
from ddp.models import build_model
from stages import STAGES


def gradient_bytes(model: torch.nn.Module, stage) -> int:
    """Bytes of the distinct storages behind .grad and the bucket buffers."""
    storages = {}
    for tensor in [p.grad for p in model.parameters() if p.grad is not None] + [
        b.buffer for b in stage.buckets
    ]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def worker(args: argparse.Namespace) -> None:
    setup_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = build_model("mlp", width=args.width, depth=args.depth)
    stage = STAGES["grad_views"](model, gradient_as_bucket_view=args.mode == "view")
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01, momentum=0.9)
    times = []
    for step in range(args.warmup + args.steps):
        inputs, labels = rank_batch(model, args.batch_size * world, step, rank, world)
        dist.barrier()
        start = time.perf_counter()
        F.cross_entropy(stage(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    held = gradient_bytes(model, stage)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out = torch.tensor([statistics.median(times), held, peak_kib], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    if rank == 0:
        result = {"mode": args.mode, "step_s": out[0].item()}
        result |= {"grad_bytes": int(out[1]), "peak_rss_kib": int(out[2])}
        print("RESULT " + json.dumps(result))
    teardown_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mode", choices=["copy", "view"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:  # a rank, under torchrun
        return worker(args)
    results = {}
    for mode in ("copy", "view"):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(args.nproc), "-m", "profiling.studies.grad_view_memory",
            "--mode", mode,
            "--width", str(args.width), "--depth", str(args.depth),
            "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup", str(args.warmup),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            sys.exit(f"{mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        results[mode] = json.loads(lines[-1].removeprefix("RESULT "))
    copy, view = results["copy"], results["view"]
    print(f"mlp width {args.width} depth {args.depth}, per-rank batch {args.batch_size}, "
          f"{args.nproc} ranks, {args.steps} timed steps (median of the slowest rank)")  # fmt: skip
    print(f"{'mode':<6}{'gradient MiB':>14}{'peak RSS MiB':>14}{'step ms':>10}")
    for r in (copy, view):
        print(f"{r['mode']:<6}{r['grad_bytes'] / 2**20:>14.1f}"
              f"{r['peak_rss_kib'] / 1024:>14.1f}{r['step_s'] * 1e3:>10.1f}")  # fmt: skip
    print(f"view / copy: gradient memory {view['grad_bytes'] / copy['grad_bytes']:.2f}x, "
          f"peak RSS {view['peak_rss_kib'] / copy['peak_rss_kib']:.2f}x, "
          f"step time {view['step_s'] / copy['step_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
