"""Nodes of several ranks on the shaped cluster (profiling.cluster): the ranks of one
node share its namespace and talk past the shaped link, as a server's GPUs do; nodes
talk through it. On 2 nodes x 2 ranks: torchrun numbers the ranks node by node, every
all-reduce of ddp.collectives over those nodes equals Gloo's, its bytes between nodes are
the model's and the link's counter's, and bad sizes are refused by the option's name."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from profiling.cluster import network as vc
from profiling.cluster.cli import main
from profiling.cluster.hierarchical import model_between_nodes, model_seconds, table
from profiling.cluster.virtual_cluster import VirtualCluster
from profiling.collectives.model import three_phases

ROOT = Path(__file__).resolve().parent.parent
AVAILABLE, WHY_NOT = vc.available()
needs_cluster = pytest.mark.skipif(not AVAILABLE, reason=f"no shaped cluster: {WHY_NOT}")

NODES, PER_NODE = 2, 2
RATE, RATE_BITS = "200mbit", 200 * 10**6  # slow enough that 4 MiB across takes 170 ms
MESSAGE_BYTES = 4 * 2**20  # one point-to-point message, inside a node and across
NUMEL = 4096  # the all-reduces' int64 elements: exact sums, small at any rate
RESULT = "NODES_RESULT "
ALGORITHMS = ("ring", "hierarchical_ring", "hierarchical_halving_doubling")

# What every rank runs under `cluster.run`. Rank 0 prints everyone's findings as one
# line; the test judges them, so that a failure shows all four ranks.
WORKER = """
import json, os, time
import torch
import torch.distributed as dist
from ddp.collectives import all_reduce

MESSAGE_BYTES, NUMEL, PER_NODE = {message_bytes}, {numel}, {per_node}
dist.init_process_group("gloo")
rank = dist.get_rank()
env = {{k: int(os.environ[k]) for k in
       ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")}}
found = {{"env": env, "netns": os.readlink("/proc/self/ns/net")}}

def sent_by_my_node():
    # The node's link's own counter, read inside its namespace (ip netns exec mounts
    # that namespace's /sys): every byte it put through the tbf, headers included.
    with open("/sys/class/net/ddp0/statistics/tx_bytes") as f:
        return int(f.read())

def one_message(src, dst):
    # src sends one message to dst; returns (seconds, bytes node 0 sent meanwhile).
    buffer = torch.ones(MESSAGE_BYTES // 4)
    dist.barrier()
    before, t0 = sent_by_my_node(), time.perf_counter()
    if rank == src:
        dist.send(buffer, dst)
    elif rank == dst:
        dist.recv(buffer, src)
    seconds = time.perf_counter() - t0
    dist.barrier()
    return seconds, sent_by_my_node() - before

found["inside"] = one_message(0, 1)  # node 0's two ranks
found["across"] = one_message(1, 2)  # node 0 to node 1

found["all_reduce"] = {{}}
for algorithm in {algorithms!r}:
    # Integers: any order of addition gives the same sum, so results compare exactly.
    mine = torch.arange(NUMEL, dtype=torch.int64) * (rank + 1) + rank
    reference = mine.clone()
    dist.all_reduce(reference)
    traffic = all_reduce(mine, algorithm, ranks_per_node=PER_NODE)
    found["all_reduce"][algorithm] = {{
        "equal": bool(torch.equal(mine, reference)),
        "between_nodes": traffic.bytes_sent_between_nodes,
    }}
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, found)
if rank == 0:
    print({result!r} + json.dumps(everyone), flush=True)
dist.destroy_process_group()
"""


def netns_list() -> list[str]:
    out = subprocess.run([vc._tool("ip"), "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> list[dict]:
    """Every rank's findings from one run on 2 nodes x 2 ranks; the cluster is gone
    afterwards, and checked to be."""
    script = tmp_path_factory.mktemp("nodes") / "worker.py"
    script.write_text(WORKER.format(message_bytes=MESSAGE_BYTES, numel=NUMEL,
                                    per_node=PER_NODE, result=RESULT,
                                    algorithms=ALGORITHMS))  # fmt: skip
    with VirtualCluster(nodes=NODES, ranks_per_node=PER_NODE, rate=RATE) as cluster:
        names, state_file = cluster.state.all_namespaces, cluster.state.path
        assert len(cluster.state.namespaces) == NODES and cluster.ranks == NODES * PER_NODE
        # The worker imports ddp from the checkout, wherever pytest was started.
        out = cluster.run([str(script)], timeout=120, capture=True, grace=5,
                          env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert not set(names) & set(netns_list()), "namespaces left behind"
    assert not state_file.exists()
    assert out.returncode == 0, out.tail()
    line = next((ln for ln in out.stdout[0].splitlines() if ln.startswith(RESULT)), None)
    assert line is not None, out.tail()
    return json.loads(line[len(RESULT) :])


@needs_cluster
def test_torchrun_numbers_the_ranks_node_by_node(found: list[dict]) -> None:
    # Node k's torchrun starts ranks 2k and 2k+1: what ranks_per_node=2 takes for node k.
    assert [f["env"] for f in found] == [
        {"RANK": r, "LOCAL_RANK": r % PER_NODE, "WORLD_SIZE": NODES * PER_NODE,
         "LOCAL_WORLD_SIZE": PER_NODE, "GROUP_RANK": r // PER_NODE}
        for r in range(NODES * PER_NODE)
    ]  # fmt: skip


@needs_cluster
def test_the_ranks_of_a_node_share_its_namespace(found: list[dict]) -> None:
    netns = [f["netns"] for f in found]
    assert netns[0] == netns[1] and netns[2] == netns[3] and netns[0] != netns[2], netns


@needs_cluster
def test_inside_a_node_unshaped_across_nodes_shaped(found: list[dict]) -> None:
    """Node 0's link counter: a message between its own two ranks never reaches the
    link; one to node 1 goes through it whole, at no more than the link's rate."""
    # Times are the receiver's: a send may return once its bytes sit in a socket buffer.
    inside_s, inside_sent = found[1]["inside"][0], found[0]["inside"][1]
    across_s, across_sent = found[2]["across"][0], found[1]["across"][1]
    shaped_s = MESSAGE_BYTES * 8 / RATE_BITS  # 168 ms at 200 Mbit/s
    print(f"4 MiB inside node 0: {inside_s * 1e3:.1f} ms, {inside_sent} bytes on its link; "
          f"to node 1: {across_s * 1e3:.1f} ms, {across_sent} bytes (shaped: "
          f"{shaped_s * 1e3:.0f} ms)")  # fmt: skip
    # Only the barriers' few messages; the whole message would be 4 MiB.
    assert inside_sent < MESSAGE_BYTES / 16, found
    assert across_sent >= MESSAGE_BYTES, found
    # The token bucket lets its 50 KiB depth through at once; the rest waits on the rate.
    assert across_s > 0.9 * shaped_s, found
    # A memory copy through loopback, however busy the machine, is far below the rate.
    assert inside_s < shaped_s / 3, found


@needs_cluster
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_over_the_nodes_equals_gloos(found: list[dict], algorithm: str) -> None:
    rows = [f["all_reduce"][algorithm] for f in found]
    assert all(row["equal"] for row in rows), rows
    between = [row["between_nodes"] for row in rows]
    n = NUMEL * 8  # int64 bytes
    if algorithm == "ring":
        # Around the ring 0-1-2-3: ranks 1 and 3 send to the next node, 2(p-1)/p n each.
        p = NODES * PER_NODE
        assert between == [0, 2 * (p - 1) * n // p, 0, 2 * (p - 1) * n // p]
    else:
        # The leaders (ranks 0 and 2) alone cross, with the model's phase 2 bytes.
        phases = three_phases(algorithm.removeprefix("hierarchical_"), NODES, PER_NODE, n)
        assert between == [phases.between.sent, 0, phases.between.sent, 0]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--nodes", "2", "--ranks-per-node", "0"], "--ranks-per-node 0"),
        (["--nodes", "0"], "--nodes 0"),
        (["--ranks", "3", "--ranks-per-node", "2"], "--ranks 3"),
        (["--ranks", "4", "--nodes", "3", "--ranks-per-node", "2"], "--ranks 4 is not --nodes 3"),
    ],
)
def test_bad_sizes_are_refused_by_the_options_name(argv, named, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["up", *argv])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_the_python_api_refuses_bad_sizes_by_name() -> None:
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1"):
        VirtualCluster(nodes=2, ranks_per_node=0)
    with pytest.raises(ValueError, match="ranks=3 does not split into nodes of ranks_per_node=2"):
        VirtualCluster(ranks=3, ranks_per_node=2)
    with pytest.raises(ValueError, match="ranks=4 is not nodes=3 x ranks_per_node=2"):
        VirtualCluster(ranks=4, nodes=3, ranks_per_node=2)
    # Either way of giving the sizes makes the same cluster; one rank per node, as before.
    assert vars(VirtualCluster(ranks=4, ranks_per_node=2)) == vars(
        VirtualCluster(nodes=2, ranks_per_node=2)
    )
    assert (VirtualCluster(ranks=3).nodes, VirtualCluster().nodes) == (3, 2)


def test_a_record_written_before_nodes_held_several_ranks_reads_as_one_each() -> None:
    # The fields of such a record, as `up` wrote it: no ranks_per_node.
    old = {"id": "x", "ranks": 2, "rate": "1gbit", "rate_bits": 10**9, "burst_bytes": 1,
           "bridge_namespace": "b", "namespaces": ["n0", "n1"], "addresses": ["a0", "a1"],
           "ifname": "i", "owner_pid": None, "created_utc": "now",
           "owner_started": None}  # fmt: skip
    cluster = VirtualCluster.attach(vc.ClusterState(**old))
    assert (cluster.nodes, cluster.ranks_per_node, cluster.ranks) == (2, 1, 2)


def test_a_node_runs_one_torchrun_of_all_its_ranks() -> None:
    state = vc.ClusterState("x", 6, "1gbit", 10**9, 1, "b", ["n0", "n1", "n2"],
                            ["10.250.0.1", "10.250.0.2", "10.250.0.3"], "ddp0", None, "now",
                            None, ranks_per_node=2)  # fmt: skip
    commands = VirtualCluster.attach(state).node_commands(["-m", "stages.naive"])
    assert len(commands) == 3
    for k, command in enumerate(commands):
        assert option(command, "exec") == f"n{k}"  # node k's namespace
        assert [option(command, o) for o in ("--nnodes", "--node-rank", "--nproc-per-node",
                "--master-addr")] == ["3", str(k), "2", "10.250.0.1"]  # fmt: skip


def option(command: list[str], name: str) -> str:
    """The word after `name` in `command`."""
    return command[command.index(name) + 1]


def test_the_hierarchical_measurement_prices_the_link_alone() -> None:
    """`python -m profiling.cluster hierarchical`'s model: the bytes between nodes on the
    critical path, less the token bucket's depth, at the rate; a leader alone crosses."""
    n, burst = 16 * 2**20, 256 * 2**10
    assert model_between_nodes("ring", 2, 2, n) == [0, 1.5 * n, 0, 1.5 * n]
    assert model_between_nodes("hierarchical_ring", 2, 2, n) == [n, 0, n, 0]
    assert model_between_nodes("hierarchical_halving_doubling", 4, 2, n) == [1.5 * n, 0] * 4
    assert model_seconds("ring", 2, 2, n, 10**9, burst) == pytest.approx((1.5 * n - burst) * 8e-9)
    assert model_seconds("hierarchical_ring", 2, 2, n, 10**9, 0) == pytest.approx(n * 8e-9)
    rows = {"hierarchical_ring": {"seconds": [0.2, 0.3, 0.25],
            "ranks": [{"between": n, "link": n}, {"between": 0, "link": n},
                      {"between": n, "link": n}, {"between": 0, "link": n}]}}  # fmt: skip
    text = table({"rows": rows, "inside_seconds": [0.1]}, 2, 2, "1gbit", 10**9, 0, n)
    assert "measured 1.000 0.000 1.000 0.000  model 1.000 0.000 1.000 0.000" in text, text
    assert "250.0" in text and "134.2" in text, text  # median ms; n bytes at 1 Gbit/s
