"""python -m profiling.simulate.cpu_cluster {validate,buckets}: the simulator on the virtual
CPU cluster."""

from profiling.simulate.cli import main
from profiling.simulate.cpu_cluster import bucket_layouts, validate

COMMANDS = {"validate": validate, "buckets": bucket_layouts}  # subcommand -> its module

if __name__ == "__main__":
    main(commands=COMMANDS, prog="python -m profiling.simulate.cpu_cluster", description=__doc__)
