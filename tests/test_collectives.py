"""ddp.collectives against torch's own all-reduce, and its byte counts against the
formulas, for every algorithm on 1 to 6 and 8 ranks, the hierarchical ones on every
way to cut those ranks into whole nodes.

Every case of tests/collectives_cases.py runs our all_reduce and `dist.all_reduce`
(Gloo's) on the same input: integer (and bool) results must be equal bit for bit,
floats within rounding, and every rank must end with bit-identical floats too. The bytes
each rank sent and received, and the part of them between nodes, must equal what the
algorithm's description says, worked out here from that description and not from the
code: p-1 is one ring, not two."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp.collectives import all_reduce
from profiling.collectives.model import Counts, counts, three_phases
from tests.against_torch import run_checked
from tests.collectives_cases import GROUPS, Record, every_layout, run_cases
from tests.pool import RankError

ROOT = Path(__file__).resolve().parent.parent

# Floats: Gloo adds the p inputs in another order; a few roundings of sums of p
# standard normals.
FLOAT_TOLERANCE = {
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
    torch.bfloat16: {"rtol": 4e-2, "atol": 1e-1},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.complex64: {"rtol": 1e-5, "atol": 1e-5},
}


def expected_bytes(
    algorithm: str, p: int, rank: int, numel: int, element_bytes: int, ranks_per_node: int = 1
) -> int:
    """What `rank` sends (and, every algorithm here being symmetric, receives), from the
    algorithm's description."""
    n = numel * element_bytes
    if p == 1 or numel == 0:
        return 0
    if algorithm.startswith("hierarchical_"):  # the tree's two halves inside the node
        g = ranks_per_node
        inside = expected_bytes("tree", g, rank % g, numel, element_bytes)
        return inside + expected_between_nodes(algorithm, p, rank, numel, element_bytes, g)
    if algorithm == "naive":  # everyone to rank 0, rank 0 back to everyone
        return (p - 1) * n if rank == 0 else n
    if algorithm == "ring":  # 2(p-1) steps of one chunk, the tensor padded to p chunks
        return 2 * (p - 1) * math.ceil(numel / p) * element_bytes
    if algorithm == "halving_doubling":
        core = 2 ** int(math.log2(p))  # the largest power of two <= p
        if rank >= core:  # folds in and out: the whole tensor, once each way
            return n
        # halves n/2, n/4, ..., one chunk; then back up: 2(core-1) chunks of n/core
        chunks = 2 * (core - 1) * math.ceil(numel / core) * element_bytes
        return chunks + (n if rank < p - core else 0)  # the extra rank folded into this one
    if algorithm == "tree":  # binomial: one message per tree edge each way, all n
        children = sum(1 for k in range(p.bit_length()) if rank % 2 ** (k + 1) == 0
                       and rank + 2**k < p)  # fmt: skip
        return (children + (rank > 0)) * n
    raise AssertionError(algorithm)


def expected_between_nodes(
    algorithm: str, p: int, rank: int, numel: int, element_bytes: int, ranks_per_node: int
) -> int:
    """The part of expected_bytes to and from other nodes: for the hierarchical forms,
    the leaders' all-reduce between nodes alone, each leader a rank of it."""
    g = ranks_per_node
    if not algorithm.startswith("hierarchical_"):  # each rank its own node: every byte
        assert g == 1, "the flat algorithms run here with one rank per node"
        return expected_bytes(algorithm, p, rank, numel, element_bytes)
    if rank % g:  # not the node's first rank: phases 1 and 3 stay inside the node
        return 0
    between = algorithm.removeprefix("hierarchical_")
    return expected_bytes(between, p // g, rank // g, numel, element_bytes)


def check_models_bytes_between_nodes(rec: Record, p: int, rank: int, at: str) -> None:
    """A leader's bytes between nodes are the cost model's (profiling.collectives.model,
    which the simulator prices the phases with): 2(N-1)/N n for the ring and for
    halving-doubling on N a power of two, where the buffer needs no padding. (With N
    not a power of two, the model's critical link carries an extra leader's n in, then
    out, one after the other, which no one rank's sends add up to.)"""
    g, between = rec.ranks_per_node, rec.algorithm.removeprefix("hierarchical_")
    nodes, n = p // g, rec.numel * rec.element_bytes
    chunks = nodes if between == "ring" else 1 << (nodes.bit_length() - 1)
    if rank % g or rec.numel % chunks or (between != "ring" and chunks != nodes):
        return
    model = three_phases(between, nodes, g, n).between.sent
    assert rec.bytes_sent_between_nodes == pytest.approx(model, rel=1e-12, abs=0), (
        f"{at}: a leader sent {rec.bytes_sent_between_nodes} bytes between nodes; the "
        f"model says {model}"
    )


def check(
    records_by_rank: list[list[Record]], where: str, layouts: list[tuple[str, int]] | None = None
) -> None:
    """The records of one group, every rank's: `layouts` (default: every_layout) ran."""
    p = len(records_by_rank)
    for rank, records in enumerate(records_by_rank):
        ran = {(r.algorithm, r.ranks_per_node) for r in records}
        assert ran == set(layouts or every_layout(p)), where
        flat = {(r.algorithm, r.case): r for r in records if r.ranks_per_node == 1}
        for rec in records:
            g = rec.ranks_per_node
            at = f"{where}, rank {rank}, {rec.algorithm}, {g} ranks per node, {rec.case}"
            assert rec.in_place, f"{at}: the result is not in the tensor given"
            floating = rec.ours is not None and (
                rec.ours.is_floating_point() or rec.ours.is_complex()
            )
            if floating:
                torch.testing.assert_close(
                    rec.ours, rec.reference, **FLOAT_TOLERANCE[rec.ours.dtype],
                    msg=lambda m, at=at: f"{at}: {m}",
                )  # fmt: skip
            else:
                assert rec.equal, (
                    f"{at}: differs from dist.all_reduce:\n{rec.ours}\n{rec.reference}"
                )
            want = expected_bytes(rec.algorithm, p, rank, rec.numel, rec.element_bytes, g)
            assert (rec.bytes_sent, rec.bytes_received) == (want, want), (
                f"{at}: sent {rec.bytes_sent} and received {rec.bytes_received} bytes; "
                f"the {rec.algorithm} algorithm sends and receives {want}"
            )
            want = expected_between_nodes(rec.algorithm, p, rank, rec.numel, rec.element_bytes, g)
            between = (rec.bytes_sent_between_nodes, rec.bytes_received_between_nodes)
            assert between == (want, want), (
                f"{at}: sent and received {between} bytes between nodes; the "
                f"{rec.algorithm} algorithm sends and receives {want}"
            )
            if rec.algorithm == "ring" and rec.numel > 0:  # the ring's 2(p-1) latencies
                assert rec.messages_sent == rec.messages_received == 2 * (p - 1), at
            if rec.algorithm.startswith("hierarchical_"):
                check_models_bytes_between_nodes(rec, p, rank, at)
            same = flat.get((rec.algorithm.removeprefix("hierarchical_"), rec.case))
            if rec.algorithm.startswith("hierarchical_") and g == 1 and same:
                # Each rank its own node: the inter-node algorithm itself, bit for bit.
                assert rec.bytes_sent == same.bytes_sent, at
                if rec.ours is not None:
                    assert torch.equal(rec.ours, same.ours), f"{at}: differs from {same.algorithm}"
    # Every rank ends with the same bits, floats included: one rank computes each sum.
    for k, rec in enumerate(records_by_rank[0]):
        for rank in range(1, p):
            other = records_by_rank[rank][k]
            if rec.ours is not None:
                assert torch.equal(rec.ours, other.ours), (
                    f"{where}, {rec.algorithm}, {rec.ranks_per_node} ranks per node, "
                    f"{rec.case}: rank {rank} differs from rank 0"
                )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_equals_torchs(pool, world_size: int) -> None:
    check(run_checked(pool, world_size, run_cases), f"{world_size} ranks")


def test_all_reduce_equals_torchs_on_five_and_six_ranks_and_subgroups(tmp_path: Path) -> None:
    """The pool has 4 ranks; the groups of collectives_cases.GROUPS run under torchrun
    on 6: 5 ranks (not a power of two, with one extra rank for halving-doubling, and a
    tree of depth 3); 6, the hierarchical algorithms on 3 nodes of 2 and 2 nodes of 3;
    and subgroups whose group ranks are not the global ones."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "6", "-m", "tests.collectives_cases", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(6)]
    for name, (members, layouts) in GROUPS.items():
        check([[Record(**d) for d in ranks[r][name]] for r in members], name, layouts)


def on_nodes(rank: int, group: dist.ProcessGroup, algorithm: str, ranks_per_node: int):
    return all_reduce(torch.ones(12), algorithm, group, ranks_per_node=ranks_per_node)


def test_ranks_per_node_must_cut_the_group_into_whole_nodes(pool) -> None:
    """3 ranks make no nodes of 2: every rank refuses before it sends anything (so no
    rank waits for another), naming both numbers; for a flat algorithm too, whose
    bytes between nodes would be counted over such nodes."""
    for algorithm in ("hierarchical_halving_doubling", "ring"):
        for run in pool.run(3, on_nodes, algorithm, 2, timeout_s=60):
            assert isinstance(run, RankError) and run.type_name == "ValueError", run
            assert "ranks_per_node=2" in run.message and "world size 3" in run.message, run


def test_a_flat_ring_counts_the_bytes_that_cross_nodes(pool) -> None:
    """The ring 0 -> 1 -> 2 -> 3 -> 0 on 2 nodes of 2: ranks 1 and 3 send across nodes
    (to 2 and to 0), ranks 0 and 2 receive from across, and nothing else crosses."""
    traffic = run_checked(pool, 4, on_nodes, "ring", 2)
    everything = 2 * 3 * 3 * 4  # 2(p-1) chunks of 3 float32
    for rank, t in enumerate(traffic):
        assert t.bytes_sent == t.bytes_received == everything, rank
        across = (t.bytes_sent_between_nodes, t.bytes_received_between_nodes)
        assert across == ((0, everything) if rank % 2 == 0 else (everything, 0)), rank


def test_the_models_three_phases_by_hand_and_at_their_limits() -> None:
    """profiling.collectives.model prices both hierarchical forms (the simulator uses the
    sharded one): worked by hand on 2 nodes of 2, and equal to a flat algorithm at the
    limits, one rank per node and one node."""
    # Goyal et al.'s, 40 B: the leader receives its neighbour's 40 B and adds it (1
    # step), swaps halves of 20 B with the other leader and adds 20 (the ring of 2:
    # 2 steps, 40 B sent), then sends the 40 B result back (1 step).
    goyal = three_phases("ring", 2, 2, 40)
    assert (goyal.inside_before, goyal.inside_after) == (Counts(1, (40,), 40), Counts(1, (40,), 0))
    assert goyal.between == Counts(2, (40,), 20) and goyal.ranks_between == 1
    assert goyal.total == Counts(4, (40, 40, 40), 60)
    # NCCL's: a reduce-scatter of 2 halves (1 step, 20 B), each rank's 20 B half with
    # its peer on the other node (2 steps, 20 B sent; both ranks of a node at once), an
    # all-gather (1 step, 20 B).
    nccl = three_phases("ring", 2, 2, 40, sharded=True)
    assert (nccl.inside_before, nccl.inside_after) == (Counts(1, (20,), 20), Counts(1, (20,), 0))
    assert nccl.between == Counts(2, (20,), 10) and nccl.ranks_between == 2
    for between in ("ring", "halving_doubling"):
        for p in (2, 3, 4, 6, 8):
            n = 48.0 * p
            assert counts(f"hierarchical_{between}", p, n) == counts(between, p, n)
            assert counts(f"hierarchical_{between}", p, n, ranks_per_node=p) == counts("tree", p, n)
            inside = three_phases(between, 1, p, n, sharded=True)  # the ring's two halves
            assert inside.total == replace(counts("ring", p, n), phases=(n * (p - 1) / p,) * 2)
    with pytest.raises(ValueError, match="ranks_per_node=4 does not cut 6 ranks"):
        counts("hierarchical_ring", 6, 1.0, ranks_per_node=4)


# The bound below leaves 0.75 of it for all else: long beside the scheduling delays of
# 3 ranks on 2 busy cores, and shorter than one more delay (one per message, not per step).
DELAY_S = 0.5
# Steps on 3 ranks, by hand: naive gathers (1) and scatters (1); the ring 2(p-1);
# halving-doubling folds rank 2 in, swaps halves (1), swaps back (1), folds out; the
# tree: ranks 1 and 2 both send to 0 at once (1), then 0 sends to 2 and to 1 (2). A
# hierarchical form on one node of 3 runs the tree's halves, over a link that joins a
# node's ranks alone; with one rank per node, it is the ring or halving-doubling.
STEPS_ON_3 = {"naive": 2, "ring": 4, "halving_doubling": 4, "tree": 3, "hierarchical_ring": 3}
RANKS_PER_NODE_ON_3 = {"hierarchical_ring": 3}  # the others: 1


def timed_with_delay(rank: int, group: dist.ProcessGroup) -> dict[str, float]:
    seconds = {}
    for algorithm in STEPS_ON_3:
        g = RANKS_PER_NODE_ON_3.get(algorithm, 1)
        dist.barrier(group=group)
        start = time.perf_counter()
        all_reduce(torch.ones(10), algorithm, group, ranks_per_node=g, delay_s=DELAY_S)
        seconds[algorithm] = time.perf_counter() - start
    return seconds


def test_emulated_delay_is_paid_once_per_step(pool) -> None:
    """The benchmark's emulated latency: every step waits DELAY_S once, on the slowest
    rank's clock; never less, and not once per message (naive's rank 0 sends to two
    ranks in one step)."""
    runs = run_checked(pool, 3, timed_with_delay)
    for algorithm, steps in STEPS_ON_3.items():
        slowest = max(run[algorithm] for run in runs)
        assert steps * DELAY_S <= slowest < (steps + 0.75) * DELAY_S, (
            f"{algorithm}: {slowest:.3f} s with {DELAY_S} s per step; {steps} steps expected"
        )


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_the_ring_figure_follows_the_rings_schedule(p, tmp_path, monkeypatch):
    from profiling.course.ring_figure import draw, ring_steps
    from tests.figures import assert_legible, record_font_sizes

    steps = ring_steps(p)
    assert len(steps) == 1 + 2 * (p - 1)
    everyone = frozenset(range(p))
    # After the reduce-scatter, rank r holds the whole sum of chunk r + 1 (the page's
    # table), and no other chunk whole; after the all-gather, every rank holds all.
    _, _, reduced = steps[p - 1]
    for r in range(p):
        assert [c for c in range(p) if reduced[r][c] == everyone] == [(r + 1) % p]
    assert all(chunk == everyone for rank in steps[-1][2] for chunk in rank)
    if p == 4:
        sizes = record_font_sizes(monkeypatch)
        draw(p, tmp_path / "ring.png")
        assert_legible(tmp_path / "ring.png", sizes)
