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

As in torch, `bucket_cap_mb=None` means 25 MiB with a 1 MiB first bucket, and a cap
you give applies to the first bucket too (a bucket here stops short of its cap, where
torch's passes it by one gradient: `ddp.buckets.plan_buckets`). `static_graph=True`
promises the graph is the same every step; here it only lets buckets be rebuilt with
`find_unused_parameters=True`. `device_ids` and `output_device` are accepted for one
device per process, the only mode torch still supports. Arguments this project does
not implement (`mixed_precision`, `device_mesh`, ...) raise an error naming them when
set to anything but torch's default. The signature is torch 2.13's, positional order
included (`init_sync` after `broadcast_buffers`, `forward_sync_buffers` last).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from ddp.dist import broadcast_buffers
from stages.auto_bucket import AutoBucketDDP

DEFAULT_BUCKET_CAP_MB = 25.0  # torch's default
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES, in MiB


# --8<-- [start:construction]
class DistributedDataParallel(AutoBucketDDP):
    """Stage 14: every idea so far, behind torch DDP's constructor."""

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
        not_default = {
            name: value
            for name, value, default in [
                ("delay_all_reduce_named_params", delay_all_reduce_named_params, None),
                ("param_to_hook_all_reduce", param_to_hook_all_reduce, None),
                ("mixed_precision", mixed_precision, None),
                ("device_mesh", device_mesh, None),
                ("skip_all_reduce_unused_params", skip_all_reduce_unused_params, False),
                ("bucket_cap_mb_list", bucket_cap_mb_list, None),
                ("batched_grad_copy", batched_grad_copy, False),
            ]
            if value != default
        }
        if not_default:
            raise NotImplementedError(
                f"{type(self).__name__} does not implement {sorted(not_default)}; "
                "use torch.nn.parallel.DistributedDataParallel for those"
            )
        if dim != 0:
            raise NotImplementedError(f"only dim=0 is supported, got dim={dim}")
        if not any(p.requires_grad for p in module.parameters()):
            raise RuntimeError(  # torch's words: there would be nothing to synchronise
                "DistributedDataParallel is not needed when a module "
                "doesn't have any parameter that requires a gradient."
            )
        _check_one_device(module, device_ids, output_device)
        # torch 2.13's rules: forward_sync_buffers wins, and then buffers are always
        # broadcast at construction; else broadcast_buffers (default True) decides both.
        if forward_sync_buffers is not None:
            forward_sync, init_sync_buffers = forward_sync_buffers, True
        else:
            forward_sync = init_sync_buffers = (
                True if broadcast_buffers is None else broadcast_buffers
            )
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
        self.static_graph = static_graph

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
        if self._awaiting_sync and not self._finish_queued:
            # As torch's DDP: a forward whose output never reached backward (an evaluation
            # pass under grad mode, a discarded output) is forgotten. The earlier stages
            # raise instead, which catches a forgotten backward while one learns.
            self._awaiting_sync = False
        return super().forward(*inputs, **kwargs)

    def _order_is_static(self) -> bool:
        return self.static_graph or super()._order_is_static()  # the graph will not change

    def _set_static_graph(self) -> None:
        """torch's older spelling of static_graph=True: before training, as in torch."""
        if self.static_graph:
            message = "You've set static_graph to be True, no need to set it again."
            warnings.warn(message, stacklevel=2)
            return
        if self._synced_backwards:
            raise RuntimeError(
                "set_static_graph() should be called before training loop starts and "
                "after DistributedDataParallel is constructed."
            )
        self.static_graph = True

    # --8<-- [end:forward]

    # --8<-- [start:pickle]
    def __getstate__(self) -> dict:
        """What pickle, copy.deepcopy and torch.save keep: as torch's DDP, everything but
        the process group and what lives in it (work in flight, a comm hook, which
        torch's DDP also drops); unpickling takes the default group again."""
        if self.process_group is not _default_group():
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default "
                "process group. That is, when you have called init_process_group and have "
                "not passed process_group argument to DDP constructor"
            )
        if len(self.round_robin_groups) > 1:
            raise NotImplementedError(
                "pickling with round_robin_groups > 1: unpickling would have to make "
                "process groups, which every rank must do together"
            )
        state = dict(self.__dict__)
        for transient in ("process_group", "round_robin_groups", "_in_flight", "_hook_handles"):
            del state[transient]
        for hook in ("_comm_hook", "_comm_state"):
            state.pop(hook, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.process_group = _default_group()
        self.round_robin_groups = [self.process_group]
        self._in_flight = []
        # A tensor's hooks are not pickled, nor copied with it; and parameters are new
        # objects, so what is keyed by their identity is keyed again there.
        self._register_hooks()

    # --8<-- [end:pickle]


def _default_group() -> dist.ProcessGroup:
    return dist.group.WORLD


def _check_one_device(
    module: nn.Module,
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
) -> None:
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise ValueError(f"the module's parameters are on several devices {devices}; one only")
    if device_ids is None:
        return
    if len(device_ids) != 1:
        raise ValueError(f"device_ids must hold one device (one per process), got {device_ids}")
    wanted = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else None
    (device,) = devices or {torch.device("cpu")}
    if device.type == "cpu":
        raise ValueError("device_ids must be None for a CPU module, as in torch's DDP")
    if (wanted or torch.device(device.type, device_ids[0])) != device:
        raise ValueError(f"device_ids {device_ids} do not match the module's device {device}")
    if output_device is not None and output_device not in (device_ids[0], device):
        raise ValueError(f"output_device {output_device} differs from the module's {device}")


if __name__ == "__main__":
    from ddp.train import main

    main(DistributedDataParallel)
