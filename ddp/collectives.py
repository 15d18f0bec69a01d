"""All-reduce built from point-to-point messages: what `dist.all_reduce` does inside.

Every stage calls `torch.distributed.all_reduce` as a black box. This module opens it:
`all_reduce(tensor, algorithm, group)` sums `tensor` over the ranks of `group`, in place,
with nothing but `isend`/`irecv` (through `batch_isend_irecv`), four flat ways:

    naive             every rank sends its tensor to rank 0, which sums and sends the
                      result back: (p-1) n bytes in and out of one rank, 2 steps
    ring              reduce-scatter then all-gather around a ring, one chunk of n/p
                      per step: 2(p-1)/p n bytes per rank, 2(p-1) steps
    halving_doubling  Rabenseifner: recursive-halving reduce-scatter, recursive-doubling
                      all-gather: 2(p-1)/p n bytes per rank, 2 lg p steps (two more,
                      and 2n more bytes, when p is not a power of two)
    tree              a binomial tree: sum up to rank 0, then broadcast down: 2 lg p
                      steps, but every step carries the whole n

and two hierarchical forms, `hierarchical_ring` and `hierarchical_halving_doubling`:
Goyal et al.'s three phases ("Accurate, Large Minibatch SGD", 2017, section 4) over
N = p/g nodes of g = `ranks_per_node` consecutive ranks (rank r on node r // g), each
node's first rank its leader (steps for g and N powers of two):

    phase                          steps             bytes each rank sends (x n)
    1 reduce: the tree up to the   lg g              1 (the leader: 0); a rank
      leader, inside each node                       receives 1 per child in the tree
    2 all-reduce between the N     2(N-1) (ring),    the leaders alone: 2(N-1)/N, all
      leaders: the ring or         2 lg N (halving-  of it between nodes
      halving-doubling             doubling)
    3 broadcast: the tree back     lg g              1 per child; a rank receives 1
      down, inside each node                         (the leader: 0)

Only phase 2 crosses nodes, one rank per node: 2(N-1)/N n through a node's link to
the network each way, where a flat halving-doubling sends that from all g ranks of
the node at once. With g = 1 it is the inter-node algorithm itself; with N = 1, the
tree.

It returns what this rank put on the wire and took off it (`Traffic`). Use it as

    traffic = all_reduce(tensor, algorithm="ring")  # tensor now holds the sum on every rank
    traffic.bytes_sent  # this rank's bytes: 2 (p-1) ceil(n/p) * element size for the ring

    traffic = all_reduce(tensor, "hierarchical_halving_doubling", ranks_per_node=8)
    traffic.bytes_sent_between_nodes  # 0 on all but a node's first rank

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
from functools import partial

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
    # The part of bytes_sent and bytes_received to or from a rank on another node
    # (`ranks_per_node`): what a shaped link between servers carries. With the default
    # of one rank per node, every byte.
    bytes_sent_between_nodes: int = 0
    bytes_received_between_nodes: int = 0


# --8<-- [end:traffic]


# --8<-- [start:exchange]
class _Link:
    """This rank's side of one all_reduce: every message goes through `exchange`, which
    counts it, and waits for all of a step's messages before it returns.

    A link joins `members`, group ranks (by default all of the group's) that it
    numbers 0..size-1 in that order: an algorithm written for ranks 0..p-1 runs
    unchanged over a subset of them, such as the nodes' leaders, with no process group
    of its own (`among`)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        delay_s: float,
        ranks_per_node: int = 1,
        members: Sequence[int] | None = None,
        traffic: Traffic | None = None,
    ):
        self.group = group
        self.members = range(group.size()) if members is None else members  # group ranks
        self.rank = self.members.index(group.rank())  # ranks here are link ranks, 0..size-1
        self.size = len(self.members)
        self.ranks_per_node = ranks_per_node  # group rank r is on node r // ranks_per_node
        self.delay_s = delay_s
        self.traffic = Traffic() if traffic is None else traffic

    def among(self, ranks: Sequence[int]) -> _Link:
        """This rank's link to `ranks` of this link alone (this rank one of them),
        renumbered 0..len(ranks)-1 in order; its messages count in this link's traffic."""
        members = [self.members[r] for r in ranks]
        return _Link(self.group, self.delay_s, self.ranks_per_node, members, self.traffic)

    def _between_nodes(self, peer: int) -> bool:
        node = self.members[self.rank] // self.ranks_per_node
        return self.members[peer] // self.ranks_per_node != node

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
        peer = self.members  # link rank -> group rank
        ops = [dist.P2POp(dist.irecv, t, group=self.group, group_peer=peer[p]) for p, t in recvs]
        if sends and self.delay_s > 0:
            time.sleep(self.delay_s)  # the emulated latency: see the module docstring
        ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=peer[p]) for p, t in sends]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        t = self.traffic
        for p, tensor in sends:
            t.bytes_sent += tensor.numel() * tensor.element_size()
            if self._between_nodes(p):
                t.bytes_sent_between_nodes += tensor.numel() * tensor.element_size()
        for p, tensor in recvs:
            t.bytes_received += tensor.numel() * tensor.element_size()
            if self._between_nodes(p):
                t.bytes_received_between_nodes += tensor.numel() * tensor.element_size()
        t.messages_sent += len(sends)
        t.messages_received += len(recvs)


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
    _reduce_up_tree(buffer, link)
    _broadcast_down_tree(buffer, link)


def _reduce_up_tree(buffer: torch.Tensor, link: _Link) -> None:
    """The sum of every rank's buffer, on rank 0; the others keep partial sums."""
    p, rank = link.size, link.rank
    incoming = torch.empty_like(buffer)  # (n,)
    distance = 1
    while distance < p:
        if rank % (2 * distance) == distance:
            link.exchange(sends=[(rank - distance, buffer)])
            return
        if rank + distance < p:
            link.exchange(recvs=[(rank + distance, incoming)])
            buffer.add_(incoming)
        distance *= 2


def _broadcast_down_tree(buffer: torch.Tensor, link: _Link) -> None:
    """Rank 0's buffer, on every rank: receive from the parent, at the distance of r's
    lowest set bit (where r sent its sum up), then send to the children at smaller
    distances, farthest first; rank 0's farthest child is below the power of two >= p."""
    p, rank = link.size, link.rank
    distance = rank & -rank if rank > 0 else 1 << (p - 1).bit_length()
    if rank > 0:
        link.exchange(recvs=[(rank - distance, buffer)])
    distance //= 2
    while distance >= 1:
        if rank + distance < p:
            link.exchange(sends=[(rank + distance, buffer)])
        distance //= 2


# --8<-- [end:tree]


# --8<-- [start:hierarchical]
def _hierarchical(
    buffer: torch.Tensor,
    numel: int,
    link: _Link,
    between_nodes: Callable[[torch.Tensor, int, _Link], None],
) -> None:
    """Goyal et al.'s three phases over nodes of g = link.ranks_per_node ranks: (1) the
    tree sums each node's buffers on its first rank, the leader; (2) the N leaders
    all-reduce those sums among themselves with `between_nodes` (halving-doubling in
    the paper, or the ring), over a link that joins them alone; (3) the tree
    broadcasts the result from each leader to the rest of its node.

    Only the leaders' messages cross nodes: 2(N-1)/N n out of each node and as much
    in. A flat halving-doubling sends that from every rank of a node at once, g times
    the bytes through the node's one link to the network; a flat ring crosses between
    nodes at every one of its 2(p-1) steps, where phase 2 takes 2(N-1). The price is
    inside the node: whole buffers, one after another, ceil(lg g) in and as many out
    on the leader. Each element's sum is still computed once, on one leader in phase 2,
    and copied: every rank ends with the same bits."""
    g = link.ranks_per_node
    first = link.rank - link.rank % g  # this node's leader
    node = link.among(range(first, first + g))  # the leader is its rank 0
    data = buffer[:numel]  # inside a node the real elements travel, not the padding
    if g > 1:
        _reduce_up_tree(data, node)
    if node.rank == 0 and link.size > g:
        between_nodes(buffer, numel, link.among(range(0, link.size, g)))
    if g > 1:
        _broadcast_down_tree(data, node)


# --8<-- [end:hierarchical]


# --8<-- [start:all_reduce]
# name -> (algorithm, the multiple of elements its buffer is padded to for p ranks on
# `nodes` nodes)
_ALGORITHMS: dict[
    str, tuple[Callable[[torch.Tensor, int, _Link], None], Callable[[int, int], int]]
] = {
    "naive": (_naive, lambda p, nodes: 1),
    "ring": (_ring, lambda p, nodes: p),  # p equal chunks
    "halving_doubling": (_halving_doubling, lambda p, nodes: 1 << (p.bit_length() - 1)),
    "tree": (_tree, lambda p, nodes: 1),
    # The phase between nodes cuts the buffer over the nodes' leaders.
    "hierarchical_ring": (partial(_hierarchical, between_nodes=_ring), lambda p, nodes: nodes),
    "hierarchical_halving_doubling": (
        partial(_hierarchical, between_nodes=_halving_doubling),
        lambda p, nodes: 1 << (nodes.bit_length() - 1),
    ),
}
ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)


def all_reduce(
    tensor: torch.Tensor,
    algorithm: str = "ring",
    group: dist.ProcessGroup | None = None,
    *,
    ranks_per_node: int = 1,
    delay_s: float = 0.0,
) -> Traffic:
    """Sum `tensor` over the ranks of `group` (default: the world), in place, with
    point-to-point messages only; return what this rank sent and received.

    Any element count (0, fewer than the ranks, not a multiple of them), any dtype
    torch can add, any layout: a non-contiguous tensor, or one whose element count the
    algorithm cannot split evenly, travels as a contiguous, zero-padded copy that is
    copied back at the end (the padding is sent too, and counted).

    `ranks_per_node`: the group's ranks sit on nodes of this many consecutive ranks
    (group rank r on node r // ranks_per_node). The hierarchical algorithms run their
    phases over these nodes; every algorithm counts the bytes that cross them
    (`Traffic.bytes_sent_between_nodes`). It must divide the group's size."""
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if delay_s < 0:
        raise ValueError(f"delay_s must be >= 0 seconds, got {delay_s}")
    group = require_process_group(group)
    if ranks_per_node < 1 or group.size() % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not cut the world size {group.size()} "
            f"(the ranks of the group) into whole nodes; pick a divisor of {group.size()}"
        )
    link = _Link(group, delay_s, ranks_per_node)
    numel = tensor.numel()
    if numel == 0 or link.size == 1:
        return link.traffic  # nothing to add, and no one to add it with
    run, multiple = _ALGORITHMS[algorithm]
    pad_to = multiple(link.size, link.size // ranks_per_node)  # elements
    padded = -(-numel // pad_to) * pad_to  # elements
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
