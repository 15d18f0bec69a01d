"""Launching: one command runs the benchmark under torchrun, on loopback or on a shaped
cluster; under a launcher of the user's own, the ranks run it directly."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from profiling.bench.options import BenchOptions, parse_options
from profiling.bench.output import write_outputs
from profiling.bench.rounds import run_worker
from profiling.cluster.network import available
from profiling.cluster.virtual_cluster import VirtualCluster
from profiling.common.report import command_line, read_json


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    opts, cfg = parse_options(argv)
    if opts.render:
        records = read_json(opts.render, "profiling.bench", "workloads")["workloads"]
        write_outputs(records[-1], dataclasses.replace(opts, json="", merge=False), records)
        return
    if "RANK" not in os.environ:
        raise SystemExit(launch(opts, argv))
    run_worker(opts, cfg)


def launch(opts: BenchOptions, argv: list[str]) -> int:
    """Run this module under torchrun on `opts.nproc` ranks, on loopback or on a shaped
    cluster (--network); return its exit code."""
    python = sys.executable
    if Path(python).is_relative_to(Path.cwd()):
        python = os.path.relpath(python)  # `.venv/bin/python`, as typed, not /home/...
    # The workers record the command that was typed, so results name what produced them
    # (BENCH_COMMAND), and the network they run on (BENCH_NETWORK): see records.py.
    env = {"BENCH_COMMAND": command_line("profiling.bench", argv, python=shlex.quote(python))}
    worker_args = ["-m", "profiling.bench", *_without(argv, "--nproc", "--network")]
    if opts.network != "loopback":
        ok, why = available()
        if ok:
            with VirtualCluster(ranks=opts.nproc, rate=opts.network) as cluster:
                probe = cluster.probe() if opts.nproc > 1 else None
                env["BENCH_NETWORK"] = json.dumps({"rate": opts.network, "probe": probe})
                return cluster.run(worker_args, env=env).returncode
        print(f"profiling.bench: no shaped network ({why}); running on loopback", file=sys.stderr)
    env["BENCH_NETWORK"] = json.dumps({"rate": "loopback"})
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += [f"--nproc-per-node={opts.nproc}", *worker_args]
    return subprocess.run(torchrun, env={**os.environ, **env}).returncode


def _without(argv: list[str], *flags: str) -> list[str]:
    """argv minus `flags` and their values: the workers don't need them, and torchrun's
    own parser rejects --nproc as an ambiguous abbreviation of its --nproc-per-node even
    after the module name."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out
