"""A real-sized classification data set made offline, and its split over workers.

No download at run time: scikit-learn's `make_classification` generates the samples
(Guyon's Madelon design: Gaussian clusters on the vertices of a hypercube, informative,
redundant and noise features, a share of flipped labels) from a seed, the same on every
rank. scikit-learn's bundled `load_digits` is real but has 1,797 images: at a global
batch of 1,024 an epoch would be a single step, and 360 validation images resolve the
error only to about 0.3 points, too coarse to tell a matching large-batch run from a
slightly worse one. A generated set can be as large as the experiment needs.

The split is the paper's: one random permutation per epoch, cut into one disjoint part
per worker (`DistributedSampler` with `set_epoch`), each worker taking n samples per
iteration from its part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sklearn.datasets import make_classification
from torch.utils.data import DistributedSampler, TensorDataset


@dataclass
class Split:
    train: TensorDataset  # (inputs (N, features) float32, labels (N,) int64)
    val: TensorDataset


def classification_data(
    train_samples: int = 20_000,
    val_samples: int = 4_000,
    features: int = 32,
    classes: int = 10,
    seed: int = 0,
) -> Split:
    """make_classification, standardised with the training split's mean and std."""
    x, y = make_classification(
        n_samples=train_samples + val_samples,
        n_features=features,
        n_informative=features // 2,
        n_redundant=features // 4,
        n_classes=classes,
        n_clusters_per_class=2,
        class_sep=1.0,
        flip_y=0.02,  # label noise: an error floor no batch size can beat
        random_state=seed,
    )
    x = torch.as_tensor(x, dtype=torch.float32)
    y = torch.as_tensor(y, dtype=torch.int64)
    mean, std = x[:train_samples].mean(0), x[:train_samples].std(0)
    x = (x - mean) / std
    return Split(
        train=TensorDataset(x[:train_samples], y[:train_samples]),
        val=TensorDataset(x[train_samples:], y[train_samples:]),
    )


def worker_samplers(
    dataset_size: int, workers: int, first: int, count: int, seed: int
) -> list[DistributedSampler]:
    """Samplers for workers first .. first+count-1 of `workers`: a process that
    simulates several workers (gradient accumulation) holds one sampler per worker.
    drop_last: every worker gets the same number of samples, so no worker repeats any."""
    if not 0 <= first < first + count <= workers:
        raise ValueError(f"workers {first}..{first + count - 1} are not among {workers} workers")
    return [
        DistributedSampler(
            range(dataset_size),  # only len() is used: the sampler yields indices
            num_replicas=workers,
            rank=worker,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        for worker in range(first, first + count)
    ]


def epoch_batches(
    samplers: list[DistributedSampler], epoch: int, per_worker_batch: int
) -> list[list[torch.Tensor]]:
    """Per iteration, each sampler's n indices for `epoch`: result[i][j] is worker
    first+j's minibatch at iteration i. A worker's tail shorter than n is dropped."""
    parts = []
    for sampler in samplers:
        sampler.set_epoch(epoch)  # a new permutation each epoch, the same on all workers
        parts.append(torch.tensor(list(sampler), dtype=torch.int64))
    iterations = len(parts[0]) // per_worker_batch
    if iterations == 0:
        raise ValueError(
            f"each worker holds {len(parts[0])} samples per epoch, fewer than its batch of "
            f"{per_worker_batch}; use fewer workers or a smaller per-worker batch"
        )
    n = per_worker_batch
    return [[part[i * n : (i + 1) * n] for part in parts] for i in range(iterations)]
