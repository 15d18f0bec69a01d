"""Stage 2, bucketed: the naive stage, but gradients travel in buckets.

A collective costs a fixed latency plus its bytes over the bandwidth. Sending one flat
buffer of many gradients pays the latency once per bucket instead of once per
parameter (the paper's Figure 2: all-reducing 60M parameters at once is far faster
than one small tensor at a time).

    torchrun --standalone --nproc-per-node 2 -m stages.bucketed --model cnn --bucket-cap-mb 25

Cost: the copies into and out of the flat buffers, and still no communication
until backward has finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import Bucket, assign_buckets, sparse_gradient_names
from ddp.spans import span
from stages.naive import NaiveDDP


# --8<-- [start:construction]
class Copies(NamedTuple):
    """How one bucket's gradients go into its buffer and its averages back into `.grad`:
    functions of the bucket alone, so that the wrapper, which keeps them, holds no
    reference to itself (a cycle would keep a model its user dropped alive)."""

    copy_in: Callable[[Bucket, int], bool]  # (bucket, divisor): whether it divided
    unload: Callable[[Bucket], None]


# Gradients of at least this many bytes on average over their bucket are divided as
# they are copied into it, one pass over each, as torch's reducer copies every gradient
# when no comm hook is registered (it multiplies by 1/W). Smaller ones go in one foreach
# copy for the bucket and one division of its buffer: two passes, but two calls, where a
# call per gradient costs more than the pass it saves (measured on a 2-core AMD EPYC: 15
# against 8 µs a gradient at 64 KiB, 180 against 280 µs at 1 MiB).
DIVIDE_WHILE_COPYING_BYTES = 256 * 1024


class BucketedDDP(NaiveDDP):
    """Stage 2: one all-reduce per bucket of gradients, after backward."""

    collectives = ("all_reduce per bucket",)  # in bucket order

    # Where a bucket is cut, wherever buckets are laid out: before a gradient would pass
    # bucket_cap_mb (False), or, as torch's DDP cuts them, once the bucket reaches it,
    # passing it by its last gradient (True: `ddp.buckets.plan_buckets`).
    overfill_buckets = False

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0, **options):
        if not bucket_cap_mb > 0:  # checked first: a bad argument, whatever else is wrong
            raise ValueError(f"bucket_cap_mb must be > 0 MiB, got {bucket_cap_mb}")
        super().__init__(module, **options)
        # Reverse parameter order, cut at bucket_cap_mb MiB, one dtype per bucket;
        # a sparse gradient (nn.Embedding(sparse=True)) alone, as it is.
        self._sparse = sparse_gradient_names(module)
        named = list(module.named_parameters())
        buckets = assign_buckets(
            named, bucket_cap_mb, sparse=self._sparse, overfill=self.overfill_buckets
        )
        self._use_buckets(buckets, bucket_cap_mb)

    def _use_buckets(self, buckets: list[Bucket], bucket_cap_mb: float) -> None:
        """Send the gradients in these buckets (cut at bucket_cap_mb MiB) from now
        on. A later stage may lay them out again, or extend this to give them room or a
        dtype of their own first."""
        self.buckets, self.bucket_cap_mb = buckets, bucket_cap_mb
        # How each bucket's gradients go in and its averages come out, chosen here, once
        # per bucket, rather than asked at every step.
        self._copies = [self._copies_for(bucket) for bucket in buckets]

    def _copies_for(self, bucket: Bucket) -> Copies:
        """The copies in and out of `bucket`: this stage's two (below), for every bucket; a
        later stage may choose others for some buckets, by their layout or its options."""
        return Copies(self._copy_in, self._unload)

    # --8<-- [end:construction]

    # --8<-- [start:finish]
    @torch.no_grad()  # a gradient made with create_graph=True is averaged outside its graph
    def finish_gradient_synchronization(self) -> None:
        """Average every gradient over the ranks, one flat buffer per bucket."""
        # Replaces stage 1's loop over parameters (its checks still run first).
        self._start_synchronization()
        divisor = self._grad_divisor()
        for bucket in self.buckets:
            self._fill(bucket, divisor)
            with span(bucket.span):
                dist.all_reduce(bucket.buffer, group=self.process_group)
            self._copies[bucket.index].unload(bucket)

    def _grad_divisor(self) -> int:
        return self.world_size  # the sum over ranks of g / W is the mean

    def _fill(self, bucket: Bucket, divisor: int) -> None:
        """The bucket's buffer := its gradients / divisor (sum of g/W = mean, as torch's
        reducer divides): divided as they are copied in, or the flat buffer after."""
        divided = self._copies[bucket.index].copy_in(bucket, divisor)
        if not divided and divisor != 1:  # a pass over the buffer for nothing
            bucket.buffer.div_(divisor)

    @staticmethod
    def _copy_in(bucket: Bucket, divisor: int) -> bool:
        """The gradients into the bucket's buffer: each divided by `divisor` as it is
        copied where they are large (one call per gradient, one pass over it; returns
        True), else one foreach copy for the whole bucket. A sparse gradient's bucket
        holds it alone: its buffer is a copy of it."""
        if bucket.sparse:
            bucket.buffer = bucket.params[0].grad.clone()
            return False
        small = bucket.nbytes < DIVIDE_WHILE_COPYING_BYTES * len(bucket.params)
        # A buffer in another dtype (the drop-in's reduce_dtype) divides after the copy,
        # in its own dtype: torch.div would divide in the gradients' (bf16, say) first.
        if small or bucket.params[0].grad.dtype != bucket.buffer.dtype:
            torch._foreach_copy_(bucket.views, [p.grad for p in bucket.params])
            return False
        for view, param in zip(bucket.views, bucket.params, strict=True):
            torch.div(param.grad, divisor, out=view)
        return True

    @staticmethod
    def _unload(bucket: Bucket) -> None:
        """The averages, from the bucket back into `.grad`: one foreach copy."""
        if bucket.sparse:  # a new tensor, not the bucket's, which the next step reuses
            bucket.params[0].grad = bucket.buffer.clone()
            return
        torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)

    # --8<-- [end:finish]


if __name__ == "__main__":
    from ddp.train import main

    main(BucketedDDP)
