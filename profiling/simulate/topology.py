"""A cluster of nodes of GPUs, and what one all-reduce costs on it.

The cluster: `nodes` servers of `gpus_per_node` GPUs each. Inside a server each GPU has
a link of `intra_bytes_per_s` each way (NVLink); each server has one link to the
network of `inter_bytes_per_s` each way (its NIC), which all its GPUs share. A message
round (a *step*) costs `intra_latency_s` inside a server and `inter_latency_s` across
servers; every collective also pays `call_latency_s` once (NCCL's base latency: the
kernel launch and the protocol's set-up), and every byte added `reduce_s_per_byte`.
Where the network's all-reduce bandwidth falls as servers are added (a cloud's
Ethernet), `inter_by_nodes` gives it at a few server counts, and `with_gpus` takes the
one at its count (`Topology.inter_at`: linear in log2 of the servers between them).

An all-reduce of n bytes over p = N x g GPUs (N nodes, g per node) returns a
`schedule.Cost`: the message rounds and the reduction, which nothing else slows, as
`latency_s`; the bytes on the busiest link, which other collectives in flight share, as
`wire_s`. Steps, bytes and bytes added come from `profiling.collectives.model.counts`
(c(algorithm, p, n) below), the per-rank counts of each algorithm on its critical path:

    algorithm          steps         bytes sent (x n)    bytes added (x n)
    ring               2(p-1)        2(p-1)/p            (p-1)/p
    halving_doubling   2 lg p        2(p-1)/p            (p-1)/p          (p a power of two)

What each algorithm costs on the cluster:

- `ring`, flat over all p GPUs, ordered server by server. The ring enters and leaves
  each server once, so a NIC carries what one GPU sends, and the slowest link sets the
  pace. The latency is NCCL's own model of a pipelined ring (src/graph/tuning.cc): a
  chunk makes c.steps hops, and of those only 2(N - 1) cross the network:

      latency = call + (c.steps - 2(N-1)) * intra + 2(N-1) * inter + c.added * gamma
      wire    = c.sent / (N > 1 ? min(B_inter, B_intra) : B_intra),   c = c(ring, p, n)

  (A ring that waited for every hop at every step, as `ddp.collectives` does, would
  pay the network's latency c.steps times: 510 times on 256 GPUs instead of 62.)

- `halving_doubling` (Rabenseifner), flat over all p GPUs, farthest partner first (as
  `ddp.collectives` does it). The partners at distance >= g are on other servers: the
  first lg N steps of the halving (and the last lg N of the doubling) cross the
  network and carry n/2 + n/4 + ... + n/N = n(1 - 1/N) per GPU, and all g GPUs of a
  server send at once through its one NIC. The remaining lg g steps each way stay
  inside the server with the rest of c.sent:

      latency = call + 2 lg N * inter + 2 lg g * intra + c.added * gamma
      wire    = g * 2n(1 - 1/N) / B_inter + (c.sent - 2n(1 - 1/N)) / B_intra

  This is why a flat halving-doubling is a poor fit for servers of many GPUs: its NICs
  carry g times what a ring's do. It needs p a power of two on more than one node.

- `hierarchical_ring`, `hierarchical_halving_doubling`: as NCCL does across nodes, and
  Goyal et al. ("Accurate, Large Minibatch SGD", section 4) did. A ring reduce-scatter
  inside each server leaves each GPU with the node's sum of one n/g shard; the g GPUs
  then each all-reduce their shard across the N servers at the same time, through the
  NIC they share (a ring or halving-doubling over N); a ring all-gather inside the
  server finishes (`profiling.collectives.model.three_phases`, sharded). With c1, c3 the
  reduce-scatter and all-gather (a ring all-reduce over g), cN = c(inter, N, n/g):

      latency = call + (c1 + c3).steps * intra + cN.steps * inter + (c1 + cN + c3).added * gamma
      wire    = (c1 + c3).sent / B_intra + g * cN.sent / B_inter

  Goyal et al. (and `ddp.collectives`: three_phases, not sharded) reduced up a tree and
  all-reduced one whole buffer per server: the same NIC bytes and inter-node steps, but
  2 ceil(lg g) steps of n inside, not 2(g-1) of n/g; the simulator prices the sharded form.

With N = 1 every algorithm is its single-server form; with g = 1 the hierarchical forms
are the flat inter-node algorithm. The bandwidth terms run one after the other: the
model has no pipelining of chunks between the phases (NCCL pipelines them), so it
over-counts a hierarchical all-reduce by up to its intra-node part.

Everything is in seconds and bytes. `tests/test_simulate_topology.py` checks each
formula against values worked out by hand for 2 nodes of 2 GPUs and other small cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from profiling.collectives.model import counts, three_phases
from profiling.simulate.schedule import Cost, CostModel

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
GB = 1e9  # bytes per second in one GB/s


@dataclass(frozen=True)
class Topology:
    """`nodes` servers of `gpus_per_node` GPUs; bandwidths in bytes per second each way,
    latencies in seconds per step (call_latency_s: once per collective)."""

    nodes: int
    gpus_per_node: int
    intra_bytes_per_s: float  # one GPU's link inside its server
    inter_bytes_per_s: float  # one server's link to the network, shared by its GPUs
    intra_latency_s: float
    inter_latency_s: float
    call_latency_s: float = 0.0
    reduce_s_per_byte: float = 0.0  # gamma: local addition
    # (servers, inter_bytes_per_s) points, servers ascending: when given, `with_gpus` sets
    # inter_bytes_per_s to `inter_at` the new number of servers (a network whose
    # all-reduce bandwidth falls with more servers); empty: the same at every count.
    inter_by_nodes: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("intra_bytes_per_s", "inter_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        nodes = [n for n, _ in self.inter_by_nodes]
        if nodes != sorted(set(nodes)) or any(
            not (n >= 1 and b > 0) for n, b in self.inter_by_nodes
        ):
            raise ValueError(
                "inter_by_nodes: (servers >= 1, bytes/s > 0) points, servers ascending, "
                f"got {self.inter_by_nodes}"
            )

    def inter_at(self, nodes: int) -> float:
        """inter_bytes_per_s on `nodes` servers: by `inter_by_nodes`, linear in log2 of
        the servers between its points and its end points' values beyond them; without
        points, inter_bytes_per_s."""
        points = self.inter_by_nodes
        if not points:
            return self.inter_bytes_per_s
        if nodes <= points[0][0]:
            return points[0][1]
        for (n0, b0), (n1, b1) in zip(points, points[1:], strict=False):
            if nodes <= n1:
                share = math.log2(nodes / n0) / math.log2(n1 / n0)
                return b0 + share * (b1 - b0)
        return points[-1][1]

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_gpus(self, gpus: int) -> Topology:
        """The same servers and links, as many of them as `gpus` GPUs need: whole
        servers, or part of one server below gpus_per_node; the network's bandwidth the
        one `inter_at` that many servers."""
        if gpus <= self.gpus_per_node:
            return replace(self, nodes=1, gpus_per_node=gpus, inter_bytes_per_s=self.inter_at(1))
        if gpus % self.gpus_per_node:
            raise ValueError(
                f"{gpus} GPUs do not fill whole servers of {self.gpus_per_node}; "
                f"pick a multiple of {self.gpus_per_node}"
            )
        nodes = gpus // self.gpus_per_node
        return replace(self, nodes=nodes, inter_bytes_per_s=self.inter_at(nodes))


def ring(topo: Topology, nbytes: float) -> Cost:
    """A flat ring over every GPU, pipelined: the network's latency on 2(N - 1) hops."""
    c = counts("ring", topo.gpus, nbytes)
    crossings = 2 * (topo.nodes - 1)  # hops between servers: one in and one out per pass
    rounds_s = (c.steps - crossings) * topo.intra_latency_s + crossings * topo.inter_latency_s
    bandwidth = topo.intra_bytes_per_s
    if topo.nodes > 1:
        bandwidth = min(topo.inter_bytes_per_s, topo.intra_bytes_per_s)
    return _cost(topo, rounds_s, c.added, c.sent / bandwidth)


def halving_doubling(topo: Topology, nbytes: float) -> Cost:
    """Rabenseifner's algorithm over every GPU, farthest partner (another server) first."""
    n_, g, p = topo.nodes, topo.gpus_per_node, topo.gpus
    c = counts("halving_doubling", p, nbytes)
    if n_ == 1:
        return _cost(topo, c.steps * topo.intra_latency_s, c.added, c.sent / topo.intra_bytes_per_s)
    if p & (p - 1) or g & (g - 1):
        raise ValueError(
            f"halving_doubling across servers needs a power of two of GPUs and of GPUs per "
            f"server, got {n_} x {g}; use a hierarchical algorithm (hierarchical_ring, "
            "hierarchical_halving_doubling) or the ring"
        )
    crossing = 2 * nbytes * (1 - 1 / n_)  # per GPU, both phases, to partners on other servers
    latency = 2 * math.log2(n_) * topo.inter_latency_s + 2 * math.log2(g) * topo.intra_latency_s
    wire = g * crossing / topo.inter_bytes_per_s + (c.sent - crossing) / topo.intra_bytes_per_s
    return _cost(topo, latency, c.added, wire)


# --8<-- [start:hierarchical]
def hierarchical(topo: Topology, nbytes: float, inter_algorithm: str = "ring") -> Cost:
    """Reduce-scatter in each server, every GPU's shard all-reduced across servers at
    once (`inter_algorithm`: ring or halving_doubling), all-gather in each server."""
    h = three_phases(inter_algorithm, topo.nodes, topo.gpus_per_node, nbytes, sharded=True)
    inside = (h.inside_before, h.inside_after)  # over NVLink
    latency = sum(c.steps for c in inside) * topo.intra_latency_s
    latency += h.between.steps * topo.inter_latency_s
    wire = sum(c.sent for c in inside) / topo.intra_bytes_per_s
    wire += h.ranks_between * h.between.sent / topo.inter_bytes_per_s  # sharing the NIC
    return _cost(topo, latency, sum(c.added for c in (*inside, h.between)), wire)


# --8<-- [end:hierarchical]


def _cost(topo: Topology, rounds_s: float, added_bytes: float, wire_s: float) -> Cost:
    if topo.gpus == 1:  # nothing to exchange, no call to make
        return Cost(0.0, 0.0)
    return Cost(topo.call_latency_s + rounds_s + added_bytes * topo.reduce_s_per_byte, wire_s)


ALGORITHMS: dict[str, Callable[[Topology, float], Cost]] = {
    "ring": ring,
    "halving_doubling": halving_doubling,
    "hierarchical_ring": lambda topo, n: hierarchical(topo, n, "ring"),
    "hierarchical_halving_doubling": lambda topo, n: hierarchical(topo, n, "halving_doubling"),
}


def cost_model(topo: Topology, algorithm: str) -> CostModel:
    """bytes -> Cost of one all-reduce with `algorithm` on `topo`, for `schedule.simulate`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"no algorithm {algorithm!r}; pick one of {', '.join(ALGORITHMS)}")
    cost = ALGORITHMS[algorithm]
    return lambda nbytes: cost(topo, nbytes)
