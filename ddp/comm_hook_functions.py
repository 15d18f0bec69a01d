"""Communication hooks: what a bucket's gradients go through on their way between ranks.

The same call convention as torch DDP's `register_comm_hook(state, hook)`: the reducer
hands `hook(state, bucket)` one bucket whose flat buffer holds this rank's local
gradients, not yet divided by the world size, and the hook returns a
`torch.futures.Future` whose value is the bucket's average over the ranks. Each hook
here is a short reimplementation of the one in torch.distributed.algorithms
.ddp_comm_hooks, and tests/test_comm_hook_functions.py checks it against torch's on the same
inputs. torch's Python hooks take our GradBucket too (they only call its methods).
One has no counterpart in torch: `point_to_point_hook` averages with our own
all-reduce from sends and receives (`ddp.collectives`: naive, ring, halving-doubling,
tree), checked against torch's DDP in tests/test_collectives_hook.py.

    state = PowerSGDState(process_group=None, start_powerSGD_iter=10)
    future = powerSGD_hook(state, GradBucket(bucket, is_last=bucket.index == len(buckets) - 1))
    averaged = future.wait()  # (numel,), the bucket's gradients averaged over the ranks
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ddp import collectives
from ddp.buckets import Bucket
from ddp.dist import require_process_group


# --8<-- [start:grad_bucket]
class GradBucket:
    """A pure-Python stand-in for `torch.distributed.GradBucket` (which Python cannot
    construct), with its method names and meanings, around one of our Buckets."""

    def __init__(self, bucket: Bucket, is_last: bool):
        self._bucket = bucket
        self._buffer = bucket.gradients if bucket.tail else bucket.buffer  # no status
        self._is_last = is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D gradient buffer, (numel,)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view into buffer() per parameter, shaped like it: writes go to the buffer."""
        return [
            self._buffer.narrow(0, offset, param.numel()).view(param.shape)
            for offset, param in zip(self._bucket.offsets, self._bucket.params, strict=True)
        ]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the iteration (torch: index == count - 1)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor this GradBucket hands out, as torch's does (its C++ assigns
        `buffer_ = buffer`; no copy). torch's fp16_compress_wrapper relies on that:
        it swaps in a half-precision copy for the wrapped hook to work on. Our Bucket's
        own buffer is untouched; the caller takes the result from the future."""
        self._buffer = buffer


# --8<-- [end:grad_bucket]


# --8<-- [start:allreduce]
def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Plain averaging: what DDP does with no hook registered."""
    group = _group_of(process_group, "allreduce_hook")
    tensor = bucket.buffer()
    # Divide before summing: W half-precision gradients can overflow where their mean
    # would not.
    tensor.div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])  # a list of one tensor


# --8<-- [end:allreduce]


# --8<-- [start:compress]
def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Send half the bytes: all-reduce a float16 copy, at float16's 3 decimal digits."""
    return _compress_hook(torch.float16, process_group, bucket, "fp16_compress_hook")


def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Send half the bytes as bfloat16: float32's range (no overflow), 2 decimal digits."""
    return _compress_hook(torch.bfloat16, process_group, bucket, "bf16_compress_hook")


def _compress_hook(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: GradBucket, name: str
) -> torch.futures.Future[torch.Tensor]:
    group = _group_of(process_group, name)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())  # divide first, as in allreduce_hook

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        # Back into the bucket's own buffer and dtype: no second full-precision buffer
        # at the peak (torch's issue 45968).
        buffer.copy_(fut.value()[0])
        return buffer

    work = dist.all_reduce(compressed, group=group, async_op=True)
    return work.get_future().then(decompress)


# --8<-- [end:compress]


# --8<-- [start:point_to_point]
@dataclass
class PointToPointState:
    """Which of `ddp.collectives.ALGORITHMS` averages the buckets, over which group; for
    the hierarchical ones, how many consecutive ranks share a node."""

    process_group: dist.ProcessGroup | None = None  # None: the default group
    algorithm: str = "ring"
    ranks_per_node: int = 1  # ranks kg .. kg + g - 1 are node k's (torchrun numbers them so)
    # Bytes this rank has sent to ranks of other nodes, over every bucket so far: what the
    # links between servers carried (with the three phases, only the nodes' first ranks').
    bytes_sent_between_nodes: int = 0

    def __post_init__(self):
        if self.algorithm not in collectives.ALGORITHMS:
            raise ValueError(
                f"PointToPointState: algorithm {self.algorithm!r} is not one of "
                f"{', '.join(collectives.ALGORITHMS)}"
            )
        if self.ranks_per_node < 1:
            raise ValueError(
                f"PointToPointState: ranks_per_node must be >= 1, got {self.ranks_per_node}"
            )


def point_to_point_hook(
    state: PointToPointState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Plain averaging, but by our own all-reduce from sends and receives
    (`ddp.collectives`) instead of Gloo's or NCCL's: `register_comm_hook(
    PointToPointState(group, "ring"), point_to_point_hook)` trains with our ring.

    Cost: our all-reduce blocks until it is done, so the future is complete when it
    is returned, and backward waits for each bucket instead of running under it.
    Every rank still ends with bit-identical gradients: each element's sum is
    computed on one rank and copied to the others. With
    `PointToPointState(group, "hierarchical_ring", ranks_per_node=g)`, Goyal et al.'s three
    phases: sum inside each node of g ranks, all-reduce between nodes, broadcast inside."""
    if not isinstance(state, PointToPointState):
        raise TypeError(
            f"point_to_point_hook's state must be a PointToPointState, got "
            f"{type(state).__name__}; register it as `register_comm_hook("
            f"PointToPointState(process_group, 'ring'), point_to_point_hook)`"
        )
    group = _group_of(state.process_group, "point_to_point_hook")
    tensor = bucket.buffer()
    tensor.div_(group.size())  # divide before summing, as allreduce_hook does
    traffic = collectives.all_reduce(
        tensor, state.algorithm, group, ranks_per_node=state.ranks_per_node
    )
    state.bytes_sent_between_nodes += traffic.bytes_sent_between_nodes
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


# --8<-- [end:point_to_point]


def _group_of(process_group: dist.ProcessGroup | None, hook: str) -> dist.ProcessGroup:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{hook}'s state is the process group to average over (or None for the "
            f"default group), got a {type(process_group).__name__}; register it as "
            f"`register_comm_hook(process_group, {hook})`"
        )
    return require_process_group(process_group)


# --8<-- [start:powersgd_state]
class PowerSGDState:
    """PowerSGD's settings and what it remembers between iterations, for all buckets.

    The arguments are torch's `PowerSGDState`'s, with its defaults. Not supported:
    `batch_tensors_with_same_shape=True` (a speed-up that stacks same-shaped matrices),
    and compression-stats logging (the counters and compression_stats() are kept)."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,  # r: each n x m gradient travels as n x r and m x r
        start_powerSGD_iter: int = 1_000,  # plain all-reduce before this iteration
        min_compression_rate: float = 2,  # compress a matrix only if it shrinks this much
        use_error_feedback: bool = True,  # add what compression lost last time
        warm_start: bool = True,  # start from last iteration's Q, not a random one
        orthogonalization_epsilon: float = 0,  # > 0 avoids NaN from an all-zero column
        random_seed: int = 0,  # the same on every rank: Q starts the same everywhere
        *,
        batch_tensors_with_same_shape: bool = False,
    ):
        if batch_tensors_with_same_shape:
            raise NotImplementedError(
                "PowerSGDState: batch_tensors_with_same_shape=True is not implemented here "
                "(it stacks same-shaped matrices into one batch for speed); pass False, or "
                "use torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
            )
        if matrix_approximation_rank < 1:
            raise ValueError(
                f"PowerSGDState: matrix_approximation_rank must be >= 1, got "
                f"{matrix_approximation_rank}"
            )
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            # torch's reason: DDP rebuilds its buckets after iteration 1, which would
            # invalidate the errors and Qs remembered per bucket index.
            raise ValueError(
                f"PowerSGDState: start_powerSGD_iter must be > 1 with error feedback or "
                f"warm start (got {start_powerSGD_iter}): DDP rebuilds buckets after the "
                "first iteration"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = False
        # Draws one seed per random Q initialisation, the same sequence on every rank,
        # and a different projection at each one. numpy's, as torch's, to match its seeds.
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}  # bucket index -> flat local error
        self.p_memory_dict: dict[int, torch.Tensor] = {}  # bucket index -> all its Ps, flat
        self.q_memory_dict: dict[int, torch.Tensor] = {}  # bucket index -> all its Qs, flat
        self.iter = 0
        self.total_numel_before_compression = 0  # elements, summed over every call
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """One iteration has passed when the last bucket of it is done."""
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(rate, elements before compression, elements after), over all calls so far."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)


# --8<-- [end:powersgd_state]


# --8<-- [start:powersgd_hook]
def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD (Vogels et al. 2019): each gradient matrix M (n x m) travels as two thin
    matrices, P = M Q (n x r) and Q = M^T P (m x r), and arrives as P Q^T.

    One step of power iteration per training step finds M's top-r subspace well enough
    when Q is warm-started; error feedback adds back what the approximation dropped, so
    nothing is lost for good. Vectors and matrices that would not shrink at least
    min_compression_rate times are averaged exactly.

    Caveat: the P and Q all-reduces start inside future callbacks, which block in
    .wait(). Wait for one bucket's future before calling the hook on the next: with
    ten buckets in flight at once, two Gloo ranks hang (torch's hook too)."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"powerSGD_hook's state must be a PowerSGDState, got {type(state).__name__}; "
            "register it as `register_comm_hook(PowerSGDState(process_group), powerSGD_hook)`"
        )
    group = require_process_group(state.process_group)
    world_size = group.size()
    buffer = bucket.buffer()  # (numel,)
    if state.iter < state.start_powerSGD_iter:
        # Early training is sensitive to gradient error: average exactly for a while.
        state.maybe_increase_iter(bucket)
        return allreduce_hook(group, bucket)

    index = bucket.index()
    if state.use_error_feedback:
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        wanted = buffer.clone()  # what we meant to send; minus what arrives = the error

    # Every gradient as a matrix: a conv weight (out, in, kh, kw) becomes (out, in*kh*kw).
    matrices, exact = [], []
    for grad in bucket.gradients():
        matrix = grad.view(grad.shape[0], -1)  # (n, m); a bias (n,) is (n, 1)
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        state.total_numel_before_compression += n * m
        if (n + m) * rank * state.min_compression_rate < n * m:
            matrices.append(matrix)
            state.total_numel_after_compression += (n + m) * rank
        else:
            exact.append(grad)
            state.total_numel_after_compression += n * m
    # torch groups same-shaped matrices (so it can batch them), and draws the random
    # Qs in that order: we keep its order to get its numbers.
    first_seen: dict[torch.Size, int] = {}
    for matrix in matrices:
        first_seen.setdefault(matrix.shape, len(first_seen))
    matrices.sort(key=lambda matrix: first_seen[matrix.shape])  # stable: ties keep order
    ranks = [min(*matrix.shape, state.matrix_approximation_rank) for matrix in matrices]

    # All Ps of the bucket live in one flat tensor, all Qs in another: one all-reduce
    # each. ps[i] (n, r) and qs[i] (m, r) are views into them.
    p_shapes = [(matrix.shape[0], r) for matrix, r in zip(matrices, ranks, strict=True)]
    q_shapes = [(matrix.shape[1], r) for matrix, r in zip(matrices, ranks, strict=True)]
    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = buffer.new_empty(sum(n * r for n, r in p_shapes))
        state.q_memory_dict[index] = buffer.new_empty(sum(m * r for m, r in q_shapes))
    ps = _split(state.p_memory_dict[index], p_shapes)
    qs = _split(state.q_memory_dict[index], q_shapes)
    if fresh:
        # Seeded from the shared RNG, so every rank starts from the same Q; on CPU in
        # a forked RNG, so training's own random stream does not move.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=buffer.dtype))
    for q in qs:
        _orthogonalize(q, state.orthogonalization_epsilon)
    for matrix, q, p in zip(matrices, qs, ps, strict=True):
        _matmul(matrix, q, out=p)  # (n, m) @ (m, r) -> (n, r)

    # Three all-reduces in a chain; each callback starts the next one and waits for it,
    # as torch's does (a future cannot hand back another future to chain on).
    exact_flat = torch.cat([grad.view(-1) for grad in exact]) if exact else buffer.new_empty(0)

    def average_exact_then_sum_ps(fut: torch.futures.Future) -> torch.Tensor:
        averaged = fut.value()[0].div_(world_size)
        offset = 0
        for grad in exact:
            grad.copy_(averaged[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        # Not divided: P only gives the subspace, and is orthonormalised next.
        p_memory = state.p_memory_dict[index]
        return dist.all_reduce(p_memory, group=group, async_op=True).get_future().wait()[0]

    def sum_qs(fut: torch.futures.Future) -> torch.Tensor:
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for matrix, p, q in zip(matrices, ps, qs, strict=True):
            _matmul(matrix.t(), p, out=q)  # (m, n) @ (n, r) -> (m, r)
        q_memory = state.q_memory_dict[index]
        return dist.all_reduce(q_memory, group=group, async_op=True).get_future().wait()[0]

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        # Q summed over ranks is (sum of M)^T P; / W makes P Q^T the average's projection.
        fut.value().div_(world_size)
        for matrix, p, q in zip(matrices, ps, qs, strict=True):
            _matmul(p, q.t(), out=matrix)  # (n, r) @ (r, m) -> (n, m), into buffer
        if state.use_error_feedback:
            state.error_dict[index] = wanted - buffer
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return buffer

    work = dist.all_reduce(exact_flat, group=group, async_op=True)
    return work.get_future().then(average_exact_then_sum_ps).then(sum_qs).then(decompress)


def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive views into `flat`, one per shape."""
    views, offset = [], 0
    for rows, cols in shapes:
        views.append(flat[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return views


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b, computed as torch's hook does: torch.bmm on a batch of one (torch's
    can batch same-shaped matrices). torch.mm takes another kernel for small matrices,
    which rounds differently in the last bit; this way we match torch bit for bit."""
    torch.bmm(a.unsqueeze(0), b.unsqueeze(0), out=out.unsqueeze(0))


def _orthogonalize(matrix: torch.Tensor, epsilon: float = 0) -> None:
    """Make the columns of `matrix` (n, r) orthonormal, in place, as torch's does: by
    Gram-Schmidt for r <= 2 or half precision (QR has no half-precision kernel),
    by QR otherwise (faster for larger r). An all-zero column gives NaN unless
    epsilon > 0."""
    rank = matrix.shape[1]
    if rank > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        matrix.copy_(torch.linalg.qr(matrix).Q)
        return
    for i in range(rank):
        col = matrix[:, i : i + 1]  # (n, 1)
        col /= torch.norm(col, dim=0, keepdim=True) + epsilon
        rest = matrix[:, i + 1 :]  # (n, r - i - 1): remove their component along col
        rest -= torch.sum(col * rest, dim=0, keepdim=True) * col


# --8<-- [end:powersgd_hook]
