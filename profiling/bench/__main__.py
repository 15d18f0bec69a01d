"""`python -m profiling.bench`: see the package's docstring, or --help."""

from profiling.bench.launch import main

if __name__ == "__main__":
    main()
