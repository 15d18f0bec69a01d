"""Stage 4, skip_sync: `no_sync()` accumulates gradients locally, with no communication.

With gradient accumulation, averaging after every micro-batch is wasted work: only the
sum over the micro-batches matters. Inside `no_sync()`, backward leaves gradients in
`.grad` to accumulate; the first backward outside it all-reduces the accumulated sum
(the paper's section 3.2.4). As in torch's DDP, the flag `require_backward_grad_sync`
is read at forward time: a backward syncs or not according to the forward that built it.

    torchrun --standalone --nproc-per-node 2 -m stages.skip_sync --model mlp

    with model.no_sync():
        for x, y in micro_batches[:-1]:
            loss_fn(model(x), y).backward()  # local accumulation only
    loss_fn(model(x_last), y_last).backward()  # all-reduces the sum

Cost: replicas hold different gradients between synchronisations (parameters stay
identical, since the optimizer only steps after a synced backward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from stages.overlapped import OverlappedDDP


# --8<-- [start:construction]
class SkipSyncDDP(OverlappedDDP):
    """Stage 4: overlapped buckets, plus `no_sync()` for gradient accumulation."""

    def __init__(self, module: nn.Module, **options):
        super().__init__(module, **options)
        self.require_backward_grad_sync = True  # torch DDP's name; no_sync() clears it

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward inside accumulate gradients locally; no collective runs."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        # Read at forward time, once, as torch does: the backward that follows syncs, or
        # only notes its gradients and leaves them in .grad, to sum up.
        if self.require_backward_grad_sync:
            return super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled() and self._backward.syncs:  # the first micro-batch
            self._prepare_for_backward(syncs=False)  # one for every micro-batch till a sync
        return self.module(*inputs, **kwargs)

    # --8<-- [end:forward]


if __name__ == "__main__":
    from ddp.train import main

    main(SkipSyncDDP)
