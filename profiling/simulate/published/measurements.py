"""Published measurements of DDP, beside what the step model predicts for each.

    python -m profiling.simulate published            # table and figure, under runs/simulate/
    python -m profiling.simulate published --docs     # the docs' own (docs/results, images)

Each row is a measurement someone else made and published:

- torch's own DDP benchmark (pytorch/pytorch, `benchmarks/distributed/ddp/README.md`):
  ResNet-50, ResNet-101, ResNeXt-50 32x4d and ResNeXt-101 32x8d at 32 images per GPU,
  median seconds per iteration on DGX-1 servers (8 V100, 4 x 100 Gbit/s InfiniBand),
  NCCL, PyTorch 1.4: one GPU without DDP, DDP on 1, 2, 4 and 8 GPUs of one server and
  16 of two. The row is the efficiency against one GPU without DDP,
  E(p) = t(no DDP) / t(p). Then the throughput change of `bucket_cap_mb=1` against the
  default 25 (p75, ResNet-50 at 8 and 16 GPUs).
- Goyal et al., "Accurate, Large Minibatch SGD" (arXiv 1706.02677): ~90% scaling
  efficiency from 8 to 256 P100 for ResNet-50.
- Li et al., "PyTorch Distributed" (VLDB 2020): overlapping communication with backward
  speeds up ResNet-50 and BERT by 38.0% and 35.2% on NCCL.

The predictions are the step model's (`schedule.simulate`): on the benchmark's DGX-1
servers (`torch_bench`) from its own one-GPU time without DDP, with the layout torch's
DDP builds (25 MiB after a 1 MiB first bucket, in ready order); on the `goyal2017`
preset; and on the `li2020` preset with the bus bandwidth NCCL achieves between its
servers and ResNet-50 at an assumed 32 images per GPU (`li_sensitivity` shows how the
answer moves with both). Backward is split by FLOPs. With a trace, the terms measured
on it (`terms`) are added one at a time.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from profiling.common import report
from profiling.common.report import command_line, markdown_table, produced_by
from profiling.simulate import accuracy, outputs, presets
from profiling.simulate.clusters import cluster
from profiling.simulate.published import paper, terms
from profiling.simulate.published.sources import (
    GOYAL_E256,
    GOYAL_E256_SOURCE,
    LI_GPUS,
    LI_OVERLAP,
    LI_OVERLAP_SOURCE,
)
from profiling.simulate.published.terms import DOCS_TRACE, GpuSharing, straggler_sigma_for
from profiling.simulate.published.torch_bench import (
    NO_DDP,
    TORCH_BENCH,
    TORCH_BENCH_BATCH,
    TORCH_BENCH_CAP_1_VS_25,
    TORCH_BENCH_MEMORY_BYTES_PER_S,
    TORCH_BENCH_P50_S,
    cost_per_bucket,
    step_s,
    straggler_bound,
    torch14_buckets,
    torch_bench_cluster,
    torch_bench_step_s,
    torch_bench_workload,
)
from profiling.simulate.scale import PER_PARAMETER
from profiling.simulate.schedule import Sharing, Workload
from profiling.simulate.topology import GBIT, Topology, cost_model

# Li et al. do not give ResNet-50's batch: ASSUMED 32 per GPU, as torch's own DDP
# benchmark, written by the same team, runs it; BERT-large at its preset's 8.
LI_BATCH = {"resnet50": 32, "bert_large": 8}
# What NCCL achieves across servers with one 100 Gbit/s NIC each: NVIDIA/nccl issue 235
# (NVIDIA), all_reduce busbw about 10 GB/s on 2 AWS p3dn servers (V100) with one such NIC,
# 6-8 GB/s on 8 to 32 servers. Li et al.'s 4 servers sit between: the 2-server figure
# here, 6 GB/s in the table of how the answer moves (`li_sensitivity`).
LI_INTER_BYTES_PER_S = 10e9


@dataclass(frozen=True)
class Row:
    what: str
    published: float
    predicted: float  # the bare model's
    unit: str  # "E" (an efficiency) or "%" (a change in throughput or a speed-up)
    source: str
    # With the measured terms (`terms`): DDP's passes, then also compute beside NCCL;
    # None where they are not modelled for the row.
    with_passes: float | None = None
    with_terms: float | None = None

    @property
    def error(self) -> float:
        """The fullest prediction minus published, in the row's unit (points for a
        percentage)."""
        best = self.predicted if self.with_terms is None else self.with_terms
        return best - self.published


def li_cluster(inter_bytes_per_s: float = LI_INTER_BYTES_PER_S) -> Topology:
    """Li et al.'s 32 GPUs (the `li2020` preset) with the bus bandwidth NCCL achieves
    across servers of one 100 Gbit/s NIC each, in place of the NIC's line rate."""
    return replace(cluster("li2020").topology, inter_bytes_per_s=inter_bytes_per_s)


def li_workload(model: str, batch: int | None = None) -> Workload:
    """The model at `batch` per GPU (LI_BATCH by default) on one V100: ResNet-50 at 32
    from torch's benchmark's own 0.097 s, at 112 from NVIDIA's; BERT-large at 8."""
    compute = presets.COMPUTE[model, "V100"]
    batch = batch or LI_BATCH[model]
    if model == "resnet50" and batch == TORCH_BENCH_BATCH:
        compute = replace(compute, batch=batch,
                          samples_per_s=batch / TORCH_BENCH_P50_S[model][NO_DDP],
                          source=TORCH_BENCH + ": 0.097 s for 32 images without DDP")  # fmt: skip
    elif batch != compute.batch:
        raise ValueError(f"no published V100 time for {model} at batch {batch}")
    return presets.workload(model, "V100", compute=compute)


def li_speedup(
    model: str,
    batch: int | None = None,
    inter_bytes_per_s: float = LI_INTER_BYTES_PER_S,
    sharing: Sharing | None = None,
) -> float:
    """Li et al.'s overlap speed-up at 32 GPUs, NCCL's ring, the layout of their DDP
    (torch 1.5's, as 1.4's: `torch14_buckets`): all-reduce after backward against
    during it, minus one."""
    w = li_workload(model, batch)
    cost = cost_model(li_cluster(inter_bytes_per_s).with_gpus(LI_GPUS), "ring")
    buckets = torch14_buckets(w, 25.0)
    after = step_s(w, buckets, cost, sharing, overlap=False)
    return after / step_s(w, buckets, cost, sharing) - 1


@cache  # one trace, read and fitted once for the table and its what-ifs
def measured_terms(trace: str | Path) -> tuple[GpuSharing, GpuSharing]:
    """The terms measured on `trace`, carried to the benchmark's V100: DDP's passes
    alone, then with compute beside NCCL."""
    events = terms.load(trace)
    work = terms.reducer_work(events, terms.A100_MEMORY_BYTES_PER_S)
    beside = terms.beside_nccl(events)
    v100 = TORCH_BENCH_MEMORY_BYTES_PER_S
    return terms.sharing(work, None, v100), terms.sharing(work, beside, v100)


def rows(trace: str | Path | None = None) -> list[Row]:
    """Every published row with the model's prediction; with `trace` (a GPU trace of
    torch's DDP training ResNet-50), also with the terms measured on it."""
    workloads = {model: torch_bench_workload(model) for model in TORCH_BENCH_P50_S}
    variants = [None] if trace is None else [None, *measured_terms(trace)]

    def predictions(measure) -> dict:
        made = [measure(v) for v in variants] + [None, None]
        return {"predicted": made[0], "with_passes": made[1], "with_terms": made[2]}

    out = []
    for model, p50 in TORCH_BENCH_P50_S.items():
        w = workloads[model]
        for gpus in (g for g in p50 if g != NO_DDP):

            def efficiency(v, w=w, g=gpus) -> float:
                return w.compute_s / torch_bench_step_s(w, g, 25.0, v)

            out.append(Row(
                f"{model}, {gpus} GPU{'s' if gpus > 1 else ''}: E against 1 GPU without DDP",
                p50[NO_DDP] / p50[gpus], unit="E", source=TORCH_BENCH,
                **predictions(efficiency),
            ))  # fmt: skip
    w = workloads["resnet50"]
    for gpus, change in TORCH_BENCH_CAP_1_VS_25.items():

        def cap_change(v, g=gpus) -> float:
            return (torch_bench_step_s(w, g, 25.0, v) / torch_bench_step_s(w, g, 1.0, v) - 1) * 100

        out.append(Row(
            f"resnet50, {gpus} GPUs: throughput, bucket_cap_mb 1 against 25",
            change * 100, unit="%", source=TORCH_BENCH + " (p75, its diff)",
            **predictions(cap_change),
        ))  # fmt: skip
    compared = paper.compare()
    goyal = compared["goyal_efficiency"]["hierarchical_halving_doubling"][PER_PARAMETER]
    # Goyal et al. trained with Caffe2 and Gloo, not DDP: the reducer's passes and the
    # trace's NCCL are not theirs, so their row has the bare model only.
    out.append(Row(
        "Goyal et al.: resnet50, E(256) against 8 P100", GOYAL_E256,
        next(r["efficiency"] for r in goyal if r["gpus"] == 256), "E",
        GOYAL_E256_SOURCE,
    ))  # fmt: skip
    for model, speedup in LI_OVERLAP.items():

        def li(v, model=model) -> float:
            return li_speedup(model, sharing=v) * 100

        batch = LI_BATCH[model]
        out.append(Row(
            f"Li et al.: {model}, speed-up of overlapping, {LI_GPUS} GPUs, NCCL (batch {batch})",
            speedup * 100, unit="%", source=LI_OVERLAP_SOURCE,
            **predictions(li),
        ))  # fmt: skip
    return out


def li_sensitivity() -> list[list[str]]:
    """Li et al.'s overlap speed-up as the unknown settings move: ResNet-50's batch, and
    the bus bandwidth between servers (the NIC's line rate, or what NCCL achieves on
    it); the bare model."""
    rates = [(100 * GBIT, "100 Gbit/s line rate"),
             (LI_INTER_BYTES_PER_S, "10 GB/s (NCCL, 2 servers)"),
             (6e9, "6 GB/s (NCCL, 8 or more)")]  # fmt: skip
    table = []
    for model, batches in (("resnet50", (32, 112)), ("bert_large", (8,))):
        for batch in batches:
            cells = [f"{li_speedup(model, batch, rate) * 100:+.1f}%" for rate, _ in rates]
            table.append([f"{model}, batch {batch}", f"{LI_OVERLAP[model] * 100:+.1f}%", *cells])
    return [["", "published", *(label for _, label in rates)], *table]


def what_ifs(trace: str | Path) -> list[str]:
    """The full model with one thing changed, on torch's benchmark: the NVLink of all
    eight GPUs for two; backward 1.19 times slower beside NCCL instead of the trace's
    ratio (arXiv 2507.03114's mean slowdown of compute overlapped with communication,
    18.9%); and backward stopped whenever a collective is in its latency."""
    _, base = measured_terms(trace)
    workloads = [torch_bench_workload(m) for m in TORCH_BENCH_P50_S]

    gpus = [g for g in TORCH_BENCH_P50_S["resnet50"] if g != NO_DDP]

    def efficiencies(sharing: Sharing) -> list[float]:
        return [w.compute_s / torch_bench_step_s(w, g, 25.0, sharing)
                for w in workloads for g in gpus]  # fmt: skip

    full_server = cost_model(torch_bench_cluster().topology.with_gpus(2), "ring")
    nvlink = [w.compute_s / step_s(w, torch14_buckets(w), full_server, base)
              - w.compute_s / torch_bench_step_s(w, 2, 25.0, base) for w in workloads]  # fmt: skip
    now = efficiencies(base)
    slower = efficiencies(replace(base, slowdown=0.189))
    stalled = Stalled(base.slowdown, work=base.work, memory_bytes_per_s=base.memory_bytes_per_s)
    w = workloads[0]
    cap = {g: (torch_bench_step_s(w, g, 25.0, stalled) / torch_bench_step_s(w, g, 1.0, stalled)
               - 1) * 100 for g in TORCH_BENCH_CAP_1_VS_25}  # fmt: skip
    moved = max(abs(a - b) for a, b in zip(now, efficiencies(stalled), strict=True))
    return [
        "What-ifs, each on the full model: the NVLink of all eight GPUs for two as well "
        f"raises E(2) by {min(nvlink) * 100:.1f} to {max(nvlink) * 100:.1f} points; "
        "backward 1.19 times slower beside NCCL (arXiv 2507.03114's mean) lowers no "
        f"efficiency by more than {max(a - b for a, b in zip(now, slower, strict=True)) * 100:.1f} "
        "points; and with backward stopped whenever a collective is in its latency, the "
        "1 MiB cap costs " + " and ".join(f"{-c:.1f}% at {g} GPUs" for g, c in cap.items())
        + f", while no efficiency moves by more than {moved * 100:.1f} points.",
        "",
    ]  # fmt: skip


@dataclass(frozen=True)
class Stalled(GpuSharing):
    """The terms, and backward making no progress while a collective is in its latency
    (its message rounds): the most the latency could cost if none of it hid."""

    def compute_rate(self, on_wire: bool, in_latency: bool) -> float:
        return 1e-12 if in_latency else super().compute_rate(on_wire, False)


def markdown(table: list[Row], notes: list[str] = ()) -> str:
    def cell(value: float, unit: str) -> str:
        return f"{value:.3f}" if unit == "E" else f"{value:+.1f}%"

    def maybe(value: float | None, unit: str) -> str:
        return "n/a" if value is None else cell(value, unit)

    def error(r: Row) -> str:
        return f"{r.error:+.3f}" if r.unit == "E" else f"{r.error:+.1f} points"

    terms = any(r.with_terms is not None for r in table)
    body = [
        [r.what, cell(r.published, r.unit), cell(r.predicted, r.unit)]
        + ([maybe(r.with_passes, r.unit), maybe(r.with_terms, r.unit)] if terms else [])
        + [error(r)]
        for r in table
    ]
    header = ["measurement", "published", "model"]
    header += ["+ DDP's passes", "+ beside NCCL"] if terms else []
    header += ["error"]
    sources = sorted({r.source for r in table})
    li = li_sensitivity()
    spread, buckets = straggler_bound(), cost_per_bucket()
    goyal_sigma = straggler_sigma_for(GOYAL_E256, 256, 8)
    return "\n".join([
        produced_by([command_line("profiling.simulate")]), "",
        markdown_table(header, body, left=1), "",
        "Sources: " + "; ".join(sources) + ".", "",
        "Li et al.'s overlap speed-up as their unknown settings move (the bare model; "
        "between servers, the NIC's line rate or the bus bandwidth NCCL achieves on one "
        "100 Gbit/s NIC per server, NVIDIA/nccl issue 235):", "",
        markdown_table(li[0], li[1:], left=1), "",
        f"Stragglers: the benchmark prints one V100's p50 and p95 without DDP at the same "
        f"millisecond ({spread['p50_s']:.3f} s for ResNet-50), so the step's spread is "
        f"under 1 ms / 1.645 = {spread['sigma']:.1%} of it. The slowest of 16 such GPUs "
        f"then costs at most {1 - spread['e16']:.1%}, and from 8 to 256 GPUs at most "
        f"{(1 - spread['e256']) * 100:.1f} points; stragglers alone would make Goyal et "
        f"al.'s E(256) = {GOYAL_E256:.2f} only with a spread of {goyal_sigma:.1%}.",
        "",
        f"Each of the {buckets[0]['extra_buckets']} extra buckets of the 1 MiB cap cost "
        + ", ".join(f"{b['per_bucket_s'] * 1e6:.0f} µs" for b in buckets)
        + " at " + ", ".join(str(b["gpus"]) for b in buckets) + " GPUs (the diff's change "
        "times its iteration); NCCL's latency for one all-reduce, in the model: "
        + ", ".join(f"{b['nccl_latency_s'] * 1e6:.0f} µs" for b in buckets[1:]) + " at 2 "
        "GPUs and up.",
        "",
        *notes,
    ])  # fmt: skip


def plot(table: list[Row], path) -> None:
    """E(p) of each model of torch's benchmark, 1 to 16 GPUs: published, the bare model,
    the model with the terms (where the table has them), and the central figure with the
    fitted loss (`accuracy.FITTED`) and its range from 2 GPUs on, shaded."""
    matplotlib.use("Agg")
    plt.rcParams.update({"font.size": report.FIGURE_FONT_PT})
    fig, axes = plt.subplots(2, 2, figsize=(report.FIGURE_WIDTH_IN, 6.0), sharex=True, sharey=True)
    gpus = [g for g in TORCH_BENCH_P50_S["resnet50"] if g != NO_DDP]
    for ax, model in zip(axes.flat, TORCH_BENCH_P50_S, strict=True):
        rows = [r for r in table if r.unit == "E" and r.what.startswith(f"{model}, ")]
        ax.plot(gpus, [r.published for r in rows], "ko-", label="published")
        ax.plot(gpus, [r.predicted for r in rows], ls="--", marker="s", color="0.6",
                label="bare model")  # fmt: skip
        if all(r.with_terms is not None for r in rows):
            ax.plot(gpus, [r.with_terms for r in rows], marker="^", color="tab:blue",
                    label="model with the terms")  # fmt: skip
        # Against 1 GPU without DDP, whose bare step is its compute (as crossval.series).
        multi = [(g, accuracy.Point(g, 1, 1 / r.predicted, 1.0, r.published)
                  .central(accuracy.FITTED))
                 for g, r in zip(gpus, rows, strict=True) if g >= 2]  # fmt: skip
        ax.plot([g for g, _ in multi], [e for _, e in multi], marker="D", ms=4,
                color="tab:orange", label="central (fitted loss)")  # fmt: skip
        ax.fill_between([g for g, _ in multi], [e + accuracy.RECORD.lo for _, e in multi],
                        [e + accuracy.RECORD.hi for _, e in multi], color="tab:orange",
                        alpha=0.2, label="its range")  # fmt: skip
        ax.set_title(model)
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("GPUs (V100, NCCL)")
    for ax in axes[:, 0]:
        ax.set_ylabel("E against 1 GPU without DDP")
    axes[0, 0].set_ylim(0.83, 1.01)
    axes[0, 0].legend(loc="lower left")
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    outputs.add_arguments(parser)
    parser.add_argument(
        "--terms-from", metavar="TRACE",
        help="a GPU trace of torch's DDP training ResNet-50 to measure the two terms on "
        f"(profiling.simulate.published.terms; default: {terms_trace_help()})",
    )  # fmt: skip
    parser.add_argument("--no-terms", action="store_true", help="the bare model only")


def terms_trace_help() -> str:
    return f"{DOCS_TRACE} in this checkout"


def run(args: argparse.Namespace) -> None:
    trace = None if args.no_terms else args.terms_from
    if trace is None and not args.no_terms:
        trace = Path(__file__).resolve().parents[3] / DOCS_TRACE
        if not trace.is_file():
            raise SystemExit(f"published: no {DOCS_TRACE} here; pass --terms-from or --no-terms")
    elif trace is not None and not Path(trace).is_file():
        raise SystemExit(f"--terms-from {trace}: no such file")
    table = rows(trace)
    text = markdown(table, what_ifs(trace) if trace is not None else [])
    print(text)
    if args.no_files:
        return
    results, images = outputs.folders(args)
    path = results / "published.md"
    path.write_text(text)
    plot(table, images / "published.png")
    print(f"wrote {path}, {images / 'published.png'}")
