"""`python -m profiling.collectives`: see the package's docstring, or --help."""

import sys

from profiling.collectives.cli import main

if __name__ == "__main__":
    sys.exit(main())
