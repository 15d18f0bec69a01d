"""Stage 5, missing_grads: a gradient missing on any rank is an error on every rank, not a hang.

Stage 3 raises when a parameter got no gradient, but only on the rank that missed it.
A rank's forward can skip a layer the others use (a data-dependent branch, an early
exit, a bug); that rank never fills the bucket, never launches its all-reduce, and the
other ranks, whose backward did produce the gradient, wait in that all-reduce for ever.

This stage keeps every rank in step whatever happened. At the end of backward it
completes every bucket, with zeros for the gradients that did not come, so every rank
issues the same all-reduces in the same order. The last bucket carries a status after
its gradients, summed over the ranks with them: how many gradients each rank missed. In
the common case it is zero and that is all; otherwise every rank sends which gradients
it had (one more all-reduce), and every rank raises the same error, naming the
parameters and the ranks. The process group stays usable afterwards.

    torchrun --standalone --nproc-per-node 2 -m stages.missing_grads --model mlp

Cost: a few numbers more in the last bucket's all-reduce, and reading them back once
per synchronised backward (on a GPU, a wait for the last bucket). torch's DDP does not
pay it: there, a gradient missing on one rank hangs the others until the process
group's timeout. A comm hook would see the status in the bucket: with one registered it
travels in a small all-reduce of its own, right after the last bucket.
"""

from __future__ import annotations

import operator
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import Bucket
from ddp.dist import collective_device
from stages.bucketed import BucketedDDP
from stages.skip_sync import SkipSyncDDP

Status = dict[str, torch.Tensor]  # column name -> (W, width) for every rank
# `x is None`, without a Python frame (`None in tensors` would compare each with ==).
_is_none = partial(operator.is_, None)


# --8<-- [start:construction]
class MissingGradsDDP(SkipSyncDDP):
    """Stage 5: every bucket completes on every rank; a missing gradient raises everywhere."""

    # Where the status rides in the last bucket (below), its all-reduce is that bucket's.
    collectives = (*SkipSyncDDP.collectives, "all_reduce of the status")
    # The status, summed over ranks every synchronised backward, by column, each one
    # number wide: "missing", how many gradients did not come. Later stages add columns.
    # It travels in the last bucket's all-reduce, after the gradients (`Bucket.tail`),
    # unless a later stage says it cannot (`_status_can_ride`): then in one of its own.
    status_columns: tuple[str, ...] = ("missing",)
    # What each rank tells the others when the status is not all zeros, so that every
    # rank can name what went wrong where: "ready" has one entry per trainable parameter
    # (in `named_trainable` order), 1 if its gradient had come when the status left.
    error_columns: tuple[str, ...] = ("ready",)
    # The columns whose sum, where it is not zero, is an error every rank raises (the
    # same on every rank: they all see the same sum). A later stage may add one, or
    # allow one.
    raising_columns: tuple[str, ...] = ("missing",)

    def __init__(self, module: nn.Module, **options):
        super().__init__(module, **options)
        self.rank = dist.get_rank(self.process_group)
        self._all_arrived = True  # every gradient came in the last synchronised backward
        self._status = StatusExchange(rides=False)  # the status of the next backward

    def _use_buckets(self, buckets: list[Bucket], bucket_cap_mb: float) -> None:
        # At every (re)build of the buckets: the last one, if dense, gets room for the
        # status after its gradients.
        if buckets:
            buckets = [*buckets[:-1], buckets[-1].with_tail(len(self.status_columns))]
        super()._use_buckets(buckets, bucket_cap_mb)

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

    # --8<-- [start:forward]
    def _prepare_for_backward(self, syncs: bool = True) -> None:
        super()._prepare_for_backward(syncs)
        self._route_status()

    def _route_status(self) -> None:
        """The status of the backward that follows, afresh: whether it rides in the last
        bucket is decided now, and every rank decides the same, from the same buckets and
        options."""
        self._status = StatusExchange(rides=self._status_can_ride())

    def _status_can_ride(self) -> bool:
        """Whether the status can travel in the last bucket's all-reduce this step."""
        return bool(self.buckets) and self.buckets[-1].tail > 0

    # --8<-- [end:forward]

    # --8<-- [start:backward]
    def _send(self, bucket: Bucket) -> dist.Work:
        if bucket.status is not None and self._status.rides:  # after the division
            self._status.ride(self, bucket, self._backward.arrived)
        return super()._send(bucket)

    @staticmethod
    def _copy_in(bucket: Bucket, divisor: int) -> bool:
        # Stage bucketed's copy when nothing is missing, as in the common case; else one
        # that takes a missing gradient (and leaves the division to the buffer).
        grads = [p.grad for p in bucket.params]
        if not any(map(_is_none, grads)):  # by name: a static method has no super()
            return BucketedDDP._copy_in(bucket, divisor)
        for grad, view in zip(grads, bucket.views or [bucket.buffer], strict=True):
            if grad is None:  # missing here: adds zero to the sum, and we raise after it
                view.zero_()
            elif bucket.sparse:
                bucket.buffer = grad.clone()
            else:
                view.copy_(grad)
        return False

    # --8<-- [end:backward]

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        backward = self._backward
        arrived = backward.arrived
        ready = set(arrived)
        self._all_arrived = len(ready) == len(self.named_trainable)
        # Complete every bucket, so that every rank issues the same all-reduces in the
        # same order and none can hang: what did not come adds the gradient the parameter
        # already holds (from no_sync() micro-batches), else zeros (`_copy_in`, above).
        # The last one takes the status with it, counting what is missing.
        if backward.next_bucket < len(self.buckets):
            backward.complete()
            self._launch_ready_buckets()
        if not self._all_arrived:  # the averages are copied out one by one, below
            backward.unloads = False
        status = self._status
        if not status.rides:  # right after the last bucket, without waiting for it
            status.send(self, arrived)
        super()._finish_backward()  # waits for every bucket (and copies the averages out)
        if not backward.unloads:  # left in the buckets (by this stage or a later one)
            for bucket, _ in backward.in_flight:
                self._unload_each(bucket)
        status.settle(self)  # all zeros in the common case: done; else raises on every rank

    def _unload_each(self, bucket: Bucket) -> None:
        """The careful way out, when a gradient is missing here: each parameter's average
        on its own, so that what is missing stays missing."""
        for i, param in enumerate(bucket.params):
            self._unload_one(param, bucket.view_of(i))

    def _unload_one(self, param: nn.Parameter, average: torch.Tensor) -> None:
        """One parameter's average into its `.grad`: the careful path, taken only when a
        gradient is missing somewhere (or later, when some are unused)."""
        if param.grad is None:  # a missing gradient stays missing: the error follows
            return
        if average.is_sparse:  # a new tensor, not the bucket's, which the next step reuses
            param.grad = average.clone()
        else:
            param.grad.copy_(average)

    def _status_row(self, missing: int, arrived: list[int]) -> list[int]:
        """This rank's part of the status, one integer per column, given how many
        gradients are `missing` (counted by `StatusExchange`) and the positions of those
        that came in this backward so far (`arrived`, a list: a gradient that came twice is
        there twice): the count alone here."""
        return [missing]

    def _send_status(self, row: list[int]) -> tuple[torch.Tensor, dist.Work]:
        """The status summed over every rank in an all-reduce of its own, where it cannot
        ride in the last bucket's: (the tensor it lands in, its work)."""
        for bucket, work in self._backward.in_flight:
            if bucket.sparse:
                # On Gloo, a collective launched while a sparse all-reduce still runs on
                # the same group corrupts the heap now and then (torch 2.13): not ours.
                work.wait()
        status = torch.tensor(row, dtype=torch.int32, device=self._collective_device)
        return status, dist.all_reduce(status, group=self.process_group, async_op=True)

    def _error_row(self, ready: set[int]) -> Status:
        """This rank's row of what went wrong, by column."""
        row = torch.zeros(len(self.named_trainable), dtype=torch.int32)
        row[list(ready)] = 1
        return {"ready": row}

    def _exchange_status(self, row: Status) -> Status:
        """Every rank's row, {column: (W, width)}, from this rank's; one all-reduce, only
        after a status that says something went wrong."""
        widths = [row[column].numel() for column in self.error_columns]
        status = torch.zeros(
            self.world_size, sum(widths), dtype=torch.int32, device=self._collective_device
        )
        status[self.rank] = torch.cat([row[c].reshape(-1) for c in self.error_columns])
        dist.all_reduce(status, group=self.process_group)
        return dict(zip(self.error_columns, status.cpu().split(widths, dim=1), strict=True))

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


# --8<-- [start:exchange]
class StatusExchange:
    """The status of one synchronised backward, from this rank's row to the error every
    rank raises: the protocol in one place, which the end of backward and join's shadow
    step (a rank that has left, taking part in the others' steps) both run.

    Forward makes one for the backward that follows (`_route_status`), knowing whether
    the status rides in the last bucket's all-reduce. Then `ride` writes the row into the
    last bucket's tail as it leaves, or `send` starts an all-reduce of its own, right
    after the last bucket; either counts the gradients missing so far (what forward did
    not reach, the backward's `unreached`, counts as come, as it does for its bucket).
    After the buckets have landed, `settle` reads the sum and, where it says something
    went wrong, exchanges the error rows and raises on every rank. What the columns hold
    is the stages': `_status_row` (and `status_columns`, `raising_columns`), `_error_row`
    (and `error_columns`), `_raise_on_every_rank`, methods of the model each step passes
    in. It keeps no reference to the model: the model holds it, and a cycle would keep a
    model its user dropped, and its process group, alive until Python's cycle collector
    runs."""

    def __init__(self, rides: bool):
        self.rides = rides  # in the last bucket's all-reduce, after the gradients
        # The positions the row counted as come: the error row says the same. A gradient
        # that comes after the row left (the one before it came twice) counts as missing.
        self.told_ready: set[int] = set()
        self._alone: tuple[torch.Tensor, dist.Work] | None = None  # where it does not ride
        self.summed: list[int] = []  # the status summed over the ranks, once settled

    def ride(self, ddp: MissingGradsDDP, bucket: Bucket, arrived: list[int]) -> None:
        """This rank's row into the last bucket's tail, as the bucket leaves."""
        self.told_ready = told = set(arrived)
        missing = len(ddp.named_trainable) - len(told.union(ddp._backward.unreached))
        for i, value in enumerate(ddp._status_row(missing, arrived)):
            bucket.status[i].fill_(value)  # a fill each, not a copy: on a GPU, no wait

    def send(self, ddp: MissingGradsDDP, arrived: list[int]) -> None:
        """This rank's row in an all-reduce of its own (`_send_status`), not waited for."""
        self.told_ready = told = set(arrived)
        missing = len(ddp.named_trainable) - len(told.union(ddp._backward.unreached))
        self._alone = ddp._send_status(ddp._status_row(missing, arrived))

    def settle(self, ddp: MissingGradsDDP) -> None:
        """Once the buckets have landed: the status summed over the ranks (the same on
        every rank, so every rank takes the same branch) and, where it is not all zeros,
        the error rows exchanged and raised on every rank."""
        if self.rides:  # the tail: floats of the gradients' dtype (complex ones too,
            # hence abs), whole numbers; only zero or not matters
            summed = [round(abs(x)) for x in ddp.buckets[-1].status.tolist()]
        else:  # `send` ran: a status that does not ride and was never sent is a bug
            self._alone[1].wait()
            summed = self._alone[0].tolist()
            self._alone = None  # done: its work and tensor are not kept past the step
        self.summed = summed
        columns = ddp.status_columns
        if any(summed[columns.index(column)] for column in ddp.raising_columns):
            ddp._raise_on_every_rank(ddp._exchange_status(ddp._error_row(self.told_ready)))


# --8<-- [end:exchange]


if __name__ == "__main__":
    from ddp.train import main

    main(MissingGradsDDP)
