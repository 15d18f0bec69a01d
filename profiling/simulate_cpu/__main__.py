"""python -m profiling.simulate_cpu {validate,gantt,buckets}: the simulator on the virtual
CPU cluster."""

from profiling.simulate.cli import main

COMMANDS = {
    "validate": "profiling.simulate_cpu.validate",
    "gantt": "profiling.simulate_cpu.gantt",
    "buckets": "profiling.simulate_cpu.buckets",
}

if __name__ == "__main__":
    main(commands=COMMANDS, prog="python -m profiling.simulate_cpu", description=__doc__)
