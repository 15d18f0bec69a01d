"""A step-time simulator for data-parallel training, in one wing.

- The core, the modules of this package: the step model (`schedule`), clusters and
  all-reduce costs (`topology`, `clusters`, `presets`), the user's model (`usermodel`,
  `shape`, `model_args`), bucket layouts (`layouts`) and the commands built on them
  (`scale`, `bucket_caps`, `gantt`). It imports neither of the checks below nor `stages`
  (cli and __main__ aside, which name every command).
- `cpu_cluster`: the model checked against the virtual CPU cluster, extending the core
  through `schedule.Sharing`;
- `published`: the model against published measurements (torch's own DDP benchmark,
  Goyal et al., Li et al.), with the papers' figures in one place.

`cli` is the wing's command line (`python -m profiling.simulate --help`)."""
