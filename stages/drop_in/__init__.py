"""Stage 14, drop_in: torch's constructor and methods, so a torch DDP script runs unchanged.

Every idea is in place; this last stage adds none. It takes
`torch.nn.parallel.DistributedDataParallel`'s constructor arguments with torch's
defaults and meanings, so that changing one import line moves a training script from
torch's DDP to this one:

    # from torch.nn.parallel import DistributedDataParallel as DDP
    from stages.drop_in import DistributedDataParallel as DDP

    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=25, find_unused_parameters=False)
    with model.no_sync(): ...
    model.register_comm_hook(state, hook)
    torch.save(model.module.state_dict(), path)   # or model.state_dict(): "module." keys

    torchrun --standalone --nproc-per-node 2 -m stages.drop_in --model cnn

As in torch, `bucket_cap_mb=None` means 25 MiB with a 1 MiB first bucket, a cap you
give applies to the first bucket too, and a bucket is cut by torch's rule, once it
reaches its cap (`overfill_buckets`), so the buckets rebuilt in ready order, and where
torch.compile cuts a compiled module's graph, are torch's. `device_ids` and
`output_device` are accepted for one device per process, the only mode torch still
supports. Arguments this project does not implement (`device_mesh`, ...) raise an error
naming them when set to anything but torch's default. The signature is torch 2.13's,
positional order included (`init_sync` after `broadcast_buffers`, `forward_sync_buffers`
last).

Two of torch's arguments are done here as torch documents them:

- `static_graph=True`: the first backward counts how often each gradient comes (twice
  for a block under reentrant checkpointing used twice) and which never come (unused
  parameters, found once, not searched again), and all-reduces at its end; later steps
  launch each bucket when its counts are in. A node on forward's outputs starts the
  step, so a reentrant backward's inner graph cannot end it early.
- `mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`: forward
  and backward run on param_dtype copies of the parameters, buckets all-reduce in
  reduce_dtype, and the optimizer steps the full-precision parameters.

What frameworks reach past the public methods is here too: `reducer` (its
`prepare_for_backward`), `_get_ddp_logging_data()`, and what torch.compile reads to cut
its graph where buckets end. `install()` puts this class where code looks up torch's
(docs: "Using the drop-in with your framework").

This stage is a package: what only it needs of torch's surface sits beside this file,
out of `ddp/` (which holds what several stages or the harness share). `torch_args`
checks the constructor's arguments as torch does, `mixed_precision` casts to param_dtype
and back, `logging_data` keeps torch's logging data, `reducer` is what frameworks call on
`model.reducer` and the node that starts static_graph's step, `static_graph` what
static_graph=True learns in its first step and how the steps after it use that,
`class_swap` is what `install()` does, `pickling` what pickle keeps;
`python -m stages.drop_in` runs `__main__.py`.

Unpickling (as torch's DDP allows, over the default group) sets the earlier stages'
`process_group` and `round_robin_groups` again: a group is not pickled.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ddp.dist import broadcast_buffers, import_dynamo_first
from stages.auto_bucket import AutoBucketDDP
from stages.drop_in import class_swap, pickling
from stages.drop_in.logging_data import RuntimeStats, gradient_bytes, layout_record, logging_data
from stages.drop_in.mixed_precision import low_precision_hook, to_full_precision, to_low_precision
from stages.drop_in.reducer import Reducer
from stages.drop_in.static_graph import StaticGraph, counted, through_sink
from stages.drop_in.torch_args import buffer_sync, check_arguments

# A script or framework that makes its own process group imports this module first
# (`install()` comes before the framework's import): torch._dynamo imported now, before
# the group exists, holds no reference to it, so the group and its Gloo threads end
# when the client destroys it and drops the model, not at interpreter shutdown.
import_dynamo_first()

DEFAULT_BUCKET_CAP_MB = 25.0  # torch's default
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES, in MiB


# --8<-- [start:construction]
class DistributedDataParallel(AutoBucketDDP):
    """Stage 14: every idea so far, behind torch DDP's constructor."""

    # static_graph's first synchronised backward sums who used what (n numbers) before
    # its buckets leave (`_learn_static_graph`); nothing more after it.
    collectives = (
        AutoBucketDDP.collectives[0],
        "all_reduce of the used parameters, static_graph's first step",
        *AutoBucketDDP.collectives[1:],
    )
    overfill_buckets = True  # torch's cut: buckets and compiled graph cuts end together

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,  # deprecated in torch for the next one
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,  # deprecated in torch, ignored there too
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list=None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        round_robin_groups: int = 1,  # this project's extension (stage round_robin)
    ):
        # mixed_precision is set before super(): the buckets take reduce_dtype as they
        # are built.
        self.mixed_precision = check_arguments(
            type(self).__name__, module,
            [("delay_all_reduce_named_params", delay_all_reduce_named_params, None),
             ("param_to_hook_all_reduce", param_to_hook_all_reduce, None),
             ("device_mesh", device_mesh, None),
             ("skip_all_reduce_unused_params", skip_all_reduce_unused_params, False),
             ("bucket_cap_mb_list", bucket_cap_mb_list, None),
             ("batched_grad_copy", batched_grad_copy, False)],
            device_ids, output_device, dim, gradient_as_bucket_view, mixed_precision,
        )  # fmt: skip
        forward_sync, init_sync_buffers = buffer_sync(broadcast_buffers, forward_sync_buffers)
        # Set before super(): the stages' constructors broadcast the initial parameters
        # and buffers through the two methods below, which follow torch's init_sync rules.
        self._init_sync, self._init_sync_buffers = init_sync, init_sync and init_sync_buffers
        super().__init__(
            module,
            process_group=process_group,
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_cap_mb=DEFAULT_FIRST_BUCKET_CAP_MB if bucket_cap_mb is None else None,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=forward_sync,
            gradient_as_bucket_view=gradient_as_bucket_view,
            round_robin_groups=round_robin_groups,
        )
        self.device_ids = device_ids
        self.output_device = output_device
        self.static_graph = False  # True through _set_static_graph() below, as in torch
        # What torch's logging data reports (`_get_ddp_logging_data`, below).
        self._stats = RuntimeStats()
        self._logged_error: str | None = None
        self._initial_bucket_bytes = [gradient_bytes(b.params) for b in self.buckets]
        self._last_ready_order: list[int] = []  # of the last synchronised backward
        self._arrivals_per_step: set[int] = set()  # gradients per synchronised backward
        if self.mixed_precision is not None:
            self.module.register_forward_pre_hook(low_precision_hook(self), with_kwargs=True)
            for buffer in self.module.buffers():
                buffer.data = buffer.to(self.mixed_precision.buffer_dtype or buffer.dtype)
        self._ran_before_forward = False  # see _inside_ddp_forward
        # static_graph: what its first synchronised backward learned (None before it ends).
        self._learned: StaticGraph | None = None
        if static_graph:
            self._set_static_graph()

    def _broadcast_initial_states(self) -> None:
        if self._init_sync:  # init_sync=False: the caller promises identical replicas
            super()._broadcast_initial_states()

    def _broadcast_initial_buffers(self) -> None:
        # Replaces stage buffers' rule (broadcast_buffers decides): torch's differs, above.
        if self._init_sync_buffers:
            broadcast_buffers(self.module, self.process_group)

    # --8<-- [end:construction]

    # --8<-- [start:forward]
    def forward(self, *inputs, **kwargs):
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.mixed_precision is not None:  # after a no_sync() backward: still low
            self._to_full_precision()
        with self._inside_ddp_forward(synced):
            output = super().forward(*inputs, **kwargs)
        if self.mixed_precision is not None and not torch.is_grad_enabled():
            self._to_full_precision()  # no backward follows (evaluation)
        if synced:
            if self._stats.timing:  # backward's compute starts here, as torch's reducer
                self._stats.mark("forward_compute_end")  # marks it (prepare_for_backward)
                self._stats.mark("backward_compute_start")
            if self.static_graph:
                output = through_sink(self, output)  # `static_graph.py`, beside this file
        return output

    # torch.compile, where a framework compiles the wrapper itself (accelerate does when
    # asked): what runs before the module at a synchronised forward (the runtime stats,
    # the collectives and bucket rebuilds) runs in the one eager call that enters the
    # forward (`_inside_ddp_forward`), as torch's C++ logger and reducer run in its
    # `_pre_forward`, so the compiled wrapper breaks its graph where torch's does.
    @torch._dynamo.disable
    def _before_module(self) -> None:
        """At a synchronised forward, before the module: the runtime stats (torch's
        logger call) and the collectives and rebuilds of the earlier stages'
        `_before_synced_forward`. Under join those wait for join's own collectives (the
        ranks that left match them in that order) and run where the earlier stages call
        them."""
        if self._stats.forward_started():
            self._stats.record.update(layout_record(self))
        self._ran_before_forward = not self._join_config.enable
        if self._ran_before_forward:
            super()._before_synced_forward()

    def _before_synced_forward(self) -> None:
        if self._ran_before_forward:  # as the forward entered: `_before_module`
            self._ran_before_forward = False
            return
        self._eager_before_synced_forward()  # join's shadow step, or a forward under join

    @torch._dynamo.disable
    def _eager_before_synced_forward(self) -> None:
        super()._before_synced_forward()

    def _forward_before_sync(self) -> None:
        # As torch's DDP: a forward whose output never reached backward (an evaluation
        # pass under grad mode, a discarded output) is forgotten. The earlier stages
        # raise instead, which catches a forgotten backward while one learns.
        if self._backward.started:  # its backward is running: no forward belongs there
            super()._forward_before_sync()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: list[str]) -> None:
        """torch's way to mark what DDP should not synchronise (torch's attributes): the
        constructor then refuses the module, naming them, as this class does not
        implement it."""
        module._ddp_params_and_buffers_to_ignore = names
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in names:
                tensor._ddp_ignored = True

    @contextmanager
    @torch._disable_dynamo(recursive=False)  # as torch's: it sets a class attribute
    def _inside_ddp_forward(self, synced: bool) -> Iterator[None]:
        """torch.compile's DDP optimizer asks torch's class for the DDP module whose
        forward runs (`_get_active_ddp_module`) and cuts the compiled graph where that
        module's buckets end, so gradients become ready bucket by bucket, as in eager
        mode, and buckets leave while backward still computes. Before a synchronised
        forward it first runs `_before_module`."""
        if synced:
            self._before_module()
        before = class_swap.TORCH_DDP._active_ddp_module
        class_swap.TORCH_DDP._active_ddp_module = self
        try:
            yield
        finally:
            class_swap.TORCH_DDP._active_ddp_module = before
            self._ran_before_forward = False  # a forward that raised before using it

    # Where torch's own class (after install(), which rebinds the name it reads) or
    # torch's replicate() note their active module: read as well as torch's.
    _active_ddp_module: nn.Module | None = None

    @classmethod
    def _get_active_ddp_module(cls) -> nn.Module | None:
        return class_swap.TORCH_DDP._active_ddp_module or DistributedDataParallel._active_ddp_module

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes, torch's name (torch.compile reads it)."""
        return int(self.bucket_cap_mb * 1024 * 1024)

    def _order_is_static(self) -> bool:
        return self.static_graph or super()._order_is_static()  # the graph will not change

    def _set_static_graph(self) -> None:
        """torch's older spelling of static_graph=True: before training, as in torch."""
        if self.static_graph:
            message = "You've set static_graph to be True, no need to set it again."
            warnings.warn(message, stacklevel=2)
            return
        if self._synced_backwards:
            self._log_and_raise(
                RuntimeError(
                    "set_static_graph() should be called before training loop starts and "
                    "after DistributedDataParallel is constructed."
                )
            )
        self.static_graph = True
        if self.find_unused_parameters:  # torch's warning, in its words
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do "
                "not need to set find_unused_parameters=true, just be sure these unused "
                "parameters will not change during training loop while calling "
                "`_set_static_graph`.",
                stacklevel=2,
            )

    # --8<-- [end:forward]

    # --8<-- [start:mixed_precision]
    def _use_buckets(self, buckets: list, bucket_cap_mb: float) -> None:
        # At every (re)build of the buckets: they all-reduce in reduce_dtype.
        if self.mixed_precision is not None:
            dtype = self.mixed_precision.reduce_dtype or self.mixed_precision.param_dtype
            buckets = [bucket.in_dtype(dtype) for bucket in buckets]
        super()._use_buckets(buckets, bucket_cap_mb)

    def _to_low_precision(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """mixed_precision, as the wrapped module's forward starts (a forward pre-hook,
        as in torch's DDP: after this class's own collectives and bucket rebuilds, which
        see full-precision parameters): the parameters' data become param_dtype copies
        of the full-precision ones (kept aside: the optimizer updates those), and so do
        gradients accumulated so far and floating-point inputs. Backward then computes
        in param_dtype."""
        return to_low_precision(self.module, self.mixed_precision.param_dtype, inputs, kwargs)

    def _to_full_precision(self) -> None:
        """mixed_precision, after a synchronised backward's gradients are in their
        buckets: parameters back to full precision, gradients too, before the
        averages (in reduce_dtype) are copied into them."""
        to_full_precision(self.module)

    def _unload_one(self, param: nn.Parameter, average: torch.Tensor) -> None:
        if average.dtype != param.dtype and not average.is_sparse:  # mixed_precision
            average = average.to(param.dtype)  # a new .grad takes the parameter's dtype
        super()._unload_one(param, average)

    # --8<-- [end:mixed_precision]

    # --8<-- [start:static_graph]
    # What the first synchronised backward learns, and how the steps after it use that,
    # is a `StaticGraph` (`static_graph.py`, beside this file): the methods below are
    # where the earlier stages ask for it.
    def _holds_buckets(self) -> bool:
        # The first backward all-reduces every bucket at its end (as torch's reducer
        # delays it), once it knows how often each gradient comes: none leave before.
        return self.static_graph and self._learned is None

    def _pending_counts(self) -> list[int]:
        if self._learned is None:
            return super()._pending_counts()
        return self._learned.pending_counts(self.buckets, self._bucket_of)

    def _unused_in(self, output) -> list[int]:
        if self._learned is not None:
            return self._learned.unused  # found in the first backward: not searched again
        return super()._unused_in(output)

    def _learn_static_graph(self, counts: list[int] | None) -> None:
        """At the end of static_graph's first synchronised backward: one all-reduce of
        every rank's `counts` (how many times each gradient came there), their maximum,
        says which parameters some rank used, before the first step's buckets leave. A
        rank that left before this step (join) counts nothing (None) and expects, from
        then on, what the rank that counted the most saw."""
        mine = [0] * len(self.named_trainable) if counts is None else counts
        most = torch.tensor(mine, dtype=torch.int64, device=self._collective_device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.process_group)
        most = most.tolist()
        self._learned = StaticGraph(most if counts is None else counts)
        self._count_as_unused(self._learned.unused, used=[int(c > 0) for c in most])

    def _shadow_backward(self) -> None:
        if self.static_graph and self._learned is None:  # a rank that left under join
            self._learn_static_graph(None)  # takes part in the first step's count
        super()._shadow_backward()

    def _shadow_arrivals(self) -> list[int]:
        if self._learned is None:
            return super()._shadow_arrivals()
        return self._learned.arrivals()

    def _nothing_unused(self) -> None:
        if not self.static_graph:  # torch's static_graph never walks, so never warns
            super()._nothing_unused()

    def _problems_in(self, arrived: list[int]) -> list[str]:
        if self._learned is None:
            return super()._problems_in(arrived)
        return self._learned.problems(arrived, self.named_trainable)

    # --8<-- [end:static_graph]

    # --8<-- [start:surface]
    @property
    def reducer(self) -> Reducer:
        """What frameworks call on torch's C++ reducer, done by this class's own steps."""
        return Reducer(self)

    def _prepare_for_synced_backward(self, outputs: list[torch.Tensor]) -> None:
        """torch's `reducer.prepare_for_backward(outputs)`: the next backward synchronises,
        even after a forward inside no_sync() (accelerate's trigger_sync_in_backward);
        with find_unused_parameters, what `outputs` do not reach is unused (none, if
        `outputs` is empty)."""
        self._prepare_for_backward()
        # With no outputs, nothing is found unused (after static_graph's first backward,
        # what it found).
        if outputs or self._learned is not None:
            self._note_unused(outputs)

    def _sender(self) -> str:
        # A step whose times are recorded marks when its first bucket leaves.
        return "_send_first_timed" if self._stats.timing else super()._sender()

    def _send_first_timed(self, bucket) -> dist.Work | torch.futures.Future:
        self._stats.mark("backward_comm_start")
        self._backward.send = super()._sender()  # the other buckets: the usual way
        return getattr(self, self._backward.send)(bucket)

    def _finish_backward(self) -> None:
        if self._stats.timing:
            self._stats.mark("backward_compute_end")
        self._last_ready_order = self._backward.arrived
        self._arrivals_per_step.add(len(self._last_ready_order))
        if self.static_graph and self._learned is None:  # static_graph's first step
            self._learn_static_graph(counted(self._last_ready_order, len(self.named_trainable)))
        if self.mixed_precision is not None:
            self._to_full_precision()
        try:
            super()._finish_backward()
        except Exception as error:
            self._logged_error = str(error)
            raise
        if self._stats.timing:
            self._stats.mark("backward_comm_end")

    def _log_and_raise(self, error: Exception) -> None:
        self._logged_error = str(error)
        raise error

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Runtime stats for the first 10 iterations, then one in `sample_rate`."""
        try:
            self._stats.set_sample_rate(sample_rate)
        except ValueError as error:
            self._log_and_raise(error)

    def _get_ddp_logging_data(self) -> dict[str, str | int]:
        """torch's logging data, with torch's keys, from this class's own state."""
        return logging_data(self)

    # --8<-- [end:surface]

    # --8<-- [start:pickle]
    def __getstate__(self) -> dict:
        """What pickle, copy.deepcopy and torch.save keep: as torch's DDP, everything but
        the process group and what lives in it (`pickling.py`, beside this file)."""
        return pickling.pickled_state(self)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.process_group = pickling.default_group()
        self.round_robin_groups = [self.process_group]
        # A tensor's hooks are not pickled, nor copied with it; and parameters are new
        # objects, so what is keyed by their identity is keyed again there.
        self._register_hooks()

    # --8<-- [end:pickle]


def install() -> None:
    """Make torch's `DistributedDataParallel` name this class, in torch and in every
    module already imported (`class_swap.py`, beside this file): one call before a
    framework (accelerate, Lightning) or a script builds its DDP, and it builds this one."""
    class_swap.swap_ddp_class(DistributedDataParallel)


def uninstall() -> None:
    """torch's class back where `install()` put this one."""
    class_swap.restore_ddp_class()
