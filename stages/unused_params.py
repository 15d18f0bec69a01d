"""Stage 5, unused_params: parameters that get no gradient, without a hang.

A model whose forward skips a branch (a mixture of experts, a loss on one head, a
layer used only at some steps) leaves some parameters without a gradient. Their
buckets never fill, and a rank that waits for them waits for ever while the other
ranks, whose graphs did reach them, have moved on.

With `find_unused_parameters=True`, after forward this stage walks the autograd graph
from forward's outputs and marks every parameter it does not reach as ready, with a
zero (or its already accumulated) gradient, so its bucket still completes on time.
At the end of backward a small bitmap of which parameters each rank really used is
all-reduced: a parameter that no rank used keeps its `.grad` as it was (as torch's DDP
leaves it), one used anywhere gets the average. Without the flag, the same bitmap
turns a missing gradient into an error that names it, on every rank, at once.

    torchrun --standalone --nproc-per-node 2 -m stages.unused_params --model mlp

Cost: the graph walk after every forward (with the flag) and one small all-reduce per
synchronised backward. torch's DDP skips that all-reduce without the flag, and a
rank whose gradient is missing hangs the others instead of failing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from ddp.buckets import Bucket
from stages.skip_sync import SkipSyncDDP


# --8<-- [start:construction]
class UnusedParamsDDP(SkipSyncDDP):
    """Stage 5: `find_unused_parameters`, and a missing gradient is an error on every rank."""

    def __init__(self, module: nn.Module, *, find_unused_parameters: bool = False, **options):
        super().__init__(module, **options)
        self.find_unused_parameters = find_unused_parameters
        self.rank = dist.get_rank(self.process_group)
        # Which gradients this rank produced since the last synchronisation (no_sync
        # backwards included): torch's "local used map", in bitmap positions.
        self._position = {id(p): k for k, (_, p) in enumerate(self.named_trainable)}
        self._locally_used = torch.zeros(len(self._position), dtype=torch.int32)
        self._globally_used = [1] * len(self._position)
        self._unreached: list[tuple[Bucket, int]] = []
        self._problems: list[str] = []  # found inside backward, raised after it

    @property
    def _slots(self) -> list[tuple[Bucket, int]]:
        # Every (bucket, index in it) in bitmap position order, whatever the layout.
        slots = {id(b.params[i]): (b, i) for b in self.buckets for i in range(len(b.params))}
        return [slots[id(p)] for _, p in self.named_trainable]

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        output = super().forward(*inputs, **kwargs)
        self._unreached = []
        self._problems = []
        if torch.is_grad_enabled() and self._sync_this_backward and self.find_unused_parameters:
            reached = _parameters_reached(output)
            self._unreached = [(b, i) for b, i in self._slots if id(b.params[i]) not in reached]
        return output

    # --8<-- [end:forward]

    # --8<-- [start:backward]
    def _on_grad_ready(self, bucket: Bucket, i: int, param: nn.Parameter) -> None:
        self._locally_used[self._position[id(param)]] = 1
        if not self._sync_this_backward:
            return
        if not self._finish_queued:  # the first hook: as torch, mark the unused ones ready
            Variable._execution_engine.queue_callback(self._finish_backward)
            self._finish_queued = True
            for b, j in self._unreached:
                self._mark_ready(b, j, b.params[j].grad)
        if self._ready[bucket.index][i]:
            # Raising here would stop only this rank's backward and leave the others
            # waiting in an all-reduce: note it, finish the step, raise on every rank.
            self._problems.append(
                f"'{bucket.names[i]}' got a gradient although forward's outputs do not reach "
                "it (it was marked unused); compute the loss only from the wrapper's outputs"
            )
            return
        super()._on_grad_ready(bucket, i, param)

    def _copy_in(self, bucket: Bucket, i: int, grad: torch.Tensor | None) -> None:
        if grad is None:  # an unused parameter with nothing accumulated: adds zero
            bucket.view_of(i).zero_()
        else:
            super()._copy_in(bucket, i, grad)

    # --8<-- [end:backward]

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        self._awaiting_sync = False
        slots = self._slots
        ready = torch.tensor([self._ready[b.index][i] for b, i in slots])
        # Complete every bucket, even ones whose gradients never came, so that every rank
        # has issued the same all-reduces in the same order and none can hang.
        for b, i in slots:
            if not self._ready[b.index][i]:
                self._mark_ready(b, i, b.params[i].grad)
        for bucket, work in self._in_flight:  # every rank issued them all: none can hang
            work.wait()
            if not self.find_unused_parameters:  # copy out while later buckets travel
                self._copy_out(bucket)  # (if a gradient was missing, we raise below)
        status = self._exchange_status(ready, self._locally_used, len(self._problems))
        self._locally_used.zero_()
        self._raise_on_every_rank(status, slots)
        if self.find_unused_parameters:  # what to copy depends on who used what
            n = len(slots)
            self._globally_used = status[:, n : 2 * n].sum(0).tolist()
            for bucket, _ in self._in_flight:
                self._copy_out(bucket)

    def _copy_out(self, bucket: Bucket) -> None:
        for i, param in enumerate(bucket.params):
            if not self._globally_used[self._position[id(param)]]:
                continue  # used on no rank: .grad stays as it was, as in torch's DDP
            if param.grad is None:  # unused here, used elsewhere: gets the average
                param.grad = bucket.view_of(i).clone()
            else:
                param.grad.copy_(bucket.view_of(i))

    def _exchange_status(self, ready, used, problems: int) -> torch.Tensor:
        """Every rank's row [ready in this backward | used since last sync | problems],
        (W, 2n + 1), from this rank's part; one all-reduce."""
        n = len(self.named_trainable)
        status = torch.zeros(self.world_size, 2 * n + 1, dtype=torch.int32)
        status[self.rank, :n] = ready
        status[self.rank, n : 2 * n] = used
        status[self.rank, 2 * n] = problems
        dist.all_reduce(status, group=self.process_group)
        return status

    def _raise_on_every_rank(self, status: torch.Tensor, slots: list[tuple[Bucket, int]]) -> None:
        name, n = type(self).__name__, len(slots)
        troubled = status[:, 2 * n].nonzero().flatten().tolist()
        if troubled:
            mine = "; ".join(self._problems) or f"see the error on rank(s) {troubled}"
            raise RuntimeError(f"{name}: bad backward on rank(s) {troubled}: {mine}")
        if self.find_unused_parameters:
            return
        absent = {
            r: [b.names[i] for k, (b, i) in enumerate(slots) if status[r, k] == 0]
            for r in range(self.world_size)
        }
        absent = {r: names for r, names in absent.items() if names}
        if absent:
            where = "; ".join(f"rank {r}: {names}" for r, names in absent.items())
            raise RuntimeError(
                f"{name}: parameters got no gradient in this backward ({where}). Pass "
                "find_unused_parameters=True if forward may skip them, or freeze them with "
                "requires_grad_(False) if they should not train"
            )

    # --8<-- [end:finish]


def _parameters_reached(output) -> set[int]:
    """ids of the leaf tensors (parameters) that output's autograd graph leads to."""
    reached, seen = set(), set()
    stack = []
    for t in _tensors(output):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))  # forward returned a parameter itself
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node holds its leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return reached


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


if __name__ == "__main__":
    from ddp.train import main

    main("unused_params")
