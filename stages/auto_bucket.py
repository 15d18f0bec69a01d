"""Stage 13, auto_bucket: `bucket_cap_mb="auto"` picks the bucket size from measurements.

The best bucket size is a trade: small buckets start communicating early and overlap
more of backward, but each collective pays a fixed cost; large ones pay it rarely but
start late. The best cap depends on the model, the machine and the network, so torch
leaves it to you (25 MiB by default); Horovod autotunes its fusion buffer instead.
This stage measures and decides. In the second synchronised backward it records when
each gradient became ready; then, at the next forward, it times a few all-reduces
(a tiny one for the fixed cost, a large one for the bandwidth), takes the slowest
rank's figures so that every rank computes the same answer, and replays that backward
with those costs, for two kinds of layout: every candidate uniform cap, as torch would
cut, and the model's own cut, where each bucket gets the size that makes the last
all-reduce end first (a dynamic program over where to cut the ready order,
`ddp/bucket_cuts.py`; torch takes one cap for every bucket, and a list of caps per
bucket was proposed upstream but not merged). It rebuilds the buckets with the cut if
that is predicted to end before the best uniform cap, and with that cap otherwise.

    model = AutoBucketDDP(model, bucket_cap_mb="auto")
    ...  # after the third step: model.auto_bucket_choice["bucket_sizes_bytes"]

    python -m profiling.bench --variants drop_in_auto,torch_ddp_default --network 1gbit

The model is simple on purpose: a collective starts when its bucket is full and the
previous one is done, and takes `latency + bytes x seconds-per-byte`. It ignores that
compute slows down while communication runs. Cost: a few all-reduces once, and the
first steps run with the default cap.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ddp.bucket_cuts import ROUNDING, bucket_bytes, linear_cost, plan_cut
from ddp.buckets import Bucket, Members, plan_buckets
from stages.join import JoinDDP

CANDIDATES_MB = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 1e6)  # 1e6: one bucket
NEAR_TIE = 0.01  # layouts predicted within 1% of the best are ties: the fewest buckets win


# --8<-- [start:construction]
class AutoBucketDDP(JoinDDP):
    """Stage 13: `bucket_cap_mb="auto"`: buckets cut where measured timings say
    communication ends first."""

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | str = 25.0, **options):
        auto = bucket_cap_mb == "auto"
        if isinstance(bucket_cap_mb, str) and not auto:
            raise ValueError(
                f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}"
            )
        if auto and options.get("find_unused_parameters"):
            raise ValueError(
                "bucket_cap_mb='auto' rebuilds buckets in the order gradients become ready, "
                "which find_unused_parameters=True allows to change every step"
            )
        super().__init__(module, bucket_cap_mb=25.0 if auto else bucket_cap_mb, **options)
        self.auto_bucket = auto
        self._ready_s: dict[int, float] = {}  # status row position -> seconds since first ready
        self._first_ready_s = 0.0  # perf_counter() at the first gradient of that backward
        self.auto_bucket_choice: dict | None = None  # what was measured and chosen
        self._cut_sizes: list[int] | None = None  # the model's buckets, in parameters

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def _before_synced_forward(self) -> None:
        super()._before_synced_forward()
        # After the second synchronised backward (shadowed ones count: Join), on every rank.
        if self.auto_bucket and self._synced_backwards >= 2 and self.auto_bucket_choice is None:
            self._choose_bucket_cap()

    def _choose_bucket_cap(self) -> None:
        n = len(self.named_trainable)
        measured = torch.zeros(n + 2, dtype=torch.float64)
        for k, seconds in self._ready_s.items():
            measured[k] = seconds
        measured[n], measured[n + 1] = self._time_allreduce()
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.process_group)
        ready_s, (latency_s, s_per_byte) = measured[:n].tolist(), measured[n:].tolist()
        order = sorted(range(n), key=lambda k: ready_s[k])
        self.auto_bucket_choice, self._cut_sizes = choose_layout(
            [self.named_trainable[k] for k in order],
            [ready_s[k] for k in order],
            latency_s,
            s_per_byte,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            sparse=self._sparse,
        )
        cap = self.auto_bucket_choice["bucket_cap_mb"]
        # The replayed order: the same everywhere.
        self._rebuild_buckets(order, cap, min(cap, self.first_bucket_cap_mb or cap))

    def _rebuilt_layout(
        self, named: Members, bucket_cap_mb: float, first_bucket_cap_mb: float | None
    ) -> list[Members]:
        if self._cut_sizes is None:  # before the choice, or the uniform cap won
            return super()._rebuilt_layout(named, bucket_cap_mb, first_bucket_cap_mb)
        plan, start = [], 0
        for size in self._cut_sizes:  # the model's buckets: runs of the ready order
            plan.append(named[start : start + size])
            start += size
        return plan

    def _time_allreduce(self) -> tuple[float, float]:
        """(fixed seconds per all-reduce, seconds per byte), from this rank's view."""
        device = self.buckets[0].buffer.device
        total = sum(b.buffer.numel() for b in self.buckets)
        small, large = torch.zeros(1, device=device), torch.zeros(min(total, 2**21), device=device)

        def seconds(t: torch.Tensor, repeats: int) -> float:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                dist.all_reduce(t, group=self.process_group)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        seconds(small, 1)  # warm the connection
        latency = seconds(small, 5)
        per_byte = max(seconds(large, 3) - latency, 0.0) / (large.numel() * large.element_size())
        return latency, per_byte

    # --8<-- [end:forward]

    # --8<-- [start:backward]
    def _mark_ready(self, bucket: Bucket, i: int, grad: torch.Tensor | None) -> None:
        if self.auto_bucket and self._synced_backwards == 1:  # the second: warmed up
            now = time.perf_counter()
            if not self._ready_s:
                self._first_ready_s = now
            self._ready_s[self._position[id(bucket.params[i])]] = now - self._first_ready_s
        super()._mark_ready(bucket, i, grad)

    # --8<-- [end:backward]


# --8<-- [start:choice]
def choose_layout(
    named: Members,
    ready_s: list[float],
    latency_s: float,
    s_per_byte: float,
    *,
    first_bucket_cap_mb: float | None,
    sparse: frozenset[str] = frozenset(),
) -> tuple[dict, list[int] | None]:
    """What `bucket_cap_mb="auto"` builds, given the parameters in the order their
    gradients became ready (`ready_s[i]`: parameter i's) and the cost of an all-reduce:
    the model's own cut where it is predicted to end first, else the best uniform cap.
    Returns the record `auto_bucket_choice` holds, and the cut's bucket lengths in
    parameters (None: the uniform cap's layout)."""
    position = {id(p): i for i, (_, p) in enumerate(named)}
    first = lambda cap: min(cap, first_bucket_cap_mb or cap)  # noqa: E731
    uniform = {
        cap: plan_buckets(
            named, cap, first_bucket_cap_mb=first(cap), ready_order=True, sparse=sparse
        )
        for cap in CANDIDATES_MB
    }
    predicted = {
        cap: _replay(plan, ready_s, position, latency_s, s_per_byte)
        for cap, plan in uniform.items()
    }
    best = min(predicted.values())
    uniform_cap = max(c for c, t in predicted.items() if t <= best * (1 + NEAR_TIE))
    plan, cut = plan_cut(
        named, ready_s, linear_cost(latency_s, s_per_byte), sparse=sparse, slack=NEAR_TIE
    )
    # The cut if it ends first, or as early (to rounding) in fewer buckets.
    uniform_s, cut_s = predicted[uniform_cap], cut.end_s
    use_cut = cut_s < uniform_s * (1 - ROUNDING) or (
        cut_s <= uniform_s * (1 + ROUNDING) and len(cut.sizes) < len(uniform[uniform_cap])
    )
    if use_cut:
        # The smallest candidate cap that every bucket of several gradients fits under:
        # what bucket_cap_mb still promises of this layout.
        several = [b for b, m in zip(bucket_bytes(plan), plan, strict=True) if len(m) > 1]
        cap = min(c for c in CANDIDATES_MB if all(b <= c * 2**20 for b in several))
    else:
        plan, cap = uniform[uniform_cap], uniform_cap
    record = {
        "layout": "cut" if use_cut else "uniform",
        "bucket_cap_mb": cap,
        "uniform_bucket_cap_mb": uniform_cap,
        "latency_s": latency_s,
        "bandwidth_MBps": 1e-6 / s_per_byte if s_per_byte > 0 else float("inf"),
        "backward_s": max(ready_s, default=0.0),
        "predicted_s": cut.end_s,  # the model's cut
        "predicted_uniform_s": predicted[uniform_cap],
        "predicted_by_cap_s": predicted,
        "bucket_sizes_bytes": bucket_bytes(plan),  # the layout built, in launch order
    }
    return record, cut.sizes if use_cut else None


# --8<-- [end:choice]


def _replay(
    plan: list[Members],
    ready_s: list[float],
    position: dict[int, int],
    latency_s: float,
    s_per_byte: float,
) -> float:
    """When the last all-reduce would end, in seconds after the first gradient."""
    end = 0.0
    for members in plan:
        full = max(ready_s[position[id(p)]] for _, p in members)
        nbytes = sum(p.numel() * p.element_size() for _, p in members)
        end = max(end, full) + latency_s + nbytes * s_per_byte
    return end


if __name__ == "__main__":
    from ddp.train import main

    main(AutoBucketDDP)
