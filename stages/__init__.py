"""The stages, simplest first; each adds one idea to the one before it.

`STAGES` is built on first use rather than at import, so that `python -m stages.naive`
runs the stage module once, not once as `stages.naive` and again as `__main__`."""

from __future__ import annotations

import importlib

from torch import nn

from ddp.train import ComputeOnly, Wrap, stage_wrap, torch_ddp_wrap

_ORDER = {
    "naive": "NaiveDDP",
    "bucketed": "BucketedDDP",
    "overlapped": "OverlappedDDP",
    "skip_sync": "SkipSyncDDP",
    "missing_grads": "MissingGradsDDP",
    "unused_params": "UnusedParamsDDP",
    "buffers": "BuffersDDP",
    "grad_views": "GradViewsDDP",
    "rebuilt_buckets": "RebuiltBucketsDDP",
    "comm_hooks": "CommHooksDDP",
    "round_robin": "RoundRobinDDP",
    "join": "JoinDDP",
    "auto_bucket": "AutoBucketDDP",
    "drop_in": "DistributedDataParallel",
}


def _load() -> dict[str, type[nn.Module]]:
    return {
        stage: getattr(importlib.import_module(f"stages.{stage}"), cls)
        for stage, cls in _ORDER.items()
    }


def __getattr__(name: str):
    if name == "STAGES":
        return _load()
    raise AttributeError(f"module 'stages' has no attribute {name!r}")


def standard_runs() -> dict[str, Wrap]:
    """The runs every comparison shows, in table order: the compute-only floor, every
    stage, and torch's DDP as the reference."""
    return {
        "compute_only": lambda model, cfg: ComputeOnly(model),
        **{name: stage_wrap(cls) for name, cls in _load().items()},
        "torch_ddp": torch_ddp_wrap,
    }
