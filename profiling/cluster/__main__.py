"""`python -m profiling.cluster`: see the package's docstring, or --help."""

import sys

from profiling.cluster.cli import main
from profiling.cluster.signals import Interrupted

if __name__ == "__main__":
    try:
        sys.exit(main())
    except Interrupted as stop:
        sys.exit(128 + stop.signum)
    except KeyboardInterrupt:
        sys.exit(130)
