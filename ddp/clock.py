"""Marks in time that mean the same on a CPU and on a GPU.

On a CPU, work is done when the call returns, so a wall clock read in a hook or after
a collective is when that work finished. On a GPU, the call only queues kernels: the
wall clock then reads when the CPU queued the work, which can be long before the GPU
did it. A CUDA event recorded on the current stream marks when the GPU reaches it.

    clock = DeviceClock(device)
    start = clock.mark()
    ...  # work, e.g. a gradient hook that keeps clock.mark()
    clock.wait()
    seconds = clock.seconds(start, end)
"""

from __future__ import annotations

import time

import torch

Mark = float | torch.cuda.Event


class DeviceClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        """Now: on a GPU, an event on the current stream (in a gradient hook, the stream
        that computed the gradient)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self) -> None:
        """Until every mark so far has been reached (before reading `seconds`)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Mark, end: Mark) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def now(self) -> float:
        """Wall-clock seconds once the device has finished what was queued: for timing
        whole steps or collectives."""
        self.wait()
        return time.perf_counter()
