"""`python -m profiling.overhead`: see `profiling.overhead.cli`, or --help."""

from profiling.overhead.cli import main

main()
