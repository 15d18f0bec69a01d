"""The model's bucket cut (ddp.bucket_cuts) against every layout tried one by one, and
against layouts worked out by hand.

The brute force is an independent computation: it lists every way to cut n gradients
into runs (2^(n-1) of them), replays each with a loop of its own, and keeps the earliest
end and, within the slack, the fewest buckets."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddp.bucket_cuts import cut_buckets, linear_cost, plan_cut, served_in_order


def every_layout(n: int):
    """Every way to cut 0..n-1 into runs, as lists of run lengths."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, length = [], 1
        for cut in cuts:
            if cut:
                sizes.append(length)
                length = 0
            length += 1
        yield [*sizes, length]


def replay(sizes, ready_s, nbytes, latency_s, s_per_byte) -> float:
    """The last all-reduce's end, bucket by bucket, written out for the test."""
    end, start = None, 0
    for size in sizes:
        members = range(start, start + size)
        full = max(ready_s[i] for i in members)
        begin = full if end is None else max(end, full)
        end = begin + latency_s + sum(nbytes[i] for i in members) * s_per_byte
        start += size
    return end


def allowed(sizes, joins) -> bool:
    """No bucket holds a gradient with one before it that it may not join."""
    start = 0
    for size in sizes:
        if not all(joins[i] for i in range(start + 1, start + size)):
            return False
        start += size
    return True


@st.composite
def cases(draw):
    n = draw(st.integers(1, 8))
    times = st.floats(0, 10, allow_nan=False).map(lambda t: round(t, 3))
    ready_s = draw(st.lists(times, min_size=n, max_size=n))
    if draw(st.booleans()):  # the order they became ready in, as the stage gives them
        ready_s.sort()
    nbytes = draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    joins = draw(st.lists(st.integers(0, 4).map(bool), min_size=n, max_size=n))
    latency_s = draw(st.sampled_from([0.0, 0.01, 0.5, 3.0]))
    s_per_byte = draw(st.sampled_from([0.0, 1e-4, 1e-2]))
    slack = draw(st.sampled_from([0.0, 0.01, 0.2]))
    return ready_s, nbytes, joins, latency_s, s_per_byte, slack


@settings(max_examples=400, deadline=None)
@given(case=cases())
def test_cut_is_the_best_of_every_layout(case) -> None:
    ready_s, nbytes, joins, latency_s, s_per_byte, slack = case
    cut = cut_buckets(
        ready_s, nbytes, linear_cost(latency_s, s_per_byte), joins_previous=joins, slack=slack
    )
    layouts = [s for s in every_layout(len(ready_s)) if allowed(s, joins)]
    ends = {tuple(s): replay(s, ready_s, nbytes, latency_s, s_per_byte) for s in layouts}
    best = min(ends.values())
    assert cut.best_end_s == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert tuple(cut.sizes) in ends, f"{cut.sizes} is not an allowed layout of {joins}"
    assert cut.end_s == pytest.approx(ends[tuple(cut.sizes)], rel=1e-12, abs=1e-12)
    close = [s for s, end in ends.items() if end <= best * (1 + slack + 1e-9)]
    assert tuple(cut.sizes) in close, f"{cut.sizes} ends at {cut.end_s}, best {best}"
    assert len(cut.sizes) == min(len(s) for s in close), (
        f"{cut.sizes}: {len(cut.sizes)} buckets, but {min(close, key=len)} is within the "
        f"slack with fewer"
    )


def test_hand_worked_three_gradients() -> None:
    # Ready at 0, 1 and 10 s, 100 bytes each; 1 s + 100 bytes per second.
    #   [g0][g1][g2]: 0-2, 2-4, 10-12      -> 12
    #   [g0 g1][g2]:  1-4, 10-12           -> 12 with one bucket fewer
    #   [g0][g1 g2]:  0-2, 10-13           -> 13
    #   [g0 g1 g2]:   10-14                -> 14
    cut = cut_buckets([0.0, 1.0, 10.0], [100, 100, 100], linear_cost(1.0, 0.01))
    assert cut.sizes == [2, 1]
    assert cut.end_s == pytest.approx(12.0)
    assert cut.best_end_s == pytest.approx(12.0)


def test_hand_worked_slack_buys_fewer_buckets() -> None:
    # Ready at 0, 0, 4; 100 bytes each; no latency, 100 bytes per second:
    #   [g0][g1][g2] and [g0 g1][g2]: 0-2, then g2 at 4-5 -> 5
    #   [g0 g1 g2]: 4-7 -> 7, 40% later: one bucket takes a slack of 0.4, not 0.39.
    cost = linear_cost(0.0, 0.01)
    assert cut_buckets([0.0, 0.0, 4.0], [100] * 3, cost).sizes == [2, 1]
    assert cut_buckets([0.0, 0.0, 4.0], [100] * 3, cost, slack=0.39).sizes == [2, 1]
    wide = cut_buckets([0.0, 0.0, 4.0], [100] * 3, cost, slack=0.4)
    assert (wide.sizes, wide.end_s, wide.best_end_s) == ([3], pytest.approx(7.0), 5.0)


def test_hand_worked_a_break_the_bucket_cannot_cross() -> None:
    # All ready at once: one bucket is best (one latency), unless gradient 2 may not
    # join gradient 1 (another dtype): then two.
    cost = linear_cost(1.0, 0.0)
    assert cut_buckets([0.0] * 4, [8] * 4, cost).sizes == [4]
    split = cut_buckets([0.0] * 4, [8] * 4, cost, joins_previous=[True, True, False, True])
    assert (split.sizes, split.end_s) == ([2, 2], pytest.approx(2.0))


def test_served_in_order_by_hand() -> None:
    # Ready at 1, 2, 10; taking 3 s each: 1-4, 4-7, 10-13.
    assert served_in_order([1.0, 2.0, 10.0], [3.0, 3.0, 3.0]) == 13.0


def test_plan_cut_keeps_kinds_apart_and_sparse_alone() -> None:
    def param(n: int, dtype=torch.float32) -> nn.Parameter:
        return nn.Parameter(torch.empty(n, dtype=dtype, device="meta"))

    frozen = param(4)
    frozen.requires_grad_(False)
    named = [
        ("a", param(4)),
        ("b", param(4)),
        ("frozen", frozen),
        ("half", param(4, torch.float16)),
        ("c", param(4)),
        ("emb", param(4)),
        ("d", param(4)),
    ]
    # Everything ready at once and a latency per all-reduce: as few buckets as allowed.
    plan, cut = plan_cut(named, [0.0] * len(named), linear_cost(1.0, 0.0), sparse={"emb"})
    assert [[name for name, _ in members] for members in plan] == [
        ["a", "b"],
        ["half"],
        ["c"],
        ["emb"],
        ["d"],
    ]
    assert cut.sizes == [2, 1, 1, 1, 1]


def test_bad_arguments_say_which() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        cut_buckets([0.0, 1.0], [1], linear_cost(0.0, 0.0))
    with pytest.raises(ValueError, match="slack"):
        cut_buckets([0.0], [1], linear_cost(0.0, 0.0), slack=-0.1)
    assert cut_buckets([], [], linear_cost(0.0, 0.0)).sizes == []
