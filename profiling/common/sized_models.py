"""Models the size of two that GPU papers measure DDP on, written out here so that no
model zoo is needed: ResNet-50 (He et al.; Li et al. and Goyal et al. train it) and
GPT-2 small (Radford et al.; a transformer of the size BERT-base and GPT-2 share).

They are for timing a wrapper's cost on a GPU (`python -m profiling.overhead --model
resnet50`), where the parameter count and the number and sizes of parameters are what
matter; and, built on the meta device, for the simulator's presets
(`profiling.simulate.presets`), where each gradient's size and FLOPs are. `resnet50()` is
torchvision's ResNet-50, 25.6M parameters in 161 tensors (and ResNet-101, ResNeXt by its
arguments); `gpt2_small()` 124M in 148 tensors (its output projection tied to the token
embedding), as Hugging Face's GPT-2."""

from __future__ import annotations

import torch
from torch import nn

# ResNet: torchvision's definition (v1.5: the stride on the 3x3 convolution), written in
# plain torch because torchvision's wheels on the package index are CUDA builds. The
# parameter names are torchvision's; tests/test_simulate_presets.py checks the counts
# against torchvision's documented ones (25,557,032 for ResNet-50) and the FLOP counter's
# against its 4.09 GFLOPS (torchvision's model table counts multiply-adds, as "GFLOPS").
RESNET_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with BatchNorm, and a projected shortcut
    (`downsample`) where the shape changes: ResNet's block, ResNeXt's with `groups`."""

    def __init__(
        self, cin: int, planes: int, stride: int, groups: int = 1, width_per_group: int = 64
    ):
        super().__init__()
        cout = planes * 4
        width = int(planes * width_per_group / 64) * groups  # torchvision's rule
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet of `depth` (50, 101, 152) on 3x224x224 images, 1000 classes; ResNeXt by
    `groups` and `width_per_group`, as torchvision's."""

    def __init__(self, depth: int = 50, groups: int = 1, width_per_group: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        widths, strides = (64, 128, 256, 512), (1, 2, 2, 2)
        for i, (width, blocks, stride) in enumerate(
            zip(widths, RESNET_BLOCKS[depth], strides, strict=True), start=1
        ):
            layer = []
            for b in range(blocks):
                first = stride if b == 0 else 1
                layer.append(Bottleneck(cin, width, first, groups, width_per_group))
                cin = width * 4
            setattr(self, f"layer{i}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(
    device: str | None = None, depth: int = 50, groups: int = 1, width_per_group: int = 64
) -> nn.Module:
    """torchvision.models.resnet50() (or resnet101, resnet152 by `depth`; ResNeXt by
    `groups` and `width_per_group`, as torchvision's), untrained, built on `device` (by
    default, torch's default device; meta: shapes only)."""
    if device is None:
        return ResNet(depth, groups, width_per_group)
    with torch.device(device):
        return ResNet(depth, groups, width_per_group)


def resnet101(device: str | None = None) -> nn.Module:
    """torchvision.models.resnet101(), untrained, built on `device` (by default, torch's
    default device)."""
    return resnet50(device, depth=101)


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
