"""One traced step of stages 6 to 14, each beside the stage before it, for the stage pages.

    sudo .venv/bin/python -m profiling.course.pairs                # trace, then draw
    .venv/bin/python -m profiling.course.pairs --analyse-only      # draw from runs/course-pairs

Each variant trains the benchmarks' MLP (2048 x 7, 128 samples per rank; the CNN for
the buffers page, which needs BatchNorm's buffers) on the 1 Gbit/s virtual cluster,
traced with the main job's own loop (`ddp.train.train`) and the stage built with the
option its page is about: `find_unused_parameters=True`, `gradient_as_bucket_view=True`,
the fp16 comm hook, two round-robin groups, `bucket_cap_mb="auto"`. The figure of a page
draws rank 0's median traced step of the previous stage above this stage's, on one time
axis: the compute lane (forward, backward, optimizer on the main thread) and every
collective in flight, one bar each, stacked when they overlap, so two all-reduces at once
(round_robin) show as two rows.

Tracing needs root (network namespaces) and removes the cluster when it ends, even on an
error; about 4 minutes on 2 cores (auto_bucket's trial steps are the longest run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import torch

from ddp import comm_hook_functions
from ddp.config import parse_config
from ddp.dist import setup_process_group, teardown_process_group
from ddp.train import train
from profiling.analysis import analyse_runs, read_logdir, step_timeline
from profiling.common import report
from profiling.common.charts import COLOURS
from profiling.course.timelines import (
    FONT_PT,
    RATE,
    TRACING,
    WIDTH_IN,
    WORKLOAD,
    comm_labels,
    save_lanes,
)
from stages import STAGES

CNN = ["--model", "cnn", "--batch-size", "32"]


@dataclass(frozen=True)
class Variant:
    stage: str  # stages.<stage>, or torch_ddp for torch's class
    options: dict = field(default_factory=dict)  # the constructor's keywords
    comm_hook: str | None = None  # a hook of ddp.comm_hook_functions, registered after construction
    args: tuple[str, ...] = ()  # the main job's options besides WORKLOAD and TRACING
    label: str = ""


VARIANTS = {
    "missing_grads": Variant("missing_grads", label="missing_grads"),
    "unused_params": Variant(
        "unused_params", {"find_unused_parameters": True},
        label="unused_params, find_unused_parameters=True",
    ),
    "unused_params_cnn": Variant("unused_params", args=tuple(CNN), label="unused_params (CNN)"),
    "buffers_cnn": Variant(
        "buffers", args=tuple(CNN), label="buffers (CNN), broadcast_buffers=True"
    ),
    "buffers": Variant("buffers", label="buffers"),
    "grad_views": Variant(
        "grad_views", {"gradient_as_bucket_view": True},
        label="grad_views, gradient_as_bucket_view=True",
    ),
    "rebuilt_buckets": Variant("rebuilt_buckets", label="rebuilt_buckets (1 MiB first bucket)"),
    "comm_hooks": Variant("comm_hooks", label="comm_hooks, no hook (plain average)"),
    "comm_hooks_fp16": Variant(
        "comm_hooks", comm_hook="fp16_compress_hook", label="comm_hooks, fp16_compress_hook"
    ),
    "round_robin": Variant(
        "round_robin", {"round_robin_groups": 2}, label="round_robin, round_robin_groups=2"
    ),
    "join": Variant("join", label="join (even inputs)"),
    "auto_bucket": Variant(
        "auto_bucket", args=("--bucket-cap-mb", "auto", "--warmup-steps", "40"),
        label='auto_bucket, bucket_cap_mb="auto" (after its trial steps)',
    ),
    "drop_in": Variant("drop_in", label="drop_in (torch's defaults)"),
    "torch_ddp": Variant("torch_ddp", label="torch's DistributedDataParallel"),
}  # fmt: skip

# page -> the variants drawn on it, top to bottom (the previous stage first)
PAGES = {
    "unused_params": ("missing_grads", "unused_params"),
    "buffers": ("unused_params_cnn", "buffers_cnn"),
    "grad_views": ("buffers", "grad_views"),
    "rebuilt_buckets": ("grad_views", "rebuilt_buckets"),
    "comm_hooks": ("rebuilt_buckets", "comm_hooks_fp16"),
    "round_robin": ("comm_hooks", "round_robin"),
    "auto_bucket": ("join", "auto_bucket"),
    "drop_in": ("auto_bucket", "drop_in", "torch_ddp"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.course.pairs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--logdir", type=Path, default=Path("runs/course-pairs"), help="traces")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/course-pairs"),
        help="where pair-<page>.svg go (docs/images for the docs' own)",
    )  # fmt: skip
    parser.add_argument(
        "--analyse-only", action="store_true", help="draw from traces already in --logdir"
    )
    parser.add_argument("--trace", choices=VARIANTS, help=argparse.SUPPRESS)  # one rank's job
    args = parser.parse_args(argv)
    if args.trace:
        trace(args.trace, args.logdir)
        return
    if not args.analyse_only:
        run(args.logdir)
    args.out.mkdir(parents=True, exist_ok=True)
    draw(args.logdir, args.out)


def trace(name: str, logdir: Path) -> None:
    """One rank of one variant: the main job's training loop, traced into logdir/<name>."""
    v = VARIANTS[name]
    cfg = parse_config(
        [*WORKLOAD, *TRACING, *v.args, "--profile-dir", str(logdir)],
        module="profiling.course.pairs",
        auto_bucket_cap=v.stage == "auto_bucket",
    )

    def wrap(model, cfg):
        if v.stage == "torch_ddp":
            return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)
        wrapped = STAGES[v.stage](model, bucket_cap_mb=cfg.bucket_cap_mb, **v.options)
        if v.comm_hook:
            wrapped.register_comm_hook(None, getattr(comm_hook_functions, v.comm_hook))
        return wrapped

    device = setup_process_group(cfg.backend, cfg.timeout)
    try:
        train(name, wrap, cfg, device)
    finally:
        teardown_process_group()


def run(logdir: Path) -> None:
    """Trace every variant on a fresh 2-rank cluster, removed at the end."""
    cluster = [sys.executable, "-m", "profiling.cluster"]
    subprocess.run([*cluster, "up", "--ranks", "2", "--rate", RATE], check=True)
    try:
        for name in VARIANTS:
            print(f"tracing {name} ...", file=sys.stderr, flush=True)
            job = ["-m", "profiling.course.pairs", "--trace", name, "--logdir", str(logdir)]
            env = {"KINETO_LOG_LEVEL": "6", **os.environ}  # as profiling.course.timelines
            subprocess.run([*cluster, "run", "--", *job], check=True, env=env)
    finally:
        subprocess.run([*cluster, "down"], check=True)


def draw(logdir: Path, out: Path) -> list[Path]:
    matplotlib.use("Agg")
    plt.rcParams.update({"font.size": FONT_PT, "svg.fonttype": "none"})  # text stays text
    traces = read_logdir(logdir)
    missing = [v for v in VARIANTS if 0 not in traces.get(v, {})]
    if missing:
        raise SystemExit(f"{logdir}: no traces for {missing}; run without --analyse-only")
    results = {r.run: r for r in analyse_runs({v: traces[v] for v in VARIANTS}) if r.rank == 0}
    written = []
    for page, variants in PAGES.items():
        drawn = []
        for v in variants:
            step = results[v].median.step
            trace = traces[v][0]
            timeline = step_timeline(trace, step)
            drawn.append((v, timeline, timeline["collective_rows"]))
        height_in = sum(1.0 + 0.45 * len(rows) for _, _, rows in drawn) + 1.2
        fig, axes = plt.subplots(len(drawn), 1, figsize=(WIDTH_IN, height_in), sharex=True,
                                 height_ratios=[2 + len(rows) for _, _, rows in drawn])  # fmt: skip
        for ax, (v, timeline, rows) in zip(axes, drawn, strict=True):
            for phase, intervals in timeline["compute"].items():
                ax.broken_barh(report.bars(intervals), (-0.35, 0.7), color=COLOURS[phase])
            for i, row in enumerate(rows):
                ax.broken_barh(report.bars(row), (-1.35 - i, 0.7), color=COLOURS["gloo"],
                               edgecolor="white", linewidth=0.8)  # fmt: skip
            names = comm_labels(len(rows))
            ax.set_yticks([0, *(-1 - i for i in range(len(rows)))], ["compute", *names])
            ax.set_ylim(-len(rows) - 0.6, 0.6)
            ax.set_title(f"{VARIANTS[v].label}: {timeline['step_ms']:.0f} ms", loc="left")
            ax.grid(axis="x", alpha=0.3)
        axes[-1].set_xlabel("ms from the start of the step (rank 0's median traced step)")
        written.append(save_lanes(fig, out / f"pair-{page}.svg", "collective in flight"))
    return written


if __name__ == "__main__":
    main()
