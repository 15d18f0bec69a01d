"""The flat ring against Goyal et al.'s three-phase all-reduce on nodes of several ranks:
bytes through the shaped link and time, measured and as the alpha-beta model says.

    python -m profiling.cluster hierarchical --nodes 2 --ranks-per-node 2 --rate 1gbit

On this cluster only the links between nodes are shaped; the ranks of a node talk over
its loopback. So a call is paced by the bytes its busiest node link carries each way:

    ring (flat, 0-1-..-p-1)   a node's last rank sends its ring share, 2(p-1)/p n, to
                              the next node: the node's link carries that, its other
                              ranks nothing between nodes
    hierarchical_X            phase 2 only: the leader (a node's first rank) sends
                              X's share over the N leaders, 2(N-1)/N n for the ring,
                              the node's other ranks nothing between nodes

and the model's time is those bytes at the link's rate (`model.counts` and
`model.three_phases(...).between`), less the token bucket's depth per stretch of
sending (tbf lets it through at memory speed). It leaves out what runs inside a node
(the tree's phases: copies and adds on the shared cores) and TCP/IP headers (about 4%
at a 1500-byte MTU): measured over model is what those cost.

Measured: each rank's `Traffic.bytes_sent_between_nodes` of one call, each node's link
counter (tx bytes of its interface, headers included) over the timed calls, and the
median of the slowest rank's time per call."""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist

from ddp.collectives import all_reduce
from ddp.dist import slowest_seconds
from profiling.cluster.network import IFNAME
from profiling.cluster.virtual_cluster import VirtualCluster
from profiling.collectives.model import counts, three_phases

ALGORITHMS = ("ring", "hierarchical_ring", "hierarchical_halving_doubling")
RESULT_PREFIX = "HIERARCHICAL_RESULT "
ELEMENT_BYTES = 4  # float32


def _link_tx_bytes() -> int:
    # This node's shaped interface, read inside its namespace (`ip netns exec` mounts
    # the namespace's own /sys).
    with open(f"/sys/class/net/{IFNAME}/statistics/tx_bytes") as f:
        return int(f.read())


def hierarchical_worker(size_bytes: int, repeats: int, algorithms: list[str]) -> None:
    """Under torchrun, on every rank: per algorithm one untimed call, then `repeats`
    timed ones. Rank 0 prints RESULT_PREFIX {json}."""
    dist.init_process_group("gloo")
    try:
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])  # torchrun's --nproc-per-node
        # Zeros stay zeros however often they are summed: no refill between calls.
        tensor = torch.zeros(size_bytes // ELEMENT_BYTES)
        rows = {}
        for algorithm in algorithms:
            traffic = all_reduce(tensor, algorithm, ranks_per_node=per_node)  # warm-up
            dist.barrier()
            before = _link_tx_bytes()
            seconds = slowest_seconds(
                lambda a=algorithm: all_reduce(tensor, a, ranks_per_node=per_node), repeats
            )
            link = (_link_tx_bytes() - before) / repeats  # the barriers' bytes are noise
            mine = {"between": traffic.bytes_sent_between_nodes, "link": link}
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            rows[algorithm] = {"seconds": seconds, "ranks": everyone}
        # Phases 1 and 3 alone: the tree inside every node at once, no link crossed.
        # What the three-phase forms spend beside the link, on the shared cores.
        rank, nodes = dist.get_rank(), dist.get_world_size() // per_node
        groups = [dist.new_group(list(range(k * per_node, (k + 1) * per_node)))
                  for k in range(nodes)]  # fmt: skip
        mine = groups[rank // per_node]
        all_reduce(tensor, "tree", mine)  # warm-up
        inside = slowest_seconds(lambda: all_reduce(tensor, "tree", mine), repeats)
        if rank == 0:
            result = {"ranks_per_node": per_node, "rows": rows, "inside_seconds": inside}
            print(RESULT_PREFIX + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


def model_between_nodes(algorithm: str, nodes: int, per_node: int, size_bytes: int) -> list[float]:
    """Bytes each rank sends to other nodes in one call, rank order, from the model."""
    p = nodes * per_node
    if algorithm == "ring":
        share = counts("ring", p, size_bytes).sent  # what every rank of the ring sends
        return [share if r % per_node == per_node - 1 and nodes > 1 else 0.0 for r in range(p)]
    between = three_phases(algorithm.removeprefix("hierarchical_"), nodes, per_node, size_bytes)
    return [between.between.sent if r % per_node == 0 else 0.0 for r in range(p)]


def model_seconds(
    algorithm: str, nodes: int, per_node: int, size_bytes: int, rate_bits: int, free_bytes: int
) -> float:
    """The link's share of one call: the bytes that cross between nodes on the critical
    path, each stretch less the token bucket's depth, at the rate."""
    if algorithm == "ring":  # every step waits on the ring's hops between nodes
        phases = counts("ring", nodes * per_node, size_bytes).phases
    else:
        between = algorithm.removeprefix("hierarchical_")
        phases = three_phases(between, nodes, per_node, size_bytes).between.phases
    return sum(max(0.0, b - free_bytes) for b in phases) * 8 / rate_bits


def measure(
    nodes: int, per_node: int, rate: str, size_bytes: int, repeats: int, algorithms: list[str]
) -> str:
    """Bring a cluster up, run the worker on it, take it down; the table, as text."""
    args = ["-m", "profiling.cluster", "hierarchical-worker", "--bytes", str(size_bytes),
            "--repeats", str(repeats), "--algorithms", ",".join(algorithms)]  # fmt: skip
    with VirtualCluster(nodes=nodes, ranks_per_node=per_node, rate=rate) as cluster:
        burst = cluster.state.burst_bytes
        result = cluster.run_for_result(args, RESULT_PREFIX, "the measurement", timeout=600)
    return table(result, nodes, per_node, rate, cluster.rate_bits, burst, size_bytes)


def table(
    result: dict,
    nodes: int,
    per_node: int,
    rate: str,
    rate_bits: int,
    burst_bytes: int,
    size_bytes: int,
) -> str:
    n = size_bytes
    p = nodes * per_node
    rows = result["rows"]
    inside_s = statistics.median(result["inside_seconds"])
    lines = [
        f"all-reduce of {n / 2**20:g} MiB ({n} bytes, float32) on {nodes} nodes x {per_node} "
        f"ranks at {rate} (tbf burst {burst_bytes} bytes); times: median of "
        f"{len(next(iter(rows.values()))['seconds'])} calls, the slowest rank's",
        "",
        "bytes each rank sends to other nodes per call (ranks 0..p-1), x buffer:",
    ]
    for algorithm, row in rows.items():
        measured = [r["between"] for r in row["ranks"]]
        model = model_between_nodes(algorithm, nodes, per_node, n)
        lines.append(f"  {algorithm:<30} measured {' '.join(f'{b / n:.3f}' for b in measured)}"
                     f"  model {' '.join(f'{b / n:.3f}' for b in model)}"
                     f"  ({', '.join(str(b) for b in measured)} bytes)")  # fmt: skip
    lines += ["", f"{'algorithm':<30} {'node link, x buffer':>20} {'ms measured':>12} "
              f"{'ms model':>9} {'measured/model':>15}"]  # fmt: skip
    for algorithm, row in rows.items():
        # Each node's link counter over the timed calls: its busiest node, per call.
        link = max(r["link"] for r in row["ranks"][::per_node])
        measured_s = statistics.median(row["seconds"])
        model_s = model_seconds(algorithm, nodes, per_node, n, rate_bits, burst_bytes)
        lines.append(f"{algorithm:<30} {link / n:>20.3f} {measured_s * 1e3:>12.1f} "
                     f"{model_s * 1e3:>9.1f} {measured_s / model_s:>15.2f}")  # fmt: skip
    lines += [
        f"{p} ranks share this machine's cores; the model counts the link alone.",
        f"The tree inside each node alone (phases 1 and 3, no link): {inside_s * 1e3:.1f} ms "
        "measured; the three-phase forms' model plus that:",
    ]
    for algorithm, row in rows.items():
        if algorithm.startswith("hierarchical_"):
            model_s = model_seconds(algorithm, nodes, per_node, n, rate_bits, burst_bytes)
            measured_s = statistics.median(row["seconds"])
            lines.append(f"  {algorithm:<30} {(model_s + inside_s) * 1e3:.1f} ms, "
                         f"measured/that {measured_s / (model_s + inside_s):.2f}")  # fmt: skip
    return "\n".join(lines)
