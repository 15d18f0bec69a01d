"""Running one command per node at once: each started out of reach of the terminal's
Ctrl-C, waited for, and stopped (torchrun and its workers) on failure, timeout or a
signal."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from profiling.cluster.signals import _signals_deferred, _signals_raise


@dataclass
class NodeRun:
    returncode: int  # 0 if all nodes succeeded; else the first failure's; 124: timeout
    returncodes: list[int | None]  # per node; None: killed by us before it exited
    stdout: list[str]  # per node, when captured
    stderr: list[str]
    seconds: float

    def tail(self, chars: int = 3000) -> str:
        parts = []
        for k, (out, err) in enumerate(zip(self.stdout, self.stderr, strict=True)):
            parts.append(f"--- node {k} (exit {self.returncodes[k]}) ---\n{(out + err)[-chars:]}")
        return "\n".join(parts)


def run_nodes(
    commands: list[list[str]],
    env: dict[str, str],
    *,
    timeout: float | None = None,
    capture: bool = False,
    grace: float = 15.0,
    started: Callable[[list[subprocess.Popen]], None] | None = None,
) -> NodeRun:
    """Start every command, wait for all; kill the rest on failure, timeout or signal.

    Each node runs in a session of its own, so that a terminal's Ctrl-C reaches us
    only, and we stop every node (torchrun and its workers: the whole session) on
    the way out, whatever the way out is. `started` is given the processes, one per
    node, once all have started (a harness that kills one while the others run)."""
    start = time.monotonic()
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = [None] * len(commands)
    first_failure: int | None = None
    try:
        with _signals_raise():
            for command, (out, err) in zip(commands, files, strict=True):
                procs.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        start_new_session=True,
                        stdout=out if capture else None,
                        stderr=err if capture else None,
                    )
                )
            if started is not None:
                started(list(procs))
            failed_at = None
            while any(c is None for c in codes):
                for k, proc in enumerate(procs):
                    if codes[k] is None and proc.poll() is not None:
                        codes[k] = proc.returncode
                        if proc.returncode != 0 and first_failure is None:
                            first_failure, failed_at = proc.returncode, time.monotonic()
                now = time.monotonic()
                if timeout is not None and now - start > timeout:
                    first_failure = 124 if first_failure is None else first_failure
                    print(f"cluster: timeout after {timeout:g} s; stopping every node",
                          file=sys.stderr)  # fmt: skip
                    break
                if failed_at is not None and now - failed_at > grace:
                    print(f"cluster: a node failed; stopping the others after {grace:g} s",
                          file=sys.stderr)  # fmt: skip
                    break
                time.sleep(0.05)
    finally:
        with _signals_deferred():
            _stop(procs)
    outs, errs = [], []
    for out, err in files:
        for f, dest in ((out, outs), (err, errs)):
            f.seek(0)
            dest.append(f.read())
            f.close()
    if first_failure is None and any(c != 0 for c in codes):
        first_failure = next(c for c in codes if c != 0)
    return NodeRun(first_failure or 0, codes, outs, errs, time.monotonic() - start)


def _stop(procs: list[subprocess.Popen], wait: float = 5.0) -> None:
    """SIGTERM each still-running node's session: torchrun passes it on to its workers
    and exits. After `wait` seconds, SIGKILL what is left, workers included: torchrun
    starts each worker in a session of its own, which a killed torchrun would orphan."""
    alive = [p for p in procs if p.poll() is None]
    workers = [d for p in alive for d in _descendants(p.pid)]  # before they are orphaned
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)  # the session we made for it: pgid == its pid
    deadline = time.monotonic() + wait
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.poll() is None]
        time.sleep(0.05)
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    _kill_those_still_running(workers)
    for p in procs:
        p.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every process below it, as a machine that loses power:
    torchrun's workers run in sessions of their own, out of reach of its process group."""
    below = _descendants(pid)  # before they are orphaned
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _kill_those_still_running(below)


def _kill_those_still_running(processes: list[tuple[int, int]]) -> None:
    """SIGKILL each (pid, start time) that is still that process, not a reused pid."""
    for pid, started in processes:
        if _start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None if it is gone: with the pid,
    it names one process even if the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces


def _descendants(root: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below `root`, from /proc."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += children
        frontier = children
    return [(pid, t) for pid in found if (t := _start_time(pid)) is not None]
