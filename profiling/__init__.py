"""Profiling, benchmarking and simulating the stages, grouped by role.

The tools a user runs (`python -m profiling.<tool> --help`):
- `compare`: trace every stage on one workload and say where each step's time goes;
- `bench`: step times against torch's DDP and compute-only, interleaved;
- `overhead`: the CPU each wrapper adds per step;
- `cluster`: a shaped network of namespaces on one machine;
- `collectives`: what each all-reduce algorithm costs, measured and modelled.

The groups:
- `analysis`: reading torch.profiler traces (compare's engine);
- `common`: what every group writes and draws with;
- `simulate`: the step simulator, its core, and its checks against the CPU cluster
  (`simulate.cpu_cluster`) and published measurements (`simulate.published`);
- `course`: the figure makers of the docs' course;
- `studies`: experiments behind the docs.

Layers: `common` and `analysis` below the tools, the tools below the simulator, and the
simulator below the course and the studies; the simulator's core imports neither its
checks nor `stages` (tests/test_layout.py)."""
