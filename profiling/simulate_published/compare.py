"""Published measurements of DDP, beside what the step model predicts for each.

    python -m profiling.simulate published            # the table, under runs/simulate/
    python -m profiling.simulate published --docs     # the docs' own (docs/results/)

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

The predictions are the step model's (`schedule.simulate`) on the benchmark's DGX-1
servers (`torch_bench_cluster`) and the `goyal2017` and `li2020` presets, each iteration
time the published one (for torch's benchmark: its own one-GPU time without DDP), split
over backward by FLOPs, with the layout torch's DDP builds (25 MiB after a 1 MiB first
bucket, in ready order).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

TORCH_BENCH = "pytorch/pytorch benchmarks/distributed/ddp/README.md"
NO_DDP = 0  # the key of the one-GPU time without DDP
# p50 seconds per iteration, 32 images per GPU: GPUs -> seconds (NO_DDP: without DDP).
TORCH_BENCH_P50_S = {
    "resnet50": {NO_DDP: 0.097, 1: 0.100, 2: 0.103, 4: 0.103, 8: 0.104, 16: 0.104},
    "resnet101": {NO_DDP: 0.162, 1: 0.171, 2: 0.176, 4: 0.176, 8: 0.179, 16: 0.179},
    "resnext50_32x4d": {NO_DDP: 0.145, 1: 0.147, 2: 0.153, 4: 0.153, 8: 0.157, 16: 0.157},
    "resnext101_32x8d": {NO_DDP: 0.415, 1: 0.425, 2: 0.438, 4: 0.439, 8: 0.447, 16: 0.450},
}
TORCH_BENCH_BATCH = 32
TORCH_BENCH_MEMORY_BYTES_PER_S = 900e9  # V100 SXM2 data sheet
# Throughput with bucket_cap_mb=1 against 25, p75, ResNet-50 (the README's diff).
TORCH_BENCH_CAP_1_VS_25 = {8: -0.026, 16: -0.038}
GOYAL_E256 = 0.90
LI_OVERLAP = {"resnet50": 0.380, "bert_large": 0.352}  # NCCL; Gloo: 26.8%, 21.5%


def resnext50_32x4d(device: str | None = None):
    """torchvision.models.resnext50_32x4d(): ResNet-50 with 32 groups of 4 channels in
    each 3x3 convolution (Xie et al., "Aggregated Residual Transformations")."""
    from profiling.simulate.presets import resnet50

    return resnet50(device, groups=32, width_per_group=4)


def resnext101_32x8d(device: str | None = None):
    """torchvision.models.resnext101_32x8d(): ResNet-101 with 32 groups of 8 channels."""
    from profiling.simulate.presets import resnet50

    return resnet50(device, depth=101, groups=32, width_per_group=8)


FACTORIES = {
    "resnet50": "profiling.simulate.presets:resnet50",
    "resnet101": "profiling.simulate.presets:resnet101",
    "resnext50_32x4d": "profiling.simulate_published.compare:resnext50_32x4d",
    "resnext101_32x8d": "profiling.simulate_published.compare:resnext101_32x8d",
}


def torch_bench_cluster():
    """The benchmark's DGX-1 servers: 8 Tesla V100 on NVLink (the hybrid cube mesh its
    `nvidia-smi topo` prints), 4 x 100 Gbit/s InfiniBand per server, NCCL with PyTorch
    1.4. Line rates; latencies NCCL 2.7.5's, the nearest modelled to the benchmark's."""
    from profiling.simulate.clusters import GB, GBIT, NCCL_2_7, NCCL_2_7_NET_STEP_S, server

    return server("V100", 900, 150 * GB, 400 * GBIT, {
        "gpus_per_node": TORCH_BENCH + ": DGX-1, 8 V100",
        "intra_bytes_per_s": "V100 SXM2 data sheet: NVLink 6 x 25 GB/s each way (line rate)",
        "inter_bytes_per_s": TORCH_BENCH + ": '4x 100Gb InfiniBand per machine' (line rate)",
        "gpu": "V100 SXM2 data sheet: 900 GB/s memory bandwidth",
    }, NCCL_2_7 + " (ASSUMED: the benchmark's NCCL is not named)", NCCL_2_7_NET_STEP_S)  # fmt: skip


@dataclass(frozen=True)
class Row:
    what: str
    published: float
    predicted: float  # the bare model's
    unit: str  # "E" (an efficiency) or "%" (a change in throughput or a speed-up)
    source: str
    # With the measured terms (`terms`): DDP's copies, then also compute beside NCCL;
    # None where they are not modelled for the row.
    with_copies: float | None = None
    with_terms: float | None = None

    @property
    def error(self) -> float:
        """The fullest prediction minus published, in the row's unit (points for a
        percentage)."""
        best = self.predicted if self.with_terms is None else self.with_terms
        return best - self.published


def torch_bench_workload(model: str):
    """The model at 32 images per GPU on one V100, from the benchmark's own time without
    DDP; the optimizer (SGD with momentum) at the V100's memory bandwidth."""
    from profiling.simulate import presets, usermodel

    prof = usermodel.profile(FACTORIES[model], (3, 224, 224))
    optimizer_s = prof.parameters * presets.SGD_MOMENTUM_BYTES / TORCH_BENCH_MEMORY_BYTES_PER_S
    return usermodel.workload(prof, TORCH_BENCH_P50_S[model][NO_DDP], optimizer_s)


def torch_bench_step_s(workload, gpus: int, bucket_cap_mb: float = 25.0, sharing=None) -> float:
    """One iteration of torch's DDP on `gpus` V100 of the benchmark's cluster: its layout
    (`bucket_cap_mb` after a 1 MiB first bucket, or `bucket_cap_mb` for both when it is
    smaller, as torch takes a cap you give), overlapped, NCCL's ring."""
    from profiling.simulate.layouts import torch_buckets
    from profiling.simulate.schedule import NO_SHARING, StageSchedule, simulate
    from profiling.simulate.topology import cost_model

    topo = torch_bench_cluster().topology.with_gpus(gpus)
    buckets = torch_buckets(workload, bucket_cap_mb, min(1.0, bucket_cap_mb))
    cost = cost_model(topo, "ring")
    return simulate(workload, buckets, cost, StageSchedule(True), sharing or NO_SHARING).step_s


def rows(trace: str | Path | None = None) -> list[Row]:
    """Every published row with the model's prediction; with `trace` (a GPU trace of
    torch's DDP training ResNet-50), also with the terms measured on it."""
    from profiling.simulate import paper
    from profiling.simulate.scale import PER_PARAMETER
    from profiling.simulate_published import terms

    workloads = {model: torch_bench_workload(model) for model in TORCH_BENCH_P50_S}
    variants = [None]
    if trace is not None:
        events = terms.load(trace)
        copied = terms.copies(events, terms.A100_MEMORY_BYTES_PER_S)
        beside = terms.beside_nccl(events)
        grads = len(workloads["resnet50"].grads)  # the trace's model
        v100 = TORCH_BENCH_MEMORY_BYTES_PER_S
        variants += [terms.sharing(copied, None, grads, v100),
                     terms.sharing(copied, beside, grads, v100)]  # fmt: skip

    def predictions(measure) -> dict:
        made = [measure(v) for v in variants] + [None, None]
        return {"predicted": made[0], "with_copies": made[1], "with_terms": made[2]}

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
    # The papers' rows: the bare model only (`paper` does not take the terms yet).
    out.append(Row(
        "Goyal et al.: resnet50, E(256) against 8 P100", GOYAL_E256,
        next(r["efficiency"] for r in goyal if r["gpus"] == 256), "E",
        "Goyal et al. 2017, sections 1 and 5.5: ~90% from 8 to 256 GPUs",
    ))  # fmt: skip
    for model, speedup in LI_OVERLAP.items():
        out.append(Row(
            f"Li et al.: {model}, speed-up of overlapping, 32 GPUs, NCCL", speedup * 100,
            compared["li_overlap"][model]["speedup"] * 100, "%",
            "Li et al. 2020, section 5.1 (Figure 6)",
        ))  # fmt: skip
    return out


def markdown(table: list[Row]) -> str:
    from profiling.report import command_line, markdown_table, produced_by

    def cell(value: float, unit: str) -> str:
        return f"{value:.3f}" if unit == "E" else f"{value:+.1f}%"

    def maybe(value: float | None, unit: str) -> str:
        return "n/a" if value is None else cell(value, unit)

    def error(r: Row) -> str:
        return f"{r.error:+.3f}" if r.unit == "E" else f"{r.error:+.1f} points"

    terms = any(r.with_terms is not None for r in table)
    body = [
        [r.what, cell(r.published, r.unit), cell(r.predicted, r.unit)]
        + ([maybe(r.with_copies, r.unit), maybe(r.with_terms, r.unit)] if terms else [])
        + [error(r)]
        for r in table
    ]
    header = ["measurement", "published", "model"]
    header += ["+ DDP's copies", "+ beside NCCL"] if terms else []
    header += ["error"]
    sources = sorted({r.source for r in table})
    return "\n".join([
        produced_by([command_line("profiling.simulate")]), "",
        markdown_table(header, body, left=1), "",
        "Sources: " + "; ".join(sources) + ".", "",
    ])  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from profiling.simulate import outputs

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    outputs.add_arguments(parser)
    parser.add_argument(
        "--terms-from", metavar="TRACE",
        help="a GPU trace of torch's DDP training ResNet-50 to measure the two terms on "
        f"(profiling.simulate_published.terms; default: {terms_trace_help()})",
    )  # fmt: skip
    parser.add_argument("--no-terms", action="store_true", help="the bare model only")


def terms_trace_help() -> str:
    from profiling.simulate_published.terms import DOCS_TRACE

    return f"{DOCS_TRACE} in this checkout"


def run(args: argparse.Namespace) -> None:
    from profiling.simulate import outputs
    from profiling.simulate_published.terms import DOCS_TRACE

    trace = None if args.no_terms else args.terms_from
    if trace is None and not args.no_terms:
        trace = Path(__file__).resolve().parents[2] / DOCS_TRACE
        if not trace.is_file():
            raise SystemExit(f"published: no {DOCS_TRACE} here; pass --terms-from or --no-terms")
    elif trace is not None and not Path(trace).is_file():
        raise SystemExit(f"--terms-from {trace}: no such file")
    text = markdown(rows(trace))
    print(text)
    if args.no_files:
        return
    results, _ = outputs.folders(args)
    path = results / "published.md"
    path.write_text(text)
    print(f"wrote {path}")
