"""What `static_graph=True` adds: the counts its first synchronised backward learns, and
what the steps after it do with them (`StaticGraph`); and the node on forward's outputs
that starts each synchronised step (`through_sink`). The all-reduce that learns them
needs the process group: it stays in the drop-in's class (`_learn_static_graph`)."""

from __future__ import annotations

import weakref

from torch import nn

from stages.drop_in.reducer import Sink, flatten


# --8<-- [start:static_graph]
class StaticGraph:
    """Per trainable position, how many times its gradient came in the first synchronised
    backward (`expected`), which never came (`unused`), and what that makes per bucket."""

    def __init__(self, expected: list[int]):
        self.expected = expected
        self.unused = [k for k, count in enumerate(expected) if count == 0]
        self._pending: tuple[list, list[int]] | None = None  # (buckets, counts) for them

    def pending_counts(self, buckets: list, bucket_of: list[int]) -> list[int]:
        """Per bucket, how many gradients it waits for: each as often as the first step
        brought it; an unused one once, as it is ready at the start of backward."""
        if self._pending is None or self._pending[0] is not buckets:  # rebuilt: count again
            counts = [0] * len(buckets)
            for k, expected in enumerate(self.expected):
                counts[bucket_of[k]] += max(expected, 1)
            self._pending = (buckets, counts)
        return list(self._pending[1])

    def arrivals(self) -> list[int]:
        """What a rank that left under join reports as come: each gradient as often as
        the first step brought it."""
        return [k for k, count in enumerate(self.expected) for _ in range(count)]

    def problems(self, arrived: list[int], named: list[tuple[str, nn.Parameter]]) -> list[str]:
        """Each gradient that came, but more or fewer times than in the first step (one
        that did not come at all is missing: the earlier stages report it)."""
        counts = counted(arrived, len(self.expected))
        if counts == self.expected:
            return []
        return [
            f"'{name}' got {counts[k]} gradient(s) in this backward where the first got "
            f"{self.expected[k]}: static_graph=True promises the same graph every step"
            for k, (name, _) in enumerate(named)
            if counts[k] != self.expected[k] and counts[k] > 0
        ]


def counted(arrived: list[int], n: int) -> list[int]:
    """Per position of `n`, how many times it is in `arrived`."""
    counts = [0] * n
    for k in arrived:
        counts[k] += 1
    return counts


def through_sink(ddp: nn.Module, output):
    """Forward's tensors pass through a node whose backward, the first thing backward
    runs, queues the end-of-backward callback (as torch's _DDPSink does). Queued at the
    first gradient instead, it would join the graph task of a reentrant checkpoint's
    inner backward if a gradient came first from there, and finish the step before the
    outer gradients come."""
    tensors, rebuild = flatten(output)
    # Only tensors in a graph: one made without autograd (a metric, an index) stays as
    # it was, as torch leaves it (a Sink output would require grad).
    chosen = [i for i, t in enumerate(tensors) if t.grad_fn is not None]
    if not chosen:
        return output
    passed = Sink.apply(weakref.ref(ddp), *(tensors[i] for i in chosen))
    for i, t in zip(chosen, passed, strict=True):
        tensors[i] = t
    return rebuild(tensors)


# --8<-- [end:static_graph]
