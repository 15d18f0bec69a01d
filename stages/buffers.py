"""Stage 6, buffers: module buffers (BatchNorm's running statistics) follow rank 0.

Gradients are averaged, so parameters stay identical; buffers are not gradients.
BatchNorm updates its running mean and variance from each rank's own slice of the
batch, so without help every replica ends up with different statistics, and the
model evaluated on rank 0 is not the one on rank 1. With `broadcast_buffers=True`
(torch's default) rank 0's buffers are broadcast to every rank before each forward,
as torch's DDP does. Training itself still normalises with each rank's own batch
statistics (the per-worker BatchNorm of Goyal et al.); only the running estimates,
used at evaluation, are rank 0's. `broadcast_buffers=False` keeps them per rank.

    torchrun --standalone --nproc-per-node 2 -m stages.buffers --model cnn

As in torch's DDP, buffers are broadcast at a forward only when the forward before it
synchronised (not after one inside `no_sync()`): the flag is
`require_forward_param_sync`. Cost: one broadcast per dtype of buffer per forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddp.dist import broadcast_module_states
from stages.unused_params import UnusedParamsDDP


# --8<-- [start:construction]
class BuffersDDP(UnusedParamsDDP):
    """Stage 6: `broadcast_buffers`: rank 0's buffers on every rank before forward."""

    def __init__(self, module: nn.Module, *, broadcast_buffers: bool = True, **options):
        self.broadcast_buffers = broadcast_buffers  # before super(): its broadcast reads it
        super().__init__(module, **options)
        self.require_forward_param_sync = True  # torch DDP's name

    def _broadcast_initial_states(self) -> None:
        # As torch's DDP: with broadcast_buffers=False each rank keeps its own buffers
        # from the start, not only after it.
        broadcast_module_states(self.module, self.process_group, buffers=self.broadcast_buffers)

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers and self.require_forward_param_sync:
            self._broadcast_buffers()
        output = super().forward(*inputs, **kwargs)
        # The next forward broadcasts only if this one will synchronise its backward.
        self.require_forward_param_sync = (
            torch.is_grad_enabled() and self.require_backward_grad_sync
        )
        return output

    def _broadcast_buffers(self, src: int = 0) -> None:
        """Every buffer of the module from group rank `src`, one broadcast per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self.module.buffers():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        for buffers in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in buffers])
            dist.broadcast(flat, group=self.process_group, group_src=src)
            offset = 0
            with torch.no_grad():
                for b in buffers:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()

    # --8<-- [end:forward]


if __name__ == "__main__":
    from ddp.train import main

    main("buffers")
