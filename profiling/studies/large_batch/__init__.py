"""Large minibatches: the linear scaling rule and warmup, reproduced small.

Goyal et al. (arXiv 1706.02677) train ResNet-50 on ImageNet with k workers of n = 32
images and keep the small-batch error up to k*n = 8k by (1) scaling the learning rate
linearly with k*n and (2) warming it up gradually over the first epochs; beyond 8k the
error rises. This module trains one small BatchNorm MLP on an offline-generated
classification set (data.py) for a fixed number of epochs at several global
batches k*n, each with four learning-rate rules:

    unscaled   base_lr at every batch size (no scaling rule), then the decay
    no_warmup  the scaled rate base_lr * k*n / reference_batch from the first step
    gradual    the scaled rate, reached from base_lr by a constant increment per step
    constant   base_lr during the warmup epochs, then the scaled rate

and reports the final validation error, mean and std over seeds, with training curves.

    .venv/bin/python -m profiling.studies.large_batch --json out.json --markdown out.md \
        --plot-prefix out/large-batch

On one process (the default) each of the k workers is simulated by one micro-batch of
gradient accumulation: its own BatchNorm statistics over its n samples, its own slice of
the epoch's permutation, its loss summed and divided by k*n. `--jobs` runs independent
trainings side by side (one per core). Under torchrun, W ranks each simulate k/W
workers, accumulating under `no_sync()` and synchronising once per step with the
skip_sync stage; BatchNorm buffers stay per rank, and rank 0 evaluates and writes:

    torchrun --standalone --nproc-per-node 2 -m profiling.studies.large_batch \
        --workers 2,8 --seeds 1

Same loss normalisation (sum / (k*n): the stage averages over W ranks of sum / (k/W * n)),
same data split, same model: only where the micro-batches run differs.

`--checkpoint-dir DIR` checkpoints every run in a folder of its own, and a command started
again goes on where it stopped (docs/when-a-rank-dies.md).

The package: `settings` (the options), `lr` (the learning-rate rules), `param_groups`
(no weight decay on normalisation layers and biases), `data` (the data set and its
split over workers), `experiment` (the model and one training run per k, rule and
seed), `checkpoints` (each run's, through ddp/checkpoint.py), `results` (the table and
the figures) and `cli`.
"""
