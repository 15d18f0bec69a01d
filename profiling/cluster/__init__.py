"""A shaped network on one machine: N network namespaces, one per node, joined by a
bridge whose every link is limited to a fixed rate, so Gloo's all-reduce waits on a wire
as it does between real machines instead of copying through loopback memory.

    python -m profiling.cluster up --ranks 2 --rate 1gbit
    python -m profiling.cluster run -- -m stages.overlapped --model mlp
    python -m profiling.cluster probe          # all-reduce bandwidth across the link
    python -m profiling.cluster down

`run` starts one torchrun node per namespace (`--nnodes N --node-rank k
--nproc-per-node R`), everything after `--` being torchrun's script and its arguments,
waits for all, and exits nonzero if any failed. From Python, and in tests:

    with VirtualCluster(ranks=2, rate="1gbit") as cluster:
        cluster.run(["-m", "stages.bucketed", "--steps", "3"])

Nodes of several ranks, as servers of several GPUs: `up --nodes N --ranks-per-node R`
(`VirtualCluster(nodes=N, ranks_per_node=R)`) puts R ranks in each node's namespace,
node k holding ranks kR..kR+R-1. They talk to each other over the namespace's loopback,
unshaped, as a server's GPUs over NVLink; only traffic between nodes crosses a shaped
link. `--ranks` is the world size, N x R; with the default R = 1, one rank per node.

    python -m profiling.cluster hierarchical   # flat ring vs three phases, 2 nodes x 2

`cluster.set_link(k, up=False)` takes node k's link down while something runs (a pulled
cable: tests/test_cluster.py checks that the rank cut off is named within --timeout).
`run --elastic` starts torchrun's elastic rendezvous instead (`ElasticLaunch`), and `lose K`
kills node K (or `--link down` cuts it off): the nodes left re-form and go on
(docs/when-a-server-is-lost.md).

Topology. Nothing is created in the host's namespace and no host interface is touched:

    ddps-<id>-r0          ddps-<id>-br                ddps-<id>-r1
    [ddp0 10.250.0.1] ==== [r0]--br0--[r1] ==== [ddp0 10.250.0.2]
       tbf (egress)       tbf (egress)  tbf (egress)     tbf (egress)

Each veth pair is created inside the namespaces (`ip -n NS link add ... peer ... netns
BR`), and both of its ends get `tbf rate RATE`: each direction of each link is shaped,
so every rank sends and receives at RATE at most, full duplex, as on a switch.

What it cannot do: add latency, which takes the netem qdisc, missing from the kernel
this was developed on; the round-trip stays at microseconds, and only bandwidth is
real. The nodes also still share this machine's CPU cores; `run` gives each rank
cores // ranks threads (ranks: all of them, every node's).

Namespaces outlive the processes that made them. `up` records what it creates in a
state file under /run/ddp-stages-cluster (next to /run/netns, so both vanish on reboot)
before creating it, and `down` removes exactly the namespaces recorded there. Removing
a namespace removes its veth ends, bridge and qdiscs with it. A cluster whose owner was
killed outright (SIGKILL, which no handler sees) is removed by the next `up` on the
machine: its record names a process that no longer runs (pid and start time).

The package: `network` (rates, what this machine can do, the namespaces and shaped links
set up and torn down), `virtual_cluster` (`VirtualCluster`), `nodes` (one torchrun per
namespace, started, waited for and stopped), `signals`, `probe` (the bandwidth probe)
`hierarchical` (the flat ring against the three-phase all-reduce, bytes and time, measured
and modelled) and `cli` (the command line).
"""
