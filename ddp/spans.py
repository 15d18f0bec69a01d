"""The profiler span every all-reduce of gradients is recorded under, written and read here.

The stages label each all-reduce `allreduce <what> (<N> B)` with `record_function`, so a
trace says what travelled and how many bytes; `profiling.analysis` reads the bytes back
from the same label."""

from __future__ import annotations

import re

ALLREDUCE_BYTES = re.compile(r"^allreduce .*\((\d+) B\)$")  # group 1: the bytes


def allreduce_span(what: str, nbytes: int) -> str:
    """The span label for an all-reduce of `nbytes` bytes of `what` (a parameter, a bucket)."""
    return f"allreduce {what} ({nbytes} B)"
