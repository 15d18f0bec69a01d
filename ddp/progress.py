"""Progress of long work, on rank 0: which run of how many, step k of N with the median
step time so far, and an estimate of the time left.

On a terminal it is one line, redrawn in place as steps finish. Where the output is not
a terminal (a log file, a pipe, CI) it prints nothing while a run goes, and one line when
it finishes, so logs stay readable:

    [3/16] overlapped | step 12/23 | 41.2 ms/step | ~14 s left     (terminal, redrawn)
    [3/16] overlapped: 23 steps, 40.8 ms/step, 1.1 s; ~12 s left    (each finished run)

It writes to stderr: stdout keeps the results, which people and tools read."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from typing import IO


class Progress:
    """`runs` runs that together hold `work` units of work: steps, or whatever time is
    proportional to (the estimate of what is left assumes it is)."""

    REDRAW_S = 0.1  # at most ten redraws a second, so a fast loop does not pay for output

    def __init__(self, runs: int, work: float, stream: IO[str] | None = None) -> None:
        self.runs, self.work = runs, work
        self.stream = stream or sys.stderr
        self.enabled = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 only
        self.live = self.enabled and self.stream.isatty()
        self.started = time.perf_counter()
        self.index = 0  # of the current run, from 1
        self.finished_work = 0.0  # planned work of the finished runs, even if one stopped early
        self.drawn_at = 0.0

    def start(
        self, name: str, steps: int, work: float | None = None, unit: str = "step", of: str = ""
    ) -> None:
        """Run `name` begins: `steps` steps (or epochs: `unit`) holding `work` units of
        work (default: one per step). `of` says whose steps the median is, where a table
        reports another figure (ddp.train's: the slowest rank's)."""
        self.index += 1
        self.name, self.steps, self.unit, self.of = name, steps, unit, of
        self.run_work = steps if work is None else work
        self.run_work_done = 0.0
        self.step_s: list[float] = []
        self.detail = ""
        self.run_started = time.perf_counter()
        self._draw(force=True)

    def step(self, seconds: float, work: float = 1, detail: str = "") -> None:
        """One step of the current run took `seconds`; `detail` names what it was."""
        self.step_s.append(seconds)
        self.run_work_done += work
        self.detail = detail
        self._draw()

    def finish(self, summary: str = "") -> None:
        """The current run is done: its line, with `summary` (a result worth a glance)."""
        self.finished_work += self.run_work
        self.run_work_done = 0.0
        parts = []
        if self.step_s:
            parts += [f"{len(self.step_s)} {self.unit}s", self._step_time()]
        parts += [summary] if summary else []
        if self.step_s:
            parts.append(duration(time.perf_counter() - self.run_started))
        line = f"[{self.index}/{self.runs}] {self.name}: {', '.join(parts)}"
        if self.index < self.runs:
            line += f"; {self._left()}"
        elif self.runs > 1:
            line += f"; all {self.runs} in {duration(time.perf_counter() - self.started)}"
        self._print(line)

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.live or (not force and now - self.drawn_at < self.REDRAW_S):
            return
        self.drawn_at = now
        parts = [f"[{self.index}/{self.runs}] {self.name}"]
        parts += [self.detail] if self.detail else []
        parts.append(f"{self.unit} {len(self.step_s)}/{self.steps}")
        if self.step_s:
            parts.append(self._step_time())
        parts.append(self._left())
        # One terminal line, or the carriage return would redraw only its last part.
        width = shutil.get_terminal_size().columns - 1
        self.stream.write("\r" + " | ".join(parts)[:width] + "\x1b[K")
        self.stream.flush()

    def _print(self, line: str) -> None:
        if self.enabled:
            self.stream.write(("\r\x1b[K" if self.live else "") + line + "\n")
            self.stream.flush()

    def _step_time(self) -> str:
        """The median step of the run so far: robust to a slow first step."""
        seconds = statistics.median(self.step_s)
        took = f"{seconds * 1e3:.1f} ms" if seconds < 1 else duration(seconds)
        return f"{took}/{self.unit}" + (f" ({self.of})" if self.of else "")

    def _left(self) -> str:
        done = self.finished_work + self.run_work_done
        if done <= 0:
            return "estimating time left"
        elapsed = time.perf_counter() - self.started
        return f"~{duration(elapsed / done * max(self.work - done, 0))} left"


def duration(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 1 h 02 min: as precise as a glance needs."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"
