"""What frameworks and torch's autograd reach inside torch's DDP, for a wrapper written
in Python: the reducer's methods they call (`model.reducer`), and the node on forward's
outputs whose backward starts a step's synchronisation in the right graph task."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


class Sink(torch.autograd.Function):
    """Passes forward's tensors through (copies, as torch's _DDPSink makes them: an
    output may then be modified in place); its backward queues the wrapper's
    end-of-backward callback in the graph task of the backward the user called."""

    @staticmethod
    def forward(ctx, ddp: weakref.ref, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)  # a gradient that is None stays None
        ctx.ddp = ddp
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ddp = ctx.ddp()
        if ddp is not None and ddp._backward.prepared:
            ddp._start_backward()
        return (None, *grads)


def flatten(output) -> tuple[list[torch.Tensor], Callable]:
    """The tensors in `output` (nested lists, tuples, dicts) and a function that puts
    replacements back in their places."""
    leaves, spec = tree_flatten(output)
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuild(tensors):
        for i, t in zip(where, tensors, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    return [leaves[i] for i in where], rebuild


class Reducer:
    """The methods of torch's C++ reducer that frameworks call on `model.reducer`."""

    def __init__(self, ddp: nn.Module):
        self._ddp = weakref.ref(ddp)

    def prepare_for_backward(self, outputs: list[torch.Tensor] | torch.Tensor) -> None:
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        self._ddp()._prepare_for_synced_backward(outputs)

    def _rebuild_buckets(self) -> bool:
        """Here buckets are rebuilt at the next synchronised forward, on every rank
        together (stage rebuilt_buckets): nothing to do now, nothing rebuilt now."""
        return False

    def _delay_all_reduce(self) -> None:
        """torch's reducer delays static_graph's first all-reduces to the end of
        backward and a framework may flush them; here every backward, the first too,
        is synchronised by its own end-of-backward callback: nothing is delayed."""

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        self._ddp()._set_ddp_runtime_logging_sample_rate(sample_rate)
