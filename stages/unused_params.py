"""Stage 6, unused_params: parameters that get no gradient on purpose, without an error.

A model whose forward skips a branch (a mixture of experts, a loss on one head, a
layer used only at some steps) leaves some parameters without a gradient. The stage
before this one turns that into an error on every rank; with
`find_unused_parameters=True` (torch's name) it is allowed instead. After forward this
stage walks the autograd graph from forward's outputs and, at the first gradient of
backward (as torch does), marks every parameter it does not reach as ready, with a
zero (or its already accumulated) gradient, so its bucket still completes on time.
The status all ranks sum at the end of backward gains which parameters each rank
really used since the last synchronisation: a parameter that no rank used keeps its
`.grad` as it was (as torch's DDP leaves it), one used anywhere gets the average. It
also gains how many problems each rank found (a gradient for a parameter marked unused,
or one that came twice), which every rank then raises.

    torchrun --standalone --nproc-per-node 2 -m stages.unused_params --model mlp

Cost: one more integer in the status summed every synchronised backward; with the flag
only, the graph walk after every forward and n more integers in the status (n:
trainable parameters), as torch's DDP exchanges its "used" bitmap only with the flag.
A walk that finds every parameter used says so on stderr, once per process, in torch's
words: the flag then costs time for nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from datetime import datetime

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import Bucket
from stages.missing_grads import MissingGradsDDP, Status


# --8<-- [start:construction]
class UnusedParamsDDP(MissingGradsDDP):
    """Stage 6: `find_unused_parameters`: what forward does not reach counts as ready."""

    # One more column of the status summed every synchronised backward: "problems", how
    # many this rank noted in backward. With find_unused_parameters, n numbers follow it
    # ("used"): 1 per parameter whose gradient this rank produced since the last
    # synchronisation (no_sync() backwards included), torch's "local used map", summed;
    # and the status then travels in an all-reduce of its own.
    status_columns = (*MissingGradsDDP.status_columns, "problems")
    error_columns = (*MissingGradsDDP.error_columns, "problems")
    # A problem is an error on every rank (with find_unused_parameters, a missing
    # gradient is not: the row counts none, below).
    raising_columns = (*MissingGradsDDP.raising_columns, "problems")

    def __init__(self, module: nn.Module, *, find_unused_parameters: bool = False, **options):
        super().__init__(module, **options)
        self.find_unused_parameters = find_unused_parameters
        self._globally_used = [1] * len(self.named_trainable)  # per position: used anywhere
        self._problems: list[str] = []  # found in this backward, raised on every rank
        self._problems_of = -1  # how many gradients had come when they were counted
        self._used: set[int] = set()  # positions this rank produced since the last sync
        self._accumulated: list[int] = []  # of those, what came in no_sync() backwards
        self._deferred: list[Bucket] = []  # buckets to copy out once we know who used what

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        output = super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled() and self._backward.syncs:
            self._note_unused(output)
        return output

    def _prepare_for_backward(self, syncs: bool = True) -> None:
        previous = self._backward
        super()._prepare_for_backward(syncs)
        # This stage's part of the backward's state, afresh. A synchronising backward
        # after no_sync() ones: what came in those counts as used too.
        self._accumulated = previous.arrived if syncs and not previous.syncs else []
        self._problems, self._problems_of, self._used = [], -1, set()

    def _count_as_unused(self, positions: list[int], used: list[int]) -> None:
        """Found after forward (the drop-in's static_graph learns it in its first
        backward): `positions` count as unused in this backward, and `used` (per
        position, 1 if some rank used it) says whose .grad takes the average."""
        self._backward.unreached, self._globally_used = positions, used

    def _note_unused(self, output) -> None:
        """What the backward that follows counts as unused: what `output` does not lead
        to, with the flag; else nothing."""
        # The overlapped stage counts them as come at the first gradient, as torch does.
        self._backward.unreached = self._unused_in(output)

    def _unused_in(self, output) -> list[int]:
        """Positions of the parameters unused by `output`: the graph walked from it,
        with the flag (the drop-in's static_graph walks only in its first step)."""
        return self._unreached_from(output) if self.find_unused_parameters else []

    def _unreached_from(self, output) -> list[int]:
        """Positions of the trainable parameters that `output`'s graph does not lead to."""
        reached = parameters_reached(output)
        unreached = [k for k, (_, p) in enumerate(self.named_trainable) if id(p) not in reached]
        if not unreached:  # the walk bought nothing this step
            self._nothing_unused()
        return unreached

    def _nothing_unused(self) -> None:
        """A walk found every parameter used: say, as torch's DDP says from the same place
        (its reducer's search), that the flag costs a walk per step for nothing
        (`warn_nothing_unused`). The drop-in's static_graph, whose first step walks where
        torch's never does, keeps quiet."""
        warn_nothing_unused()

    # --8<-- [end:forward]

    def _status_can_ride(self) -> bool:
        # With the flag, the used map is n numbers, and a gradient of a parameter marked
        # unused may still come after the last bucket has left.
        return super()._status_can_ride() and not self.find_unused_parameters

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        arrived = self._backward.arrived
        if self.find_unused_parameters:  # no_sync() micro-batches count as used
            self._used = {*self._accumulated, *arrived}
            # What to copy out depends on who used what: after the status (`_unload_each`).
            self._backward.unloads = False
        # Where the status rode in the last bucket, something can have come since only
        # from a nested, reentrant backward (a layer used inside a reentrant checkpoint
        # and outside it): a gradient again, after its bucket left. Only this rank
        # knows; it raises (as torch's DDP does on that rank) rather than average half
        # of that gradient in silence. The group stays in step: every collective of the
        # step has run.
        if len(arrived) != self._problems_of:  # counted again only if more came since
            self._problems, self._problems_of = self._problems_in(arrived), len(arrived)
        self._deferred = []
        super()._finish_backward()  # with the flag, its copy-outs wait for the status
        if self._problems:  # noted after the status left in the last bucket: see above
            raise RuntimeError(
                f"{type(self).__name__}: bad backward on rank {self.rank}, found after the "
                f"status had left (the other ranks go on): {'; '.join(self._problems)}"
            )
        if self.find_unused_parameters:  # the "used" numbers, summed: used anywhere?
            self._globally_used = self._status.summed[len(self.status_columns) :]
        for bucket in self._deferred:
            for i, param in enumerate(bucket.params):
                self._unload_one(param, bucket.view_of(i))

    def _problems_in(self, arrived: list[int]) -> list[str]:
        """What went wrong inside this backward. Raising there would stop only this rank's
        backward and leave the others waiting in an all-reduce: it is noted, the step
        finishes, and every rank raises."""
        unreached = self._backward.unreached
        if not unreached and len(set(arrived)) == len(arrived):
            return []  # the common case, in one pass
        names = [name for name, _ in self.named_trainable]
        unreached, seen, problems = set(unreached), set(), []
        for k in arrived:
            if k in unreached:
                problems.append(
                    f"'{names[k]}' got a gradient although forward's outputs do not reach "
                    "it (it was marked unused); compute the loss only from the wrapper's outputs"
                )
            elif k in seen:
                problems.append(f"'{names[k]}' got its gradient twice in one backward")
            seen.add(k)
        return problems

    def _unload_each(self, bucket: Bucket) -> None:
        if self.find_unused_parameters:  # what to copy depends on who used what
            self._deferred.append(bucket)
        else:
            super()._unload_each(bucket)

    def _unload_one(self, param: nn.Parameter, average: torch.Tensor) -> None:
        if not self._globally_used[self._position[id(param)]]:
            return  # used on no rank: .grad stays as it was, as in torch's DDP
        if param.grad is None:  # unused here, used elsewhere: gets the average
            param.grad = self._new_grad(average)
        else:
            super()._unload_one(param, average)

    def _new_grad(self, average: torch.Tensor) -> torch.Tensor:
        return average.clone()

    def _status_row(self, missing: int, arrived: list[int]) -> list[int]:
        # Replaces stage missing_grads' row, the count alone, with all three columns.
        used = []
        if self.find_unused_parameters:  # forward may skip parameters: none is missing
            missing = 0
            used = [0] * len(self.named_trainable)
            for k in self._used:
                used[k] = 1
        # Counted once per step where nothing comes after (the common case: the status
        # rides as the last gradient's bucket leaves); the end of backward reads them.
        if len(arrived) != self._problems_of:
            self._problems, self._problems_of = self._problems_in(arrived), len(arrived)
        return [missing, len(self._problems), *used]

    def _error_row(self, ready: set[int]) -> Status:
        return {
            **super()._error_row(ready | set(self._backward.unreached)),
            "problems": torch.tensor([len(self._problems)], dtype=torch.int32),
        }

    def _raise_on_every_rank(self, status: Status) -> None:
        troubled = status["problems"][:, 0].nonzero().flatten().tolist()
        if troubled:
            mine = "; ".join(self._problems) or f"see the error on rank(s) {troubled}"
            raise RuntimeError(f"{type(self).__name__}: bad backward on rank(s) {troubled}: {mine}")
        if not self.find_unused_parameters:  # with the flag, a missing gradient is allowed
            super()._raise_on_every_rank(status)

    def _missing_advice(self) -> str:
        return "pass find_unused_parameters=True if forward may skip them, or " + (
            super()._missing_advice()
        )

    # --8<-- [end:finish]


def parameters_reached(output) -> set[int]:
    """ids of the leaf tensors (parameters) that output's autograd graph leads to."""
    reached, seen = set(), set()
    stack = []
    for t in _tensors(output):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))  # forward returned a parameter itself
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node holds its leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return reached


# torch's words, to the letter (its double space too): a log filter written for torch's
# warning hides this one.
NOTHING_UNUSED = (
    "find_unused_parameters=True was specified in DDP constructor, but did not find any "
    "unused parameters in the forward pass. This flag results in an extra traversal of the "
    "autograd graph every iteration,  which can adversely affect performance. If your model "
    "indeed never has any unused parameters in the forward pass, consider turning this flag "
    "off. Note that this warning may be a false positive if your model has flow control "
    "causing later iterations to have unused parameters."
)
_said_nothing_unused = False  # in this process


def warn_nothing_unused() -> None:
    """NOTHING_UNUSED as torch 2.13 writes it (reducer.cpp's search_unused_parameters,
    TORCH_WARN_ONCE): a line of C++'s log on stderr, not a Python warning (`warnings`
    filters do not hide it), once per process, so once on every rank; at every walk under
    `torch.set_warn_always(True)`; never at TORCH_CPP_LOG_LEVEL=ERROR or FATAL."""
    global _said_nothing_unused
    if _said_nothing_unused and not torch.is_warn_always_enabled():
        return
    _said_nothing_unused = True
    if os.environ.get("TORCH_CPP_LOG_LEVEL", "").upper() in ("2", "ERROR", "3", "FATAL"):
        return
    rank = f"[rank{dist.get_rank()}]:" if dist.is_initialized() else ""
    stamp = datetime.now().strftime("%m%d %H:%M:%S.%f")
    print(f"{rank}[W{stamp} unused_params.py] Warning: {NOTHING_UNUSED}", file=sys.stderr)
    sys.stderr.flush()


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


if __name__ == "__main__":
    from ddp.train import main

    main(UnusedParamsDDP)
