"""The cluster's all-reduce costs against values worked out by hand, message by message,
on 2 servers of 2 GPUs and other small clusters."""

from __future__ import annotations

import argparse

import pytest

from profiling.simulate.topology import (
    Topology,
    cost_model,
    halving_doubling,
    hierarchical,
    ring,
)

# Round numbers, so every figure below can be checked on paper: NVLink 100 B/s and 1 s
# per step, the network 10 B/s and 10 s per step, 0.5 s per call, 0.01 s per byte added.
LINKS = dict(
    intra_bytes_per_s=100,
    inter_bytes_per_s=10,
    intra_latency_s=1.0,
    inter_latency_s=10.0,
    call_latency_s=0.5,
    reduce_s_per_byte=0.01,
)
TWO_BY_TWO = Topology(nodes=2, gpus_per_node=2, **LINKS)


def costs(cost):
    return pytest.approx(cost.latency_s), pytest.approx(cost.wire_s)


def test_ring_on_two_servers_of_two():
    # 40 bytes, GPUs 0 1 | 2 3 in a ring: chunks of 10 B, each GPU sends 6 of them (60 B)
    # and adds 3 (30 B: 0.3 s). The hop 1 -> 2 is the network: 60 B at 10 B/s, 6 s. A
    # chunk makes 6 hops; 2 of them (1 -> 2 and 3 -> 0) cross servers: 2 x 10 + 4 x 1.
    assert costs(ring(TWO_BY_TWO, 40)) == (0.5 + 24 + 0.3, 6.0)


def test_halving_doubling_on_two_servers_of_two():
    # Distance 2 first: GPU 0 swaps half (20 B) with GPU 2 on the other server, and GPU 1
    # with GPU 3 at the same time: 40 B through each NIC, 4 s; then 10 B with the
    # neighbour over NVLink, 0.1 s. The doubling retraces it: 0.1 + 4. Adds 20 + 10 B.
    # Steps: 2 across (20 s), 2 inside (2 s).
    assert costs(halving_doubling(TWO_BY_TWO, 40)) == (0.5 + 22 + 0.3, 8.2)


def test_halving_doubling_on_four_servers_of_two():
    # 80 bytes. Distance 4, another server: 40 B from each GPU, 80 B through each NIC,
    # 8 s; distance 2, another server too: 20 B each, 4 s; distance 1, the neighbour on
    # NVLink: 10 B, 0.1 s. The doubling the same back: 24.2 s. 4 steps across, 2 inside;
    # 40 + 20 + 10 B added.
    four = Topology(nodes=4, gpus_per_node=2, **LINKS)
    assert costs(halving_doubling(four, 80)) == (0.5 + 42 + 0.7, 24.2)


def test_hierarchical_on_two_servers_of_two():
    # Reduce-scatter inside: 1 step, 20 B over NVLink (0.2 s), 20 B added. Each GPU's
    # 20 B shard with its peer on the other server: a ring of 2, 2 steps (20 s), 20 B
    # sent by each of the two GPUs through the NIC (40 B, 4 s), 10 B added. All-gather
    # inside: 1 step, 0.2 s. The inter-node algorithm makes no difference on 2 servers.
    expected = (0.5 + 2 + 20 + 0.3, 4.4)
    assert costs(hierarchical(TWO_BY_TWO, 40, "ring")) == expected
    assert costs(hierarchical(TWO_BY_TWO, 40, "halving_doubling")) == expected


def test_hierarchical_between_four_servers_ring_against_halving_doubling():
    four = Topology(nodes=4, gpus_per_node=2, **LINKS)
    # 80 B: reduce-scatter and all-gather inside, 1 step and 40 B each (0.8 s); 40 B
    # added. Shards of 40 B over 4 servers: each GPU sends 2 x 3/4 x 40 = 60 B, two GPUs
    # per NIC: 120 B, 12 s; adds 30 B. Ring: 6 steps across; halving-doubling: 4.
    assert costs(hierarchical(four, 80, "ring")) == (0.5 + 2 + 60 + 0.7, 12.8)
    assert costs(hierarchical(four, 80, "halving_doubling")) == (0.5 + 2 + 40 + 0.7, 12.8)


def test_one_server_and_one_gpu_per_server():
    one_server = Topology(nodes=1, gpus_per_node=4, **LINKS)
    # 4 GPUs on NVLink, 40 B: each sends 60 B (0.6 s), adds 30 B; ring 6 steps, h-d 4.
    assert costs(ring(one_server, 40)) == (0.5 + 6 + 0.3, 0.6)
    assert costs(halving_doubling(one_server, 40)) == (0.5 + 4 + 0.3, 0.6)
    # One GPU per server: every hop of the ring is the network.
    servers = Topology(nodes=4, gpus_per_node=1, **LINKS)
    assert costs(ring(servers, 40)) == (0.5 + 60 + 0.3, 6.0)
    assert costs(hierarchical(servers, 40, "ring")) == costs(ring(servers, 40))
    # A single GPU exchanges nothing.
    alone = Topology(nodes=1, gpus_per_node=1, **LINKS)
    assert costs(ring(alone, 40)) == (0, 0)


def test_with_gpus_keeps_the_servers_and_refuses_a_partial_one():
    assert TWO_BY_TWO.with_gpus(8).nodes == 4
    assert TWO_BY_TWO.with_gpus(1).gpus_per_node == 1
    with pytest.raises(ValueError, match="multiple of 2"):
        TWO_BY_TWO.with_gpus(5)
    with pytest.raises(ValueError, match="power of two"):
        halving_doubling(Topology(nodes=3, gpus_per_node=2, **LINKS), 40)
    with pytest.raises(ValueError, match="no algorithm 'tree'"):
        cost_model(TWO_BY_TWO, "tree")


def test_inter_bandwidth_by_servers_is_interpolated_in_log2_and_clamped():
    curve = Topology(nodes=1, gpus_per_node=2, inter_by_nodes=((2, 40), (8, 10)),
                     **LINKS)  # fmt: skip
    # 4 servers: half way from 2 to 8 in log2; below 2 and beyond 8 the ends' values.
    assert [curve.inter_at(n) for n in (1, 2, 4, 8, 64)] == [40, 40, 25, 10, 10]
    assert curve.with_gpus(8).inter_bytes_per_s == 25  # 4 servers of 2
    assert curve.with_gpus(2).inter_bytes_per_s == 40
    # Without points, the same at every count, as before.
    assert TWO_BY_TWO.with_gpus(64).inter_bytes_per_s == 10
    with pytest.raises(ValueError, match="servers ascending"):
        Topology(nodes=1, gpus_per_node=2, inter_by_nodes=((8, 1), (2, 1)), **LINKS)


def test_cloud_100gbe_follows_its_source_per_server_count():
    from profiling.simulate import clusters
    from profiling.simulate.topology import GB, GBIT

    cloud = clusters.cluster("cloud_100gbe")
    # NVIDIA/nccl issue 235: ~10 GB/s on 2 servers, 6-8 GB/s on 8 to 32.
    at = {p // 8: cloud.topology.with_gpus(p).inter_bytes_per_s / GB for p in (16, 64, 256, 512)}
    assert at == pytest.approx({2: 10, 8: 7, 32: 6, 64: 6})
    assert 7 < cloud.topology.with_gpus(32).inter_bytes_per_s / GB < 10  # 4 servers: between
    assert "7 GB/s (56 Gbit/s) on 8" in "\n".join(clusters.describe(cloud, "cloud_100gbe", "ring"))
    assert "log2(servers)" in cloud.sources["inter_bytes_per_s"]
    # --inter-gbps replaces the whole curve: the same at every count.
    args = argparse.Namespace(cluster="cloud_100gbe", inter_gbps=40.0, model=None)
    custom, _ = clusters.from_args(args)
    assert custom.topology.with_gpus(256).inter_bytes_per_s == 40 * GBIT
    # Every other preset: one bandwidth at every count.
    for name in set(clusters.NAMES) - {"cloud_100gbe"}:
        t = clusters.cluster(name).topology
        assert not t.inter_by_nodes
        assert t.with_gpus(256).inter_bytes_per_s == t.inter_bytes_per_s
