"""`VirtualCluster`: a shaped cluster as a context manager, and what runs inside it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import sys
import time

from profiling.cluster.network import (
    IFNAME,
    MASTER_PORT,
    PREFIX,
    SUBNET,
    ClusterState,
    _sh,
    _tool,
    available,
    create,
    parse_rate,
    process_started,
    remove,
    remove_stale,
    tbf_burst_bytes,
)
from profiling.cluster.nodes import NodeRun, run_nodes
from profiling.cluster.probe import PROBE_PREFIX, expected_allreduce_MBps
from profiling.cluster.signals import _signals_deferred, _signals_raise


class VirtualCluster:
    """N namespaces on a shaped bridge. A context manager: `with` brings it up and
    always takes it down, on an exception, Ctrl-C or SIGTERM too. What a SIGKILL leaves,
    the next cluster's `up` removes (or `python -m profiling.cluster down --stale`)."""

    def __init__(self, ranks: int = 2, rate: str = "1gbit", *, persistent: bool = False):
        if ranks < 1 or ranks > 200:
            raise ValueError(f"ranks must be 1..200 (one /24), got {ranks}")
        self.ranks = ranks
        self.rate = rate
        self.rate_bits = parse_rate(rate)
        self.persistent = persistent  # the CLI's `up`: no owner process, lives until `down`
        self.state: ClusterState | None = None

    @classmethod
    def attach(cls, state: ClusterState) -> VirtualCluster:
        """A handle on a cluster that is already up (e.g. made by the CLI's `up`)."""
        cluster = cls(state.ranks, state.rate, persistent=state.owner_pid is None)
        cluster.state = state
        return cluster

    # - up and down -

    def up(self) -> ClusterState:
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        # Namespaces outlive a process killed before it could take its cluster down; the
        # next cluster made on this machine removes them, so none piles up.
        left = remove_stale()
        if left:
            print(f"profiling.cluster: removed {', '.join(left)}, left by a process that "
                  "no longer runs", file=sys.stderr)  # fmt: skip
        cid = secrets.token_hex(3)
        base = f"{PREFIX}-{cid}"
        self.state = state = ClusterState(
            id=cid,
            ranks=self.ranks,
            rate=self.rate,
            rate_bits=self.rate_bits,
            burst_bytes=tbf_burst_bytes(self.rate_bits),
            bridge_namespace=f"{base}-br",
            namespaces=[f"{base}-r{k}" for k in range(self.ranks)],
            addresses=[f"{SUBNET}.{k + 1}" for k in range(self.ranks)],
            ifname=IFNAME,
            owner_pid=None if self.persistent else os.getpid(),
            owner_started=None if self.persistent else process_started(os.getpid()),
            created_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        )
        # Record first, create second: an `up` that dies half-way leaves a record that
        # `down` can act on, never an unrecorded namespace.
        state.save()
        try:
            with _signals_raise():
                create(state)
        except BaseException:
            self.down()
            raise
        return state

    def down(self) -> None:
        """Remove the namespaces this cluster recorded (those still there), then the
        record. Signals wait until it is done: a half-removed cluster helps no one."""
        if self.state is None:
            return
        with _signals_deferred():
            remove(self.state)
        self.state = None

    def __enter__(self) -> VirtualCluster:
        # For the whole `with` body, SIGTERM and SIGHUP unwind like Ctrl-C, so that
        # __exit__ runs; a bare SIGTERM would end Python without running it.
        self._signals = contextlib.ExitStack()
        self._signals.enter_context(_signals_raise())
        try:
            self.up()
        except BaseException:
            self._signals.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            self._signals.close()

    # - running things inside -

    def node_commands(self, args: list[str]) -> list[list[str]]:
        """One torchrun node per namespace; `args` is what follows torchrun's options
        (`-m stages.bucketed --steps 3`, or `script.py ...`)."""
        s = self._require_up()
        commands = []
        for k, ns in enumerate(s.namespaces):
            torchrun = [sys.executable, "-m", "torch.distributed.run",
                        "--nnodes", str(s.ranks), "--node-rank", str(k), "--nproc-per-node", "1",
                        "--master-addr", s.addresses[0], "--master-port", str(MASTER_PORT),
                        ]  # fmt: skip
            commands.append([_tool("ip"), "netns", "exec", ns, *torchrun, *args])
        return commands

    def node_env(self) -> dict[str, str]:
        s = self._require_up()
        # Each "node" is a whole machine on a real cluster; here they share the cores.
        threads = max(1, len(os.sched_getaffinity(0)) // s.ranks)
        return {
            **os.environ,
            "GLOO_SOCKET_IFNAME": s.ifname,  # Gloo's traffic over the shaped link
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
        }

    def run(
        self,
        args: list[str],
        *,
        timeout: float | None = None,
        capture: bool = False,
        grace: float = 15.0,
        env: dict[str, str] | None = None,
    ) -> NodeRun:
        """Run torchrun `args` on every node at once and wait for all of them.

        Once one node fails, the others get `grace` seconds to notice (their peers'
        sockets close) before being killed; on `timeout` (seconds) or Ctrl-C all are
        killed. With `capture`, each node's stdout and stderr are returned, else they
        go to ours. `env` adds to (or overrides) the environment every node gets."""
        return run_nodes(
            self.node_commands(args), {**self.node_env(), **(env or {})}, timeout=timeout,
            capture=capture, grace=grace,
        )  # fmt: skip

    def probe(self, megabytes: float = 25.0, iterations: int = 5, timeout: float = 120) -> dict:
        """Gloo all-reduce bandwidth between the nodes: see `probe_worker`."""
        args = ["-m", "profiling.cluster", "probe-worker", "--megabytes", str(megabytes),
                "--iterations", str(iterations)]  # fmt: skip
        out = self.run(args, timeout=timeout, capture=True)
        if out.returncode != 0:
            raise RuntimeError(f"probe failed (exit {out.returncode}):\n{out.tail()}")
        lines = [ln for ln in out.stdout[0].splitlines() if ln.startswith(PROBE_PREFIX)]
        if not lines:
            raise RuntimeError(f"probe printed no result:\n{out.tail()}")
        result = json.loads(lines[-1][len(PROBE_PREFIX) :])
        result["expected_MBps"] = expected_allreduce_MBps(self.rate_bits, self.ranks)
        result["rate"] = self.rate
        return result

    def link_bytes(self) -> list[int]:
        """Bytes each node has sent through its shaped link so far (tc's counter)."""
        s = self._require_up()
        sent = []
        for ns in s.namespaces:
            text = _sh(_tool("tc"), "-n", ns, "-s", "qdisc", "show", "dev", s.ifname)
            sent.append(int(re.search(r"Sent (\d+) bytes", text).group(1)))
        return sent

    def set_link(self, node: int, up: bool) -> None:
        """Take node `node`'s link down (or up again), from inside its namespace: as if its
        cable were pulled. Its processes go on running, cut off from every other node,
        the rendezvous store on node 0 included."""
        s = self._require_up()
        _sh(_tool("ip"), "-n", s.namespaces[node], "link", "set", s.ifname, "up" if up else "down")

    def node_pids(self, node: int) -> list[int]:
        """The processes running in node `node`'s namespace (its torchrun and workers)."""
        s = self._require_up()
        return [int(pid) for pid in _sh(_tool("ip"), "netns", "pids", s.namespaces[node]).split()]

    def _require_up(self) -> ClusterState:
        if self.state is None:
            raise RuntimeError("the cluster is not up: use `with VirtualCluster(...)` or up()")
        return self.state
