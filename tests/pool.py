"""Gloo worker processes kept alive across test examples.

Spawning torch processes costs seconds per example; hypothesis wants hundreds. So the
suite starts MAX_WORLD workers once, joins them into one Gloo group with a subgroup for
every world size 1..MAX_WORLD, and sends each example to the first W of them."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_WORLD = 4
ROUND_ROBIN: dict = {}  # in a worker: world size -> extra groups over the same ranks


@dataclass
class RankError:
    """What a worker sends back when the example raised."""

    rank: int
    type_name: str
    message: str
    traceback: str


def check_no_errors(runs: list) -> list:
    """The runs, unless a rank raised: then the first such rank's traceback fails the test."""
    errors = [r for r in runs if isinstance(r, RankError)]
    if errors:
        raise AssertionError(f"rank {errors[0].rank} raised:\n{errors[0].traceback}")
    return runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    # A worker that crashes (a segfault, glibc's abort on a corrupted heap) prints every
    # thread's Python stack to stderr, where the test's output shows it.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)  # MAX_WORLD ranks share 2 cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    # Every rank must take part in creating every subgroup, in the same order.
    groups = {w: dist.new_group(list(range(w))) for w in range(1, world + 1)}
    for w in range(1, world + 1):  # for stages that spread buckets over several groups
        ROUND_ROBIN[w] = [dist.new_group(list(range(w))) for _ in range(2)]
    outbox.put((rank, pickle.dumps("ready")))
    while True:
        job = inbox.get()
        if job is None:
            break
        world_size, fn, args = job
        try:
            result = fn(rank, groups[world_size], *args)
        except BaseException as e:  # noqa: BLE001 - everything goes back to the test
            result = RankError(rank, type(e).__name__, str(e), traceback.format_exc())
        # Plain pickle copies tensors by value. Through the queue they would travel as
        # shared-memory file descriptors, which run out after a few thousand examples
        # ("received 0 items of ancdata").
        outbox.put((rank, pickle.dumps(result)))
    dist.destroy_process_group()


class GlooPool:
    def __init__(self, world: int = MAX_WORLD):
        self.world = world
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(rank, self.world, port, self.inboxes[rank], self.outbox),
                daemon=True,
            )
            for rank in range(self.world)
        ]
        for p in self.procs:
            p.start()
        self._collect(self.world, timeout_s=600)  # MAX_WORLD imports of torch on 2 cores

    def run(
        self, world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120
    ) -> list[Any]:
        """Run fn(rank, group, *args) on ranks 0..world_size-1; results by rank.

        A rank that raised gives a RankError. An example that hangs (no answer in
        `timeout_s`), or whose worker died (as soon as it is seen), restarts the pool (its
        workers are stuck in a collective) and raises TimeoutError."""
        for rank in range(world_size):
            self.inboxes[rank].put((world_size, fn, args))
        try:
            return self._collect(world_size, timeout_s)
        except TimeoutError:
            self.close(kill=True)
            self._start()
            raise

    def _collect(self, n: int, timeout_s: float) -> list[Any]:
        """The answers of ranks 0..n-1. Without one after `timeout_s` (a hang), or once a
        silent rank's worker is seen dead (it never will answer), TimeoutError."""
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < n:
            left_s = deadline - time.monotonic()
            try:
                rank, value = self.outbox.get(timeout=min(1.0, max(left_s, 0.0)))
            except queue.Empty:
                rank = None
            if rank is not None:
                results[rank] = pickle.loads(value)  # from our own workers
                continue
            silent = sorted(set(range(n)) - set(results))
            if self._dead(silent):
                raise TimeoutError(f"ranks {silent} gave no answer: {self._why(silent)}")
            if left_s <= 0:
                raise TimeoutError(f"ranks {silent} gave no answer in {timeout_s} s: a hang")
        return [results[r] for r in range(n)]

    def _dead(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if not self.procs[r].is_alive()]

    def _why(self, silent: list[int]) -> str:
        """A hang, unless a silent rank's worker is gone: then how it ended."""
        dead = [(r, self.procs[r].exitcode) for r in self._dead(silent)]
        if not dead:
            return "a hang"
        return "; ".join(
            f"rank {r}'s worker died (exit code {code}"
            + (f", {signal.Signals(-code).name}" if code is not None and code < 0 else "")
            + "; its stack is in the captured stderr)"
            for r, code in dead
        )

    def close(self, kill: bool = False) -> None:
        for p, inbox in zip(self.procs, self.inboxes, strict=True):
            if kill:
                p.kill()
            else:
                inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
