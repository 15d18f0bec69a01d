"""Stage 7, buffers: module buffers (BatchNorm's running statistics) follow rank 0.

Gradients are averaged, so parameters stay identical; buffers are not gradients.
BatchNorm updates its running mean and variance from each rank's own slice of the
batch, so without help every replica ends up with different statistics, and the
model evaluated on rank 0 is not the one on rank 1. With `broadcast_buffers=True`
(torch's default) rank 0's buffers are broadcast to every rank before each forward,
as torch's DDP does. Training itself still normalises with each rank's own batch
statistics (the per-worker BatchNorm of Goyal et al.); only the running estimates,
used at evaluation, are rank 0's. `broadcast_buffers=False` keeps them per rank. The
stages before this one leave buffers alone, at construction too.

    torchrun --standalone --nproc-per-node 2 -m stages.buffers --model cnn

As in torch's DDP, buffers are broadcast at a forward only when the forward before it
synchronised (not after one inside `no_sync()`): the flag is
`require_forward_param_sync`. Cost: one broadcast per dtype of buffer per forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp.dist import broadcast_buffers
from stages.unused_params import UnusedParamsDDP


# --8<-- [start:construction]
class BuffersDDP(UnusedParamsDDP):
    """Stage 7: `broadcast_buffers`: rank 0's buffers on every rank before forward."""

    def __init__(self, module: nn.Module, *, broadcast_buffers: bool = True, **options):
        super().__init__(module, **options)
        self.broadcast_buffers = broadcast_buffers
        self.require_forward_param_sync = True  # torch DDP's name
        self._module_buffers = list(module.buffers())  # listed once, as torch's DDP does
        self._broadcast_initial_buffers()

    def _broadcast_initial_buffers(self) -> None:
        # As torch's DDP: with broadcast_buffers=False each rank keeps its own buffers
        # from the start, not only after it.
        if self.broadcast_buffers:
            broadcast_buffers(self.module, self.process_group)

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        if self._buffers_due():
            self._broadcast_buffers()
        output = super().forward(*inputs, **kwargs)
        # The next forward broadcasts only if this one will synchronise its backward.
        self.require_forward_param_sync = (
            torch.is_grad_enabled() and self.require_backward_grad_sync
        )
        return output

    def _buffers_due(self) -> bool:
        """Whether this forward starts with one rank's buffers: the option is on, the
        forward before it synchronised (torch's rule), and the module has buffers."""
        return (
            self.broadcast_buffers
            and self.require_forward_param_sync
            and bool(self._module_buffers)
        )

    def _broadcast_buffers(self, src: int = 0) -> None:
        """Every buffer of the module from group rank `src`, one broadcast per dtype."""
        broadcast_buffers(self.module, self.process_group, src, buffers=self._module_buffers)

    # --8<-- [end:forward]


if __name__ == "__main__":
    from ddp.train import main

    main(BuffersDDP)
