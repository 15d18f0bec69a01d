"""The command line: run the sweep on each world size (a shaped cluster per world size,
or loopback), keep every run in one JSON file, and write the fit, the Markdown and the
figure from all the runs in it."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from ddp.collectives import ALGORITHMS
from profiling.cluster.network import available
from profiling.cluster.virtual_cluster import VirtualCluster
from profiling.collectives import output
from profiling.collectives.worker import GLOO
from profiling.common.report import command_line, load_average, machine, read_json, write_json

_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
# The default sweep: the hierarchical algorithms are the same as these with one rank
# per node, and are asked for by name with --ranks-per-node.
FLAT = tuple(a for a in ALGORITHMS if not a.startswith("hierarchical_"))


def parse_size(text: str) -> int:
    """Bytes from "4KiB", "256MiB", "4096"."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in {"", *_UNITS}:
        raise argparse.ArgumentTypeError(f"size {text!r}: give a number with B, KiB, MiB or GiB")
    return int(match.group(1)) * _UNITS[match.group(2) or "b"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m profiling.collectives",
        description="Time every all-reduce of ddp.collectives, and Gloo's, against message "
        "size and world size; fit the alpha-beta-gamma model of each.",
    )
    parser.add_argument(
        "--network",
        default="1gbit",
        help="each link's rate on the shaped cluster (needs root), or loopback",
    )
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated, each >= 2")
    parser.add_argument(
        "--algorithms",
        default=",".join([*FLAT, GLOO]),
        help=f"any of {', '.join([*ALGORITHMS, GLOO])}",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks 0..R-1 make node 0, and so on: the nodes of the hierarchical "
        "algorithms (every link is alike, on loopback and on the shaped cluster)",
    )
    parser.add_argument("--min-size", type=parse_size, default=4 * 2**10)
    parser.add_argument(
        "--max-size",
        type=parse_size,
        default=256 * 2**20,
        help="sizes go from --min-size up by factors of 4",
    )
    parser.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="emulated delay per step inside ddp.collectives (not Gloo's)",
    )
    parser.add_argument("--min-repeats", type=int, default=3, help="calls per algorithm and size")
    parser.add_argument("--max-repeats", type=int, default=30)
    parser.add_argument(
        "--seconds-per-size",
        type=float,
        default=2.0,
        help="as many rounds of every algorithm as fit, within the repeats",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    parser.add_argument("--json", help="results file; with --merge, runs are added to it")
    parser.add_argument("--merge", action="store_true", help="keep the runs already in --json")
    parser.add_argument("--markdown", help="the fit and tables, for the docs")
    parser.add_argument("--plot", help="the figure (png)")
    parser.add_argument("--render", help="write --markdown/--plot from this JSON; run nothing")
    args = parser.parse_args(argv)  # fmt: skip
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    if any(w < 2 for w in args.world_sizes):
        parser.error("--world-sizes: each must be >= 2 (one rank has nothing to exchange)")
    if args.ranks_per_node < 1 or any(w % args.ranks_per_node for w in args.world_sizes):
        parser.error(f"--ranks-per-node {args.ranks_per_node} must divide every world size")
    args.algorithms = args.algorithms.split(",")
    unknown = set(args.algorithms) - {*ALGORITHMS, GLOO}
    if unknown:
        parser.error(f"--algorithms: unknown {', '.join(sorted(unknown))}")
    if args.min_size % 4 or args.min_size > args.max_size:
        parser.error("--min-size must be a multiple of 4 bytes (float32) and <= --max-size")
    if args.merge and not args.json:
        parser.error("--merge needs --json")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.render:
        runs = read_json(args.render, "profiling.collectives", "runs")["runs"]
        return _write(runs, args)
    python = sys.executable
    if Path(python).is_relative_to(Path.cwd()):
        python = os.path.relpath(python)  # `.venv/bin/python`, as typed
    command = command_line("profiling.collectives", argv, python=shlex.quote(python))
    sizes = []
    size = args.min_size
    while size <= args.max_size:
        sizes.append(size)
        size *= 4
    runs = []
    if args.merge and Path(args.json).exists():
        runs = read_json(args.json, "profiling.collectives", "runs")["runs"]
    for world_size in args.world_sizes:
        settings = {
            "sizes_bytes": sizes, "algorithms": args.algorithms, "delay_ms": args.delay_ms,
            "min_repeats": args.min_repeats, "max_repeats": args.max_repeats,
            "seconds_per_size": args.seconds_per_size, "ranks_per_node": args.ranks_per_node,
        }  # fmt: skip
        run = _run_world(world_size, args.network, settings, args.timeout)
        run |= {"command": command, "settings": settings, "machine": machine()}
        runs.append(run)
        if args.json:  # after every world size: a later failure keeps what was measured
            write_json(args.json, {"runs": runs})
    return _write(runs, args)


def _run_world(world_size: int, network: str, settings: dict, timeout: float) -> dict:
    """One sweep on `world_size` ranks: rank 0's result, with the network it ran on."""
    before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {"COLLECTIVES_SETTINGS": json.dumps({**settings, "out": str(out)})}
        worker = ["-m", "profiling.collectives.worker"]
        if network == "loopback":
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={world_size}", *worker]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
            code = subprocess.run(torchrun, env=env, timeout=timeout).returncode
            net = {"rate": "loopback"}
        else:
            ok, why = available()
            if not ok:
                raise SystemExit(f"profiling.collectives: no shaped network ({why}); "
                                 "run as root, or pass --network loopback")  # fmt: skip
            with VirtualCluster(ranks=world_size, rate=network) as cluster:
                net = {"rate": network, "probe": cluster.probe()}
                code = cluster.run(worker, env=env, timeout=timeout).returncode
        if code != 0:
            raise SystemExit(f"profiling.collectives: {world_size} ranks failed (exit {code})")
        result = json.loads(out.read_text())
    return {**result, "network": net, "load_average_before": before}


def _write(runs: list[dict], args: argparse.Namespace) -> int:
    analysis = output.analyse(runs)
    print(output.summary(analysis))
    if args.markdown:
        Path(args.markdown).write_text(output.markdown(runs, analysis))
    if args.plot:
        output.plot(analysis, args.plot)
    return 0
