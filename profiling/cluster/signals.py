"""Signals while a cluster is up: SIGTERM and SIGHUP unwind like Ctrl-C, so that
cleanup runs, and cleanup itself is not interrupted."""

from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwind as Ctrl-C does (every `finally` runs; pytest
    tears its fixtures down and stops), then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _signals_raise():
    """Turn SIGTERM and SIGHUP into an exception, as Ctrl-C already is, so that
    `finally` blocks (and `with` exits) run. Main thread only: elsewhere Python cannot
    install handlers, and the main thread's own handlers apply."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _signals_deferred():
    """Block Ctrl-C, SIGTERM and SIGHUP while cleaning up; they arrive right after."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
