"""Optimizer parameter groups with no weight decay on normalisation layers and biases.

Goyal et al. (arXiv 1706.02677, section 5.1) do not apply weight decay to BatchNorm's
learnable scale and shift (gamma, beta); later large-batch recipes leave every bias out
too. These are few parameters, each a per-channel scale or offset, and shrinking them
towards 0 is not the capacity control that weight decay on the weights is meant to be.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

NORMS = (_NormBase, nn.LayerNorm, nn.GroupNorm)  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d


def no_decay_param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups for torch.optim: weights with `weight_decay`, and the parameters of
    normalisation layers plus every bias with 0. Frozen parameters are left out; a
    parameter shared by two modules appears once (its first owner decides)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for owner in module.modules():
        for name, p in owner.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            exempt = isinstance(owner, NORMS) or name == "bias"
            (no_decay if exempt else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
