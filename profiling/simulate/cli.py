"""The command line: one subcommand per question the simulator answers.

python -m profiling.simulate scale     will my model scale on my cluster (1 to 256 GPUs)
python -m profiling.simulate buckets   which bucket_cap_mb, against torch's default layout
python -m profiling.simulate gantt     one simulated step, drawn
python -m profiling.simulate paper     the papers' scaling figures against the model
python -m profiling.simulate published published measurements against the model's predictions
python -m profiling.simulate accuracy  the loss the model leaves out, checked on held-out rows
python -m profiling.simulate shape     when each gradient is ready, measured on a GPU
python -m profiling.simulate validate  predictions against the virtual CPU cluster
                                       (profiling.simulate.cpu_cluster, which extends the model)
"""

from __future__ import annotations

import argparse
from types import ModuleType

from profiling.simulate import bucket_caps, gantt, scale, shape
from profiling.simulate.cpu_cluster import validate
from profiling.simulate.published import crossval, measurements, paper

# subcommand -> module with add_arguments(parser) and run(args). The core's commands, and
# the two checks of the model (each extends the core; the core imports neither).
COMMANDS: dict[str, ModuleType] = {
    "scale": scale,
    "buckets": bucket_caps,
    "gantt": gantt,
    "paper": paper,
    "published": measurements,
    "accuracy": crossval,
    "shape": shape,
    "validate": validate,
}


def main(
    argv: list[str] | None = None,
    commands: dict[str, ModuleType] = COMMANDS,
    prog: str = "python -m profiling.simulate",
    description: str = __doc__,
) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in commands.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    commands[args.command].run(args)
