"""Stage 9, rebuilt_buckets: buckets follow the order gradients really became ready in.

Reverse parameter order is only a guess at the order backward produces gradients: a
model whose forward calls its layers in another order than it registered them (or
shares a layer) fills its buckets out of turn, and a full bucket waits for the ones
before it. So, as torch's DDP does, this stage watches the first synchronised
backward, records the order in which gradients became ready, takes rank 0's order
(broadcast, since every rank must launch the same buckets in the same order), and
before the next forward rebuilds the buckets in that order, once.

The first bucket also gets a small cap of its own (`first_bucket_cap_mb`, 1 MiB as
in torch): the last layer's gradients are ready first, and a small bucket starts the
first all-reduce as soon as they are, instead of waiting for 25 MiB to fill.

    torchrun --standalone --nproc-per-node 2 -m stages.rebuilt_buckets --model transformer

As in torch, buckets are not rebuilt with `find_unused_parameters=True`, whose order
may change every step. Cost: one broadcast of n integers, once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import Members, buckets_from_plan, plan_buckets
from stages.grad_views import GradViewsDDP


# --8<-- [start:construction]
class RebuiltBucketsDDP(GradViewsDDP):
    """Stage 9: after the first backward, buckets in rank 0's real gradient order."""

    # The order is broadcast once, before the buckets of the second synchronised step.
    collectives = ("broadcast of the ready order, once", *GradViewsDDP.collectives)

    def __init__(
        self,
        module: nn.Module,
        *,
        first_bucket_cap_mb: float | None = 1.0,  # None: the same cap as the others
        **options,
    ):
        if first_bucket_cap_mb is not None and not first_bucket_cap_mb > 0:
            raise ValueError(f"first_bucket_cap_mb must be > 0 MiB, got {first_bucket_cap_mb}")
        super().__init__(module, **options)
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self._ready_order: list[int] = []  # positions in named_trainable, first ready first
        self._rebuilt = False

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        # Only at a forward whose backward synchronises: no collective inside no_sync().
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._before_synced_forward()
        return super().forward(*inputs, **kwargs)

    def _before_synced_forward(self) -> None:
        """Collectives that come before a synchronising forward; every rank runs them."""
        self._keep_ready_order()
        if not self._rebuilt and self._synced_backwards > 0 and self._order_is_static():
            self._rebuild_buckets(self._ready_order, self.bucket_cap_mb, self.first_bucket_cap_mb)
            self._rebuilt = True

    def _order_is_static(self) -> bool:
        """Whether the order gradients become ready in is the same every step."""
        return not self.find_unused_parameters

    def _rebuild_buckets(
        self, ready_order: list[int], bucket_cap_mb: float, first_bucket_cap_mb: float | None
    ) -> None:
        """New buckets in rank 0's `ready_order` (positions in named_trainable, first ready
        first; the ones it lacks follow in position order); every rank must call this
        together."""
        seen = dict.fromkeys(ready_order)  # in order, once each
        order = [*seen, *(k for k in range(len(self.named_trainable)) if k not in seen)]
        order_t = torch.tensor(order, dtype=torch.int64, device=self._collective_device)
        dist.broadcast(order_t, group=self.process_group, group_src=0)  # rank 0's order
        old_views = {id(p): p.grad for _, p in self.named_trainable}
        self._use_buckets(
            buckets_from_plan(
                self._rebuilt_layout(
                    [self.named_trainable[k] for k in order_t.tolist()],
                    bucket_cap_mb,
                    first_bucket_cap_mb,
                ),
                self._sparse,
            ),
            bucket_cap_mb,
        )
        if self.gradient_as_bucket_view:  # gradients move into the new buffers
            for bucket in (b for b in self.buckets if not b.buffer.is_sparse):
                for i, param in enumerate(bucket.params):
                    if old_views[id(param)] is not None:
                        bucket.view_of(i).copy_(old_views[id(param)])
                        param.grad = bucket.view_of(i)

    def _rebuilt_layout(
        self, named: Members, bucket_cap_mb: float, first_bucket_cap_mb: float | None
    ) -> list[Members]:
        """The new buckets' members, in launch order, from the trainable parameters in
        ready order, cut at `bucket_cap_mb` MiB as `plan_buckets` cuts them."""
        return plan_buckets(
            named,
            bucket_cap_mb,
            # A small first bucket, never larger than the others.
            first_bucket_cap_mb=min(first_bucket_cap_mb or bucket_cap_mb, bucket_cap_mb),
            ready_order=True,
            sparse=self._sparse,
            overfill=self.overfill_buckets,
        )

    # --8<-- [end:forward]

    # --8<-- [start:backward]
    def _prepare_for_backward(self, syncs: bool = True) -> None:
        self._keep_ready_order()  # before the backward that ended gives way to the next
        super()._prepare_for_backward(syncs)

    def _keep_ready_order(self) -> None:
        """The order of the first synchronised backward, kept once, read from that
        backward's state at the next forward (nothing runs for it in backward itself):
        as torch's reducer records it, what forward did not reach (stage unused_params
        marks it ready at the first gradient), then the gradients as they came."""
        ended = self._backward  # the last backward, until a forward makes the next
        if ended.started and ended.finished and not self._ready_order and not self._rebuilt:
            if self._order_is_static():
                self._ready_order = [*ended.unreached, *ended.arrived]

    # --8<-- [end:backward]


if __name__ == "__main__":
    from ddp.train import main

    main(RebuiltBucketsDDP)
