"""`python -m profiling.large_batch`: see the package's docstring, or --help."""

from profiling.large_batch.cli import main

if __name__ == "__main__":
    main()
