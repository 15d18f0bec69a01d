"""When buckets leave under torch.compile: eager, compiled without graph cuts, compiled
with them (the drop-in, or torch's DDP with --ddp torch).

    torchrun --standalone --nproc-per-node 2 -m profiling.studies.compile_overlap
    sudo .venv/bin/python -m profiling.cluster run -- -m profiling.studies.compile_overlap  # 1 Gbit

A compiled model's backward is one autograd node per compiled graph: every gradient of
a graph becomes ready when that graph's whole backward is done. Compiled as one graph,
all gradients come at the end of backward, and every bucket leaves then: nothing
overlaps. torch.compile's DDP optimizer cuts the graph where the active DDP module's
buckets end (`bucket_bytes_cap`), so each bucket's gradients come when its layers'
backward is done, as in eager mode. `torch._dynamo.config.optimize_ddp = False` turns the
cuts off: the second variant.

Model: --layers Linear(W, W)+ReLU blocks (W = --width; 1 MiB of fp32 weights each at
512) under 1 MiB buckets, a batch of --batch-size per rank, MSE loss, SGD; compiled with
torch's `aot_eager` backend (forward and backward traced into one autograd node per
graph, as inductor does, with no code generation: the variants differ in where
gradients become ready, not in the kernels), counting the graphs. Per variant,
--warmup untimed steps, then --steps timed ones, recorded with torch.profiler: one trace
per rank in OUT/<variant>/ (TensorBoard's PyTorch Profiler tab, or Perfetto; and
`python -m profiling.compare --analyse-only OUT` measures the overlap from them). Printed by
rank 0: graphs compiled, and per step (median over steps) when the first and the last
bucket left, as a share of backward's time (from loss.backward() to its return), and the
step time. Nothing is written but OUT (default runs/compile-overlap) and --figure.

`--versus R` instead compares the drop-in with torch's DDP, both compiled with the cuts, in
R interleaved rounds of --steps untraced steps each (after --warmup steps of each): the
same machine's noise falls on both sides of a round, so the ratio per round compares.
Printed by rank 0: each side's median step (the slowest rank's), and the ratio's median
over rounds with its 95% confidence interval and its range. The interval is
distribution-free (from the rounds' order statistics: scipy's `quantile_test`): a ratio
whose interval holds 1.00 is one the run cannot tell from torch's. On the 1 Gbit cluster
a round's ratio typically falls within ±5% of the median (its extremes about ±20%, the
link's hiccups), and 480 rounds (about twelve minutes) know the median to about ±0.5%.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from scipy.stats import quantile_test
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

from ddp.dist import setup_process_group, teardown_process_group
from stages.drop_in import DistributedDataParallel as DropInDDP

VARIANTS = ("eager", "compiled, no cuts", "compiled, cut at buckets")


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers))
    )


def run_variant(variant: str, args: argparse.Namespace, out: Path) -> dict:
    """One variant's steps: graphs compiled, bucket launch shares of backward, step ms."""
    DDP = TorchDDP if args.ddp == "torch" else DropInDDP
    graphs: list = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return aot_eager(graph_module, example_inputs)

    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = variant != "compiled, no cuts"
    model = _model(args.layers, args.width)
    if variant != "eager":
        model = torch.compile(model, backend=counting_backend)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch_size, args.width, generator=data)
    y = torch.randn(args.batch_size, args.width, generator=data)
    launches: list[float] = []
    _time_launches(ddp, launches)
    first, last, step_ms = [], [], []
    trace_dir = out / variant.replace(", ", "-").replace(" ", "-")
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=0, warmup=args.warmup, active=args.steps),
        on_trace_ready=tensorboard_trace_handler(str(trace_dir)),
    ) as profiler:
        for step in range(args.warmup + args.steps):
            dist.barrier()
            start = time.perf_counter()
            with record_function("forward"):
                loss = F.mse_loss(ddp(x), y)
            launches.clear()
            backward_start = time.perf_counter()
            with record_function("backward"):
                loss.backward()
            backward_end = time.perf_counter()
            with record_function("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            if step >= args.warmup and launches:
                span = backward_end - backward_start
                first.append((launches[0] - backward_start) / span)
                last.append((launches[-1] - backward_start) / span)
                step_ms.append((time.perf_counter() - start) * 1e3)
            profiler.step()
    torch._dynamo.config.optimize_ddp = True
    return {
        "variant": variant,
        "graphs": len(graphs),
        "first": statistics.median(first),
        "last": statistics.median(last),
        "step_ms": statistics.median(step_ms),
    }


def versus(args: argparse.Namespace) -> dict:
    """The drop-in against torch's DDP, both compiled with graph cuts at buckets, in
    `args.versus` interleaved rounds: per round, --steps steps of one, then of the other
    (the order alternating), each step the slowest rank's time from a barrier."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = True
    sides = {}
    for name, DDP in (("drop_in", DropInDDP), ("torch", TorchDDP)):
        ddp = DDP(torch.compile(_model(args.layers, args.width), backend=aot_eager),
                  bucket_cap_mb=args.bucket_cap_mb)  # fmt: skip
        sides[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    data = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch_size, args.width, generator=data)
    y = torch.randn(args.batch_size, args.width, generator=data)

    def step(name: str) -> float:
        ddp, optimizer = sides[name]
        dist.barrier()
        start = time.perf_counter()
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's
        return seconds.item() * 1e3

    for name in sides:
        for _ in range(args.warmup):
            step(name)
    times: dict[str, list[float]] = {name: [] for name in sides}
    ratios = []
    for r in range(args.versus):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        medians = {}
        for name in order:
            ms = [step(name) for _ in range(args.steps)]
            times[name] += ms
            medians[name] = statistics.median(ms)
        ratios.append(medians["drop_in"] / medians["torch"])
    return {
        "drop_in_ms": statistics.median(times["drop_in"]),
        "torch_ms": statistics.median(times["torch"]),
        **ratio_summary(ratios),
    }


def ratio_summary(ratios: list[float]) -> dict[str, float]:
    """The median of per-round ratios, the 95% confidence interval of that median, and the
    range. The interval needs no assumption about how the ratios are distributed (a
    round's ratio is skewed by the network's hiccups), only that rounds are independent:
    it is the j-th smallest and the j-th largest ratio, j the largest rank with
    P(Binomial(rounds, 1/2) < j) <= 2.5%, so it holds the true median with at least 95%
    probability. NaN for too few rounds (fewer than 6)."""
    median = statistics.median(ratios)
    # q is only the value the test's p-value is about (a ratio of 1: level); the
    # interval it gives does not depend on it.
    interval = quantile_test(ratios, q=1.0).confidence_interval(0.95)
    return {
        "ratio": median,
        "ratio_low": float(interval.low),
        "ratio_high": float(interval.high),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": len(ratios),
    }


def _time_launches(ddp: nn.Module, launches: list[float]) -> None:
    """Note when each bucket's all-reduce is launched (torch's DDP: its comm hook)."""
    if hasattr(ddp, "_send"):
        send = ddp._send

        def timed_send(bucket):
            launches.append(time.perf_counter())
            return send(bucket)

        ddp._send = timed_send
    else:

        def timed_hook(group, bucket):
            launches.append(time.perf_counter())
            return default_hooks.allreduce_hook(group, bucket)

        ddp.register_comm_hook(None, timed_hook)


def figure(rows: list[dict], path: Path) -> None:
    """When the first and the last bucket left, as a share of backward, per variant."""
    matplotlib.use("Agg")
    fig, ax = plt.subplots(figsize=(7, 2.4))
    for i, row in enumerate(reversed(rows)):
        ax.barh(i, 1.0, color="#dddddd", height=0.5)
        ax.barh(i, row["last"] - row["first"], left=row["first"], color="#1f77b4", height=0.5)
    ax.set_yticks(range(len(rows)), [r["variant"] for r in reversed(rows)])
    ax.set_xlim(0, 1.05)
    ax.set_xlabel("share of loss.backward()'s time: first to last bucket launch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.studies.compile_overlap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ddp", choices=["drop_in", "torch"], default="drop_in")
    parser.add_argument("--layers", type=int, default=12, help="Linear+ReLU blocks (12)")
    parser.add_argument("--width", type=int, default=512, help="features per layer (512)")
    parser.add_argument("--batch-size", type=int, default=256, help="per rank (256)")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0, help="MiB (1)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (5)")
    parser.add_argument("--out", type=Path, default=Path("runs/compile-overlap"))
    parser.add_argument("--figure", type=Path, help="a PNG of the launch shares")
    parser.add_argument("--versus", type=int, metavar="R",
                        help="compare the drop-in with torch's DDP, both compiled with cuts, "
                        "in R interleaved rounds (nothing traced)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.versus is not None and args.versus < 1:
        parser.error(f"--versus {args.versus}: run at least 1 round")
    setup_process_group("gloo")
    try:
        if args.versus:
            result = versus(args)
        else:
            rows = [run_variant(v, args, args.out) for v in VARIANTS]
    finally:
        teardown_process_group()
    if int(os.environ["RANK"]) != 0:
        return
    if args.versus:
        print(
            f"compiled, cut at buckets: {args.layers} layers of {args.width}, "
            f"{args.bucket_cap_mb} MiB buckets, {args.versus} rounds of {args.steps} steps"
        )
        interval = (
            "no 95% CI (fewer than 6 rounds)"
            if math.isnan(result["ratio_low"])
            else f"95% CI {result['ratio_low']:.3f}-{result['ratio_high']:.3f}"
        )
        print(
            f"drop_in {result['drop_in_ms']:.1f} ms, torch's DDP {result['torch_ms']:.1f} ms; "
            f"drop_in / torch per round: median {result['ratio']:.3f}, {interval} "
            f"(rounds {result['ratio_min']:.3f}-{result['ratio_max']:.3f})"
        )
        return
    print(f"{args.ddp}, {args.layers} layers of {args.width}, {args.bucket_cap_mb} MiB buckets")
    print("| variant | graphs | first bucket leaves | last leaves | step ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['graphs']} | {r['first']:.2f} | {r['last']:.2f} "
            f"| {r['step_ms']:.0f} |"
        )
    print(f"traces: {args.out}/<variant>/ (tensorboard --logdir {args.out})")
    if args.figure:
        figure(rows, args.figure)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
