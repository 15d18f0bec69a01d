"""torch's own DDP benchmark (pytorch/pytorch, `benchmarks/distributed/ddp/README.md`):
its figures, its servers and what the step model makes of one of its iterations.

ResNet-50, ResNet-101, ResNeXt-50 32x4d and ResNeXt-101 32x8d at 32 images per GPU,
median seconds per iteration on DGX-1 servers (8 V100, 4 x 100 Gbit/s InfiniBand),
NCCL, PyTorch 1.4: one GPU without DDP, DDP on 1, 2, 4 and 8 GPUs of one server and 16
of two; and its comparison of `bucket_cap_mb=1` against the default 25.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from itertools import permutations

import torch.distributed as dist

from profiling.common.sized_models import resnet50
from profiling.simulate import presets, usermodel
from profiling.simulate.clusters import GB, GBIT, NCCL_2_7, NCCL_2_7_NET_STEP_S, server
from profiling.simulate.layouts import stand_ins
from profiling.simulate.published.terms import GpuSharing, straggler_efficiency
from profiling.simulate.schedule import NO_SHARING, StageSchedule, Workload, simulate
from profiling.simulate.topology import Topology, cost_model

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


def resnext50_32x4d(device: str | None = None):
    """torchvision.models.resnext50_32x4d(): ResNet-50 with 32 groups of 4 channels in
    each 3x3 convolution (Xie et al., "Aggregated Residual Transformations")."""
    return resnet50(device, groups=32, width_per_group=4)


def resnext101_32x8d(device: str | None = None):
    """torchvision.models.resnext101_32x8d(): ResNet-101 with 32 groups of 8 channels."""
    return resnet50(device, depth=101, groups=32, width_per_group=8)


FACTORIES = {
    "resnet50": "profiling.simulate.presets:resnet50",
    "resnet101": "profiling.simulate.presets:resnet101",
    "resnext50_32x4d": "profiling.simulate.published.torch_bench:resnext50_32x4d",
    "resnext101_32x8d": "profiling.simulate.published.torch_bench:resnext101_32x8d",
}


def torch_bench_cluster():
    """The benchmark's DGX-1 servers: 8 Tesla V100 on NVLink (the hybrid cube mesh its
    `nvidia-smi topo` prints), 4 x 100 Gbit/s InfiniBand per server, NCCL with PyTorch
    1.4. Line rates; latencies NCCL 2.7.5's, the nearest modelled to the benchmark's."""
    return server("V100", 900, 150 * GB, 400 * GBIT, {
        "gpus_per_node": TORCH_BENCH + ": DGX-1, 8 V100",
        "intra_bytes_per_s": "V100 SXM2 data sheet: NVLink 6 x 25 GB/s each way (line rate)",
        "inter_bytes_per_s": TORCH_BENCH + ": '4x 100Gb InfiniBand per machine' (line rate)",
        "gpu": "V100 SXM2 data sheet: 900 GB/s memory bandwidth",
    }, NCCL_2_7 + " (ASSUMED: the benchmark's NCCL is not named)", NCCL_2_7_NET_STEP_S)  # fmt: skip


@cache  # frozen: every row of a table takes the same
def torch_bench_workload(model: str) -> Workload:
    """The model at 32 images per GPU on one V100, from the benchmark's own time without
    DDP; the optimizer (SGD with momentum) at the V100's memory bandwidth."""
    prof = usermodel.profile(FACTORIES[model], (3, 224, 224))
    optimizer_s = prof.parameters * presets.SGD_MOMENTUM_BYTES / TORCH_BENCH_MEMORY_BYTES_PER_S
    return usermodel.workload(prof, TORCH_BENCH_P50_S[model][NO_DDP], optimizer_s)


def torch_bench_step_s(workload, gpus: int, bucket_cap_mb: float = 25.0, sharing=None) -> float:
    """One iteration of torch 1.4's DDP on `gpus` V100 of the benchmark's cluster: its
    layout (`torch14_buckets`), overlapped, NCCL's ring."""
    buckets = torch14_buckets(workload, bucket_cap_mb)
    return step_s(workload, buckets, cost_model(torch_bench_topology(gpus), "ring"), sharing)


def torch14_buckets(workload, bucket_cap_mb: float = 25.0) -> list[list[int]]:
    """The layout torch 1.4's DDP builds and keeps (it rebuilt none), as lists of
    gradient indices in bucket order: `_compute_bucket_assignment_by_size` over the
    parameters in the order they are defined, 1 MiB for the first of them ("such that
    their gradients don't spill into a much larger bucket, adding unnecessary latency
    after gradient computation finishes", its comment), then `bucket_cap_mb`; the
    list reversed, so that the 1 MiB bucket is launched last."""
    params = [p for _, p in stand_ins(workload)]
    caps = [min(2**20, int(bucket_cap_mb * 2**20)), int(bucket_cap_mb * 2**20)]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        params, caps, [False] * len(params), list(range(len(params)))
    )
    return [list(b) for b in reversed(buckets)]


@cache  # frozen; its ring search runs once per GPU count
def torch_bench_topology(gpus: int) -> Topology:
    """The benchmark's `gpus`: GPUs 0 to gpus - 1 of one server, or whole servers. Inside
    one server, the NVLink bandwidth of the rings NCCL can lay over those GPUs: 1 ring
    on GPUs 0-1 (one NVLink between them), 4 on 0-3, 6 on all 8."""
    topo = torch_bench_cluster().topology.with_gpus(gpus)
    if 1 < gpus <= topo.gpus_per_node:
        rings = nvlink_rings(DGX1_NVLINKS, gpus)
        if not rings:
            raise ValueError(f"GPUs 0 to {gpus - 1} of a DGX-1 close no NVLink ring; "
                             "the benchmark ran 1, 2, 4 and 8 of a server")  # fmt: skip
        return replace(topo, intra_bytes_per_s=rings * NVLINK2_BYTES_PER_S)
    return topo


def nvlink_rings(links: list[list[int]], gpus: int) -> int:
    """The most rings over GPUs 0 to gpus - 1 that the links carry at once: each ring
    enters and leaves every GPU once, one way round, and uses one NVLink of each pair
    it joins in that direction (a pair of `links[u][v]` NVLinks carries that many rings
    each way). Two GPUs make one ring per link between them."""
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


def step_s(workload, buckets: list[list[int]], cost, sharing=None, overlap: bool = True) -> float:
    """The step with `sharing`'s terms (a `terms.GpuSharing` made for these buckets)."""
    sharing = sharing or NO_SHARING
    if isinstance(sharing, GpuSharing):
        sharing = sharing.for_buckets(workload, buckets)
    return simulate(workload, buckets, cost, StageSchedule(overlap), sharing).step_s


def cost_per_bucket() -> list[dict]:
    """What each extra bucket of the 1 MiB cap cost in the benchmark (its diff: the
    change times the iteration), against the latency NCCL's model gives one all-reduce
    at that GPU count (the step model's, which it hides under backward)."""
    w = torch_bench_workload("resnet50")
    extra = len(torch14_buckets(w, 1.0)) - len(torch14_buckets(w, 25.0))
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
    p50 = TORCH_BENCH_P50_S["resnet50"][NO_DDP]
    sigma = 1e-3 / 1.645 / p50
    return {
        "p50_s": p50,
        "sigma": sigma,
        "e16": straggler_efficiency(sigma, 16, 1),
        "e256": straggler_efficiency(sigma, 256, 8),
    }
