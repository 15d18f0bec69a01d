"""Your cluster: every number the all-reduce cost takes, as a flag or from a preset, each
with where it came from.

    python -m profiling.simulate scale --cluster dgx_a100 ...
    python -m profiling.simulate scale --gpus-per-node 4 --intra-gbps 600 --inter-gbps 200 ...

A cluster is servers of `--gpus-per-node` GPUs (`topology.Topology`). Bandwidths are
the **bus bandwidth NCCL achieves** on an all-reduce, as nccl-tests reports it
(`busbw`, its doc/PERFORMANCE.md: the algorithm bandwidth x 2(p - 1)/p, which a ring
sends per byte reduced), not the links' line rate: a ring all-reduce of n bytes over p
GPUs then takes 2n(p - 1)/p / busbw on the wire, what nccl-tests measures. Inside a
server, the busbw of the server's GPUs; across servers, the busbw nccl-tests reports on
several servers, which their NICs together carry. Latencies are NCCL's own model of
them (src/graph/tuning.cc), Ring with the Simple protocol DDP's large buckets use.
Bus bandwidths fit `--algorithm ring`, NCCL's for large buffers, whose cost is the one
nccl-tests measures; the halving-doubling and hierarchical forms (`topology`) take the
links' own rates, which the papers' presets (`li2020`, `goyal2017`) give. The flags take
Gbit/s (8 x the GB/s nccl-tests prints); every output prints both.

Every output of `scale`, `buckets` and `gantt` begins with these numbers and their
sources (`describe`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from profiling.simulate.presets import MODELS
from profiling.simulate.topology import ALGORITHMS, GB, GBIT, Topology, cost_model

# NCCL 2.20.3's latency model, src/graph/tuning.cc (NVIDIA/nccl, version.mk 2.20.3),
# Ring, Simple protocol: a base latency per call (baseLat), and per step over NVLink and
# over the network (hwLat NVLINK, NET). NCCL 2.7.5 had 14 us less per network step: 9.6.
NCCL_2_20 = "NCCL 2.20.3 src/graph/tuning.cc, Ring/Simple: 8.4 us per call, 3.4 per NVLink step, 14 per network step"  # noqa: E501
CALL_S, NVLINK_STEP_S, NET_STEP_S = 8.4e-6, 3.4e-6, 14.0e-6
NCCL_2_7 = "NCCL 2.7.5 src/graph/tuning.cc (the papers' time), Ring/Simple: 8.4 us per call, 3.4 per NVLink step, 9.6 per network step"  # noqa: E501
NCCL_2_7_NET_STEP_S = 9.6e-6


@dataclass(frozen=True)
class Cluster:
    """One server's worth of cluster (the sweep adds servers), its GPU, and a source
    for each number."""

    topology: Topology
    gpu: str
    memory_bytes_per_s: float  # one GPU's memory bandwidth: what the optimizer's step costs
    sources: dict[str, str]  # Topology field (and "gpu") -> where its value comes from


AZURE_A100 = "Azure AI-benchmarking-guide, ND A100 v4 results, 'NCCL Bandwidth': all_reduce busbw 231.6 GB/s at 8 GB on 8 A100 (NCCL 2.18.5)"  # noqa: E501
AZURE_H100 = "Azure AI-benchmarking-guide, ND H100 v5 results, 'NCCL Bandwidth': all_reduce busbw 478.9 GB/s at 8 GB on 8 H100 (NCCL 2.18.5, NVLS)"  # noqa: E501

A100_MEMORY = "A100 40GB SXM data sheet: 1,555 GB/s memory bandwidth"


def server(gpu: str, memory_gbs: float, intra_bytes_per_s: float, inter_bytes_per_s: float,
           sources: dict[str, str], latencies: str = NCCL_2_20,
           net_step_s: float = NET_STEP_S,
           inter_by_nodes: tuple[tuple[int, float], ...] = ()) -> Cluster:  # fmt: skip
    """A server of 8 GPUs, NCCL's latencies (`latencies` says which NCCL's);
    `inter_by_nodes`: the network's bandwidth by server count, where it falls with more
    (`Topology.inter_at`)."""
    topology = Topology(nodes=1, gpus_per_node=8, intra_bytes_per_s=intra_bytes_per_s,
                        inter_bytes_per_s=inter_bytes_per_s, intra_latency_s=NVLINK_STEP_S,
                        inter_latency_s=net_step_s, call_latency_s=CALL_S,
                        inter_by_nodes=inter_by_nodes)  # fmt: skip
    keys = ("intra_latency_s", "inter_latency_s", "call_latency_s")
    return Cluster(topology, gpu, memory_gbs * GB, dict.fromkeys(keys, latencies) | sources)


# cloud_100gbe's all-reduce busbw across servers by server count (servers, bytes/s), from
# NVIDIA/nccl issue 235: ~10 GB/s on 2 servers, 6-8 GB/s on 8 to 32 (see its source).
CLOUD_INTER_BY_NODES = ((2, 10 * GB), (8, 7 * GB), (32, 6 * GB))

# fmt: off
PRESETS: dict[str, Cluster] = {
    # DGX A100: 8 A100 SXM4 on NVSwitch, 8 ConnectX-6 HDR 200 Gbit/s NICs (one per GPU).
    "dgx_a100": server("A100", 1555, 231 * GB, 192 * GB, {
        "gpus_per_node": "NVIDIA DGX A100 data sheet: 8 A100 GPUs",
        "intra_bytes_per_s": AZURE_A100,
        "inter_bytes_per_s": "NVIDIA/nccl issue 812 (NVIDIA): 'we measure 192 GB/s AllReduce "
        "BusBW' across DGX A100 servers, 8 x 200 Gbit/s InfiniBand",
        "gpu": A100_MEMORY,
    }),
    # DGX H100: 8 H100 SXM on NVLink 4 / NVSwitch, 8 ConnectX-7 NDR 400 Gbit/s NICs.
    "dgx_h100": server("H100", 3350, 479 * GB, 396 * GB, {
        "gpus_per_node": "NVIDIA DGX H100 data sheet: 8 H100 GPUs",
        "intra_bytes_per_s": AZURE_H100,
        "inter_bytes_per_s": "NVIDIA/nccl-tests issue 319 (NVIDIA): 'up to ~396GB/s with the "
        "RING protocol' across servers of 8 x 400 Gbit/s NDR",
        "gpu": "H100 SXM data sheet: 3.35 TB/s memory bandwidth",
    }),
    # A cloud server of 8 A100 on NVSwitch with one 100 Gbit/s Ethernet NIC for all of
    # them (as GCP's a2-highgpu-8g, AWS's p3dn with V100). Its network's busbw falls with
    # more servers, as its source measured: CLOUD_INTER_BY_NODES.
    "cloud_100gbe": server("A100", 1555, 231 * GB, CLOUD_INTER_BY_NODES[0][1], {
        "gpus_per_node": "8 GPUs per server, as GCP a2-highgpu-8g and AWS p3dn.24xlarge",
        "intra_bytes_per_s": AZURE_A100,
        "inter_bytes_per_s": "NVIDIA/nccl issue 235 (NVIDIA): all_reduce busbw ~10 GB/s (80 "
        "Gbit/s) on 2 AWS p3dn servers with one 100 Gbit/s NIC each, 6-8 GB/s on 8 to 32 "
        "servers; taken as 10 GB/s on 2 servers (and 1), 7 (the middle of 6-8) on 8, 6 on "
        "32 and more, linear in log2(servers) between (ASSUMED: the rule between and "
        "beyond the issue's counts)",
        "inter_latency_s": NCCL_2_20 + " (ASSUMED: a cloud network's step is likely slower)",
        "gpu": A100_MEMORY,
    }, inter_by_nodes=CLOUD_INTER_BY_NODES),
    # Li et al., "PyTorch Distributed" (VLDB 2020), section 5: 8 Tesla V100 per server,
    # NVLink inside it, servers joined by a Mellanox ConnectX-4 100 Gbit/s NIC (as the
    # paper's evaluation section describes its exclusive 32-GPU cluster; ASSUMED: one
    # such NIC per server, which no text available here confirms). Line rates, not
    # what NCCL achieves. NVLink: V100 SXM2, 6 links of 25 GB/s each way (300 GB/s in
    # all). Latencies: NCCL 2.7.5's model (NVIDIA/nccl commit 01afd20a), of the paper's
    # time.
    "li2020": server("V100", 900, 150 * GB, 100 * GBIT, {
        "gpus_per_node": "Li et al. 2020 section 5: 8 V100 per server",
        "intra_bytes_per_s": "V100 SXM2 data sheet: NVLink 6 x 25 GB/s each way (line rate)",
        "inter_bytes_per_s": "Li et al. 2020 section 5: a 100 Gbit/s NIC (one per server "
        "ASSUMED; line rate)",
        "gpu": "V100 SXM2 data sheet: 900 GB/s memory bandwidth",
    }, NCCL_2_7, NCCL_2_7_NET_STEP_S),
    # Goyal et al., "Accurate, Large Minibatch SGD" (arXiv 1706.02677), section 5: Big
    # Basin servers of 8 Tesla P100 joined by NVLink, each with a Mellanox ConnectX-4 50
    # Gbit Ethernet card. NVLink: P100 SXM2, 4 links of 20 GB/s each way (160 GB/s in
    # all). Latencies ASSUMED NCCL's: Goyal et al.'s inter-server all-reduce was their
    # own (Gloo) over Ethernet, whose per-step latency the paper does not give.
    "goyal2017": server("P100", 732, 80 * GB, 50 * GBIT, {
        "gpus_per_node": "Goyal et al. 2017 section 5: Big Basin, 8 P100 per server",
        "intra_bytes_per_s": "P100 SXM2 data sheet: NVLink 4 x 20 GB/s each way (line rate)",
        "inter_bytes_per_s": "Goyal et al. 2017 section 5: 50 Gbit/s Ethernet per server "
        "(line rate)",
        "gpu": "P100 SXM2 data sheet: 732 GB/s memory bandwidth",
    }, NCCL_2_7 + " (ASSUMED)", NCCL_2_7_NET_STEP_S),
}
# fmt: on
NAMES = tuple(PRESETS)

# flag -> (Topology field, or "gpu" for the GPU's memory; the flag's value in its unit)
FLAGS = {
    "gpus_per_node": ("gpus_per_node", int),
    "intra_gbps": ("intra_bytes_per_s", lambda v: v * GBIT),
    "inter_gbps": ("inter_bytes_per_s", lambda v: v * GBIT),
    "intra_latency_us": ("intra_latency_s", lambda v: v * 1e-6),
    "inter_latency_us": ("inter_latency_s", lambda v: v * 1e-6),
    "call_latency_us": ("call_latency_s", lambda v: v * 1e-6),
    "memory_gbytes_per_s": ("gpu", lambda v: v * GB),
}


def cluster(name: str) -> Cluster:
    if name in PRESETS:
        return PRESETS[name]
    raise ValueError(f"--cluster {name!r}: pick one of {', '.join(NAMES)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cluster (a preset; each flag replaces its value; bandwidths are NCCL's bus "
        "bandwidth, as nccl-tests reports it)"
    )
    group.add_argument(
        "--cluster", "--network", dest="cluster", choices=NAMES,
        help="preset: " + ", ".join(NAMES) + " (default: li2020 for the presets' models, "
        "whose published timings are V100s; dgx_a100 for yours)",
    )  # fmt: skip
    group.add_argument("--gpus-per-node", type=int, help="GPUs in one server")
    group.add_argument(
        "--intra-gbps", type=float, help="all-reduce bus bandwidth inside a server, Gbit/s"
    )
    group.add_argument(
        "--inter-gbps", type=float,
        help="all-reduce bus bandwidth across servers, Gbit/s per server (its NICs together)",
    )  # fmt: skip
    group.add_argument("--intra-latency-us", type=float, help="per ring step inside a server")
    group.add_argument("--inter-latency-us", type=float, help="per ring step across servers")
    group.add_argument("--call-latency-us", type=float, help="per collective call")
    group.add_argument(
        "--memory-gbytes-per-s", type=float,
        help="one GPU's memory bandwidth, GB/s: what the optimizer's step costs",
    )  # fmt: skip
    group.add_argument(
        "--algorithm", choices=list(ALGORITHMS), default="ring",
        help="the all-reduce (default: %(default)s, NCCL's for large buffers)",
    )  # fmt: skip


def from_args(args: argparse.Namespace) -> tuple[Cluster, bool]:
    """The preset with every flag given replacing its value (its source: the flag), and
    whether any did."""
    if args.cluster is None:  # a preset's model: the GPU its published timing is of
        args.cluster = "li2020" if getattr(args, "model", None) in MODELS else "dgx_a100"
    base = cluster(args.cluster)
    changes, sources, memory = {}, dict(base.sources), base.memory_bytes_per_s
    for flag, (name, to_field) in FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {value:g}")
        sources[name] = f"--{flag.replace('_', '-')}"
        if name == "gpu":
            memory = to_field(value)
        else:
            changes[name] = to_field(value)
    if sources == base.sources:
        return base, False
    if "inter_bytes_per_s" in changes:  # --inter-gbps: the same at every server count
        changes["inter_by_nodes"] = ()
    topology = replace(base.topology, **changes)
    return replace(base, topology=topology, memory_bytes_per_s=memory, sources=sources), True


def check_gpus(topology: Topology, algorithm: str, gpus: list[int]) -> None:
    """One ValueError naming --gpus (and --algorithm) for a GPU count the cluster cannot
    take: not whole servers, or a layout `algorithm` does not fit (a flat
    halving-doubling across servers needs powers of two)."""
    for p in gpus:
        try:
            topology.with_gpus(p)
        except ValueError as error:
            raise ValueError(f"--gpus {p}: {error}") from None
    errors = {}
    for p in gpus:
        try:
            cost_model(topology.with_gpus(p), algorithm)(1.0)  # every size: the same layout
        except ValueError as error:
            errors[p] = error
    if errors:
        raise ValueError(
            f"--algorithm {algorithm} does not fit --gpus {','.join(map(str, errors))} "
            f"(servers of {topology.gpus_per_node}): {next(iter(errors.values()))}"
        )


def describe(c: Cluster, name: str, algorithm: str) -> list[str]:
    """The cluster's numbers, one per line, each with its source."""
    t = c.topology
    values = {
        "gpus_per_node": f"{t.gpus_per_node} GPUs per server",
        "intra_bytes_per_s": f"{t.intra_bytes_per_s / GB:g} GB/s "
        f"({t.intra_bytes_per_s / GBIT:g} Gbit/s) inside a server",
        "inter_bytes_per_s": _inter(t),
        "intra_latency_s": f"{t.intra_latency_s * 1e6:g} us per step inside",
        "inter_latency_s": f"{t.inter_latency_s * 1e6:g} us per step across",
        "call_latency_s": f"{t.call_latency_s * 1e6:g} us per call",
        "gpu": f"GPU {c.gpu}, {c.memory_bytes_per_s / GB:g} GB/s memory",
    }
    lines = [f"cluster {name}, all-reduce {algorithm}:"]
    notes: dict[str, int] = {}  # source -> its number, in order of first use
    for key, text in values.items():
        source = c.sources.get(key, "preset")
        lines.append(f"  {text}  [{notes.setdefault(source, len(notes) + 1)}]")
    lines += [f"  [{k}] {source}" for source, k in notes.items()]
    return lines


def _inter(t: Topology) -> str:
    """The network's bandwidth: one figure, or one per server count where it varies."""
    if not t.inter_by_nodes:
        return (f"{t.inter_bytes_per_s / GB:g} GB/s ({t.inter_bytes_per_s / GBIT:g} Gbit/s) "
                "across servers, per server")  # fmt: skip
    at = ", ".join(f"{b / GB:g} GB/s ({b / GBIT:g} Gbit/s) on {n}" for n, b in t.inter_by_nodes)
    return (f"across servers, per server: {at} servers (beyond them the nearest's), "
            "linear in log2(servers) between")  # fmt: skip
