"""torch DDP's `mixed_precision` for the drop-in: its config, the casts of parameters,
gradients and inputs to param_dtype and back, and the forward pre-hook that casts."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.utils import _cast_forward_inputs


def check_mixed_precision(config):
    """torch's `_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`, or None."""
    if config is None:
        return None
    if not all(hasattr(config, a) for a in ("param_dtype", "reduce_dtype", "buffer_dtype")):
        raise TypeError(
            "mixed_precision must be a torch.nn.parallel.distributed._MixedPrecision "
            f"(param_dtype, reduce_dtype, buffer_dtype), got {config!r}"
        )
    if config.param_dtype is None:
        raise ValueError("mixed_precision.param_dtype must be set (e.g. torch.bfloat16)")
    return config


def to_low_precision(
    module: nn.Module, dtype: torch.dtype, inputs: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """The parameters' data become `dtype` copies of the full-precision ones (kept
    aside, once: the optimizer updates those), and so do gradients accumulated so far
    and floating-point inputs, which are returned."""
    for param in module.parameters():
        if not hasattr(param, "_full_precision"):  # set once: the optimizer's tensor
            param._full_precision = param.data
        param.data = param._full_precision.to(dtype)
        if param.grad is not None:
            param.grad = param.grad.to(dtype)
    return _cast_forward_inputs(dtype, *inputs, **kwargs)


def to_full_precision(module: nn.Module) -> None:
    """The parameters back to their full-precision data, their gradients to its dtype."""
    for param in module.parameters():
        if hasattr(param, "_full_precision"):
            param.data = param._full_precision
            if param.grad is not None:
                param.grad = param.grad.to(param.data.dtype)


def low_precision_hook(ddp) -> Callable:
    """The wrapped module's forward pre-hook: `ddp._to_low_precision(inputs, kwargs)`.
    It holds the wrapper weakly, as the gradient hooks do: held strongly, module ->
    hook -> wrapper -> module would be a cycle, freed only by the garbage collector, and
    the process group with it (stage overlapped says why that matters)."""
    wrapper = weakref.ref(ddp)

    def cast(module: nn.Module, inputs: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        ddp = wrapper()
        return None if ddp is None else ddp._to_low_precision(inputs, kwargs)

    return cast
