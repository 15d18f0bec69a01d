"""The command line: run every training the settings ask for (on one process or under
torchrun), then print and write the results."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddp.dist import setup_process_group
from profiling.common.report import command_line, machine, read_json, write_json
from profiling.studies.large_batch.experiment import Run, run_all
from profiling.studies.large_batch.results import markdown, plot, summarise
from profiling.studies.large_batch.settings import Settings, parse_settings


def main(argv: list[str] | None = None) -> None:
    s = parse_settings(argv)
    if s.render:
        render(s.render, s.plot_prefix)
        return
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        setup_process_group("gloo")
        s = dataclasses.replace(s, jobs=1)  # the ranks are the parallelism
    rank = dist.get_rank() if distributed else 0
    # One thread per process: a micro-batch of 32 gains nothing from intra-op threads,
    # and two processes (jobs or ranks) already fill the two cores.
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        runs = run_all(s)
        wall_s = time.perf_counter() - start
        if rank != 0:
            return
        table = summarise(s, runs)
        world = dist.get_world_size() if distributed else 1
        note = f"torchrun, {world} ranks" if distributed else ""
        command = command_line("profiling.studies.large_batch", argv, note=note)
        report = markdown(s, table, runs, wall_s, command)
        print(report)
        print(f"wall time {wall_s:.1f} s")
        if s.json:
            Path(s.json).parent.mkdir(parents=True, exist_ok=True)
            m = machine()
            payload = {
                "settings": dataclasses.asdict(s),
                "world_size": world,
                "wall_s": wall_s,
                "machine": {"cpus": m["cores"], "torch": m["torch"]},
                "table": list(table.values()),
                "runs": [
                    {k: v for k, v in dataclasses.asdict(r).items() if k != "params"} for r in runs
                ],
            }
            write_json(s.json, payload)
        if s.markdown:
            Path(s.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(s.markdown).write_text(report)
        if s.plot_prefix:
            for path in plot(s, table, runs, s.plot_prefix):
                print(f"wrote {path}")
    finally:
        if distributed:
            dist.destroy_process_group()


def render(json_path: str, plot_prefix: str) -> None:
    """The figures again from a results file, with the settings it was run with; the
    Markdown is left alone (it names the machine and the wall time of the run)."""
    if not plot_prefix:
        raise SystemExit("--render needs --plot-prefix: where the figures go")
    payload = read_json(json_path, "profiling.studies.large_batch", "table")
    s = Settings(**{**payload["settings"], "plot_prefix": plot_prefix})
    table = {f"{row['workers']},{row['variant']}": row for row in payload["table"]}
    runs = [Run(**run) for run in payload["runs"]]
    for path in plot(s, table, runs, plot_prefix):
        print(f"wrote {path}")
