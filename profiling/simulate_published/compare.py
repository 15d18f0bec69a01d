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
# The NVLinks between each pair of the benchmark's GPUs 0-7 (NV1, NV2; 0: none), as
# the `nvidia-smi topo -m` in its README prints them: DGX-1's hybrid cube mesh.
DGX1_NVLINKS = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
]
NVLINK2_BYTES_PER_S = 25e9  # V100 SXM2 data sheet: 25 GB/s each way per NVLink
TORCH_BENCH_MEMORY_BYTES_PER_S = 900e9  # V100 SXM2 data sheet
# Throughput with bucket_cap_mb=1 against 25, p75, ResNet-50 (the README's diff): the
# change, and the p75 seconds per iteration with the 1 MiB cap. The rows hold 8 and 16.
TORCH_BENCH_CAP_1_DIFF = {1: (-0.003, 0.101), 2: (-0.010, 0.104), 4: (-0.016, 0.105),
                          8: (-0.026, 0.107), 16: (-0.038, 0.108)}  # fmt: skip
TORCH_BENCH_CAP_1_VS_25 = {g: TORCH_BENCH_CAP_1_DIFF[g][0] for g in (8, 16)}
GOYAL_E256 = 0.90
LI_OVERLAP = {"resnet50": 0.380, "bert_large": 0.352}  # NCCL; Gloo: 26.8%, 21.5%
LI_GPUS = 32
# Li et al. do not give ResNet-50's batch: ASSUMED 32 per GPU, as torch's own DDP
# benchmark (the same team, the same V100 servers) runs it; BERT-large at the preset's 8.
LI_BATCH = {"resnet50": 32}
GBIT = 1e9 / 8
# What NCCL achieves across servers with one 100 Gbit/s NIC each: NVIDIA/nccl issue 235
# (NVIDIA), all_reduce busbw about 10 GB/s on 2 AWS p3dn servers (V100) with one such NIC,
# 6-8 GB/s on 8 to 32 servers. Li et al.'s 4 servers of 8 V100 sit between; 10 GB/s.
LI_INTER_BUSBW = 10e9


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
    from profiling.simulate.topology import cost_model

    buckets = torch_buckets(workload, bucket_cap_mb, min(1.0, bucket_cap_mb))
    return _step_s(workload, buckets, cost_model(torch_bench_topology(gpus), "ring"), sharing)


def torch_bench_topology(gpus: int):
    """The benchmark's `gpus`: GPUs 0 to gpus - 1 of one server, or whole servers. Inside
    one server, the NVLink bandwidth of the rings NCCL can lay over those GPUs: 1 ring
    on GPUs 0-1 (one NVLink between them), 4 on 0-3, 6 on all 8."""
    from dataclasses import replace

    topo = torch_bench_cluster().topology.with_gpus(gpus)
    if 1 < gpus <= topo.gpus_per_node:
        rings = nvlink_rings(DGX1_NVLINKS, gpus)
        return replace(topo, intra_bytes_per_s=rings * NVLINK2_BYTES_PER_S)
    return topo


def nvlink_rings(links: list[list[int]], gpus: int) -> int:
    """The most rings over GPUs 0 to gpus - 1 that the links carry at once: each ring
    enters and leaves every GPU once, one way round, and uses one NVLink of each pair
    it joins in that direction (a pair of `links[u][v]` NVLinks carries that many rings
    each way). Two GPUs make one ring per link between them."""
    from itertools import permutations

    if gpus == 2:
        return links[0][1]
    ring_edges = []
    for rest in permutations(range(1, gpus)):
        order = (0, *rest)
        edges = [(order[i], order[(i + 1) % gpus]) for i in range(gpus)]
        if all(links[u][v] for u, v in edges):
            ring_edges.append(edges)
    # No GPU can be in more rings than it has links (to the others) leaving it.
    bound = min(sum(links[u][v] for v in range(gpus) if v != u) for u in range(gpus))
    left = {(u, v): links[u][v] for u in range(gpus) for v in range(gpus)}
    best = 0

    def pack(start: int, laid: int) -> bool:  # depth first, stopping at the bound
        nonlocal best
        best = max(best, laid)
        if best == bound:
            return True
        for i in range(start, len(ring_edges)):
            if all(left[e] for e in ring_edges[i]):
                for e in ring_edges[i]:
                    left[e] -= 1
                if pack(i, laid + 1):
                    return True
                for e in ring_edges[i]:
                    left[e] += 1
        return False

    pack(0, 0)
    return best


def _step_s(workload, buckets, cost, sharing, overlap: bool = True) -> float:
    """The step with `sharing`'s terms: its passes at the hooks and after the last
    all-reduce (`terms.with_finalize`), its slowdown beside collectives."""
    from profiling.simulate.schedule import NO_SHARING, StageSchedule, simulate
    from profiling.simulate_published.terms import GpuSharing, with_finalize

    sharing = sharing or NO_SHARING
    if isinstance(sharing, GpuSharing):
        sharing = sharing.for_buckets(workload, buckets)
    w = with_finalize(workload, sharing)
    return simulate(w, buckets, cost, StageSchedule(overlap), sharing).step_s


def li_cluster(inter_bytes_per_s: float = LI_INTER_BUSBW):
    """Li et al.'s 32 GPUs (the `li2020` preset) with the bus bandwidth NCCL achieves
    across servers of one 100 Gbit/s NIC each, in place of the NIC's line rate."""
    from dataclasses import replace

    from profiling.simulate.clusters import cluster

    return replace(cluster("li2020").topology, inter_bytes_per_s=inter_bytes_per_s)


def li_workload(model: str, batch: int | None = None):
    """ResNet-50 at `batch` images per GPU (LI_BATCH by default: torch's benchmark's own
    0.097 s for 32), or BERT-large as the `li2020` comparisons take it (batch 8)."""
    from dataclasses import replace

    from profiling.simulate import presets

    compute = presets.COMPUTE[model, "V100"]
    batch = batch or LI_BATCH.get(model, compute.batch)
    if model == "resnet50" and batch == TORCH_BENCH_BATCH:
        compute = replace(compute, batch=batch,
                          samples_per_s=batch / TORCH_BENCH_P50_S[model][NO_DDP],
                          source=TORCH_BENCH + ": 0.097 s for 32 images without DDP")  # fmt: skip
    elif batch != compute.batch:
        raise ValueError(f"no published V100 time for {model} at batch {batch}")
    return presets.workload(model, "V100", compute=compute)


def li_speedup(model: str, batch: int | None = None, inter: float = LI_INTER_BUSBW,
               sharing=None) -> float:  # fmt: skip
    """Li et al.'s overlap speed-up at 32 GPUs, 25 MB buckets, NCCL's ring: all-reduce
    after backward against during it, minus one."""
    from profiling.simulate.layouts import uniform_buckets
    from profiling.simulate.topology import cost_model

    w = li_workload(model, batch)
    cost = cost_model(li_cluster(inter).with_gpus(LI_GPUS), "ring")
    buckets = uniform_buckets(w, 25)
    after = _step_s(w, buckets, cost, sharing, overlap=False)
    return after / _step_s(w, buckets, cost, sharing) - 1


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
        work = terms.reducer_work(events, terms.A100_MEMORY_BYTES_PER_S)
        beside = terms.beside_nccl(events)
        v100 = TORCH_BENCH_MEMORY_BYTES_PER_S
        variants += [terms.sharing(work, None, v100), terms.sharing(work, beside, v100)]

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
    # Goyal et al. trained with Caffe2 and Gloo, not DDP: the reducer's passes and the
    # trace's NCCL are not theirs, so their row has the bare model only.
    out.append(Row(
        "Goyal et al.: resnet50, E(256) against 8 P100", GOYAL_E256,
        next(r["efficiency"] for r in goyal if r["gpus"] == 256), "E",
        "Goyal et al. 2017, sections 1 and 5.5: ~90% from 8 to 256 GPUs",
    ))  # fmt: skip
    for model, speedup in LI_OVERLAP.items():

        def li(v, model=model) -> float:
            return li_speedup(model, sharing=v) * 100

        batch = LI_BATCH.get(model, 8)
        out.append(Row(
            f"Li et al.: {model}, speed-up of overlapping, 32 GPUs, NCCL (batch {batch})",
            speedup * 100, unit="%", source="Li et al. 2020, section 5.1 (Figure 6)",
            **predictions(li),
        ))  # fmt: skip
    return out


def li_sensitivity() -> list[list[str]]:
    """Li et al.'s overlap speed-up as the unknown settings move: ResNet-50's batch, and
    the bus bandwidth between servers (the NIC's line rate, or what NCCL achieves on
    it); the bare model."""
    rates = [(100 * GBIT, "100 Gbit/s line rate"), (LI_INTER_BUSBW, "10 GB/s (NCCL, 2 servers)"),
             (6e9, "6 GB/s (NCCL, 8 or more)")]  # fmt: skip
    table = []
    for model, batches in (("resnet50", (32, 112)), ("bert_large", (8,))):
        for batch in batches:
            cells = [f"{li_speedup(model, batch, rate) * 100:+.1f}%" for rate, _ in rates]
            table.append([f"{model}, batch {batch}", f"{LI_OVERLAP[model] * 100:+.1f}%", *cells])
    return [["", "published", *(label for _, label in rates)], *table]


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
    header += ["+ DDP's passes", "+ beside NCCL"] if terms else []
    header += ["error"]
    sources = sorted({r.source for r in table})
    li = li_sensitivity()
    spread, buckets = straggler_bound(), cost_per_bucket()
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
        f"al.'s E(256) = {GOYAL_E256:.2f} only with a spread of {spread['goyal_sigma']:.1%}.",
        "",
        f"Each of the {buckets[0]['extra_buckets']} extra buckets of the 1 MiB cap cost "
        + ", ".join(f"{b['per_bucket_s'] * 1e6:.0f} µs" for b in buckets)
        + " at " + ", ".join(str(b["gpus"]) for b in buckets) + " GPUs (the diff's change "
        "times its iteration); NCCL's latency for one all-reduce, in the model: "
        + ", ".join(f"{b['nccl_latency_s'] * 1e6:.0f} µs" for b in buckets[1:]) + " at 2 "
        "GPUs and up.",
        "",
    ])  # fmt: skip


def cost_per_bucket() -> list[dict]:
    """What each extra bucket of the 1 MiB cap cost in the benchmark (its diff: the
    change times the iteration), against the latency NCCL's model gives one all-reduce
    at that GPU count (the step model's, which it hides under backward)."""
    from profiling.simulate.layouts import torch_buckets
    from profiling.simulate.topology import cost_model

    w = torch_bench_workload("resnet50")
    extra = len(torch_buckets(w, 1.0, 1.0)) - len(torch_buckets(w, 25.0, 1.0))
    out = []
    for gpus, (change, p75_s) in TORCH_BENCH_CAP_1_DIFF.items():
        cost = cost_model(torch_bench_topology(gpus), "ring")
        latency = cost(2**20).latency_s if gpus > 1 else 0.0
        out.append({"gpus": gpus, "extra_buckets": extra,
                    "per_bucket_s": -change * p75_s / extra,
                    "nccl_latency_s": latency})  # fmt: skip
    return out


def straggler_bound() -> dict:
    """What stragglers can cost, from the spread torch's benchmark shows on one GPU:
    its p95 - p50 under the 1 ms its README prints (a normal law's p95 is 1.645 sigma
    above its median)."""
    from profiling.simulate_published.terms import straggler_efficiency, straggler_sigma_for

    p50 = TORCH_BENCH_P50_S["resnet50"][NO_DDP]
    sigma = 1e-3 / 1.645 / p50
    return {
        "p50_s": p50,
        "sigma": sigma,
        "e16": straggler_efficiency(sigma, 16, 1),
        "e256": straggler_efficiency(sigma, 256, 8),
        "goyal_sigma": straggler_sigma_for(GOYAL_E256, 256, 8),
    }


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
