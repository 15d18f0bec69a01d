"""Stage 3, overlapped: buckets are all-reduced while backward is still running.

Backward produces gradients last layer first. As soon as every gradient of a bucket is
there, its all-reduce can start asynchronously while autograd computes the gradients
of earlier layers: communication hides behind computation (the paper's section 3.2.3).
A hook on each parameter marks its gradient ready; a callback at the end of backward
waits for the buckets in flight and writes the averages back into `.grad`. So this
stage finishes inside backward, and a loop written for torch's DDP,
`loss.backward(); optimizer.step()`, works unchanged.

    torchrun --standalone --nproc-per-node 2 -m stages.overlapped --model cnn

Every rank must launch the buckets in the same order, because collectives are matched
by the order they are issued in: a bucket that fills early waits for the buckets
before it. Cost: the bucket order only approximates the order gradients are ready in.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from ddp.buckets import Bucket
from ddp.spans import span
from stages.bucketed import BucketedDDP


# --8<-- [start:construction]
class OverlappedDDP(BucketedDDP):
    """Stage 3: launch each bucket's all-reduce from backward, as soon as it is full."""

    def __init__(self, module: nn.Module, **options):
        super().__init__(module, **options)
        self._sync_this_backward = True  # stage skip_sync sets it at each forward
        # Positions in named_trainable of the gradients, as they came, and when (if a
        # later stage sets a list: a clock mark each).
        self._arrived: list[int] = []
        self._ready_times: list | None = None
        self._finish_queued = False  # this backward's end-of-backward callback is queued
        self._in_flight: list[tuple[Bucket, dist.Work]] = []
        self._register_hooks()

    def _register_hooks(self) -> None:
        # Fires once per backward, after the parameter's gradient is summed into .grad
        # (once even for tied weights that receive gradient from two places). Each hook
        # knows its parameter's position k in named_trainable and its bucket's index.
        self._position = {id(p): k for k, (_, p) in enumerate(self.named_trainable)}
        self._bucket_of = [0] * len(self.named_trainable)  # position k -> bucket index
        self._bucket_lengths = [len(b.params) for b in self.buckets]
        # The hook holds this wrapper weakly. A tensor keeps its hooks from C++, where
        # Python's garbage collector cannot follow, so a strong reference would make a
        # cycle (parameter -> hook -> wrapper -> module -> parameter) that is never freed:
        # the wrapper and its process group would live on into interpreter shutdown, and
        # Gloo's threads with them, which abort the process if they touch Python then
        # ("terminate called without an active exception").
        me = weakref.ref(self)
        self._hook_handles = []
        for bucket in self.buckets:
            for param in bucket.params:
                k = self._position[id(param)]
                self._bucket_of[k] = bucket.index
                hook = _gradient_hook(me, k, bucket.index)
                self._hook_handles.append(param.register_post_accumulate_grad_hook(hook))

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        output = super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled():
            self._prepare_for_backward()
        return output

    def _prepare_for_backward(self) -> None:
        """The per-step facts the backward that follows reads, set once here."""
        self._pending = list(self._bucket_lengths)  # per bucket, gradients still to come
        self._next_bucket = 0  # the next bucket to launch, in bucket order on every rank
        self._in_flight = []
        self._finish_queued = False
        self._sync_from = len(self._arrived)  # arrivals before: no_sync() micro-batches
        self._divisor = self._grad_divisor()

    # --8<-- [end:forward]

    # --8<-- [start:hook]
    def _on_grad_ready(self, k: int, b: int) -> None:
        """Per gradient, all it does: note that gradient k came (and when, if asked),
        count its bucket b down, and launch what is complete. What later stages need of
        each gradient they read once per step from `_arrived` and `_ready_times`."""
        self._arrived.append(k)
        if not self._sync_this_backward:
            return  # inside no_sync() (stage skip_sync): the gradient stays in .grad
        if self._ready_times is not None:
            self._ready_times.append(self._clock_mark())
        if not self._finish_queued:  # the first gradient of this backward
            self._start_backward()
        self._pending[b] -= 1
        if self._pending[b] == 0 and b == self._next_bucket:
            self._launch_ready_buckets()

    # --8<-- [end:hook]

    # --8<-- [start:backward]
    def _start_backward(self) -> None:
        """Once per synchronised backward, at its first gradient: queue the callback that
        finishes it (stage unused_params also marks here what forward did not reach)."""
        if not self._awaiting_sync:
            name = self.named_trainable[self._arrived[-1]][0]
            raise RuntimeError(
                f"{type(self).__name__}: gradient of '{name}' computed without a forward "
                "before it; run forward once per backward"
            )
        # The callback and the launches run under no_grad: backward(create_graph=True)
        # runs hooks with grad mode on, and the copies into and out of buckets are no part
        # of a graph.
        Variable._execution_engine.queue_callback(torch.no_grad()(self._finish_backward))
        self._finish_queued = True

    @torch.no_grad()
    def _launch_ready_buckets(self) -> None:
        """Launch, in bucket order, every bucket whose gradients have all come: per bucket,
        fill its buffer, then send it (an all-reduce that runs while backward goes on)."""
        # `<= 0`: a count goes below zero when a gradient counted as unused (stage
        # unused_params) comes after all, which is noted and raised at the end.
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] <= 0:
            bucket = self.buckets[self._next_bucket]
            self._fill(bucket)
            self._in_flight.append((bucket, self._send(bucket)))
            self._next_bucket += 1

    def _send(self, bucket: Bucket) -> dist.Work:
        with span(bucket.span):
            return dist.all_reduce(
                bucket.buffer, group=self._group_for(bucket.index), async_op=True
            )

    def _group_for(self, index: int) -> dist.ProcessGroup:
        """The group that all-reduces bucket `index`: one for all of them, until stage
        round_robin spreads them over several."""
        return self.process_group

    def _clock_mark(self) -> float:
        """When a gradient came, for a stage that sets `_ready_times` to a list."""
        return time.perf_counter()

    # --8<-- [end:backward]

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        """Once per synchronised backward, after its last gradient: wait for the buckets
        and copy each one's averages out as it lands (while later ones still travel, as
        torch's reducer does)."""
        self._awaiting_sync = False
        self._finish_queued = False  # so a second backward without forward is caught
        arrived, self._arrived = self._arrived[self._sync_from :], []
        with span("wait for communication"):
            for bucket, work in self._in_flight:
                work.wait()  # even on error below: leave no collective half-finished
                self._unload(bucket)
        if self._next_bucket < len(self.buckets):  # a bucket never filled
            missing = [n for k, (n, _) in enumerate(self.named_trainable) if k not in arrived]
            raise RuntimeError(
                f"{type(self).__name__}: parameters {missing} got no gradient in this backward "
                f"on rank {dist.get_rank(self.process_group)}, so their buckets never filled; "
                "every trainable parameter must take part in the loss (freeze it with "
                "requires_grad_(False) if it should not train)"
            )

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do after loss.backward(): its last callback finished it, so
        this replaces stage 2's work with a check that backward did run."""
        if self._awaiting_sync:
            raise RuntimeError(
                f"{type(self).__name__}: finish_gradient_synchronization() called after "
                "forward but before loss.backward()"
            )

    # --8<-- [end:finish]


# --8<-- [start:closure]
def _gradient_hook(wrapper: weakref.ref, k: int, b: int) -> Callable[[nn.Parameter], None]:
    """The hook on parameter k (of bucket b): calls the wrapper if it is still alive (a
    wrapper dropped by its user is not)."""

    def on_ready(param: nn.Parameter) -> None:
        ddp = wrapper()
        if ddp is not None:
            ddp._on_grad_ready(k, b)

    return on_ready


# --8<-- [end:closure]


if __name__ == "__main__":
    from ddp.train import main

    main(OverlappedDDP)
