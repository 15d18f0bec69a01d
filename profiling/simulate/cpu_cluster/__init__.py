"""The simulator on the virtual CPU cluster: what a laptop's two shared cores add to the
step model (`profiling.simulate.schedule`), calibrated, and checked against measured
steps. It extends the model through `schedule.Sharing` and changes nothing in it.

- `sharing`: how backward and Gloo's collectives slow each other on shared cores, and a
  stage's own time (its copies, its Python), as a `Sharing`;
- `calibration`: the model inputs of one (rate, world size), measured (`calibrate`),
  fitted and loaded (`Calibration`); `contention`, the slowdowns fitted in it;
- `worker` and `measure`: what the calibration times on every rank, in order; `inputs`,
  the compute;
- `predict`, `analyse`, `validation_tables` and `validate`: the grid's runs predicted,
  measured, compared and written up (`python -m profiling.simulate validate`);
- `bucket_layouts`: where torch's default bucket layout loses on some MLPs.

    python -m profiling.simulate.cpu_cluster {validate,buckets} --help
"""
