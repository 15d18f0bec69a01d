"""torch DDP's constructor arguments, checked as torch checks them: what the drop-in
does not implement, the one device per process torch still supports, the rules for
syncing buffers, and `mixed_precision`'s config (`mixed_precision.py`). Each error
names the argument."""

from __future__ import annotations

import torch
from torch import nn

from stages.drop_in.mixed_precision import check_mixed_precision


def check_arguments(
    name: str,
    module: nn.Module,
    unimplemented: list[tuple[str, object, object]],
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
    dim: int,
    gradient_as_bucket_view: bool,
    mixed_precision,
):
    """Raise for anything `name` (the wrapper's class) cannot do with these arguments;
    `unimplemented` holds (argument, value, torch's default) for those it takes only at
    their default. Returns `mixed_precision`, checked."""
    not_default = {arg: value for arg, value, default in unimplemented if value != default}
    if not_default:
        raise NotImplementedError(
            f"{name} does not implement {sorted(not_default)}; "
            "use torch.nn.parallel.DistributedDataParallel for those"
        )
    if mixed_precision is not None and gradient_as_bucket_view:
        raise NotImplementedError(
            "mixed_precision with gradient_as_bucket_view=True: the gradients are "
            "computed in param_dtype and reduced in reduce_dtype, so they cannot be "
            "views of one bucket"
        )
    if dim != 0:
        raise NotImplementedError(f"only dim=0 is supported, got dim={dim}")
    if not any(p.requires_grad for p in module.parameters()):
        raise RuntimeError(  # torch's words: there would be nothing to synchronise
            "DistributedDataParallel is not needed when a module "
            "doesn't have any parameter that requires a gradient."
        )
    check_one_device(module, device_ids, output_device)
    if getattr(module, "_ddp_params_and_buffers_to_ignore", None):
        raise NotImplementedError(
            f"{name} does not implement parameters and buffers to ignore "
            f"(_ddp_params_and_buffers_to_ignore: "
            f"{sorted(module._ddp_params_and_buffers_to_ignore)}); "
            "use torch.nn.parallel.DistributedDataParallel for those"
        )
    return check_mixed_precision(mixed_precision)


def buffer_sync(
    broadcast_buffers: bool | None, forward_sync_buffers: bool | None
) -> tuple[bool, bool]:
    """(sync buffers before each forward, broadcast them at construction), by torch
    2.13's rules: forward_sync_buffers wins, and then buffers are always broadcast at
    construction; else broadcast_buffers (default True) decides both."""
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    sync = True if broadcast_buffers is None else broadcast_buffers
    return sync, sync


def check_one_device(
    module: nn.Module,
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
) -> None:
    """torch's rules for one device per process: the parameters on one device;
    `device_ids=None` for a CPU module, else one entry matching the module's device;
    an `output_device`, if given, that agrees."""
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
