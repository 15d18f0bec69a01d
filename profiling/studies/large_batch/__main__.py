"""`python -m profiling.studies.large_batch`: see the package's docstring, or --help."""

from profiling.studies.large_batch.cli import main

if __name__ == "__main__":
    main()
