"""What each DDP wrapper adds to a training step's time and CPU, over the bare model:
`cli` measures (`python -m profiling.overhead --help`), `tables` does the paired
arithmetic and writes the tables."""
