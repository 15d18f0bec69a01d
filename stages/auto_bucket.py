"""Stage 13, auto_bucket: `bucket_cap_mb="auto"` picks the bucket size from measurements.

The best bucket size is a trade: small buckets start communicating early and overlap
more of backward, but each collective pays a fixed cost; large ones pay it rarely but
start late. The best cap depends on the model, the machine and the network, so torch
leaves it to you (25 MiB by default); Horovod autotunes its fusion buffer instead.
This stage measures and decides. In the second synchronised backward it records when
each gradient became ready; then, at the next forward, it times a few all-reduces
(a tiny one for the fixed cost, a large one for the bandwidth), takes the slowest
rank's figures so that every rank computes the same answer, replays that backward for
each candidate cap with those costs, and rebuilds the buckets with the cap whose
communication would end first.

    model = AutoBucketDDP(model, bucket_cap_mb="auto")
    ...  # after the third step: model.auto_bucket_choice["bucket_cap_mb"]

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

from ddp.buckets import Bucket, Members, plan_buckets
from stages.join import JoinDDP

CANDIDATES_MB = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 1e6)  # 1e6: one bucket


# --8<-- [start:construction]
class AutoBucketDDP(JoinDDP):
    """Stage 13: `bucket_cap_mb="auto"`: the cap that measured timings say ends first."""

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
        named = [self.named_trainable[k] for k in order]
        first = lambda cap: min(cap, self.first_bucket_cap_mb or cap)  # noqa: E731
        predicted = {
            cap: _replay(
                plan_buckets(
                    named,
                    cap,
                    first_bucket_cap_mb=first(cap),
                    ready_order=True,
                    sparse=self._sparse,
                ),
                ready_s,
                self._position,
                latency_s,
                s_per_byte,
            )
            for cap in CANDIDATES_MB
        }
        best = min(predicted.values())
        cap = max(c for c, t in predicted.items() if t <= best * 1.01)  # near-ties: fewer
        self.auto_bucket_choice = {
            "bucket_cap_mb": cap,
            "latency_s": latency_s,
            "bandwidth_MBps": 1e-6 / s_per_byte if s_per_byte > 0 else float("inf"),
            "backward_s": max(ready_s),
            "predicted_s": predicted,
        }
        self._rebuild_buckets(order, cap, first(cap))  # the replayed order: the same everywhere

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
