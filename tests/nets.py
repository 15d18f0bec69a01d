"""The models the tests train: a family hypothesis can shape (NetSpec, Net, build_net) and
the small fixed models of the tests against torch's DistributedDataParallel."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# ---------------------------------------------------------------------------------------
# A model family hypothesis can shape.


@dataclass(frozen=True)
class NetSpec:
    d_in: int
    width: int
    d_out: int
    order: tuple[int, ...]  # hidden layers in the order forward applies them
    dtypes: tuple[str, ...] = ()  # per hidden layer
    frozen: tuple[bool, ...] = ()  # per hidden layer
    tied: bool = False  # one more layer sharing hidden[0]'s weight
    transposed: bool = False  # input weight stored transposed: a non-contiguous parameter
    unused: bool = False  # a trainable layer forward never calls (a bad input)


class TransposedLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in).t() / d_in**0.5)  # (d_in, d_out)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class Net(nn.Module):
    """Registration order is not the order forward runs the hidden layers in, so the
    order gradients become ready differs from reverse parameter order."""

    def __init__(self, spec: NetSpec):
        super().__init__()
        self.spec = spec
        linear = TransposedLinear if spec.transposed else nn.Linear
        self.inp = linear(spec.d_in, spec.width)
        self.hidden = nn.ModuleList(
            nn.Linear(spec.width, spec.width, dtype=getattr(torch, dt)) for dt in spec.dtypes
        )
        for layer, frozen in zip(self.hidden, spec.frozen, strict=True):
            layer.requires_grad_(not frozen)
        if spec.tied:
            self.twin = nn.Linear(spec.width, spec.width, dtype=self.hidden[0].weight.dtype)
            self.twin.weight = self.hidden[0].weight
        if spec.unused:
            self.unused = nn.Linear(spec.width, spec.width)
        self.out = nn.Linear(spec.width, spec.d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        layers = [self.hidden[i] for i in self.spec.order] + ([self.twin] if self.spec.tied else [])
        for layer in layers:
            h = torch.tanh(layer(h.to(layer.weight.dtype)))
        return self.out(h.float())


def build_net(spec: NetSpec, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(spec)


# ---------------------------------------------------------------------------------------
# Fixed models.

BRANCHES = 3


class Branchy(nn.Module):
    """A trunk, three branches and a head; forward runs only the branches it is told to,
    in the order it is told, as a router sends each batch to some experts."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.trunk = nn.Linear(3, 4)
        self.branches = nn.ModuleList(nn.Linear(4, 4) for _ in range(BRANCHES))
        self.head = nn.Linear(4, 2)
        if extra:
            self.extra = nn.Linear(4, 4)  # forward never calls it

    def forward(self, x: torch.Tensor, use: tuple[int, ...]) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        for k in use:
            h = torch.tanh(self.branches[k](h))
        return self.head(h)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)  # running_mean, running_var, num_batches_tracked
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


WIDTH, DEPTH = 16, 4  # Layers' shape
ONE_BUCKET_MB = 25.0  # a bucket cap over any of these models' gradients: one bucket


class Layers(nn.Module):
    """Four 16 x 16 layers. PowerSGD (rank 1) compresses each weight, 256 numbers sent as
    32, and sends the biases exact. A cap of exactly one layer's gradient bytes gives
    torch and the stages the same buckets, one layer each: torch closes a bucket once it
    reaches the cap, the stages before it would exceed it, and here both happen at the
    same parameter. PowerSGD draws its random projections per bucket, so its results
    depend on the layout; the test checks the layouts are torch's."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Wide(nn.Module):
    """Four 256 x 256 layers, 0.25 MiB of float32 gradient each: the candidate caps give
    from four buckets to one."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class UserNet(nn.Module):
    def __init__(self, unused: bool):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        if unused:
            self.spare = nn.Linear(8, 8)  # forward never calls it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


class TwoHeads(nn.Module):
    """Two heads on one input. Forward returns both, so both are reached by its outputs,
    even in a step whose loss uses only one."""

    def __init__(self):
        super().__init__()
        self.main = nn.Linear(3, 1)
        self.aux = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.main(x), self.aux(x)


class Gated(nn.Module):
    """A trunk with BatchNorm buffers, and two branches; forward skips branch b when told,
    which leaves its parameters unused in that step."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.norm = nn.BatchNorm1d(8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        return self.out(self.a(h) + self.b(h) if use_b else self.a(h))


class Bag(nn.Module):
    """A sparse embedding (its gradients are sparse tensors) and a dense head."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


class UsedTwice(nn.Module):
    """A layer used inside a reentrant checkpoint and again outside it: in one backward
    its gradient comes twice (the outer graph's, then the checkpoint's inner backward's),
    both before the first layer's, the last to come (without it, the last of all)."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = nn.Linear(3, 3) if first else nn.Identity()
        self.inner = nn.Linear(3, 3)
        self.out = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.inner, self.first(x).requires_grad_(), use_reentrant=True)
        return self.out(self.inner(h))
