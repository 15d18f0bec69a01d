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

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import Bucket, assign_buckets, sparse_gradient_names
from ddp.spans import span
from stages.naive import NaiveDDP


# --8<-- [start:construction]
class BucketedDDP(NaiveDDP):
    """Stage 2: one all-reduce per bucket of gradients, after backward."""

    collectives = ("all_reduce per bucket",)  # in bucket order

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0, **options):
        if not bucket_cap_mb > 0:  # checked first: a bad argument, whatever else is wrong
            raise ValueError(f"bucket_cap_mb must be > 0 MiB, got {bucket_cap_mb}")
        super().__init__(module, **options)
        self.bucket_cap_mb = bucket_cap_mb
        # Reverse parameter order, at most bucket_cap_mb MiB each, one dtype per bucket;
        # a sparse gradient (nn.Embedding(sparse=True)) alone, as it is.
        self._sparse = sparse_gradient_names(module)
        self.buckets = assign_buckets(
            list(module.named_parameters()), bucket_cap_mb, sparse=self._sparse
        )

    # --8<-- [end:construction]

    # --8<-- [start:finish]
    @torch.no_grad()  # a gradient made with create_graph=True is averaged outside its graph
    def finish_gradient_synchronization(self) -> None:
        """Average every gradient over the ranks, one flat buffer per bucket."""
        # Replaces stage 1's loop over parameters (its checks still run first).
        self._start_synchronization()
        self._divisor = self._grad_divisor()
        for bucket in self.buckets:
            self._fill(bucket)
            with span(bucket.span):
                dist.all_reduce(bucket.buffer, group=self.process_group)
            self._unload(bucket)

    def _grad_divisor(self) -> int:
        return self.world_size  # the sum over ranks of g / W is the mean

    def _fill(self, bucket: Bucket) -> None:
        """The bucket's buffer := its gradients / the divisor (sum of g/W = mean, as torch's
        reducer divides): one copy of all of them (a foreach op, one call for the whole
        bucket) and one division of the flat buffer."""
        if bucket.sparse:  # its bucket holds it alone: the buffer is the gradient
            bucket.buffer = bucket.params[0].grad / self._divisor
            return
        torch._foreach_copy_(bucket.views, [p.grad for p in bucket.params])
        if self._divisor != 1:  # 1: a comm hook divides by itself
            bucket.buffer.div_(self._divisor)

    def _unload(self, bucket: Bucket) -> None:
        """The averages, from the bucket back into `.grad`: one foreach copy."""
        if bucket.sparse:  # a new tensor, not the bucket's, which the next step reuses
            bucket.params[0].grad = bucket.buffer.clone()
            return
        torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)

    # --8<-- [end:finish]


if __name__ == "__main__":
    from ddp.train import main

    main(BucketedDDP)
