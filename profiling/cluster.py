"""A shaped network on one machine: N network namespaces, one per node, joined by a
bridge whose every link is limited to a fixed rate, so Gloo's all-reduce waits on a wire
as it does between real machines instead of copying through loopback memory.

    python -m profiling.cluster up --ranks 2 --rate 1gbit
    python -m profiling.cluster run -- -m stages.overlapped --model mlp
    python -m profiling.cluster probe          # all-reduce bandwidth across the link
    python -m profiling.cluster down

`run` starts one torchrun node per namespace (`--nnodes N --node-rank k
--nproc-per-node 1`), everything after `--` being torchrun's script and its arguments,
waits for all, and exits nonzero if any failed. From Python, and in tests:

    with VirtualCluster(ranks=2, rate="1gbit") as cluster:
        cluster.run(["-m", "stages.bucketed", "--steps", "3"])

Topology. Nothing is created in the host's namespace and no host interface is touched:

    ddps-<id>-r0          ddps-<id>-br                ddps-<id>-r1
    [ddp0 10.250.0.1] ==== [r0]--br0--[r1] ==== [ddp0 10.250.0.2]
       tbf (egress)       tbf (egress)  tbf (egress)     tbf (egress)

Each veth pair is created inside the namespaces (`ip -n NS link add ... peer ... netns
BR`), and both of its ends get `tbf rate RATE`: each direction of each link is shaped,
so every rank sends and receives at RATE at most, full duplex, as on a switch.

What it cannot do: this kernel has no netem (ENVIRONMENT.md), so latency cannot be
added: the round-trip stays at microseconds, and only bandwidth is real. The nodes also
still share this machine's CPU cores; `run` gives each rank cores // ranks threads.

Namespaces outlive the processes that made them. `up` records what it creates in a
state file under /run/ddp-stages-cluster (next to /run/netns, so both vanish on reboot)
before creating it, and `down` removes exactly the namespaces recorded there. Removing
a namespace removes its veth ends, bridge and qdiscs with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PREFIX = "ddps"  # every namespace is ddps-<id>-...; <id> is random per cluster
STATE_DIR = Path(os.environ.get("DDPS_CLUSTER_DIR", "/run/ddp-stages-cluster"))
SUBNET = "10.250.0"  # a private /24, only inside our namespaces (each cluster's own)
IFNAME = "ddp0"  # each node's interface; a name no host is likely to have
MASTER_PORT = 29500  # free by construction: each namespace has its own ports
LATENCY = "100ms"  # tbf queue: how long a packet may wait before being dropped
PROBE_PREFIX = "PROBE_RESULT "


# --- rates ---------------------------------------------------------------------------

# tc's bit units (SI). tc reads a bare number, and "mbps", as *bytes* per second; only
# bit units are accepted here, so "1gbit" always means what it says.
_BIT_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int:
    """Bits per second from tc's notation: "1gbit" -> 1_000_000_000."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
    if not match or match.group(2) not in _BIT_UNITS:
        raise ValueError(
            f"rate {text!r} not understood: give a number and one of "
            f"{', '.join(_BIT_UNITS)}, e.g. 1gbit or 500mbit"
        )
    bits = int(float(match.group(1)) * _BIT_UNITS[match.group(2)])
    if bits < 10**6:
        raise ValueError(f"rate {text!r} is below 1mbit: Gloo would take minutes per step")
    return bits


def tbf_burst_bytes(rate_bits: int) -> int:
    """The token bucket's depth: 256 KiB per Gbit/s, about 2 ms of traffic, at least
    16 KiB: the settings ENVIRONMENT.md measured (256kb at 1gbit, 1 MB at 4gbit). What
    fits in the bucket leaves at memory speed, so a much deeper one would let bursts
    through unshaped."""
    return max(16 * 2**10, rate_bits * 256 * 2**10 // 10**9)


# --- can this machine do it? -----------------------------------------------------------


def _tool(name: str) -> str | None:
    # /usr/sbin is not on every non-root PATH; look there too.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


_available: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """(True, "") if a shaped cluster can be made here, else (False, why): root, `ip`
    and `tc`, network namespaces and the tbf qdisc. Tried for real once per process, on
    a throwaway namespace, so that benchmarks can fall back to loopback up front."""
    global _available
    if _available is not None:
        return _available
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and tc); run as root or use loopback"
    missing = [t for t in ("ip", "tc") if _tool(t) is None]
    if missing:
        return False, f"{' and '.join(missing)} not found: install iproute2"
    ns = f"{PREFIX}-{secrets.token_hex(3)}-check"
    try:
        _sh(_tool("ip"), "netns", "add", ns)
        try:
            _sh(_tool("ip"), "-n", ns, "link", "add", "br0", "type", "bridge")
            _sh(_tool("tc"), "-n", ns, "qdisc", "replace", "dev", "br0", "root", "tbf",
                "rate", "1gbit", "burst", "256kb", "latency", LATENCY)  # fmt: skip
        finally:
            _sh(_tool("ip"), "netns", "del", ns)
    except RuntimeError as error:
        _available = (False, f"cannot build a shaped network here: {error}")
    else:
        _available = (True, "")
    return _available


def _sh(*command: str) -> str:
    """Run one ip/tc command; raise with its stderr if it fails."""
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {out.stderr.strip()}")
    return out.stdout


def _namespaces() -> set[str]:
    return {line.split()[0] for line in _sh(_tool("ip"), "netns", "list").splitlines() if line}


# --- what a cluster is, on disk --------------------------------------------------------


@dataclass
class ClusterState:
    """What `up` created: exactly what `down` removes."""

    id: str
    ranks: int
    rate: str  # as given, e.g. "1gbit"
    rate_bits: int  # bits per second, each direction of each link
    burst_bytes: int
    bridge_namespace: str
    namespaces: list[str]  # one per node rank, rank order
    addresses: list[str]  # node rank k's address, inside its namespace
    ifname: str
    owner_pid: int | None  # the process whose exit tears it down; None: until `down`
    created_utc: str

    @property
    def path(self) -> Path:
        return STATE_DIR / f"{self.id}.json"

    @property
    def all_namespaces(self) -> list[str]:
        return [self.bridge_namespace, *self.namespaces]

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        return cls(**json.loads(path.read_text()))


def recorded_clusters() -> list[ClusterState]:
    if not STATE_DIR.is_dir():
        return []
    return [ClusterState.load(p) for p in sorted(STATE_DIR.glob("*.json"))]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- the cluster -----------------------------------------------------------------------


class VirtualCluster:
    """N namespaces on a shaped bridge. A context manager: `with` brings it up and
    always takes it down, on an exception, Ctrl-C or SIGTERM too (not on SIGKILL:
    `python -m profiling.cluster down --stale` then removes what is left)."""

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
            created_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        )
        # Record first, create second: an `up` that dies half-way leaves a record that
        # `down` can act on, never an unrecorded namespace.
        state.save()
        try:
            with _signals_raise():
                self._create(state)
        except BaseException:
            self.down()
            raise
        return state

    def _create(self, s: ClusterState) -> None:
        ip, tc, br = _tool("ip"), _tool("tc"), s.bridge_namespace
        tbf = ["root", "tbf", "rate", f"{s.rate_bits}bit", "burst", str(s.burst_bytes),
               "latency", LATENCY]  # fmt: skip
        _sh(ip, "netns", "add", br)
        # No STP, no forwarding delay: ports forward as soon as they are up.
        _sh(ip, "-n", br, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        _sh(ip, "-n", br, "link", "set", "br0", "up")
        for k, (ns, address) in enumerate(zip(s.namespaces, s.addresses, strict=True)):
            port = f"r{k}"
            _sh(ip, "netns", "add", ns)
            _sh(ip, "-n", ns, "link", "set", "lo", "up")  # a node's own processes use it
            _sh(ip, "-n", ns, "link", "add", s.ifname, "type", "veth", "peer", "name", port,
                "netns", br)  # fmt: skip
            _sh(ip, "-n", br, "link", "set", port, "master", "br0")
            _sh(ip, "-n", br, "link", "set", port, "up")
            _sh(ip, "-n", ns, "addr", "add", f"{address}/24", "dev", s.ifname)
            _sh(ip, "-n", ns, "link", "set", s.ifname, "up")
            # Both ends: the node's egress is what it sends, the bridge port's egress
            # what it receives.
            _sh(tc, "-n", ns, "qdisc", "replace", "dev", s.ifname, *tbf)
            _sh(tc, "-n", br, "qdisc", "replace", "dev", port, *tbf)

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

    def _require_up(self) -> ClusterState:
        if self.state is None:
            raise RuntimeError("the cluster is not up: use `with VirtualCluster(...)` or up()")
        return self.state


def remove(state: ClusterState) -> list[str]:
    """Delete the recorded namespaces that still exist, then the record; return the
    names deleted. Nothing but names in the record is touched."""
    present = _namespaces()
    removed = []
    for ns in reversed(state.all_namespaces):
        if ns in present:
            _sh(_tool("ip"), "netns", "del", ns)
            removed.append(ns)
    state.path.unlink(missing_ok=True)
    return removed


def expected_allreduce_MBps(rate_bits: int, ranks: int) -> float:
    """What the probe should measure, in tensor bytes per second (MB = 10**6 bytes).

    A ring all-reduce of S bytes over N ranks makes every rank send, and receive,
    2(N-1)/N * S bytes (reduce-scatter, then all-gather). Links are full duplex and
    every rank's link runs at the shaped rate R, so one all-reduce takes
    2(N-1)/N * S / R, and S / time = R * N / (2(N-1)): for 2 ranks, the link rate
    itself (125 MB/s at 1gbit). TCP/IP and Ethernet headers take about 4% of it."""
    if ranks < 2:
        return float("inf")
    return rate_bits / 8 / 1e6 * ranks / (2 * (ranks - 1))


# --- running one command per node ------------------------------------------------------


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
) -> NodeRun:
    """Start every command, wait for all; kill the rest on failure, timeout or signal.

    Each node runs in a session of its own, so that a terminal's Ctrl-C reaches us
    only, and we stop every node (torchrun and its workers: the whole session) on
    the way out, whatever the way out is."""
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
    for pid, started in workers:
        if _start_time(pid) == started:  # still that process, not a reused pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait()


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


# --- signals ---------------------------------------------------------------------------


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


# --- the bandwidth probe (runs under torchrun, on every node) --------------------------


def probe_worker(megabytes: float, iterations: int) -> None:
    """All-reduce a float32 tensor of `megabytes` MB (10**6 bytes) `iterations` times
    after one untimed warm-up; each time is the slowest rank's, from a barrier. Rank 0
    prints one line: PROBE_RESULT {json}, with MB/s = tensor bytes / median time (the
    figure ENVIRONMENT.md calls Gloo all-reduce bandwidth; nccl-tests' "algbw")."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        numel = int(megabytes * 1e6) // 4  # float32
        tensor = torch.ones(numel)
        dist.all_reduce(tensor)  # connections, buffers
        times = []
        for _ in range(iterations):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        world = dist.get_world_size()
        per_rank = [numel * 4 / t / 1e6 for t in slowest.tolist()]
        if dist.get_rank() == 0:
            result = {
                "bytes": numel * 4,
                "ranks": world,
                "seconds": slowest.tolist(),
                "MBps": statistics.median(per_rank),  # tensor bytes / time
                "MBps_min": min(per_rank),
                "MBps_max": max(per_rank),
                # What each rank sent per second (nccl-tests' "busbw"): 2(N-1)/N of it.
                "bus_MBps": statistics.median(per_rank) * 2 * (world - 1) / world,
            }
            print(PROBE_PREFIX + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


# --- the command line ------------------------------------------------------------------


def _cli_cluster(cid: str | None) -> VirtualCluster:
    """The cluster a CLI command acts on: --id, else the one `up` made."""
    clusters = recorded_clusters()
    if cid is not None:
        chosen = [c for c in clusters if c.id == cid]
        if not chosen:
            status = "python -m profiling.cluster status"
            raise SystemExit(f"no cluster with id {cid!r}; see `{status}`")
        return VirtualCluster.attach(chosen[0])
    mine = [c for c in clusters if c.owner_pid is None]
    if not mine:
        raise SystemExit("no cluster is up: run `python -m profiling.cluster up` first")
    if len(mine) > 1:
        ids = ", ".join(c.id for c in mine)
        raise SystemExit(f"several clusters are up ({ids}): pick one with --id")
    return VirtualCluster.attach(mine[0])


def _rate_arg(text: str) -> str:
    try:
        parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Everything after `--` is torchrun's, untouched by our parser.
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m profiling.cluster", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="create the namespaces, bridge and shaped links")
    p.add_argument("--ranks", type=int, default=2, help="nodes (one rank each)")
    p.add_argument("--rate", default="1gbit", type=_rate_arg, help="each link's rate, each way")
    p = sub.add_parser("run", help="one torchrun node per namespace: run ... -- <torchrun args>")
    p.add_argument("--id", help="which cluster (default: the one `up` made)")
    p.add_argument("--timeout", type=float, help="seconds before every node is killed")
    p = sub.add_parser("probe", help="measure Gloo all-reduce bandwidth across the links")
    p.add_argument("--id", help="which cluster (default: the one `up` made)")
    p.add_argument("--megabytes", type=float, default=25.0, help="tensor size, MB")
    p.add_argument("--iterations", type=int, default=5, help="timed all-reduces")
    p = sub.add_parser("down", help="remove what `up` created")
    p.add_argument("--id", help="which cluster (default: the one `up` made)")
    p.add_argument(
        "--stale",
        action="store_true",
        help="instead: remove clusters whose owning process is gone (killed with -9)",
    )
    sub.add_parser("status", help="list the clusters recorded, and whether they are there")
    p = sub.add_parser("probe-worker", help="(internal) what `probe` runs under torchrun")
    p.add_argument("--megabytes", type=float, default=25.0)
    p.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args(argv)
    if rest and args.command != "run":
        parser.error("`--` and torchrun arguments go with `run` only")

    if args.command == "probe-worker":
        probe_worker(args.megabytes, args.iterations)
        return 0
    if args.command == "status":
        present = _namespaces() if available()[0] else set()
        for c in recorded_clusters():
            there = sum(ns in present for ns in c.all_namespaces)
            owner = "until `down`" if c.owner_pid is None else f"owner pid {c.owner_pid}"
            print(f"{c.id}: {c.ranks} ranks at {c.rate}, {owner}, "
                  f"{there}/{len(c.all_namespaces)} namespaces present")  # fmt: skip
        return 0
    ok, why = available()
    if not ok:
        print(f"profiling.cluster: {why}", file=sys.stderr)
        return 2
    if args.command == "up":
        cluster = VirtualCluster(args.ranks, args.rate, persistent=True)
        s = cluster.up()
        print(f"cluster {s.id}: {s.ranks} nodes at {s.rate} each way "
              f"(tbf burst {s.burst_bytes} bytes, latency {LATENCY})")  # fmt: skip
        for ns, address in zip(s.namespaces, s.addresses, strict=True):
            print(f"  {ns}  {s.ifname} {address}")
        print("next: python -m profiling.cluster run -- -m stages.bucketed --model mlp")
        return 0
    if args.command == "down":
        if args.stale:
            for c in recorded_clusters():
                if c.owner_pid is not None and not _pid_alive(c.owner_pid):
                    print(f"removed {', '.join(remove(c)) or 'nothing left'} ({c.id})")
            return 0
        state = _cli_cluster(args.id).state
        print(f"removed {', '.join(remove(state)) or 'nothing left'} ({state.id})")
        return 0
    cluster = _cli_cluster(args.id)
    if args.command == "run":
        if not rest:
            parser.error("give torchrun's arguments after --, e.g. run -- -m stages.naive")
        return cluster.run(rest, timeout=args.timeout).returncode
    if args.command == "probe":
        r = cluster.probe(args.megabytes, args.iterations)
        print(
            f"Gloo all-reduce of {r['bytes'] / 1e6:g} MB over {r['ranks']} ranks at {r['rate']}: "
            f"{r['MBps']:.1f} MB/s median ({r['MBps_min']:.1f}-{r['MBps_max']:.1f}) of tensor "
            f"bytes per second; expected about {r['expected_MBps']:.1f} "
            f"(rate/8 x N/(2(N-1))); {r['bus_MBps']:.1f} MB/s sent per rank"
        )
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Interrupted as stop:
        sys.exit(128 + stop.signum)
    except KeyboardInterrupt:
        sys.exit(130)
