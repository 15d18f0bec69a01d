"""The shaped network on disk and in the kernel: rates in tc's units, whether this
machine can make namespaces, the record of a cluster, and its namespaces, bridge and
shaped links set up and removed."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

PREFIX = "ddps"  # every namespace is ddps-<id>-...; <id> is random per cluster
STATE_DIR = Path(os.environ.get("DDPS_CLUSTER_DIR", "/run/ddp-stages-cluster"))
SUBNET = "10.250.0"  # a private /24, only inside our namespaces (each cluster's own)
IFNAME = "ddp0"  # each node's interface; a name no host is likely to have
MASTER_PORT = 29500  # free by construction: each namespace has its own ports
LATENCY = "100ms"  # tbf queue: how long a packet may wait before being dropped


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
    16 KiB: the settings measured to hold the rate on the machine this was developed on
    (256kb at 1gbit, 1 MB at 4gbit). What fits in the bucket leaves at memory speed, so
    a much deeper one would let bursts through unshaped."""
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
    ranks: int  # the world size: nodes x ranks_per_node
    rate: str  # as given, e.g. "1gbit"
    rate_bits: int  # bits per second, each direction of each link
    burst_bytes: int
    bridge_namespace: str
    namespaces: list[str]  # one per node rank, rank order
    addresses: list[str]  # node rank k's address, inside its namespace
    ifname: str
    owner_pid: int | None  # the process whose exit tears it down; None: until `down`
    created_utc: str
    # When the owner started (/proc/<pid>/stat, clock ticks since boot): a later process
    # that reuses its pid is not its owner. None in records written before it was kept.
    owner_started: int | None = None
    # Ranks sharing each node's namespace. Records written before nodes could hold
    # several ranks have one per node, as this default says.
    ranks_per_node: int = 1

    @property
    def nodes(self) -> int:
        return len(self.namespaces)

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


def process_started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of
    /proc/<pid>/stat); None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # after the name, fields 3 onwards


def stale(state: ClusterState) -> bool:
    """Whether `state`'s owner is gone (killed with no chance to tear down: SIGKILL, the
    machine's OOM killer, a container stopped): its namespaces serve no one. A cluster
    made by `up` (no owner) is never stale."""
    if state.owner_pid is None:
        return False
    if state.owner_started is None:
        return not _pid_alive(state.owner_pid)
    return process_started(state.owner_pid) != state.owner_started


def remove_stale() -> list[str]:
    """Remove every recorded cluster whose owner is gone; return the names deleted."""
    removed = []
    for state in recorded_clusters():
        if stale(state):
            removed += remove(state)
    return removed


# --- set-up and teardown --------------------------------------------------------------


def create(s: ClusterState) -> None:
    """Make what `s` records: the bridge's namespace, then per node its namespace,
    its veth pair into the bridge, its address and both ends' tbf."""
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


def remove(state: ClusterState) -> list[str]:
    """Delete the recorded namespaces that still exist, then the record; return the
    names deleted. Nothing but names in the record is touched."""
    present = _namespaces()
    removed = []
    for ns in reversed(state.all_namespaces):
        if ns in present:
            try:
                _sh(_tool("ip"), "netns", "del", ns)
            except RuntimeError:
                if ns in _namespaces():
                    raise
                continue  # another process removed it meanwhile (both reaping a stale one)
            removed.append(ns)
    state.path.unlink(missing_ok=True)
    return removed
