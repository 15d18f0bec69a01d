"""The models the stages are run and tested on. Each is small by default and sized by
arguments; `build_model` is what the command line and the benchmarks call."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ModelChoice(Protocol):
    """What of a `ddp.config.Config` picks a rank's model (Config imports this module)."""

    model: str
    width: int
    depth: int
    seed: int


class MLP(nn.Module):
    """`depth` linear layers of `width` units. width=2048, depth=7 is ~25M parameters."""

    def __init__(self, in_features: int = 32, width: int = 64, depth: int = 3, classes: int = 10):
        super().__init__()
        sizes = [in_features] + [width] * (depth - 1) + [classes]
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class CNN(nn.Module):
    """A small CNN with BatchNorm on 3x32x32 images: many small parameters, which is
    where per-parameter all-reduce hurts most."""

    def __init__(self, channels: int = 32, classes: int = 10):
        super().__init__()
        blocks: list[nn.Module] = []
        fan_in = 3
        for fan_out in (channels, channels, 2 * channels, 2 * channels, 4 * channels):
            blocks += [
                nn.Conv2d(fan_in, fan_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(fan_out),
                nn.ReLU(),
            ]
            if fan_out != fan_in and fan_in != 3:
                blocks.append(nn.MaxPool2d(2))
            fan_in = fan_out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(fan_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, 32, 32)
        return self.head(self.features(x).mean(dim=(2, 3)))


class TinyTransformer(nn.Module):
    """One pre-norm transformer block over token ids, with the output projection tied
    to the embedding: one parameter that receives gradient from two places."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T)
        hidden = self.norm(self.block(self.embed(tokens)))  # (B, T, dim)
        return self.out(hidden[:, -1])  # predict the next token after the sequence


class FrozenMLP(MLP):
    """An MLP whose first layer is frozen (fine-tuning): its parameters need no
    gradient and no all-reduce, but must still start identical on every rank."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.layers[0].requires_grad_(False)


MODELS = {"mlp": MLP, "cnn": CNN, "transformer": TinyTransformer, "frozen": FrozenMLP}


def build_model(name: str, width: int = 64, depth: int = 3) -> nn.Module:
    """Build model `name`; `width` and `depth` size the MLPs (ignored by the others)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; pick one of {sorted(MODELS)}")
    if name in ("mlp", "frozen"):
        return MODELS[name](in_features=width, width=width, depth=depth)
    return MODELS[name]()


def rank_model(cfg: ModelChoice, rank: int) -> nn.Module:
    """`cfg`'s model as rank `rank` builds it: seeded per rank on purpose, so the
    replicas start different and the wrapper must make them identical."""
    torch.manual_seed(cfg.seed * 1000 + rank)
    return build_model(cfg.model, width=cfg.width, depth=cfg.depth)
