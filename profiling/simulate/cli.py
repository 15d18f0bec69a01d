"""The command line: one subcommand per question the simulator answers.

python -m profiling.simulate validate [--quick]   predictions against the virtual cluster
python -m profiling.simulate gantt                 the simulated step of each stage, drawn
python -m profiling.simulate scale                 efficiency from 8 to 256 GPUs
python -m profiling.simulate paper                 the papers' figures against the model
python -m profiling.simulate buckets               where torch's default layout loses most
python -m profiling.simulate repeat                one validate run's measurement against another's
python -m profiling.simulate shape                 when each gradient is ready, on a GPU
python -m profiling.simulate pace                  what the compute, timed before, misses
"""

from __future__ import annotations

import argparse
import importlib

# subcommand -> module with add_arguments(parser) and run(args). Building the parser
# imports all of them, so each keeps its module-level imports light (torch, the virtual
# cluster and matplotlib are imported inside run).
COMMANDS = {
    "validate": "profiling.simulate.validate",
    "gantt": "profiling.simulate.gantt",
    "scale": "profiling.simulate.scale",
    "paper": "profiling.simulate.paper",
    "buckets": "profiling.simulate.buckets",
    "repeat": "profiling.simulate.repeat",
    "shape": "profiling.simulate.shape",
    "pace": "profiling.simulate.pace",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m profiling.simulate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    importlib.import_module(COMMANDS[args.command]).run(args)
