"""Stage 8, grad_views: `.grad` tensors are views into the buckets' flat buffers.

Until now every gradient lived twice: once in `.grad`, where autograd puts it, and once
in its bucket, where the all-reduce needs it, with a copy in and a copy out every step.
With `gradient_as_bucket_view=True` (torch's name), after the first step each
parameter's `.grad` *is* its slice of the bucket buffer. Autograd then accumulates
straight into the bucket, the all-reduce averages it in place, and the optimizer reads
the result there: no second copy of the gradients in memory, and no copy in or out.

    torchrun --standalone --nproc-per-node 2 -m stages.grad_views --model mlp

The saving lasts only while `.grad` stays the view: `optimizer.zero_grad(set_to_none=True)`
(torch's default) drops it, autograd allocates a fresh gradient next backward, and this
stage copies it in once more and re-points `.grad`. Use `zero_grad(set_to_none=False)`
to keep the views, as torch's documentation advises for this option.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp.buckets import Bucket
from stages.bucketed import Copies
from stages.buffers import BuffersDDP


# --8<-- [start:construction]
class GradViewsDDP(BuffersDDP):
    """Stage 8: `gradient_as_bucket_view`: gradients live in the bucket buffers."""

    def __init__(self, module: nn.Module, *, gradient_as_bucket_view: bool = False, **options):
        # Set before super(): the buckets choose their copies (below) as they are made.
        self.gradient_as_bucket_view = gradient_as_bucket_view
        super().__init__(module, **options)

    def _copies_for(self, bucket: Bucket) -> Copies:
        # Chosen once per bucket: a sparse gradient is no view.
        if not self.gradient_as_bucket_view or bucket.sparse:
            return super()._copies_for(bucket)
        return Copies(self._copy_in_views, self._unload_views)

    # --8<-- [end:construction]

    # --8<-- [start:backward]
    @staticmethod
    def _copy_in_views(bucket: Bucket, divisor: int) -> bool:
        """Autograd summed the gradients into the bucket itself: only fresh ones are
        copied (undivided: the buffer is divided after)."""
        for param, view in zip(bucket.params, bucket.views, strict=True):
            grad = param.grad
            if grad is None:  # missing here (stage missing_grads): adds zero to the sum
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                # A fresh gradient (the first step, or after zero_grad(set_to_none=True)):
                # copied in once, and from now on .grad is the view.
                view.copy_(grad)
                param.grad = view
        return False

    # --8<-- [end:backward]

    # --8<-- [start:finish]
    @staticmethod
    def _unload_views(bucket: Bucket) -> None:
        """Nothing: every .grad already is its view, and the average is in place. (Where
        a gradient is missing here, the averages go out one by one: `_unload_one`.)"""

    def _unload_one(self, param: nn.Parameter, average: torch.Tensor) -> None:
        if self.gradient_as_bucket_view and param.grad is not None and not average.is_sparse:
            return  # .grad already is its view: the average is in place
        super()._unload_one(param, average)

    def _new_grad(self, average: torch.Tensor) -> torch.Tensor:
        # A parameter unused here but used elsewhere: its .grad becomes the view too.
        if self.gradient_as_bucket_view and not average.is_sparse:
            return average
        return super()._new_grad(average)

    # --8<-- [end:finish]


if __name__ == "__main__":
    from ddp.train import main

    main(GradViewsDDP)
