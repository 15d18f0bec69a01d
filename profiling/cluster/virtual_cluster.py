"""`VirtualCluster`: a shaped cluster as a context manager, and what runs inside it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ElasticLaunch:
    """torchrun's elastic rendezvous (c10d), in place of the static one: a node may be
    lost, and torchrun re-forms the group with the nodes left, down to `min_nodes`,
    restarting the workers at most `max_restarts` times. The store of the rendezvous is
    hosted by the agent of the endpoint's node (node 0's): lose another.

    The times are torch's defaults shortened so that a re-formation takes seconds: a
    node is dead once its agent's keep-alive has been missing `keep_alive_s` x 3, and a
    rendezvous that has its minimum of nodes waits `last_call_s` more for others (the
    first one too: the nodes must start within that of each other, or the run starts
    smaller and grows when the late one joins)."""

    min_nodes: int = 1
    max_restarts: int = 3
    last_call_s: int = 3
    keep_alive_s: int = 1
    run_id: str = "ddp-stages"

    def torchrun_options(
        self, endpoint: str, local_addr: str, nodes: int, ranks_per_node: int, host: bool
    ) -> list[str]:
        """torchrun's options for one node; `host`: this node holds the store."""
        conf = (f"last_call_timeout={self.last_call_s},keep_alive_interval={self.keep_alive_s},"
                f"keep_alive_max_attempt=3,is_host={int(host)}")  # fmt: skip
        return ["--nnodes", f"{self.min_nodes}:{nodes}", "--nproc-per-node", str(ranks_per_node),
                "--max-restarts", str(self.max_restarts), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_id, "--rdzv-conf", conf,
                # Published to the workers as the store's address when this node is rank 0:
                # the host name would resolve outside the namespaces.
                "--local-addr", local_addr]  # fmt: skip


class VirtualCluster:
    """N namespaces on a shaped bridge, one per node, each holding `ranks_per_node`
    ranks. A context manager: `with` brings it up and always takes it down, on an
    exception, Ctrl-C or SIGTERM too. What a SIGKILL leaves, the next cluster's `up`
    removes (or `python -m profiling.cluster down --stale`).

    `ranks` is the world size, `nodes` the namespaces: give either (or both, if they
    agree); with the default of one rank per node they are the same number, so
    `VirtualCluster(ranks=4)` is four nodes of one rank, and
    `VirtualCluster(nodes=2, ranks_per_node=2)` two nodes of two."""

    def __init__(
        self,
        ranks: int | None = None,
        rate: str = "1gbit",
        *,
        nodes: int | None = None,
        ranks_per_node: int = 1,
        persistent: bool = False,
    ):
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
            raise TypeError(f"ranks_per_node must be an int, got {ranks_per_node!r}")
        if ranks_per_node < 1:
            raise ValueError(
                f"ranks_per_node must be >= 1 (ranks in each node), got {ranks_per_node}"
            )
        if nodes is None:
            ranks = 2 if ranks is None else ranks
            if ranks < 1:
                raise ValueError(f"ranks must be >= 1 (the world size), got {ranks}")
            if ranks % ranks_per_node:
                raise ValueError(
                    f"ranks={ranks} does not split into nodes of ranks_per_node={ranks_per_node}; "
                    "give a multiple of it, or nodes= instead"
                )
            nodes = ranks // ranks_per_node
        elif ranks is not None and ranks != nodes * ranks_per_node:
            raise ValueError(
                f"ranks={ranks} is not nodes={nodes} x ranks_per_node={ranks_per_node}; "
                "give nodes= or ranks=, not both"
            )
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes must be 1..200 (one address each in a /24), got {nodes}")
        self.nodes = nodes  # namespaces, each a server
        self.ranks_per_node = ranks_per_node  # ranks sharing a namespace: its GPUs
        self.ranks = nodes * ranks_per_node  # the world size
        self.rate = rate
        self.rate_bits = parse_rate(rate)
        self.persistent = persistent  # the CLI's `up`: no owner process, lives until `down`
        self.state: ClusterState | None = None

    @classmethod
    def attach(cls, state: ClusterState) -> VirtualCluster:
        """A handle on a cluster that is already up (e.g. made by the CLI's `up`)."""
        cluster = cls(
            nodes=state.nodes, rate=state.rate, ranks_per_node=state.ranks_per_node,
            persistent=state.owner_pid is None,
        )  # fmt: skip
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
            ranks_per_node=self.ranks_per_node,
            rate=self.rate,
            rate_bits=self.rate_bits,
            burst_bytes=tbf_burst_bytes(self.rate_bits),
            bridge_namespace=f"{base}-br",
            namespaces=[f"{base}-r{k}" for k in range(self.nodes)],
            addresses=[f"{SUBNET}.{k + 1}" for k in range(self.nodes)],
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

    def node_commands(
        self, args: list[str], launch: ElasticLaunch | None = None
    ) -> list[list[str]]:
        """One torchrun node per namespace, starting `ranks_per_node` ranks there; `args`
        is what follows torchrun's options (`-m stages.bucketed --steps 3`, or
        `script.py ...`). Node k's ranks are k*R .. k*R+R-1 (torchrun's static
        rendezvous numbers them so), the consecutive ranks ddp.collectives'
        `ranks_per_node` takes for a node. With `launch`, the elastic rendezvous instead,
        its store on node 0 (whose address sorts first, so its ranks are 0 .. R-1 too)."""
        s = self._require_up()
        commands = []
        for k, ns in enumerate(s.namespaces):
            torchrun = [sys.executable, "-m", "torch.distributed.run"]
            if launch is None:
                torchrun += ["--nnodes", str(s.nodes), "--node-rank", str(k),
                             "--nproc-per-node", str(s.ranks_per_node),
                             "--master-addr", s.addresses[0], "--master-port", str(MASTER_PORT),
                             ]  # fmt: skip
            else:
                endpoint = f"{s.addresses[0]}:{MASTER_PORT}"
                torchrun += launch.torchrun_options(
                    endpoint, s.addresses[k], s.nodes, s.ranks_per_node, host=k == 0
                )
            commands.append([_tool("ip"), "netns", "exec", ns, *torchrun, *args])
        return commands

    def node_env(self) -> dict[str, str]:
        s = self._require_up()
        # Each "node" is a whole machine on a real cluster; here all ranks share the cores.
        threads = max(1, len(os.sched_getaffinity(0)) // s.ranks)
        return {
            **os.environ,
            # Gloo binds to the node's address on the shaped link. Between ranks of one
            # node that address is local, so the kernel carries their traffic over the
            # namespace's loopback, past the link's tbf: unshaped, as inside a server.
            "GLOO_SOCKET_IFNAME": s.ifname,
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
        launch: ElasticLaunch | None = None,
        started: Callable[[list[subprocess.Popen]], None] | None = None,
    ) -> NodeRun:
        """Run torchrun `args` on every node at once and wait for all of them.

        Once one node fails, the others get `grace` seconds to notice (their peers'
        sockets close) before being killed; on `timeout` (seconds) or Ctrl-C all are
        killed. With `capture`, each node's stdout and stderr are returned, else they
        go to ours. `env` adds to (or overrides) the environment every node gets.
        `launch`: torchrun's elastic rendezvous; `started`: see `run_nodes`."""
        return run_nodes(
            self.node_commands(args, launch), {**self.node_env(), **(env or {})},
            timeout=timeout, capture=capture, grace=grace, started=started,
        )  # fmt: skip

    def run_for_result(self, args: list[str], prefix: str, what: str, timeout: float) -> dict:
        """Run `args` on the cluster (as `run`) and return the JSON its rank 0 printed last
        after `prefix`; `what` names the run in the error if it fails or prints none."""
        out = self.run(args, timeout=timeout, capture=True)
        if out.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {out.returncode}):\n{out.tail()}")
        lines = [ln for ln in out.stdout[0].splitlines() if ln.startswith(prefix)]
        if not lines:
            raise RuntimeError(f"{what} printed no result:\n{out.tail()}")
        return json.loads(lines[-1][len(prefix) :])

    def probe(self, megabytes: float = 25.0, iterations: int = 5, timeout: float = 120) -> dict:
        """Gloo all-reduce bandwidth between the nodes: see `probe_worker`."""
        args = ["-m", "profiling.cluster", "probe-worker", "--megabytes", str(megabytes),
                "--iterations", str(iterations)]  # fmt: skip
        result = self.run_for_result(args, PROBE_PREFIX, "probe", timeout)
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

    def left_behind(self) -> list[str]:
        """What still runs or listens in the cluster's namespaces (nothing, after a run
        that cleaned up): processes, and TCP listeners."""
        s = self._require_up()
        found = []
        for ns in s.all_namespaces:
            pids = _sh(_tool("ip"), "netns", "pids", ns).split()
            if pids:
                found.append(f"{ns}: processes {' '.join(pids)}")
            listening = _sh(_tool("ip"), "netns", "exec", ns, _tool("ss"), "-Hltn").strip()
            if listening:
                found.append(f"{ns}: listening {' | '.join(listening.splitlines())}")
        return found

    def _require_up(self) -> ClusterState:
        if self.state is None:
            raise RuntimeError("the cluster is not up: use `with VirtualCluster(...)` or up()")
        return self.state
