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
from torch.profiler import record_function

from ddp.buckets import Bucket, assign_buckets, sparse_gradient_names
from ddp.spans import allreduce_span
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
        for bucket in self.buckets:
            for i, param in enumerate(bucket.params):
                self._copy_in(bucket, i, param.grad)
            with record_function(allreduce_span(f"bucket {bucket.index}", bucket.nbytes)):
                dist.all_reduce(bucket.buffer, group=self.process_group)
            self._copy_out(bucket)

    def _grad_divisor(self) -> int:
        return self.world_size  # the sum over ranks of g / W is the mean

    def _copy_in(self, bucket: Bucket, i: int, grad: torch.Tensor) -> None:
        # Already divided (sum of g/W = mean), as torch's reducer does: one pass over
        # the gradient instead of a copy and then a division. A view as `out` also
        # takes non-contiguous gradients.
        if grad.is_sparse:  # its bucket holds it alone: the buffer is the gradient
            bucket.buffer = grad / self._grad_divisor()
        else:
            torch.div(grad, self._grad_divisor(), out=bucket.view_of(i))

    def _copy_out(self, bucket: Bucket) -> None:
        for i, param in enumerate(bucket.params):
            self._copy_grad_out(param, bucket.view_of(i))

    def _copy_grad_out(self, param: nn.Parameter, average: torch.Tensor) -> None:
        if average.is_sparse:  # a new tensor, not the bucket's, which the next step reuses
            param.grad = average.clone()
        else:
            param.grad.copy_(average)

    # --8<-- [end:finish]


if __name__ == "__main__":
    from ddp.train import main

    main(BucketedDDP)
