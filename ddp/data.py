"""Seeded synthetic data: every rank can make the same global batch and keep its slice,
so W ranks on b samples each see exactly the W*b samples one process would."""

from __future__ import annotations

import torch
from torch import nn


def split_batch(global_batch_size: int, rank: int, world_size: int) -> slice:
    """The samples of the global batch that `rank` trains on."""
    if global_batch_size % world_size:
        raise ValueError(
            f"global batch {global_batch_size} does not split over {world_size} ranks; "
            f"pick a multiple of {world_size}"
        )
    per_rank = global_batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def synthetic_batch(
    model: nn.Module, global_batch_size: int, step: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and class labels for `model`, the same on every rank for the same step."""
    from ddp.models import CNN, MLP, TinyTransformer

    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if isinstance(model, CNN):
        inputs = torch.randn(global_batch_size, 3, 32, 32, generator=gen)
        classes = model.head.out_features
    elif isinstance(model, TinyTransformer):
        vocab = model.embed.num_embeddings
        inputs = torch.randint(vocab, (global_batch_size, 8), generator=gen)
        classes = vocab
    elif isinstance(model, MLP):
        inputs = torch.randn(global_batch_size, model.layers[0].in_features, generator=gen)
        classes = model.layers[-1].out_features
    else:
        raise TypeError(f"no synthetic data for {type(model).__name__}")
    labels = torch.randint(classes, (global_batch_size,), generator=gen)
    return inputs, labels


def rank_batch(
    model: nn.Module, global_batch_size: int, step: int, rank: int, world_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step `step`'s global batch."""
    part = split_batch(global_batch_size, rank, world_size)
    inputs, labels = synthetic_batch(model, global_batch_size, step, seed)
    return inputs[part], labels[part]
