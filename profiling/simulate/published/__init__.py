"""The step model against measurements others published: torch's own DDP benchmark,
Goyal et al. and Li et al. (`python -m profiling.simulate published`), the papers'
figures each held once in `sources`. Kept apart from the model (`profiling.simulate`),
which reads in one sitting without it."""
