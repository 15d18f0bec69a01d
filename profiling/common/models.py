"""Models the size of two that GPU papers measure DDP on, written out here so that no
model zoo is needed: ResNet-50 (He et al.; Li et al. and Goyal et al. train it) and
GPT-2 small (Radford et al.; a transformer of the size BERT-base and GPT-2 share).

They are for timing a wrapper's cost on a GPU (`python -m profiling.overhead --model
resnet50`): the parameter count and the number and sizes of parameters are what matter
there, not the exact architecture. `resnet50()` has 25.6M parameters in 161 tensors, as
torchvision's; `gpt2_small()` 124M in 148 tensors (its output projection tied to the
token embedding), as Hugging Face's GPT-2."""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with BatchNorm, and a projected shortcut where the
    shape changes: ResNet-50's block."""

    def __init__(self, fan_in: int, width: int, stride: int):
        super().__init__()
        out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(fan_in, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or fan_in != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(fan_in, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet50(classes: int = 1000) -> nn.Module:
    """ResNet-50 on 3x224x224 images: stages of 3, 4, 6 and 3 bottlenecks."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    fan_in = 64
    for blocks, width, stride in ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(fan_in, width, stride if b == 0 else 1))
            fan_in = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(fan_in, classes)]
    return nn.Sequential(*layers)


class GPT2Small(nn.Module):
    """12 pre-norm transformer blocks of width 768 (12 heads, MLP 3072, GELU), learned
    positions for 1024 tokens, a 50,257-token vocabulary; the output projection is the
    token embedding (tied), so that parameter gets gradient from two places."""

    def __init__(self, vocab: int = 50257, positions: int = 1024, dim: int = 768):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(positions, dim)
        for table in (self.tokens, self.positions):
            nn.init.normal_(table.weight, std=0.02)  # GPT-2's: logits start near uniform
        block = lambda: nn.TransformerEncoderLayer(  # noqa: E731
            dim, 12, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.ModuleList(block() for _ in range(12))
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(positions))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (B, T) -> logits (B, T, vocab)
        t = ids.shape[1]
        x = self.tokens(ids) + self.positions.weight[:t]
        for block in self.blocks:
            x = block(x, src_mask=self.causal[:t, :t], is_causal=True)
        return self.norm(x) @ self.tokens.weight.T


def gpt2_small() -> nn.Module:
    return GPT2Small()


def example_batch(
    name: str, batch_size: int, device: torch.device, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for `name`: 224x224 images and class labels, or 512 token ids
    and the next ones."""
    if name == "resnet50":
        images = torch.randn(batch_size, 3, 224, 224, generator=generator)
        labels = torch.randint(0, 1000, (batch_size,), generator=generator)
        return images.to(device), labels.to(device)
    ids = torch.randint(0, 50257, (batch_size, 513), generator=generator)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def loss_of(name: str, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if name == "resnet50":
        return nn.functional.cross_entropy(output, targets)
    return nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten())


SIZED = {"resnet50": resnet50, "gpt2_small": gpt2_small}
