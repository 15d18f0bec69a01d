"""A heartbeat that names the rank which stopped answering.

A rank that is stopped (SIGSTOP, a debugger, swapped out) or cut off keeps its peers
waiting in their next collective, and Gloo's error after its timeout says that a receive
timed out, not from whom. So each rank counts up its own key in the rendezvous store
every `timeout_s / 50` seconds (at most every second) from a thread, and watches the
others' counts: a rank whose count has not moved for `timeout_s` is named, and this rank
exits, so torchrun stops the job (or restarts it, with --max-restarts).

The store is torchrun's (the agent's on node 0, or rank 0's), not the peers' Gloo links:
a rank whose links are dropped but whose node still reaches the store is seen only by
Gloo's own timeout. `setup_process_group` gives the collectives a timeout 10% longer
than `timeout_s`, so this watchdog, which names the rank, speaks first. A rank cut off
from the store ends too: a second thread sees that the store has not answered its
heartbeat for `timeout_s`, and says so."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist


class Watchdog:
    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, timeout_s / 50)
        self.stopping = threading.Event()
        self.answered = time.monotonic()  # when the store last answered this rank
        self.thread = threading.Thread(target=self.run, name="ddp-watchdog", daemon=True)
        self.thread.start()
        # A call to a store that cannot be reached does not return (torch's store client
        # gives no timeout to `add`), so a second thread watches the first.
        self.store_watch = threading.Thread(
            target=self.watch_store, name="ddp-store-watch", daemon=True
        )
        self.store_watch.start()

    def run(self) -> None:
        now = time.monotonic()
        last_count = dict.fromkeys(range(self.world_size), 0)
        last_change = dict.fromkeys(range(self.world_size), now)
        while not self.stopping.wait(self.interval_s):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                counts = {r: self.store.add(f"beat/{r}", 0) for r in range(self.world_size)}
            except Exception as e:  # the store itself is gone: torchrun's agent stopped
                self.fail(f"the rendezvous store is gone ({e}): torchrun's agent has stopped")
                return
            now = self.answered = time.monotonic()
            for r, count in counts.items():
                if count != last_count[r]:
                    last_count[r], last_change[r] = count, now
            silent = [r for r in counts if r != self.rank and now - last_change[r] > self.timeout_s]
            if silent and not self.stopping.is_set():
                names = ", ".join(map(str, silent))
                self.fail(
                    f"rank {names} has not answered for {self.timeout_s:g} s (--timeout): it "
                    "is stopped, hung, or cut off from the store; check that process or its "
                    "node, or raise --timeout if its steps are that slow"
                )
                return

    def watch_store(self) -> None:
        while self.thread.is_alive():  # after stop() too, until the heartbeat's call returns
            time.sleep(self.interval_s)
            if self.thread.is_alive() and time.monotonic() - self.answered > self.timeout_s:
                self.fail(
                    f"the rendezvous store has not answered for {self.timeout_s:g} s "
                    "(--timeout): this node is cut off from the store's node, or that node "
                    "is down"
                )
                return

    def fail(self, why: str) -> None:
        """Say why on stderr and end this process: the main thread may be blocked inside a
        collective that nothing in Python can interrupt."""
        print(f"rank {self.rank}: {why}", file=sys.stderr, flush=True)
        os._exit(1)

    def stop(self) -> None:
        """Before teardown: ranks that finish at different times are not missing. The
        heartbeat may be inside a store call; the store watch ends this rank if that call
        does not return within the timeout."""
        self.stopping.set()
        self.thread.join()
        self.store_watch.join()
