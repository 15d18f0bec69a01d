"""The shaped cluster (profiling.cluster): stages train across namespaces over a link
limited to 1 Gbit/s, Gloo's all-reduce runs at that rate, a node whose link is dropped is
named within --timeout, and nothing is left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from profiling.cluster import network as vc
from profiling.cluster.cli import main
from profiling.cluster.probe import expected_allreduce_MBps
from profiling.cluster.virtual_cluster import VirtualCluster

ROOT = Path(__file__).resolve().parent.parent
AVAILABLE, WHY_NOT = vc.available()
needs_cluster = pytest.mark.skipif(not AVAILABLE, reason=f"no shaped cluster: {WHY_NOT}")


def netns_list() -> list[str]:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    out = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cluster():
    """Two nodes at 1gbit, for the module; removed afterwards whatever happened, and
    checked to be gone."""
    c = VirtualCluster(ranks=2, rate="1gbit")
    prefix = None
    try:
        with c:
            prefix = f"{vc.PREFIX}-{c.state.id}-"
            assert sorted(ns for ns in netns_list() if ns.startswith(prefix)) == sorted(
                c.state.all_namespaces
            )
            yield c
    finally:
        if prefix is not None:
            left = [ns for ns in netns_list() if ns.startswith(prefix)]
            assert not left, f"namespaces left behind: {left}"


@needs_cluster
def test_stage_trains_across_the_shaped_link(cluster: VirtualCluster) -> None:
    from ddp.models import build_model

    sent_before = cluster.link_bytes()
    steps, warmup = 3, 3
    out = cluster.run(
        ["-m", "stages.bucketed", "--model", "mlp", "--steps", str(steps),
         "--warmup-steps", str(warmup)],
        timeout=120,
        capture=True,
    )  # fmt: skip
    assert out.returncode == 0, out.tail()
    row = next(line for line in out.stdout[0].splitlines() if line.startswith("bucketed "))
    assert row.split()[-1] == "True", out.tail()  # replicas identical
    # Every step all-reduces every gradient through the link: over 2 ranks a ring
    # sends as many bytes as the gradients hold, from each node.
    grad_bytes = sum(p.numel() * 4 for p in build_model("mlp", width=256, depth=3).parameters())
    sent = [after - before for after, before in zip(cluster.link_bytes(), sent_before, strict=True)]
    assert all(s >= (steps + warmup) * grad_bytes for s in sent), (sent, grad_bytes)


@needs_cluster
def test_allreduce_runs_at_the_shaped_rate(cluster: VirtualCluster) -> None:
    """MB/s = tensor bytes / time per all-reduce. A 2-rank ring sends and receives the
    tensor's size per rank (2(N-1)/N of it), each way at the link's rate, so the figure
    expected is the rate itself: 1 Gbit/s = 125 MB/s (measured on this machine: 118-126,
    TCP/IP headers taking about 4%)."""
    result = cluster.probe(megabytes=25, iterations=4)
    expected = expected_allreduce_MBps(10**9, 2)
    assert expected == pytest.approx(125.0)
    # The fastest repeat: the shaped link caps every one, so none beats the rate (by more
    # than the clock's noise); a busy machine slows them all, so below it the test asks
    # only for the right order of magnitude (a rate in the wrong unit is off 8 or 10
    # times). Two busy loops beside the suite gave 100 MB/s at best; unloaded, 118-126.
    # How close to the rate it runs is the benchmark's: `profiling.cluster probe`.
    fastest = result["bytes"] / min(result["seconds"]) / 1e6
    print(f"all-reduce {fastest:.1f} MB/s at best, expected {expected:.1f}")
    assert expected / 2 < fastest < expected * 1.15, result


@needs_cluster
def test_a_failing_node_fails_the_run_and_stops_the_others(cluster: VirtualCluster, capsys) -> None:
    # Node 1 fails at once; node 0 would sleep for a day, but is stopped after `grace`.
    script = 'if [ "$GROUP_RANK" = 1 ]; then exit 3; fi; sleep 86400'
    out = cluster.run(["--no-python", "bash", "-c", script], timeout=600, capture=True, grace=1)
    assert out.returncode != 0, out.tail()
    assert out.returncode != 124, f"hit the timeout instead of stopping early:\n{out.tail()}"
    # Stopped because node 1 failed, not by the timeout (which only a hang reaches): node 0
    # has no exit status of its own, and the run says why it stopped it.
    assert out.returncodes[1] not in (0, None) and out.returncodes[0] is None, out.tail()
    said = capsys.readouterr().err
    assert "a node failed; stopping the others after 1 s" in said and "timeout" not in said, said


@needs_cluster
def test_an_exception_inside_still_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with VirtualCluster(ranks=3, rate="500mbit") as c:
            names = c.state.all_namespaces
            state_file = c.state.path
            assert set(names) <= set(netns_list())
            raise RuntimeError("boom")
    assert not set(names) & set(netns_list())
    assert not state_file.exists()


def worker_pids(cluster: VirtualCluster, node: int, module: str) -> list[int]:
    """The node's training processes: those running `module`, not torchrun itself."""
    pids = []
    for pid in cluster.node_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # gone meanwhile
        if module in argv and "torch.distributed.run" not in argv:
            pids.append(pid)
    return pids


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left


@needs_cluster
def test_a_node_whose_link_drops_is_named_within_the_timeout() -> None:
    """Node 1's link goes down mid-run. Node 0 holds the rendezvous store (torchrun's
    agent there), so rank 1's heartbeat stops and rank 0 must fail once --timeout has
    passed, named by the watchdog (not by an error before it), naming rank 1; then every
    process ends and every namespace goes. How soon after the timeout is the machine's
    speed, so on that side only a hang fails."""
    from ddp.models import build_model

    timeout_s, module = 5.0, "stages.drop_in"
    # A hang. Without the watchdog the collective fails by itself at 1.1 x the timeout
    # with another message, which the checks of stderr below catch.
    hang_s = 120.0
    grad_bytes = sum(p.numel() * 4 for p in build_model("mlp", width=256, depth=3).parameters())
    with VirtualCluster(ranks=2, rate="1gbit") as cluster:
        names, state_file = cluster.state.all_namespaces, cluster.state.path
        finished: dict = {}

        def run() -> None:
            finished["out"] = cluster.run(
                ["-m", module, "--model", "mlp", "--steps", "1000000",
                 "--timeout", str(timeout_s)],
                timeout=600, capture=True, grace=1,
            )  # fmt: skip

        runner = threading.Thread(target=run)
        runner.start()
        try:
            # Training: both nodes have sent a few steps' gradients over their links.
            while min(cluster.link_bytes()) < 5 * grad_bytes and runner.is_alive():
                time.sleep(0.1)
            assert runner.is_alive(), finished["out"].tail()
            (rank0,) = worker_pids(cluster, 0, module)
            (rank1,) = worker_pids(cluster, 1, module)
            dropped_at = time.monotonic()
            cluster.set_link(1, up=False)
            ended_after_s: dict[int, float] = {}
            while len(ended_after_s) < 2 and time.monotonic() - dropped_at < hang_s:
                for rank, pid in ((0, rank0), (1, rank1)):
                    if rank not in ended_after_s and not running(pid):
                        ended_after_s[rank] = time.monotonic() - dropped_at
                time.sleep(0.02)
            failed_after_s = ended_after_s.get(0, float("inf"))
        finally:
            runner.join(timeout=600)
        assert not runner.is_alive(), "the run did not end after rank 0 failed"
        out = finished["out"]
        print(f"rank 0 failed {failed_after_s:.2f} s after node 1's link dropped; "
              f"the run ended {out.seconds:.1f} s after it started")  # fmt: skip
        assert out.returncode not in (0, 124), out.tail()  # failed, and not by the timeout
        assert f"rank 0: rank 1 has not answered for {timeout_s:g} s" in out.stderr[0], out.tail()
        # Named by the watchdog after the timeout, not by an error before it.
        assert 0.9 * timeout_s <= failed_after_s < hang_s, out.tail()
        # The cut-off rank ends by itself, saying why: its store watch sees no answer to
        # its heartbeat for the timeout (its collective would fail at 10% more).
        print(f"rank 1 ended {ended_after_s.get(1, float('inf')):.2f} s after the drop")
        assert "rank 1: the rendezvous store has not answered" in out.stderr[1], out.tail()
        assert ended_after_s.get(1, float("inf")) < hang_s, out.tail()
        assert [cluster.node_pids(k) for k in range(2)] == [[], []]  # rank 1 too is gone
    assert not set(names) & set(netns_list())
    assert not state_file.exists()


def test_without_root_it_says_so_and_fails(monkeypatch, capsys) -> None:
    monkeypatch.setattr(vc, "_available", None)  # not the cached answer
    monkeypatch.setattr(vc.os, "geteuid", lambda: 1000)
    ok, why = vc.available()
    assert not ok and "root" in why
    assert main(["up", "--ranks", "2", "--rate", "1gbit"]) != 0
    assert "needs root" in capsys.readouterr().err


def test_rates_read_as_tc_reads_bit_units() -> None:
    assert vc.parse_rate("1gbit") == 10**9
    assert vc.parse_rate("500mbit") == 5 * 10**8
    assert vc.tbf_burst_bytes(10**9) == 256 * 2**10  # the 1gbit setting measured here
    assert vc.tbf_burst_bytes(4 * 10**9) == 2**20  # and its 4gbit one
    with pytest.raises(ValueError, match="1gbit"):
        vc.parse_rate("125mbps")  # tc would read bytes per second: refused


OWNER = """
import sys, time
from profiling.cluster.virtual_cluster import VirtualCluster
cluster = VirtualCluster(ranks=2, rate="1gbit")
cluster.up()
print(cluster.state.id, flush=True)
time.sleep(600)
"""


@needs_cluster
def test_the_next_cluster_removes_what_a_killed_owner_left() -> None:
    # SIGKILL gives the owner no chance to take its cluster down: the next `up` must.
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        cid = owner.stdout.readline().strip()
        assert cid, "the owner made no cluster"
    finally:
        owner.kill()
        owner.wait()
    orphans = [ns for ns in netns_list() if ns.startswith(f"{vc.PREFIX}-{cid}-")]
    assert len(orphans) == 3, orphans  # the bridge and two nodes, still there
    with VirtualCluster(ranks=1, rate="1gbit"):
        assert not [ns for ns in netns_list() if ns in orphans]
    assert not (vc.STATE_DIR / f"{cid}.json").exists()


def test_a_cluster_is_stale_once_its_owner_is_gone() -> None:
    def state(pid, started):
        return vc.ClusterState("x", 1, "1gbit", 10**9, 1, "b", ["n"], ["a"], "i", pid,
                               "now", started)  # fmt: skip

    me = os.getpid()
    assert not vc.stale(state(me, vc.process_started(me)))
    assert not vc.stale(state(None, None))  # `up` from the command line: until `down`
    assert vc.stale(state(me, vc.process_started(me) - 1))  # its pid, reused by another
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert vc.stale(state(child.pid, None))  # a record without a start time: the pid
