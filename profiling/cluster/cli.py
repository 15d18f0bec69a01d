"""The command line: up, run, lose, probe, down, status, hierarchical (and probe-worker
and hierarchical-worker, which `probe` and `hierarchical` run on every node)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

import profiling.cluster
from profiling.cluster.hierarchical import (
    ALGORITHMS,
    ELEMENT_BYTES,
    hierarchical_worker,
    measure,
)
from profiling.cluster.network import (
    LATENCY,
    _namespaces,
    available,
    parse_rate,
    recorded_clusters,
    remove,
    remove_stale,
)
from profiling.cluster.probe import probe_worker
from profiling.cluster.virtual_cluster import ElasticLaunch, VirtualCluster


def _cli_cluster(cid: str | None) -> VirtualCluster:
    """The cluster a CLI command acts on: --id, else the one `up` made."""
    clusters = recorded_clusters()
    if cid is not None:
        chosen = [c for c in clusters if c.id == cid]
        if not chosen:
            status = "python -m profiling.cluster status"
            raise SystemExit(f"no cluster with id {cid!r}; see `{status}`")
        return VirtualCluster.attach(chosen[0])
    mine = [c for c in clusters if c.owner_pid is None]
    if not mine:
        raise SystemExit("no cluster is up: run `python -m profiling.cluster up` first")
    if len(mine) > 1:
        ids = ", ".join(c.id for c in mine)
        raise SystemExit(f"several clusters are up ({ids}): pick one with --id")
    return VirtualCluster.attach(mine[0])


def _rate_arg(text: str) -> str:
    try:
        parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _check_up_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`up`'s sizes, refused by the option's name before anything is created."""
    r = args.ranks_per_node
    if r < 1:
        parser.error(f"--ranks-per-node {r}: each node holds at least 1 rank")
    if args.nodes is not None and not 1 <= args.nodes <= 200:
        parser.error(f"--nodes {args.nodes}: give 1 to 200 (one address each in a /24)")
    if args.ranks is not None:
        if args.ranks < 1 or args.ranks % r:
            parser.error(f"--ranks {args.ranks}: the world size must be a positive "
                         f"multiple of --ranks-per-node {r}")  # fmt: skip
        if args.nodes is not None and args.ranks != args.nodes * r:
            parser.error(f"--ranks {args.ranks} is not --nodes {args.nodes} x "
                         f"--ranks-per-node {r}: give one of --ranks and --nodes")  # fmt: skip
    elif args.nodes is None:
        args.nodes = 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Everything after `--` is torchrun's, untouched by our parser.
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m profiling.cluster", description=profiling.cluster.__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = argparse.ArgumentDefaultsHelpFormatter  # every option's help shows its default
    p = sub.add_parser(
        "up", formatter_class=defaults, help="create the namespaces, bridge and shaped links"
    )
    p.add_argument(
        "--nodes",
        type=int,
        help="namespaces, each a server behind its shaped link; 2 if no --ranks",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks sharing each node's namespace, unshaped between them (a server's GPUs)",
    )
    p.add_argument(
        "--ranks", type=int, help="the world size, instead of --nodes: nodes x --ranks-per-node"
    )
    p.add_argument("--rate", default="1gbit", type=_rate_arg, help="each link's rate, each way")
    p = sub.add_parser(
        "run",
        formatter_class=defaults,
        help="one torchrun per node (--nproc-per-node R): run ... -- <torchrun args>",
    )
    p.add_argument("--id", help="which cluster (default: the one `up` made)")
    p.add_argument("--timeout", type=float, help="seconds before every node is killed")
    p.add_argument(
        "--elastic",
        action="store_true",
        help="torchrun's elastic rendezvous (--nnodes 1:N, its store on node 0): a node lost "
        "leaves the others to re-form, and the run's exit status is node 0's",
    )
    p.add_argument("--max-restarts", type=int, default=3, help="with --elastic: torchrun's")
    p = sub.add_parser(
        "lose",
        formatter_class=defaults,
        help="lose node K while something runs: SIGKILL everything in it, or --link down",
    )
    p.add_argument("node", type=int, help="the node's index (0 holds an elastic run's store)")
    p.add_argument("--id", help="which cluster (default: the one `up` made)")
    p.add_argument(
        "--link", choices=("down", "up"), help="instead: take its link down (or up again)"
    )
    p = sub.add_parser(
        "probe", formatter_class=defaults, help="measure Gloo all-reduce bandwidth across the links"
    )
    p.add_argument("--id", help="which cluster (default: the one `up` made)")
    p.add_argument("--megabytes", type=float, default=25.0, help="tensor size, MB")
    p.add_argument("--iterations", type=int, default=5, help="timed all-reduces")
    p = sub.add_parser("down", formatter_class=defaults, help="remove what `up` created")
    p.add_argument("--id", help="which cluster (default: the one `up` made)")
    p.add_argument(
        "--stale",
        action="store_true",
        help="instead: remove clusters whose owning process is gone (killed with -9)",
    )
    sub.add_parser(
        "status",
        formatter_class=defaults,
        help="list the clusters recorded, and whether they are there",
    )
    p = sub.add_parser(
        "hierarchical",
        formatter_class=defaults,
        help="on a cluster of its own: the flat ring against the three-phase all-reduce, "
        "bytes between nodes and time, measured and modelled",
    )
    p.add_argument("--nodes", type=int, default=2, help="namespaces behind the shaped links")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks sharing each node")
    p.add_argument("--rate", default="1gbit", type=_rate_arg, help="each link's rate, each way")
    p.add_argument("--mebibytes", type=float, default=16.0, help="the buffer, MiB of float32")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per algorithm")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="any of these")
    p = sub.add_parser(
        "hierarchical-worker",
        formatter_class=defaults,
        help="(internal) what `hierarchical` runs under torchrun",
    )
    p.add_argument("--bytes", type=int, required=True, help="the buffer, bytes")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per algorithm")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="any of these")
    p = sub.add_parser(
        "probe-worker", formatter_class=defaults, help="(internal) what `probe` runs under torchrun"
    )
    p.add_argument("--megabytes", type=float, default=25.0, help="tensor size, MB")
    p.add_argument("--iterations", type=int, default=5, help="timed all-reduces")
    args = parser.parse_args(argv)
    if rest and args.command != "run":
        parser.error("`--` and torchrun arguments go with `run` only")
    if args.command == "up":
        _check_up_args(parser, args)

    if args.command in ("hierarchical", "hierarchical-worker"):
        args.algorithms = args.algorithms.split(",")
        unknown = sorted(set(args.algorithms) - set(ALGORITHMS))
        if unknown:
            parser.error(f"--algorithms: {', '.join(unknown)} not among {', '.join(ALGORITHMS)}")
        if args.repeats < 1:
            parser.error(f"--repeats {args.repeats}: time at least 1 call")
    if args.command == "hierarchical":
        if args.nodes < 2 or args.ranks_per_node < 1:
            parser.error(f"--nodes {args.nodes} --ranks-per-node {args.ranks_per_node}: "
                         "give at least 2 nodes of at least 1 rank")  # fmt: skip
        # Whole float32 elements, as many per rank: the ring splits them without padding,
        # so its bytes are the model's to the byte.
        quantum = ELEMENT_BYTES * args.nodes * args.ranks_per_node
        size_bytes = int(args.mebibytes * 2**20) // quantum * quantum
        if size_bytes == 0:
            parser.error(f"--mebibytes {args.mebibytes}: too small to split over the ranks")
    if args.command == "hierarchical-worker":
        hierarchical_worker(args.bytes, args.repeats, args.algorithms)
        return 0
    if args.command == "probe-worker":
        probe_worker(args.megabytes, args.iterations)
        return 0
    if args.command == "status":
        present = _namespaces() if available()[0] else set()
        for c in recorded_clusters():
            there = sum(ns in present for ns in c.all_namespaces)
            owner = "until `down`" if c.owner_pid is None else f"owner pid {c.owner_pid}"
            size = f"{c.ranks} ranks" if c.ranks_per_node == 1 else (
                f"{c.nodes} nodes x {c.ranks_per_node} ranks")  # fmt: skip
            print(f"{c.id}: {size} at {c.rate}, {owner}, "
                  f"{there}/{len(c.all_namespaces)} namespaces present")  # fmt: skip
        return 0
    ok, why = available()
    if not ok:
        print(f"profiling.cluster: {why}", file=sys.stderr)
        return 2
    if args.command == "hierarchical":
        print(measure(args.nodes, args.ranks_per_node, args.rate, size_bytes, args.repeats,
                      args.algorithms))  # fmt: skip
        return 0
    if args.command == "up":
        cluster = VirtualCluster(
            args.ranks, args.rate, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
            persistent=True,
        )  # fmt: skip
        s = cluster.up()
        r = s.ranks_per_node
        each = "" if r == 1 else f", {r} ranks each (unshaped between them)"
        print(f"cluster {s.id}: {s.nodes} nodes at {s.rate} each way "
              f"(tbf burst {s.burst_bytes} bytes, latency {LATENCY}){each}")  # fmt: skip
        for k, (ns, address) in enumerate(zip(s.namespaces, s.addresses, strict=True)):
            ranks = "" if r == 1 else f"  ranks {k * r}-{k * r + r - 1}"
            print(f"  {ns}  {s.ifname} {address}{ranks}")
        print("next: python -m profiling.cluster run -- -m stages.bucketed --model mlp")
        return 0
    if args.command == "down":
        if args.stale:
            print(f"removed {', '.join(remove_stale()) or 'nothing'}")
            return 0
        state = _cli_cluster(args.id).state
        print(f"removed {', '.join(remove(state)) or 'nothing left'} ({state.id})")
        return 0
    cluster = _cli_cluster(args.id)
    if args.command == "run":
        if not rest:
            parser.error("give torchrun's arguments after --, e.g. run -- -m stages.naive")
        if not args.elastic:
            return cluster.run(rest, timeout=args.timeout).returncode
        # A lost node is the point: the others go on, and node 0 says how the run ended.
        launch = ElasticLaunch(max_restarts=args.max_restarts)
        out = cluster.run(rest, timeout=args.timeout, grace=float("inf"), launch=launch)
        return out.returncodes[0] if out.returncodes[0] is not None else out.returncode
    if args.command == "lose":
        if not 0 <= args.node < cluster.nodes:
            parser.error(f"node {args.node}: the cluster has nodes 0 to {cluster.nodes - 1}")
        if args.link:
            cluster.set_link(args.node, up=args.link == "up")
        else:
            for pid in cluster.node_pids(args.node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return 0
    if args.command == "probe":
        r = cluster.probe(args.megabytes, args.iterations)
        print(
            f"Gloo all-reduce of {r['bytes'] / 1e6:g} MB over {r['ranks']} ranks at {r['rate']}: "
            f"{r['MBps']:.1f} MB/s median ({r['MBps_min']:.1f}-{r['MBps_max']:.1f}) of tensor "
            f"bytes per second; expected about {r['expected_MBps']:.1f} "
            f"(rate/8 x N/(2(N-1))); {r['bus_MBps']:.1f} MB/s sent per rank"
        )
        return 0
    raise AssertionError(args.command)
