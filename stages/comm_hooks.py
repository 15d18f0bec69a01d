"""Stage 10, comm_hooks: what travels, and how, is a function you can swap.

Plain averaging is one choice among several. `register_comm_hook(state, hook)`, with
torch DDP's signature, hands each full bucket to `hook(state, bucket)`, which returns a
`torch.futures.Future` of the averaged flat bucket; the stage writes that result back
into the gradients. The bucket is a `ddp.comm_hook_functions.GradBucket`, with the methods of
torch's `GradBucket`, so torch's own built-in hooks run here unchanged, and so do the
reimplementations in `ddp/comm_hook_functions.py`: plain all-reduce, fp16 and bf16 compression
(half the bytes on the wire) and PowerSGD (low-rank compression with error feedback).

    torchrun --standalone --nproc-per-node 2 -m stages.comm_hooks --model mlp

As with torch's reducer, a registered hook gets the local gradients *summed*, not yet
divided by the world size: the hook decides when to divide (before compressing, so
that half precision does not overflow). Cost: the stage calls the hook for a bucket
only once the previous bucket's future is done. Hooks such as PowerSGD wait for
collectives inside their callbacks, which run on Gloo's few worker threads; with
several buckets in flight those threads all block and the ranks hang.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddp.buckets import Bucket
from ddp.comm_hook_functions import GradBucket
from ddp.spans import span
from stages.rebuilt_buckets import RebuiltBucketsDDP

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


# --8<-- [start:construction]
class CommHooksDDP(RebuiltBucketsDDP):
    """Stage 10: `register_comm_hook(state, hook)`: each bucket goes through `hook`."""

    _comm_hook: CommHook | None = None
    _comm_state: Any = None

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Send every bucket through `hook(state, bucket)` from the next backward on.

        Misuse raises torch's exception types with torch's messages, so that code and
        tests written against torch's DDP keep working."""
        _check_comm_hook(hook)
        if self._comm_hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        self._comm_hook, self._comm_state = hook, state
        if self._backward.prepared:  # after a forward, before its backward
            # What the hook changes in the step forward prepared: no division, the buckets
            # sent through it, and the status in an all-reduce of its own.
            self._backward.divisor = self._grad_divisor()
            self._backward.send = self._sender()
            self._route_status()

    def _grad_divisor(self) -> int:
        # A hook gets the sum and averages by itself, as torch's built-in hooks do.
        return 1 if self._comm_hook is not None else super()._grad_divisor()

    # --8<-- [end:construction]

    # --8<-- [start:backward]
    def _sender(self) -> str:
        # Chosen at forward, once per step: with a hook, every bucket goes through it.
        return "_send_through_hook" if self._comm_hook is not None else super()._sender()

    def _send_through_hook(self, bucket: Bucket) -> torch.futures.Future:
        """The bucket through the hook: a future of the averaged flat bucket, which is
        written back into the bucket when it is done."""
        in_flight = self._backward.in_flight
        if in_flight:  # one hook at a time: see the module docstring
            in_flight[-1][1].wait()
        with span(f"comm hook bucket {bucket.index} ({bucket.nbytes} B)"):
            future = self._comm_hook(
                self._comm_state, GradBucket(bucket, is_last=bucket.index == len(self.buckets) - 1)
            )

        def write_back(done: torch.futures.Future) -> torch.Tensor:
            result = done.value()
            if result.is_sparse:
                bucket.buffer = result
            elif result.data_ptr() != bucket.buffer.data_ptr():
                bucket.gradients.copy_(result)  # e.g. a half-precision result, cast back
            return bucket.buffer

        return future.then(write_back)

    def _status_can_ride(self) -> bool:
        # A hook would see the status in the bucket, and compress it with the gradients.
        return super()._status_can_ride() and self._comm_hook is None

    def _send_status(self, row: list[int]) -> tuple[torch.Tensor, dist.Work]:
        # A hook may issue collectives from its future's callbacks, on a Gloo thread
        # (PowerSGD does): the status goes after the last bucket's have all been issued,
        # or the ranks could issue them in different orders.
        in_flight = self._backward.in_flight
        if self._comm_hook is not None and in_flight:
            in_flight[-1][1].wait()
        return super()._send_status(row)

    # --8<-- [end:backward]


def _check_comm_hook(hook: CommHook) -> None:
    """torch DDP's checks: a callable whose `bucket` parameter and return value, where
    annotated, are a GradBucket and a Future of a tensor."""
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    try:  # resolve string annotations (`from __future__ import annotations`) first
        signature = inspect.signature(hook, eval_str=True)
    except NameError:
        signature = inspect.signature(hook)
    bucket = signature.parameters["bucket"].annotation
    if bucket is not inspect.Parameter.empty and bucket not in (dist.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and returned != torch.futures.Future[torch.Tensor]:
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
        )


if __name__ == "__main__":
    from ddp.train import main

    main(CommHooksDDP)
