"""Stage 1, naive: after backward, one all-reduce per parameter gradient.

The whole idea of data parallelism in one file: every rank holds a full replica,
trains on its own slice of the batch, and averages gradients with the others before
the optimizer step, so the replicas stay identical.

    torchrun --standalone --nproc-per-node 2 -m stages.naive --model mlp --steps 20

Cost: one collective per parameter, each paying the full latency of a round trip, and
none of it starts until backward has finished.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from ddp.dist import broadcast_module_states, check_same_parameters, require_process_group
from ddp.spans import allreduce_span


# --8<-- [start:construction]
class NaiveDDP(nn.Module):
    """Stage 1: all-reduce every parameter's gradient after backward."""

    # What one synchronised backward sends, in order, as the test suite checks it (its
    # property 4): one all-reduce per trainable parameter. Later stages change this.
    collectives: tuple[str, ...] = ("all_reduce per parameter",)

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.process_group = require_process_group(process_group)
        self.world_size = dist.get_world_size(self.process_group)
        check_same_parameters(module, self.process_group)
        self._broadcast_initial_states()
        # Tied weights appear once in named_parameters(), so each gradient is sent once.
        self.named_trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._awaiting_sync = False  # a forward ran whose gradients are not yet averaged

    def _broadcast_initial_states(self) -> None:
        """Rank 0's parameters, to every rank (the buffers stage adds buffers)."""
        broadcast_module_states(self.module, self.process_group, buffers=False)

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled():
            if self._awaiting_sync:
                self._forward_before_sync()
            self._awaiting_sync = True
        return self.module(*inputs, **kwargs)

    def _forward_before_sync(self) -> None:
        """A forward while the one before it still waits for its synchronisation: most
        likely a forgotten backward or finish, so an error."""
        raise RuntimeError(
            f"{type(self).__name__}: forward called again before "
            "finish_gradient_synchronization(); call it after each loss.backward()"
        )

    # --8<-- [end:forward]

    # --8<-- [start:finish]
    @torch.no_grad()  # a gradient made with create_graph=True is averaged outside its graph
    def finish_gradient_synchronization(self) -> None:
        """Average every gradient over the ranks. Call after loss.backward()."""
        self._start_synchronization()
        for name, param in self.named_trainable:
            # Itself, unless transposed (NCCL needs contiguous tensors); a sparse gradient
            # (nn.Embedding(sparse=True)) travels as it is.
            grad = param.grad if param.grad.is_sparse else param.grad.contiguous()
            nbytes = grad.numel() * grad.element_size()
            with record_function(allreduce_span(name, nbytes)):  # a span in traces
                dist.all_reduce(grad, group=self.process_group)  # the sum, in place
            # sum -> mean (each rank's loss is a local mean), back into .grad if a copy
            param.grad.copy_(grad.div_(self.world_size))

    # --8<-- [end:finish]

    def _start_synchronization(self) -> None:
        """Check that a backward happened and every gradient exists, before any collective.

        A missing gradient would otherwise hang the other ranks in a collective this rank
        never joins (or silently leave a stale gradient in place)."""
        if not self._awaiting_sync:
            raise RuntimeError(
                f"{type(self).__name__}: finish_gradient_synchronization() called without a "
                "forward and backward before it (or twice for the same backward)"
            )
        self._awaiting_sync = False
        missing = [name for name, p in self.named_trainable if p.grad is None]
        if len(missing) == len(self.named_trainable):
            raise RuntimeError(
                f"{type(self).__name__}: finish_gradient_synchronization() called after "
                "forward but before loss.backward(): no parameter has a gradient"
            )
        if missing:
            raise RuntimeError(
                f"{type(self).__name__}: parameters {missing} got no gradient in this backward "
                f"on rank {dist.get_rank(self.process_group)}; every trainable parameter must take "
                "part in the loss (freeze it with requires_grad_(False) if it should not train)"
            )


if __name__ == "__main__":
    from ddp.train import main

    main(NaiveDDP)
