"""ddp.collectives against torch's own all-reduce, and its byte counts against the
formulas, for every algorithm on 1 to 5 ranks.

Every case of tests/collectives_cases.py runs our all_reduce and `dist.all_reduce`
(Gloo's) on the same input: integer (and bool) results must be equal bit for bit,
floats within rounding, and every rank must end with bit-identical floats too. The bytes
each rank sent and received must equal what the algorithm's description says, worked
out here from that description and not from the code: p-1 is one ring, not two."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp.collectives import ALGORITHMS, all_reduce
from tests.against_torch import run_checked
from tests.collectives_cases import Record, run_cases

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


def expected_bytes(algorithm: str, p: int, rank: int, numel: int, element_bytes: int) -> int:
    """What `rank` sends (and, every algorithm here being symmetric, receives), from the
    algorithm's description."""
    n = numel * element_bytes
    if p == 1 or numel == 0:
        return 0
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


def check(records_by_rank: list[list[Record]], where: str) -> None:
    p = len(records_by_rank)
    for rank, records in enumerate(records_by_rank):
        assert {r.algorithm for r in records} == set(ALGORITHMS), where
        for rec in records:
            at = f"{where}, rank {rank}, {rec.algorithm}, {rec.case}"
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
            want = expected_bytes(rec.algorithm, p, rank, rec.numel, rec.element_bytes)
            assert (rec.bytes_sent, rec.bytes_received) == (want, want), (
                f"{at}: sent {rec.bytes_sent} and received {rec.bytes_received} bytes; "
                f"the {rec.algorithm} algorithm sends and receives {want}"
            )
            if rec.algorithm == "ring" and rec.numel > 0:  # the ring's 2(p-1) latencies
                assert rec.messages_sent == rec.messages_received == 2 * (p - 1), at
    # Every rank ends with the same bits, floats included: one rank computes each sum.
    for k, rec in enumerate(records_by_rank[0]):
        for rank in range(1, p):
            other = records_by_rank[rank][k]
            if rec.ours is not None:
                assert torch.equal(rec.ours, other.ours), (
                    f"{where}, {rec.algorithm}, {rec.case}: rank {rank} differs from rank 0"
                )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_equals_torchs(pool, world_size: int) -> None:
    check(run_checked(pool, world_size, run_cases), f"{world_size} ranks")


def test_all_reduce_equals_torchs_on_five_ranks_and_a_subgroup(tmp_path: Path) -> None:
    """The pool has 4 ranks; 5 (not a power of two, with one extra rank for
    halving-doubling, and a tree of depth 3) run under torchrun, and the same cases on
    a subgroup of global ranks 1, 3, 4."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "5", "-m", "tests.collectives_cases", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(5)]
    check([[Record(**d) for d in r["world"]] for r in ranks], "5 ranks")
    subgroup = [[Record(**d) for d in ranks[r]["subgroup"]] for r in (1, 3, 4)]
    check(subgroup, "subgroup of ranks 1, 3, 4")


# The bound below leaves 0.75 of it for all else: long beside the scheduling delays of
# 3 ranks on 2 busy cores, and shorter than one more delay (one per message, not per step).
DELAY_S = 0.5
# Steps on 3 ranks, by hand: naive gathers (1) and scatters (1); the ring 2(p-1);
# halving-doubling folds rank 2 in, swaps halves (1), swaps back (1), folds out; the
# tree: ranks 1 and 2 both send to 0 at once (1), then 0 sends to 2 and to 1 (2).
STEPS_ON_3 = {"naive": 2, "ring": 4, "halving_doubling": 4, "tree": 3}


def timed_with_delay(rank: int, group: dist.ProcessGroup) -> dict[str, float]:
    seconds = {}
    for algorithm in ALGORITHMS:
        dist.barrier(group=group)
        start = time.perf_counter()
        all_reduce(torch.ones(10), algorithm, group, delay_s=DELAY_S)
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
