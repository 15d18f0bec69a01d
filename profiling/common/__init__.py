"""What every group of `profiling` writes and draws with: how a result describes itself
(`report`: machine, command line, Markdown tables, JSON, figures), the step charts
(`charts`) and the models the size of those GPU papers measure DDP on (`sized_models`)."""
