"""The command line: one subcommand per question the simulator answers.

python -m profiling.simulate scale     will my model scale on my cluster (1 to 256 GPUs)
python -m profiling.simulate buckets   which bucket_cap_mb, against torch's default layout
python -m profiling.simulate gantt     one simulated step, drawn
python -m profiling.simulate paper     the papers' scaling figures against the model
python -m profiling.simulate published published measurements against the model's predictions
python -m profiling.simulate shape     when each gradient is ready, measured on a GPU
python -m profiling.simulate validate  predictions against the virtual CPU cluster
                                       (profiling.simulate_cpu, which extends the model)
"""

from __future__ import annotations

import argparse
import importlib

# subcommand -> module with add_arguments(parser) and run(args). Building the parser
# imports all of them, so each keeps its module-level imports light (torch, the virtual
# cluster and matplotlib are imported inside run).
COMMANDS = {
    "scale": "profiling.simulate.scale",
    "buckets": "profiling.simulate.buckets",
    "gantt": "profiling.simulate.gantt",
    "paper": "profiling.simulate.paper",
    "published": "profiling.simulate_published.compare",
    "shape": "profiling.simulate.shape",
    "validate": "profiling.simulate_cpu.validate",
}


def main(
    argv: list[str] | None = None,
    commands: dict[str, str] = COMMANDS,
    prog: str = "python -m profiling.simulate",
    description: str = __doc__,
) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in commands.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    importlib.import_module(commands[args.command]).run(args)
