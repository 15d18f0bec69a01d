"""The profiler span every all-reduce of gradients is recorded under, written and read here.

The stages label each all-reduce `allreduce <what> (<N> B)` with `record_function`, so a
trace says what travelled and how many bytes; `profiling.analysis` reads the bytes back
from the same label."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext

from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

ALLREDUCE_BYTES = re.compile(r"^allreduce .*\((\d+) B\)$")  # group 1: the bytes
_NOTHING = nullcontext()


def allreduce_span(what: str, nbytes: int) -> str:
    """The span label for an all-reduce of `nbytes` bytes of `what` (a parameter, a bucket)."""
    return f"allreduce {what} ({nbytes} B)"


def span(label: str) -> AbstractContextManager:
    """`record_function(label)` while a profiler records, else a context that does nothing:
    a span costs a few microseconds even with no profiler, and the stages open one per
    bucket every step."""
    return record_function(label) if _profiler_enabled() else _NOTHING
