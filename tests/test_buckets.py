"""The bucket layout the stages promise (reverse parameter order, at most bucket_cap_mb
MiB each unless one parameter alone is larger, one dtype per bucket), as properties over
drawn parameter lists."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from ddp.buckets import assign_buckets, plan_buckets

DTYPES = [torch.float32, torch.float64, torch.float16]


@st.composite
def parameter_lists(draw) -> list[tuple[str, nn.Parameter]]:
    params = []
    for i in range(draw(st.integers(1, 12))):
        p = nn.Parameter(
            torch.zeros(draw(st.integers(1, 300)), dtype=draw(st.sampled_from(DTYPES))),
            requires_grad=draw(st.integers(0, 4)) > 0,  # one in five frozen
        )
        params.append((f"p{i}", p))
    return params


@settings(max_examples=300, deadline=None)
@given(named=parameter_lists(), cap_mb=st.floats(1e-6, 2e-3))
def test_bucket_layout(named, cap_mb: float) -> None:
    buckets = assign_buckets(named, cap_mb)
    cap_bytes = cap_mb * 2**20
    trainable = [name for name, p in named if p.requires_grad]
    reverse_position = {name: i for i, name in enumerate(reversed(trainable))}
    # Every trainable parameter in exactly one bucket; frozen ones in none.
    assert sorted(n for b in buckets for n in b.names) == sorted(trainable)
    for b in buckets:
        assert len({p.dtype for p in b.params}) == 1, "a bucket holds one dtype"
        assert b.buffer.dtype == b.params[0].dtype
        assert b.buffer.numel() == sum(p.numel() for p in b.params)
        assert b.nbytes <= cap_bytes or len(b.params) == 1, "over the cap with >1 parameter"
        positions = [reverse_position[n] for n in b.names]
        assert positions == sorted(positions), "within a bucket, reverse parameter order"
    # Buckets in the order of their first parameter in reverse order: the same on
    # every rank, and roughly the order backward fills them in.
    firsts = [reverse_position[b.names[0]] for b in buckets]
    assert firsts == sorted(firsts)
    # Greedy: a bucket was closed only because the next parameter of its dtype would
    # have pushed it over the cap.
    for dtype in DTYPES:
        same = [b for b in buckets if b.buffer.dtype == dtype]
        for b, following in zip(same, same[1:], strict=False):
            nxt = following.params[0]
            assert b.nbytes + nxt.numel() * nxt.element_size() > cap_bytes


@settings(max_examples=300, deadline=None)
@given(named=parameter_lists(), ready_order=st.booleans(), data=st.data())
def test_overfill_cuts_as_torchs_own_assignment(named, ready_order: bool, data) -> None:
    """`overfill=True` (the drop-in's rule) cuts the gradients it is given where torch's
    DDP cuts them (torch's own `_compute_bucket_assignment_by_size`, given the same
    order): the same buckets, with the same members in the same order. The order of the
    buckets is this project's (by their first gradient): torch's as well for one dtype."""
    trainable = [(name, p) for name, p in named if p.requires_grad]
    assume(trainable)
    ordered = trainable if ready_order else trainable[::-1]  # the order plan_buckets cuts
    # Caps of whole bytes, often what a run of gradients holds exactly: where a bucket
    # reaches its cap, and the two rules part.
    sizes = [p.numel() * p.element_size() for _, p in ordered]
    runs = sorted(
        {sum(sizes[i:j]) for i in range(len(sizes)) for j in range(i + 1, len(sizes) + 1)}
    )
    cap_bytes = st.sampled_from(runs) | st.integers(1, 2400)
    cap, first_cap = data.draw(cap_bytes), data.draw(st.none() | cap_bytes)
    plan = plan_buckets(
        named,
        cap / 2**20,
        first_bucket_cap_mb=None if first_cap is None else first_cap / 2**20,
        ready_order=ready_order,
        overfill=True,
    )
    index = {name: i for i, (name, _) in enumerate(ordered)}
    ours = [[index[name] for name, _ in members] for members in plan]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [p for _, p in ordered],
        [first_cap or cap, cap],
        [False] * len(ordered),
        list(range(len(ordered))),  # labels: given, torch keeps its closing order
    )
    theirs = [list(bucket) for bucket in theirs]
    assert sorted(ours) == sorted(theirs), f"ours {ours}, torch's {theirs}"
    if len({p.dtype for _, p in trainable}) == 1:
        assert ours == theirs


def test_views_are_the_gradients_slots() -> None:
    a, b = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))
    (bucket,) = assign_buckets([("a", a), ("b", b)], bucket_cap_mb=1.0)
    assert bucket.names == ["b", "a"]  # reverse order
    bucket.buffer.copy_(torch.arange(10.0))
    assert torch.equal(bucket.view_of(0), torch.arange(4.0))
    assert torch.equal(bucket.view_of(1), torch.arange(4.0, 10.0).view(2, 3))
