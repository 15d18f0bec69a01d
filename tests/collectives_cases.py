"""The cases every all-reduce algorithm of ddp.collectives runs, on every rank, with
torch's own `dist.all_reduce` (Gloo's) on the same input as the reference.

`run_cases(rank, group)` runs on every rank of a group: from the test pool
(tests/test_collectives.py, 1 to 4 ranks), or under torchrun for world sizes the pool
does not have:

    torchrun --standalone --nproc-per-node 6 -m tests.collectives_cases OUT_DIR

which runs them on each group of GROUPS and writes each rank's records to
OUT_DIR/rank<r>.pt, by group (as dicts: a class pickled from `__main__` would not load
elsewhere), for the test to check."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ddp.collectives import ALGORITHMS, all_reduce

HIERARCHICAL = tuple(a for a in ALGORITHMS if a.startswith("hierarchical_"))
FLAT = tuple(a for a in ALGORITHMS if a not in HIERARCHICAL)

# Every dtype Gloo's all-reduce sums (it has no int16), run at one awkward size.
DTYPES = [
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
]  # fmt: skip


@dataclass
class Record:
    """One algorithm on one case, on one rank."""

    algorithm: str
    ranks_per_node: int
    case: str
    numel: int
    element_bytes: int
    equal: bool  # ours and the reference hold the same values, bit for bit
    in_place: bool  # the result is in the tensor given: same memory, same strides
    ours: torch.Tensor | None  # our all_reduce's result (None for the large case)
    reference: torch.Tensor | None  # dist.all_reduce's result on the same input
    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    bytes_sent_between_nodes: int
    bytes_received_between_nodes: int


SMALL = 10_000  # elements: results up to this size travel back to the test whole


def cases(world_size: int) -> list[tuple[str, torch.dtype, Callable]]:
    """(name, dtype, make(generator) -> this rank's input) for world size p: element
    counts 0, 1, p-1, p, p+1 (fewer than p, a multiple of p, not one), a few
    thousand, one large enough that a blocking send would wait for its receive; every
    dtype; and two non-contiguous layouts."""
    p = world_size
    shapes = {"0": (0,), "1": (1,), "p-1": (max(p - 1, 0),), "p": (p,), "p+1": (p + 1,)}
    shapes |= {"3p+2": (3 * p + 2,), "4099": (4099,), "2^20": (1 << 20,)}
    out = [(f"n={name}", torch.int64, _maker(shape, torch.int64)) for name, shape in shapes.items()]
    out += [(f"{dtype}, n=2p+1", dtype, _maker((2 * p + 1,), dtype)) for dtype in DTYPES]
    out.append(("transposed (p+2, 7)", torch.int64, lambda g: _ints((7, p + 2), g).t()))
    out.append(("every other of 4p+3", torch.int32, lambda g: _ints((4 * p + 3,), g)[::2]))
    return out


def _maker(shape: tuple[int, ...], dtype: torch.dtype):
    def make(g: torch.Generator) -> torch.Tensor:
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(shape, generator=g, dtype=dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        # Wide enough that int8 and uint8 sums over 5 ranks wrap around, as Gloo's do.
        low = 0 if dtype == torch.uint8 else -100
        return torch.randint(low, 100, shape, generator=g).to(dtype)

    return make


def _ints(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(-1000, 1000, shape, generator=g)


def every_layout(world_size: int) -> list[tuple[str, int]]:
    """(algorithm, ranks_per_node) pairs for a group of `world_size` ranks: every
    algorithm with each rank its own node, and the hierarchical ones on every other
    way to cut the group into whole nodes (one node of them all included)."""
    p = world_size
    nodes = [g for g in range(2, p + 1) if p % g == 0]
    return [(a, 1) for a in ALGORITHMS] + [(a, g) for g in nodes for a in HIERARCHICAL]


def run_cases(
    rank: int, group: dist.ProcessGroup, layouts: list[tuple[str, int]] | None = None
) -> list[Record]:
    """Every (algorithm, ranks_per_node) of `layouts` (default: `every_layout`) on every
    case: ours and dist.all_reduce on copies of one input."""
    records = []
    for k, (case, _, make) in enumerate(cases(group.size())):
        for algorithm, ranks_per_node in layouts or every_layout(group.size()):
            # Differs per rank; the same for every algorithm, so they can be compared.
            g = torch.Generator().manual_seed(1000 * rank + k)
            ours = make(g)
            reference = ours.clone()
            where = (ours.data_ptr(), ours.stride())
            traffic = all_reduce(ours, algorithm, group, ranks_per_node=ranks_per_node)
            dist.all_reduce(reference, group=group)
            small = ours.numel() <= SMALL
            records.append(
                Record(
                    algorithm, ranks_per_node, case, ours.numel(), ours.element_size(),
                    torch.equal(ours, reference), where == (ours.data_ptr(), ours.stride()),
                    ours if small else None,
                    reference if small else None, traffic.bytes_sent, traffic.bytes_received,
                    traffic.messages_sent, traffic.messages_received,
                    traffic.bytes_sent_between_nodes, traffic.bytes_received_between_nodes,
                )
            )  # fmt: skip
    return records


# The groups the pool's 4 ranks cannot make, under torchrun on 6: name -> (global
# ranks, the layouts run on them). 5 ranks: one extra rank for halving-doubling, a tree
# of depth 3. 6 ranks: the hierarchical algorithms on 3 nodes of 2 (an extra leader
# for halving-doubling between nodes) and on 2 nodes of 3 (a tree of 3 inside each).
# With the pool's, every count of 1 to 4 nodes of 1 to 3 ranks is run but 3 nodes of
# 3, 4 of 2 and 4 of 3, which add no new phase and would need up to 12 processes (each
# costs seconds of CPU to start, on 2 cores). In the subgroups, group ranks are not
# the global ones (global 1, 3, 4 are group ranks 0, 1, 2): an algorithm, a node or a
# leader that mixed the two would send to the wrong process.
GROUPS: dict[str, tuple[list[int], list[tuple[str, int]]]] = {
    "5 ranks": (list(range(1, 6)), [(a, 1) for a in FLAT]),
    "ranks 1, 3, 4": ([1, 3, 4], every_layout(3)),
    "6 ranks": (list(range(6)), [(a, g) for g in (2, 3) for a in HIERARCHICAL]),
    "ranks 1, 2, 4, 5": ([1, 2, 4, 5], [(a, 2) for a in HIERARCHICAL]),
}


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = {}
    for name, (ranks, layouts) in GROUPS.items():
        group = dist.new_group(ranks)  # collective: every rank makes every group
        if dist.get_rank() in ranks:
            result[name] = [asdict(r) for r in run_cases(group.rank(), group, layouts)]
    torch.save(result, out_dir / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
