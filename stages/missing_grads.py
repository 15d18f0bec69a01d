"""Stage 5, missing_grads: a gradient missing on any rank is an error on every rank, not a hang.

Stage 3 raises when a parameter got no gradient, but only on the rank that missed it.
A rank's forward can skip a layer the others use (a data-dependent branch, an early
exit, a bug); that rank never fills the bucket, never launches its all-reduce, and the
other ranks, whose backward did produce the gradient, wait in that all-reduce for ever.

This stage keeps every rank in step whatever happened. At the end of backward it
completes every bucket, with zeros for the gradients that did not come, so every rank
issues the same all-reduces in the same order. Then one small all-reduce of a status
row per rank (which gradients were ready) tells every rank what went wrong where, and
every rank raises the same error, naming the parameters and the ranks. The process
group stays usable afterwards.

    torchrun --standalone --nproc-per-node 2 -m stages.missing_grads --model mlp

Cost: one all-reduce of W x n integers per synchronised backward (n: trainable
parameters). torch's DDP does not pay it: there, a gradient missing on one rank hangs
the others until the process group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import Bucket
from ddp.dist import collective_device
from stages.skip_sync import SkipSyncDDP

Status = dict[str, torch.Tensor]  # column name -> (W, width) for every rank, or (width,)


# --8<-- [start:construction]
class MissingGradsDDP(SkipSyncDDP):
    """Stage 5: every bucket completes on every rank; a missing gradient raises everywhere."""

    collectives = (*SkipSyncDDP.collectives, "all_reduce of the status")
    # The status row's columns, in order; "ready" has one entry per trainable parameter
    # (in `named_trainable` order): 1 if its gradient came in this backward.
    status_columns: tuple[str, ...] = ("ready",)

    def __init__(self, module: nn.Module, **options):
        super().__init__(module, **options)
        self.rank = dist.get_rank(self.process_group)
        # Each trainable parameter's position in the status row: its index in named_trainable.
        self._position = {id(p): k for k, (_, p) in enumerate(self.named_trainable)}

    @property
    def _slots(self) -> list[tuple[Bucket, int]]:
        """(bucket, index in it) of every trainable parameter, in status row order."""
        slots = {id(b.params[i]): (b, i) for b in self.buckets for i in range(len(b.params))}
        return [slots[id(p)] for _, p in self.named_trainable]

    @property
    def _collective_device(self) -> torch.device:
        """Where the small tensors of this model's own collectives (status rows, flags,
        orders) live: the buckets' device, which the group's backend sends. NCCL sends
        CUDA tensors only, and refuses a CPU one ("No backend type associated with
        device type cpu")."""
        if self.buckets:
            return self.buckets[0].buffer.device
        return collective_device(self.process_group)  # every parameter frozen: no buckets

    # --8<-- [end:construction]

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        slots = self._slots
        ready = torch.tensor([self._ready[b.index][i] for b, i in slots], dtype=torch.int32)
        # Complete every bucket, so that every rank issues the same all-reduces in the
        # same order and none can hang: what did not come adds the gradient the parameter
        # already holds (from no_sync() micro-batches), else zeros.
        for bucket, i in slots:
            if not self._ready[bucket.index][i]:
                self._mark_ready(bucket, i, bucket.params[i].grad)
        super()._finish_backward()  # waits for every bucket and copies the averages out
        status = self._exchange_status(self._status_row(ready))
        self._raise_on_every_rank(status)

    def _copy_in(self, bucket: Bucket, i: int, grad: torch.Tensor | None) -> None:
        if grad is None:  # missing here: adds zero to the sum, and we raise after it
            bucket.view_of(i).zero_()
        else:
            super()._copy_in(bucket, i, grad)

    def _copy_grad_out(self, param: nn.Parameter, average: torch.Tensor) -> None:
        if param.grad is not None:  # a missing gradient stays missing: the error follows
            super()._copy_grad_out(param, average)

    def _status_row(self, ready: torch.Tensor) -> Status:
        """This rank's row, by column."""
        return {"ready": ready}

    def _exchange_status(self, row: Status) -> Status:
        """Every rank's row, {column: (W, width)}, from this rank's; one all-reduce."""
        widths = [row[column].numel() for column in self.status_columns]
        status = torch.zeros(
            self.world_size, sum(widths), dtype=torch.int32, device=self._collective_device
        )
        status[self.rank] = torch.cat([row[c].reshape(-1) for c in self.status_columns])
        dist.all_reduce(status, group=self.process_group)
        return dict(zip(self.status_columns, status.cpu().split(widths, dim=1), strict=True))

    def _raise_on_every_rank(self, status: Status) -> None:
        names = [name for name, _ in self.named_trainable]
        absent = {
            r: [names[k] for k in (row == 0).nonzero().flatten().tolist()]
            for r, row in enumerate(status["ready"])
        }
        absent = {r: missing for r, missing in absent.items() if missing}
        if absent:
            where = "; ".join(f"rank {r}: {missing}" for r, missing in absent.items())
            raise RuntimeError(
                f"{type(self).__name__}: parameters got no gradient in this backward "
                f"({where}); {self._missing_advice()}"
            )

    def _missing_advice(self) -> str:
        return "freeze them with requires_grad_(False) if they should not train"

    # --8<-- [end:finish]


if __name__ == "__main__":
    from ddp.train import main

    main(MissingGradsDDP)
