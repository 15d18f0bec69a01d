"""The course's figure makers: each module draws or computes what a docs page shows, and
names the command that remakes it (`python -m profiling.course.<module> --help`).

- `timelines`, `pairs`: each stage's traced step on the shaped cluster;
- `simulated_steps`: the same steps as the step model draws them;
- `anatomy`: the data behind the page with sliders;
- `numbers`, `numbers_measure`: every figure the pages quote about the course's MLP, and
  the time of every command they give, measured by one command and rendered into the
  pages by the docs build;
- `ring_figure`, `drawings`: schematics no trace can show;
- `tensorboard_screenshot`: TensorBoard over traced runs;
- `backward_path`: which stage's method runs at each point of one gradient's path, the
  final class's page's table (the docs build renders it from a fresh trace).

They use the tools (`profiling.compare`, `profiling.cluster`, ...) and the simulator;
nothing below imports them."""
