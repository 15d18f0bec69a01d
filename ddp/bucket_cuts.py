"""Where to cut buckets: the layout whose last all-reduce a simple model says ends first.

torch's DDP, and the stages, cut buckets at one uniform cap (`bucket_cap_mb`), so every
bucket but the first holds about as many bytes as the others. The best layout need not
be uniform: a large bucket is cheap while backward still has gradients to make, but the
last one waits for the end of backward, and whatever it holds is paid after it. This
module finds the best layout of all, for the model the automatic bucket size
(`stages/auto_bucket.py`) replays:

- gradients are taken in the order they become ready, and a bucket is a run of
  consecutive ones (as the rebuilt buckets are);
- bucket j's all-reduce starts when its last gradient is ready and bucket j - 1's has
  ended (one stream of collectives, served in bucket order), and takes `cost_s(bytes)`:
  a fixed latency plus bytes x seconds per byte;
- a layout's time is when its last all-reduce ends.

Why a dynamic program over prefixes is exact. A bucket's end depends on the buckets
before it only through when the previous one ended, and an earlier previous end never
makes it end later. So, of all the layouts of the first j gradients, one that ends
earliest is as good a start as any for what follows, and the earliest end over the
first i gradients is

    E[0] = no collective yet;  E[i] = min over j < i of max(E[j], ready(j..i)) + cost(j..i)

where j..i is the last bucket, gradients j to i - 1. That is O(n^2) pairs (j, i).

Fewest buckets among the near-best. The model counts an all-reduce's latency, but not
the CPU each one takes from backward on a machine whose cores do both; its exact
optimum can buy a microsecond with one more bucket. So the layout returned is the one
with the fewest buckets whose end is within `slack` (a fraction) of the best (with
slack 0: the fewest among those that end earliest), found by the same recurrence with
the number of buckets k as a second index (E_k[i]: the earliest end of the first i
gradients in exactly k buckets), for k = 1, 2, ... until one is close enough: O(n^2)
per k.

What a bucket may hold is what `ddp.buckets.plan_buckets` allows: one dtype on one
device (a flat buffer has one of each), and a gradient that is sparse alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the cost model and the cut need no torch
    from torch import nn

    from ddp.buckets import Members

CostModel = Callable[[int], float]  # bytes -> seconds one all-reduce of them takes
# Ends this close (a fraction) are the same: two layouts add the same costs in another
# order, and rounding can tell them apart by a last bit.
ROUNDING = 1e-9


@dataclass(frozen=True)
class Cut:
    """A layout: how many consecutive gradients each bucket holds, in launch order."""

    sizes: list[int]  # gradients per bucket; they sum to the number of gradients
    end_s: float  # when this layout's last all-reduce ends, by the model
    best_end_s: float  # the earliest any layout ends; end_s is within the slack of it


@dataclass(frozen=True)
class LinearCost:
    """The one cost of an all-reduce the project's models share: a fixed latency, then
    bytes at one rate. The automatic bucket size cuts by it (here and in
    `stages/auto_bucket.py`); the simulator splits it into the latency nothing else
    slows and the time on the wire (`profiling.simulate.schedule.linear_cost`)."""

    latency_s: float
    s_per_byte: float

    def wire_s(self, nbytes: float) -> float:
        return nbytes * self.s_per_byte

    def __call__(self, nbytes: float) -> float:
        return self.latency_s + self.wire_s(nbytes)


def linear_cost(latency_s: float, s_per_byte: float) -> LinearCost:
    """A fixed latency per all-reduce, then bytes at one rate."""
    return LinearCost(latency_s, s_per_byte)


def served_in_order(ready_s: Sequence[float], seconds: Sequence[float]) -> float:
    """When the last of a stream of collectives ends: collective j starts at
    max(ready_s[j], the end of collective j - 1) and takes seconds[j]."""
    end = -math.inf
    for ready, took in zip(ready_s, seconds, strict=True):
        end = max(end, ready) + took
    return end


# --8<-- [start:cut]
def cut_buckets(
    ready_s: Sequence[float],
    nbytes: Sequence[int],
    cost_s: CostModel,
    *,
    joins_previous: Sequence[bool] | None = None,
    slack: float = 0.0,
) -> Cut:
    """The fewest buckets of consecutive gradients 0..n-1 (in launch order: the order
    they become ready) whose last all-reduce ends within (1 + slack) x the earliest any
    such layout can end (to rounding: ROUNDING).

    `joins_previous[i]` says whether gradient i may share a bucket with gradient i - 1
    (default: all may); gradient 0 always starts one."""
    n = len(ready_s)
    if len(nbytes) != n or (joins_previous is not None and len(joins_previous) != n):
        raise ValueError(
            f"ready_s, nbytes and joins_previous must have one entry per gradient, got "
            f"{n}, {len(nbytes)} and {None if joins_previous is None else len(joins_previous)}"
        )
    if not slack >= 0:
        raise ValueError(f"slack must be >= 0 (a fraction of the best end), got {slack}")
    if n == 0:
        return Cut([], 0.0, 0.0)
    joins = [False, *([True] * (n - 1) if joins_previous is None else joins_previous[1:])]
    # The lowest gradient a bucket ending at gradient i - 1 may start at: the last one
    # that may not join the gradient before it.
    lowest = [0] * (n + 1)
    for i in range(1, n + 1):
        lowest[i] = i - 1 if not joins[i - 1] else lowest[i - 1]
    prefix_bytes = [0]
    for b in nbytes:
        prefix_bytes.append(prefix_bytes[-1] + b)

    def relax(previous: list[float], ends: list[float], starts: list[int]) -> None:
        """ends[i] = the earliest end over the first i gradients of a layout whose last
        bucket follows a prefix that ended at previous[j]; starts[i] = that bucket's j.
        With `previous is ends`, the prefix may have any number of buckets: E above."""
        for i in range(1, n + 1):
            full_s = -math.inf  # when the last bucket's last gradient is ready
            for j in range(i - 1, lowest[i] - 1, -1):  # the last bucket: gradients j..i-1
                full_s = max(full_s, ready_s[j])
                end = max(previous[j], full_s) + cost_s(prefix_bytes[i] - prefix_bytes[j])
                if end <= ends[i]:  # at a tie, the larger last bucket
                    ends[i], starts[i] = end, j

    best = [-math.inf] + [math.inf] * n  # E[0]: no collective yet
    relax(best, best, [0] * (n + 1))
    # Layer k: the earliest ends with exactly k buckets, k = 1, 2, ... until close enough.
    previous = [-math.inf] + [math.inf] * n  # no gradient in no bucket
    starts_by_layer: list[list[int]] = []
    while True:
        ends, starts = [math.inf] * (n + 1), [0] * (n + 1)
        relax(previous, ends, starts)
        starts_by_layer.append(starts)
        if ends[n] <= best[n] + (slack + ROUNDING) * abs(best[n]) or len(starts_by_layer) == n:
            break
        previous = ends
    sizes, i = [], n  # walk back: each bucket's start, from the layer with one fewer
    for starts in reversed(starts_by_layer):
        sizes.append(i - starts[i])
        i = starts[i]
    return Cut(sizes[::-1], ends[n], best[n])


# --8<-- [end:cut]


def plan_cut(
    named_params: Sequence[tuple[str, nn.Parameter]],
    ready_s: Sequence[float],
    cost_s: CostModel,
    *,
    sparse: frozenset[str] = frozenset(),
    slack: float = 0.0,
) -> tuple[list[Members], Cut]:
    """`cut_buckets` on parameters given in the order their gradients became ready
    (`ready_s[i]`: parameter i's), as `plan_buckets` lays them out: lists of (name,
    parameter) per bucket, in launch order; a bucket holds one dtype on one device,
    and a parameter named in `sparse` is alone in its bucket."""
    if len(ready_s) != len(named_params):
        raise ValueError(
            f"ready_s has {len(ready_s)} times for {len(named_params)} parameters; "
            "give one per parameter"
        )
    trainable = [(k, item) for k, item in enumerate(named_params) if item[1].requires_grad]
    kinds = [(p.dtype, p.device, name in sparse) for _, (name, p) in trainable]
    joins = [i > 0 and kinds[i] == kinds[i - 1] and not kinds[i][2] for i in range(len(trainable))]
    cut = cut_buckets(
        [ready_s[k] for k, _ in trainable],
        [p.numel() * p.element_size() for _, (_, p) in trainable],
        cost_s,
        joins_previous=joins,
        slack=slack,
    )
    plan, start = [], 0
    for size in cut.sizes:
        plan.append([item for _, item in trainable[start : start + size]])
        start += size
    return plan, cut


def bucket_bytes(plan: Sequence[Members]) -> list[int]:
    """Gradient bytes of each bucket of a plan."""
    return [sum(p.numel() * p.element_size() for _, p in members) for members in plan]
