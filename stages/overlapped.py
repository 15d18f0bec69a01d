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

What one backward needs (counts, arrivals, buckets in flight, the divisor) is one
object, `Backward`, that forward makes and only this stage's hook and its own methods
change. The end of backward also clears stage naive's `_awaiting_sync`: it did what
naive's `finish_gradient_synchronization()` did. What each bucket needs at its launch
(its group) is fixed when the buckets are made, and what the sending does (`_sender`)
once per step at forward, so that the path per bucket asks nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

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
        super().__init__(module, **options)  # its buckets get their hooks (below)
        # The state of the backward after the last forward, made by that forward; before
        # the first, a finished one (a gradient then had no forward before it).
        self._backward = Backward.none_yet()
        self._synced_backwards = 0  # synchronised backwards so far: the same on every rank

    def _use_buckets(self, buckets: list[Bucket], bucket_cap_mb: float) -> None:
        for handle in getattr(self, "_hook_handles", []):  # the previous buckets' (if any)
            handle.remove()
        super()._use_buckets(buckets, bucket_cap_mb)
        self._register_hooks()

    def _register_hooks(self) -> None:
        # Fires once per backward, after the parameter's gradient is summed into .grad
        # (once even for tied weights that receive gradient from two places). Each hook
        # knows its parameter's position k in named_trainable and its bucket's index.
        self._position = {id(p): k for k, (_, p) in enumerate(self.named_trainable)}
        self._bucket_of = [0] * len(self.named_trainable)  # position k -> bucket index
        self._bucket_lengths = [len(b.params) for b in self.buckets]
        # Per bucket, the group that all-reduces it (`_group_for`), fixed once per layout
        # rather than asked at every launch: at the next forward, since a later stage's
        # groups may exist only once its constructor has run.
        self._bucket_groups: list[dist.ProcessGroup] | None = None
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

    def _prepare_for_backward(self, syncs: bool = True) -> None:
        """The state of the backward that follows, made once here, in one object: the
        hooks and the end of backward read and change it, nothing else."""
        if self._bucket_groups is None:  # the buckets are new: their groups, once
            self._bucket_groups = [self._group_for(b.index) for b in self.buckets]
        self._backward = Backward(
            pending=self._pending_counts() if syncs else [],
            divisor=self._grad_divisor(),
            syncs=syncs,
            held=syncs and self._holds_buckets(),
            send=self._sender(),
        )

    def _pending_counts(self) -> list[int]:
        """Per bucket, how many gradients it waits for before it leaves: each of its
        gradients, once."""
        return list(self._bucket_lengths)

    def _holds_buckets(self) -> bool:
        """Whether no bucket leaves before the end of this backward (never, here: each
        leaves once complete)."""
        return False

    def _sender(self) -> str:
        """The name of the method that sends each bucket of the backward that follows:
        `_send` here. A later stage may name another of its own for a step; chosen once
        at forward, so that no launch asks."""
        return "_send"

    # --8<-- [end:forward]

    # --8<-- [start:hook]
    def _on_grad_ready(self, k: int, b: int) -> None:
        """Per gradient, all it does: note that gradient k came, count its bucket b down,
        and launch what is complete. What later stages need of each gradient they read
        once per step from the backward's `arrived`."""
        backward = self._backward
        backward.arrived.append(k)
        if not backward.syncs:
            return  # the gradient stays in .grad, summed with the next backwards' (no_sync)
        if not backward.started:  # the first gradient of this backward
            self._start_backward()
        backward.pending[b] -= 1
        if backward.pending[b] == 0 and b == backward.next_bucket:
            self._launch_ready_buckets()

    # --8<-- [end:hook]

    # --8<-- [start:backward]
    def _start_backward(self) -> None:
        """Once per synchronised backward, at its first gradient: queue the callback that
        finishes it."""
        backward = self._backward
        if backward.finished:
            name = self.named_trainable[backward.arrived[-1]][0]
            raise RuntimeError(
                f"{type(self).__name__}: gradient of '{name}' computed without a forward "
                "before it; run forward once per backward"
            )
        # The callback and the launches run under no_grad: backward(create_graph=True)
        # runs hooks with grad mode on, and the copies into and out of buckets are no part
        # of a graph.
        Variable._execution_engine.queue_callback(torch.no_grad()(self._finish_backward))
        backward.started = True
        if backward.unreached:  # counted as come now (none here), and launched if that completes
            for k in backward.unreached:
                backward.pending[self._bucket_of[k]] -= 1
            self._launch_ready_buckets()

    @torch.no_grad()
    def _launch_ready_buckets(self) -> None:
        """Launch, in bucket order, every bucket whose gradients have all come: per bucket,
        fill its buffer, then send it (an all-reduce that runs while backward goes on)."""
        backward = self._backward
        buckets, pending = self.buckets, backward.pending
        # `<= 0`: a count goes below zero for a gradient that came although it was
        # counted before (one in `unreached`); the end of backward finds out why.
        while not backward.held and backward.next_bucket < len(buckets):
            if pending[backward.next_bucket] > 0:
                return
            bucket = buckets[backward.next_bucket]
            self._fill(bucket, backward.divisor)
            backward.in_flight.append((bucket, getattr(self, backward.send)(bucket)))
            backward.next_bucket += 1

    def _send(self, bucket: Bucket) -> dist.Work:
        with span(bucket.span):
            return dist.all_reduce(
                bucket.buffer, group=self._bucket_groups[bucket.index], async_op=True
            )

    def _group_for(self, index: int) -> dist.ProcessGroup:
        """The group that all-reduces bucket `index`, asked once per bucket layout (at the
        first forward after the buckets are made): the wrapper's process_group here, for
        all of them. Any group over the same ranks would do, as long as every rank picks
        the same one."""
        return self.process_group

    # --8<-- [end:backward]

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        """Once per synchronised backward, after its last gradient: wait for the buckets
        and copy each one's averages out as it lands (while later ones still travel, as
        torch's reducer does)."""
        self._awaiting_sync = False  # stage naive's flag: this backward synchronised
        self._synced_backwards += 1
        backward = self._backward
        backward.finished = True  # a second backward without a forward is caught
        copies = self._copies
        with span("wait for communication"):
            for bucket, work in backward.in_flight:
                work.wait()  # even on error below: leave no collective half-finished
                if backward.unloads:
                    copies[bucket.index].unload(bucket)
        if backward.next_bucket < len(self.buckets):  # a bucket never filled
            came = set(backward.arrived)
            missing = [n for k, (n, _) in enumerate(self.named_trainable) if k not in came]
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


# --8<-- [start:state]
@dataclass(eq=False)
class Backward:
    """One backward's state, made by the forward before it (`_prepare_for_backward`);
    what forward finds (`unreached`) it fills in before backward starts. From the first
    gradient on, only the wrapper's hook and launches (through the method `send` names)
    and `complete()` change it; the end of backward reads it, and may first turn
    `unloads` off."""

    pending: list[int]  # per bucket, gradients still to come; <= 0: complete
    divisor: int  # each bucket is divided by it before it leaves (sum of g / W = mean)
    syncs: bool = True  # False: gradients stay in .grad, summed over backwards, unsent
    held: bool = False  # True: no bucket leaves until `complete()`
    # The wrapper's method that sends each bucket (`_sender`), by name: the wrapper holds
    # this state, and a method bound to the wrapper here would be a reference cycle.
    send: str = "_send"
    # False: the end of backward waits for every bucket but leaves the averages in it,
    # for a later stage to copy out its own way (never, here).
    unloads: bool = True
    # Positions counted as come when backward starts, without their hooks: none here; a
    # later stage's forward may find some (parameters its outputs do not lead to).
    unreached: list[int] = field(default_factory=list)
    arrived: list[int] = field(default_factory=list)  # positions k, in the order they came
    next_bucket: int = 0  # the next to launch, in bucket order on every rank
    in_flight: list[tuple[Bucket, dist.Work]] = field(default_factory=list)  # launched
    started: bool = False  # its first gradient came: the end-of-backward callback is queued
    finished: bool = False  # that callback ran

    @classmethod
    def none_yet(cls) -> Backward:
        """The state before any forward: a finished backward, so that a gradient that
        comes now is one without a forward before it."""
        return cls(pending=[], divisor=1, finished=True)

    @property
    def prepared(self) -> bool:
        """Made by a forward that synchronises, and its backward not begun."""
        return self.syncs and not self.started and not self.finished

    def complete(self) -> None:
        """Every bucket counts as complete, whatever has not come, and may leave."""
        self.pending = [0] * len(self.pending)
        self.held = False


# --8<-- [end:state]


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
