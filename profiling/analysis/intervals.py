"""Interval algebra: merged lists of disjoint, sorted (start, end) pairs, in microseconds,
the traces' unit. Every figure of the analysis is a length of such a list."""

from __future__ import annotations

Interval = tuple[float, float]  # (start, end) in microseconds, the traces' unit


def merge(intervals) -> list[Interval]:
    """The union of any intervals, as a sorted list of disjoint ones (empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    """Total length of merged intervals."""
    return sum(end - start for start, end in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a ∩ b for two merged lists (one pass over both)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:  # the one that ends first can meet nothing further on
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a minus b for two merged lists."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if end > start:
            out.append((start, end))
    return out


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    """Merged intervals cut to [lo, hi]."""
    return intersect(intervals, [(lo, hi)]) if hi > lo else []
