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

import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.profiler import record_function

from ddp.buckets import Bucket
from ddp.spans import allreduce_span
from stages.bucketed import BucketedDDP


# --8<-- [start:construction]
class OverlappedDDP(BucketedDDP):
    """Stage 3: launch each bucket's all-reduce from backward, as soon as it is full."""

    def __init__(self, module: nn.Module, **options):
        super().__init__(module, **options)
        self._register_hooks()
        self._prepare_for_backward()

    def _register_hooks(self) -> None:
        # Fires once per backward, after the parameter's gradient is summed into .grad
        # (once even for tied weights that receive gradient from two places).
        # The hook holds this wrapper weakly. A tensor keeps its hooks from C++, where
        # Python's garbage collector cannot follow, so a strong reference would make a
        # cycle (parameter -> hook -> wrapper -> module -> parameter) that is never freed:
        # the wrapper and its process group would live on into interpreter shutdown, and
        # Gloo's threads with them, which abort the process if they touch Python then
        # ("terminate called without an active exception").
        on_ready = weakref.WeakMethod(self._on_grad_ready)
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(partial(_call_weakly, on_ready, bucket, i))
            for bucket in self.buckets
            for i, param in enumerate(bucket.params)
        ]

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        output = super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled():
            self._prepare_for_backward()
        return output

    def _prepare_for_backward(self) -> None:
        self._ready = [[False] * len(b.params) for b in self.buckets]
        self._pending = [len(b.params) for b in self.buckets]  # gradients still to come
        self._next_bucket = 0  # the next bucket to launch, in bucket order on every rank
        self._in_flight: list[tuple[Bucket, dist.Work]] = []
        self._finish_queued = False

    # --8<-- [end:forward]

    # --8<-- [start:backward]
    # Under no_grad, here and in the callback: backward(create_graph=True) runs hooks with
    # grad mode on, and the copies into and out of buckets are no part of the graph.
    @torch.no_grad()
    def _on_grad_ready(self, bucket: Bucket, i: int, param: nn.Parameter) -> None:
        if not self._awaiting_sync:
            raise RuntimeError(
                f"{type(self).__name__}: gradient of '{bucket.names[i]}' computed without a "
                "forward before it; run forward once per backward"
            )
        if not self._finish_queued:  # runs once, when this whole backward is done
            Variable._execution_engine.queue_callback(torch.no_grad()(self._finish_backward))
            self._finish_queued = True
            self._backward_started()
        self._mark_ready(bucket, i, param.grad)

    def _backward_started(self) -> None:
        """Called at the first gradient of each synchronised backward: nothing to do yet;
        stage unused_params marks what forward did not reach here."""

    def _mark_ready(self, bucket: Bucket, i: int, grad: torch.Tensor | None) -> None:
        self._copy_in(bucket, i, grad)
        self._ready[bucket.index][i] = True
        self._pending[bucket.index] -= 1
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
            self._in_flight.append(
                (self.buckets[self._next_bucket], self._launch(self._next_bucket))
            )
            self._next_bucket += 1

    def _launch(self, index: int) -> dist.Work:
        bucket = self.buckets[index]
        with record_function(allreduce_span(f"bucket {index}", bucket.nbytes)):
            return dist.all_reduce(bucket.buffer, group=self._group_for(index), async_op=True)

    def _group_for(self, index: int) -> dist.ProcessGroup:
        """The group that all-reduces bucket `index`: one for all of them, until stage
        round_robin spreads them over several."""
        return self.process_group

    # --8<-- [end:backward]

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        self._awaiting_sync = False
        with record_function("wait for communication"):
            for bucket, work in self._in_flight:
                work.wait()  # even on error below: leave no collective half-finished
                # Copy out now, while later buckets still travel (as torch's reducer
                # does), not after the last one. If a gradient was missing, we raise below.
                self._copy_out(bucket)
        missing = [
            name
            for bucket in self.buckets
            for name, ready in zip(bucket.names, self._ready[bucket.index], strict=True)
            if not ready
        ]
        if missing:
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


def _call_weakly(method: weakref.WeakMethod, *args) -> None:
    """Call the method if its object is still alive (a wrapper dropped by its user is)."""
    bound = method()
    if bound is not None:
        bound(*args)


if __name__ == "__main__":
    from ddp.train import main

    main(OverlappedDDP)
