"""Bucket layout: which gradients travel together in one all-reduce."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ddp.spans import allreduce_span

# The uniform caps worth trying, MiB (1e6: one bucket): what the automatic stage
# (`stages.auto_bucket`) tries, and the simulator (`profiling.simulate`) and the course
# set against torch's default. Here, with the layout rule, so all read one list.
CANDIDATES_MB = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 1e6)


@dataclass
class Bucket:
    """Gradients of several parameters, flattened into one buffer for one all-reduce."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]  # element offset of each parameter's gradient in `buffer`
    # flat, one dtype and device, numel = sum of the params' numel (+ tail); or, for a parameter
    # whose gradients are sparse, that gradient itself, alone in its bucket
    buffer: torch.Tensor
    # Elements after the gradients in `buffer`, for a few numbers that travel in the same
    # all-reduce (stage missing_grads' status), so they cost no collective of their own.
    tail: int = 0
    nbytes: int = field(init=False)
    sparse: bool = field(init=False)  # a sparse gradient's bucket: no flat buffer, no views
    # Per parameter, the slice of `buffer` that holds its gradient, shaped like it. Made
    # once here, not at every step: a view costs a few microseconds to make, and a step
    # copies every gradient in and out.
    views: list[torch.Tensor] = field(init=False)
    span: str = field(init=False)  # the label of its all-reduce in traces, made once too
    gradients: torch.Tensor = field(init=False)  # `buffer` less its tail (dense buckets)
    status: torch.Tensor | None = field(init=False)  # the tail, or None without one

    def __post_init__(self) -> None:
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.sparse = self.buffer.is_sparse
        self.views = self._make_views()
        self.span = allreduce_span(f"bucket {self.index}", self.nbytes)
        grads = self.buffer.numel() - self.tail
        self.gradients = self.buffer if self.sparse else self.buffer.narrow(0, 0, grads)
        self.status = self.buffer.narrow(0, grads, self.tail) if self.tail else None

    def with_tail(self, tail: int) -> Bucket:
        """This bucket with room for `tail` more elements after its gradients (a new,
        zeroed buffer: call it before the bucket holds anything)."""
        if tail == self.tail or self.sparse:
            return self
        numel = self.buffer.numel() - self.tail + tail
        buffer = torch.zeros(numel, dtype=self.buffer.dtype, device=self.buffer.device)
        return Bucket(self.index, self.names, self.params, self.offsets, buffer, tail)

    def in_dtype(self, dtype: torch.dtype) -> Bucket:
        """This bucket with its buffer in `dtype` (a new, zeroed one: call it before the
        bucket holds anything), for gradients all-reduced in another dtype than their
        parameters' (the drop-in's mixed_precision)."""
        if dtype == self.buffer.dtype or self.sparse:
            return self
        buffer = torch.zeros(self.buffer.numel(), dtype=dtype, device=self.buffer.device)
        return Bucket(self.index, self.names, self.params, self.offsets, buffer, self.tail)

    def _make_views(self) -> list[torch.Tensor]:
        members = [] if self.sparse else zip(self.offsets, self.params, strict=True)
        return [
            self.buffer.narrow(0, offset, param.numel()).view(param.shape)
            for offset, param in members
        ]

    # Pickle copies each view's storage on its own, so views unpickled would no longer
    # be slices of the unpickled buffer: they are made again from it instead.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("views", "gradients", "status")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def view_of(self, i: int) -> torch.Tensor:
        """The slice of `buffer` that holds parameter i's gradient, shaped like it."""
        if self.sparse:  # no flat buffer: the one gradient is the buffer
            return self.buffer
        return self.views[i]


Members = list[tuple[str, nn.Parameter]]


def sparse_gradient_names(module: nn.Module) -> frozenset[str]:
    """Parameters whose gradients are sparse: those of nn.Embedding and nn.EmbeddingBag
    built with sparse=True, which torch's DDP looks for too."""
    return frozenset(
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
        for name, _ in sub.named_parameters(recurse=False)
    )


def assign_buckets(
    named_params: list[tuple[str, nn.Parameter]],
    bucket_cap_mb: float,
    *,
    first_bucket_cap_mb: float | None = None,
    ready_order: bool = False,
    sparse: frozenset[str] = frozenset(),
    overfill: bool = False,
) -> list[Bucket]:
    """Buckets as `plan_buckets` lays them out, each with its zeroed flat buffer."""
    plan = plan_buckets(
        named_params,
        bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        ready_order=ready_order,
        sparse=sparse,
        overfill=overfill,
    )
    return buckets_from_plan(plan, sparse)


def buckets_from_plan(plan: list[Members], sparse: frozenset[str] = frozenset()) -> list[Bucket]:
    """One bucket per list of members, in the plan's order, each with its zeroed flat
    buffer (or, for a parameter named in `sparse`, an empty sparse gradient)."""
    return [_make_bucket(index, members, sparse) for index, members in enumerate(plan)]


def plan_buckets(
    named_params: list[tuple[str, nn.Parameter]],
    bucket_cap_mb: float,
    *,
    first_bucket_cap_mb: float | None = None,
    ready_order: bool = False,
    sparse: frozenset[str] = frozenset(),
    overfill: bool = False,
) -> list[Members]:
    """Group gradients into buckets cut at `bucket_cap_mb` MiB.

    Parameters are taken in reverse order because backward produces gradients roughly
    last layer first, so the first bucket fills first; with `ready_order=True` they are
    taken in the order given (the order gradients were seen to become ready). A bucket
    holds one dtype on one device (a flat buffer has one of each); a parameter larger
    than the cap gets a bucket of its own. The first bucket of each dtype may have a
    smaller cap, `first_bucket_cap_mb`, so that the first all-reduce starts early.
    Frozen parameters have no gradient and no bucket. A parameter named in `sparse` has
    sparse gradients, which no flat buffer holds: it gets a bucket of its own, as in
    torch's DDP. A bucket is closed before a gradient would pass its cap; with
    `overfill=True` it is cut by torch's DDP's rule instead: a gradient is added and
    the bucket closed once it reaches its cap, so it may pass the cap by that last
    gradient. The two rules can cut a model at different places (never to different
    results): 1 MiB buckets of Linear(512, 512) layers, whose weight alone is 1 MiB, hold
    a bias or a weight each (24 for 12 layers) by the first rule and a layer each by
    torch's (12)."""
    for name, cap in (
        ("bucket_cap_mb", bucket_cap_mb),
        ("first_bucket_cap_mb", first_bucket_cap_mb),
    ):
        if cap is not None and not cap > 0:
            raise ValueError(f"{name} must be > 0 MiB, got {cap}")
    caps_bytes = [  # MiB of gradient bytes, whole as in torch's DDP: the first bucket, the rest
        int((first_bucket_cap_mb or bucket_cap_mb) * 2**20),
        int(bucket_cap_mb * 2**20),
    ]
    ordered = list(named_params) if ready_order else list(reversed(named_params))
    closed: list[list[tuple[str, nn.Parameter]]] = []
    open_by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}  # the open bucket's
    closed_by_kind: dict[tuple[torch.dtype, torch.device], int] = {}

    def close(kind: tuple[torch.dtype, torch.device]) -> None:
        # The open bucket of this kind is done; the kind's next gradient opens another.
        closed.append(open_by_kind.pop(kind))
        del open_bytes[kind]
        closed_by_kind[kind] = closed_by_kind.get(kind, 0) + 1

    for name, param in ordered:
        if not param.requires_grad:
            continue
        if name in sparse:
            closed.append([(name, param)])
            continue
        kind = (param.dtype, param.device)
        grad_bytes = param.numel() * param.element_size()
        nbytes = open_bytes.get(kind, 0) + grad_bytes  # the bucket's, with this gradient
        cap_bytes = caps_bytes[min(closed_by_kind.get(kind, 0), 1)]
        if not overfill and kind in open_bytes and nbytes > cap_bytes:  # it would pass
            close(kind)
            nbytes = grad_bytes  # the gradient opens the next bucket
        open_by_kind.setdefault(kind, []).append((name, param))
        open_bytes[kind] = nbytes
        if overfill and nbytes >= cap_bytes:  # torch's: closed once it reaches the cap
            close(kind)
    closed.extend(members for members in open_by_kind.values() if members)
    # All ranks must all-reduce buckets in the same order: order them by where their
    # first parameter stands in the parameter order, which every rank shares.
    position = {id(p): i for i, (_, p) in enumerate(ordered)}
    closed.sort(key=lambda members: position[id(members[0][1])])
    return closed


def _make_bucket(
    index: int, members: list[tuple[str, nn.Parameter]], sparse: frozenset[str]
) -> Bucket:
    offsets, numel = [], 0
    for _, param in members:
        offsets.append(numel)
        numel += param.numel()
    first = members[0][1]
    if members[0][0] in sparse:  # an empty sparse gradient, until backward gives one
        buffer = torch.sparse_coo_tensor(size=first.shape, dtype=first.dtype, device=first.device)
    else:
        buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
    return Bucket(
        index=index,
        names=[name for name, _ in members],
        params=[param for _, param in members],
        offsets=offsets,
        buffer=buffer,
    )
