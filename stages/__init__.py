"""The stages, simplest first; each adds one idea to the one before it.

`STAGES` is built on first use rather than at import, so that `python -m stages.naive`
runs the stage module once, not once as `stages.naive` and again as `__main__`."""

from __future__ import annotations

import importlib

_ORDER = {
    "naive": "NaiveDDP",
    "bucketed": "BucketedDDP",
    "overlapped": "OverlappedDDP",
    "skip_sync": "SkipSyncDDP",
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


def __getattr__(name: str):
    if name == "STAGES":
        return {
            stage: getattr(importlib.import_module(f"stages.{stage}"), cls)
            for stage, cls in _ORDER.items()
        }
    raise AttributeError(f"module 'stages' has no attribute {name!r}")
