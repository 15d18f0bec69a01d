"""All-reduce built from point-to-point messages: what `dist.all_reduce` does inside.

Every stage calls `torch.distributed.all_reduce` as a black box. This module opens it:
`all_reduce(tensor, algorithm, group)` sums `tensor` over the ranks of `group`, in place,
with nothing but `isend`/`irecv` (through `batch_isend_irecv`), four ways:

    naive             every rank sends its tensor to rank 0, which sums and sends the
                      result back: (p-1) n bytes in and out of one rank, 2 steps
    ring              reduce-scatter then all-gather around a ring, one chunk of n/p
                      per step: 2(p-1)/p n bytes per rank, 2(p-1) steps
    halving_doubling  Rabenseifner: recursive-halving reduce-scatter, recursive-doubling
                      all-gather: 2(p-1)/p n bytes per rank, 2 lg p steps (two more,
                      and 2n more bytes, when p is not a power of two)
    tree              a binomial tree: sum up to rank 0, then broadcast down: 2 lg p
                      steps, but every step carries the whole n

It returns what this rank put on the wire and took off it (`Traffic`). Use it as

    traffic = all_reduce(tensor, algorithm="ring")  # tensor now holds the sum on every rank
    traffic.bytes_sent  # this rank's bytes: 2 (p-1) ceil(n/p) * element size for the ring

or, in training, through `ddp.comm_hook_functions.point_to_point_hook` on every bucket.

All ranks must call it with the same algorithm and the same element count, in the
same order, as with any collective. Every rank ends with a bit-identical result: each
element's sum is computed once, on one rank, and copied to the others. Integer sums are
exact, so they equal Gloo's to the bit; float sums add in another order than Gloo's,
so they agree within rounding.

`delay_s` (for the benchmark, `python -m profiling.collectives`) makes every rank
wait that long before it posts each step's sends: an emulated network latency, paid
once per step on the critical path, for a machine whose kernel cannot add one to a link.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp.dist import require_process_group


# --8<-- [start:traffic]
@dataclass
class Traffic:
    """What one rank put on the wire and took off it during one all_reduce."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0


# --8<-- [end:traffic]


# --8<-- [start:exchange]
class _Link:
    """This rank's side of one all_reduce: every message goes through `exchange`, which
    counts it, and waits for all of a step's messages before it returns."""

    def __init__(self, group: dist.ProcessGroup, delay_s: float):
        self.group = group
        self.rank = group.rank()  # ranks here are group ranks, 0..size-1
        self.size = group.size()
        self.delay_s = delay_s
        self.traffic = Traffic()

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]] = (),
        recvs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> None:
        """One step: send each (peer, tensor) of `sends`, receive into each (peer,
        tensor) of `recvs`, and return once all of them are done.

        Two pitfalls shape it. A blocking send followed by a blocking receive on every
        rank deadlocks once messages are too large to sit in a socket buffer (everyone
        sends, no one receives), so all of a step's messages are posted at once,
        receives first. And a tensor handed to `isend` must not be written to (or
        freed) before the send completes, so the step waits for every send as well as
        every receive: after `exchange` returns, every buffer it was given is free."""
        ops = [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p) for p, t in recvs]
        if sends and self.delay_s > 0:
            time.sleep(self.delay_s)  # the emulated latency: see the module docstring
        ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=p) for p, t in sends]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for _, tensor in sends:
            self.traffic.bytes_sent += tensor.numel() * tensor.element_size()
        for _, tensor in recvs:
            self.traffic.bytes_received += tensor.numel() * tensor.element_size()
        self.traffic.messages_sent += len(sends)
        self.traffic.messages_received += len(recvs)


# --8<-- [end:exchange]


# --8<-- [start:naive]
def _naive(buffer: torch.Tensor, numel: int, link: _Link) -> None:
    """Reduce to rank 0, then broadcast from it. Every byte of every rank goes through
    rank 0's link, twice: (p-1) n in, (p-1) n out, while the other links idle."""
    if link.rank == 0:
        incoming = torch.empty_like(buffer)  # (n,)
        for peer in range(1, link.size):  # one message at a time, one scratch buffer
            link.exchange(recvs=[(peer, incoming)])
            buffer.add_(incoming)
        link.exchange(sends=[(peer, buffer) for peer in range(1, link.size)])
    else:
        link.exchange(sends=[(0, buffer)])
        link.exchange(recvs=[(0, buffer)])


# --8<-- [end:naive]


# --8<-- [start:ring]
def _ring(buffer: torch.Tensor, numel: int, link: _Link) -> None:
    """Reduce-scatter, then all-gather, around the ring 0 -> 1 -> ... -> p-1 -> 0.

    The buffer is cut into p chunks. At every step each rank sends one chunk to its
    right neighbour and receives one from its left, so every link carries n/p bytes
    in each direction at once and none idles: 2(p-1) steps of n/p bytes is
    2(p-1)/p n per rank, the least any all-reduce can put through each rank's link
    (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", 2009). The price is 2(p-1) latencies, one per step."""
    p, rank = link.size, link.rank
    chunks = buffer.view(p, -1)  # (p, n/p): the buffer is padded to a multiple of p
    right, left = (rank + 1) % p, (rank - 1) % p
    incoming = torch.empty_like(chunks[0])  # (n/p,)
    # Reduce-scatter. At step s, rank r passes on chunk r-s, which holds the sum over
    # ranks r-s..r, and adds what its left neighbour passed on to chunk r-s-1.
    for step in range(p - 1):
        send, recv = (rank - step) % p, (rank - step - 1) % p
        link.exchange(sends=[(right, chunks[send])], recvs=[(left, incoming)])
        chunks[recv].add_(incoming)
    # Now chunk r+1 holds the sum over all ranks, here and nowhere else. All-gather:
    # pass the finished chunks on around the ring, each received straight into place.
    for step in range(p - 1):
        send, recv = (rank + 1 - step) % p, (rank - step) % p
        link.exchange(sends=[(right, chunks[send])], recvs=[(left, chunks[recv])])


# --8<-- [end:ring]


# --8<-- [start:halving_doubling]
def _halving_doubling(buffer: torch.Tensor, numel: int, link: _Link) -> None:
    """Rabenseifner's all-reduce: the ring's bytes in 2 lg p steps instead of 2(p-1).

    Reduce-scatter by recursive halving: rank r swaps half of its segment with rank
    r XOR p/2, keeps the half its bit selects and adds the partner's copy of it; then
    the same with the partner at distance p/4 on the half it kept, and so on down to
    distance 1, when each rank holds one fully summed chunk, chunk r. All-gather by
    recursive doubling walks back up: swap segments with the partner at distance 1,
    2, ..., p/2, each time doubling the segment held. Each rank sends n/2 + n/4 + ...
    + n/p twice: 2(p-1)/p n, as on the ring.

    The halving needs a power of two. With p = 2^k + extra ranks, the extra ranks
    first fold in (rank 2^k + i sends all n to rank i, which adds it), wait while the
    2^k core ranks run the algorithm, and get the result back from rank i: two more
    steps and 2n more bytes on rank i's link."""
    p, rank = link.size, link.rank
    core = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    extra = p - core
    data = buffer[:numel]  # the fold moves the real elements, not the padding
    if rank >= core:  # an extra rank: fold in, then out
        link.exchange(sends=[(rank - core, data)])
        link.exchange(recvs=[(rank - core, data)])
        return
    if rank < extra:
        incoming = torch.empty_like(data)  # (n,)
        link.exchange(recvs=[(rank + core, incoming)])
        data.add_(incoming)
        del incoming

    chunk = buffer.numel() // core  # elements; the buffer is padded to a multiple of core
    scratch = buffer.new_empty(buffer.numel() // 2)  # the largest half
    lo, hi = 0, core  # the segment this rank is responsible for, in chunks
    distance = core // 2
    while distance >= 1:  # recursive halving
        partner, mid = rank ^ distance, (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        incoming = scratch[: (mid - lo) * chunk]
        link.exchange(
            sends=[(partner, buffer[give[0] * chunk : give[1] * chunk])],
            recvs=[(partner, incoming)],
        )
        lo, hi = keep
        buffer[lo * chunk : hi * chunk].add_(incoming)
        distance //= 2
    distance = 1
    while distance < core:  # recursive doubling: the partner holds the neighbouring segment
        partner, width = rank ^ distance, hi - lo
        other = (lo - width, lo) if rank & distance else (hi, hi + width)
        link.exchange(
            sends=[(partner, buffer[lo * chunk : hi * chunk])],
            recvs=[(partner, buffer[other[0] * chunk : other[1] * chunk])],
        )
        lo, hi = min(lo, other[0]), max(hi, other[1])
        distance *= 2

    if rank < extra:  # fold out: the extra rank gets the result
        link.exchange(sends=[(rank + core, data)])


# --8<-- [end:halving_doubling]


# --8<-- [start:tree]
def _tree(buffer: torch.Tensor, numel: int, link: _Link) -> None:
    """A binomial tree rooted at rank 0: sum up it, then broadcast down it.

    Going up, at distance d = 1, 2, 4, ... every rank r with r mod 2d == d sends its
    partial sum to r - d and is done; the rank below adds it. After lg p steps rank 0
    holds the sum; the broadcast runs the same tree backwards. Only 2 lg p steps, as
    halving-doubling, but every message carries all n elements, so rank 0 sends and
    receives lg p times n bytes: a win only where latency, not bytes, costs the time."""
    p, rank = link.size, link.rank
    incoming = torch.empty_like(buffer)  # (n,)
    distance = 1
    while distance < p:  # reduce toward rank 0
        if rank % (2 * distance) == distance:
            link.exchange(sends=[(rank - distance, buffer)])
            break
        if rank + distance < p:
            link.exchange(recvs=[(rank + distance, incoming)])
            buffer.add_(incoming)
        distance *= 2
    # Broadcast down: receive from the parent (at the distance of r's lowest set bit,
    # where the loop above stopped), then send to the children at smaller distances.
    if rank > 0:
        link.exchange(recvs=[(rank - distance, buffer)])
    distance //= 2
    while distance >= 1:
        if rank + distance < p:
            link.exchange(sends=[(rank + distance, buffer)])
        distance //= 2


# --8<-- [end:tree]


# --8<-- [start:all_reduce]
# name -> (algorithm, the multiple of elements its buffer is padded to for world size p)
_ALGORITHMS: dict[str, tuple[Callable[[torch.Tensor, int, _Link], None], Callable[[int], int]]] = {
    "naive": (_naive, lambda p: 1),
    "ring": (_ring, lambda p: p),  # p equal chunks
    "halving_doubling": (_halving_doubling, lambda p: 1 << (p.bit_length() - 1)),
    "tree": (_tree, lambda p: 1),
}
ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)


def all_reduce(
    tensor: torch.Tensor,
    algorithm: str = "ring",
    group: dist.ProcessGroup | None = None,
    *,
    delay_s: float = 0.0,
) -> Traffic:
    """Sum `tensor` over the ranks of `group` (default: the world), in place, with
    point-to-point messages only; return what this rank sent and received.

    Any element count (0, fewer than the ranks, not a multiple of them), any dtype
    torch can add, any layout: a non-contiguous tensor, or one whose element count the
    algorithm cannot split evenly, travels as a contiguous, zero-padded copy that is
    copied back at the end (the padding is sent too, and counted)."""
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if delay_s < 0:
        raise ValueError(f"delay_s must be >= 0 seconds, got {delay_s}")
    link = _Link(require_process_group(group), delay_s)
    numel = tensor.numel()
    if numel == 0 or link.size == 1:
        return link.traffic  # nothing to add, and no one to add it with
    run, multiple = _ALGORITHMS[algorithm]
    padded = -(-numel // multiple(link.size)) * multiple(link.size)  # elements
    with torch.no_grad():
        if tensor.is_contiguous() and padded == numel:
            run(tensor.view(-1), numel, link)  # in the tensor's own memory
        else:
            buffer = tensor.new_zeros(padded)  # zeros: the padding adds nothing
            buffer[:numel].view(tensor.shape).copy_(tensor)
            run(buffer, numel, link)
            tensor.copy_(buffer[:numel].view(tensor.shape))
    return link.traffic


# --8<-- [end:all_reduce]
